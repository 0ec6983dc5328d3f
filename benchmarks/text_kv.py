"""The text K/V computed once per sample stage (issue #29, item 5) vs per step: Wan's sampling step
(the DiT on the CFG batch, jitted as the sampling loop runs it) at a moderate width, one process,
the two programs as interleaved pairs.

    python -m benchmarks.text_kv [--pairs 15] [--dim-heads 12] [--layers 2] [--latents 4,32,32]
                                 [--text 512] [--json PATH]

"per step": ``forward(state, x, t, ctx)`` (the text projection and every block's cross-attention
keys / values inside the step, as before); "once": ``forward(state, x, t, context=kv)`` with ``kv``
from the context program, run once per sample stage (its time is printed too). Reports the median
of the per-pair step-time ratios (once / per step) with its quartiles: below 1, faster. The K/V
share of a step shrinks as the video tokens grow (short clips and long prompts gain most).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from benchmarks.harness import paired, quartiles, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--dim-heads", type=int, default=12, help="heads of 128 (12: Wan2.1-1.3B's width, 1536)")
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--latents", default="4,32,32", help="latent frames,height,width (video tokens: f*h*w/4)")
    ap.add_argument("--text", type=int, default=512, help="text tokens (Wan pads to 512)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from vidax.models.wan import dit as wdit

    f, h, w = (int(v) for v in a.latents.split(","))
    cfg = replace(wdit.PRESETS["1.3b"], num_heads=a.dim_heads, head_dim=128, ffn_dim=a.ffn, num_layers=a.layers)
    state = jax.device_put(wdit.init_state(cfg, seed=0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, f, h, w, 16)), jnp.float32)  # the CFG batch [cond; uncond]
    t = jnp.full((2,), 500.0, jnp.float32)
    ctx = jnp.asarray(rng.standard_normal((2, a.text, cfg.text_dim)), jnp.float32)
    rope = wdit.rope_tables(cfg, (f, h // 2, w // 2))
    per_step = jax.jit(lambda s, x, t, c, r: wdit.forward(s, cfg, x, t, c, rope=r))
    with_kv = jax.jit(lambda s, x, t, kv, r: wdit.forward(s, cfg, x, t, None, rope=r, context=kv))
    context = jax.jit(lambda s, c: wdit.context(s, cfg, c))
    kv = jax.block_until_ready(context(state, ctx))
    t0 = time.perf_counter()
    kv = jax.block_until_ready(context(state, ctx))
    ctx_s = time.perf_counter() - t0
    err = float(jnp.max(jnp.abs(with_kv(state, x, t, kv, rope) - per_step(state, x, t, ctx, rope))))

    res = paired(lambda: with_kv(state, x, t, kv, rope).block_until_ready(),
                 lambda: per_step(state, x, t, ctx, rope).block_until_ready(), pairs=a.pairs, warmup=1)
    lo, med, hi = quartiles(res.ratios)
    tokens = f * (h // 2) * (w // 2)
    desc = (f"Wan DiT step (CFG batch 2): dim {cfg.dim} ({a.dim_heads}x128 heads), FFN {a.ffn}, {a.layers} blocks, "
            f"{tokens} video + {a.text} text tokens, float32, one device")
    print(desc)
    for x_, y_ in zip(res.a, res.b):
        print(f"  once {x_:.3f}s  per step {y_:.3f}s  ratio {x_ / y_:.3f}")
    print(f"step time, K/V once / per step: {med:.3f}x [{lo:.3f}-{hi:.3f}] over {len(res.ratios)} pairs "
          f"(medians {np.median(res.a):.3f}s vs {np.median(res.b):.3f}s); the context program once: {ctx_s:.3f}s; "
          f"max abs difference of the outputs {err:.1e}")
    write_json(a.json, {"config": desc, "once_s": res.a, "per_step_s": res.b, "ratio": med, "ratio_q1": lo,
                        "ratio_q3": hi, "context_s": ctx_s, "max_abs_diff": err})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
