"""The text K/V computed once per sample stage (issue #29, item 5) vs per step: Wan's sample stage
at a moderate width, one process, the two paths as interleaved pairs (``runner.TEXT_KV_ONCE`` on /
off, each with its own compiled programs, warmed up first).

    python -m benchmarks.text_kv [--pairs 7] [--dim-heads 12] [--layers 2] [--latents 4,32,32]
                                 [--text 512] [--steps 4] [--mesh SPEC] [--json PATH]

Reports the median of the per-pair time ratios (once / per step) with its quartiles: below 1, the
once-computed K/V are faster. The K/V share of a step shrinks as the video tokens grow, so the
saving is largest at short clips and long prompts.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from benchmarks.harness import paired, quartiles, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--dim-heads", type=int, default=12, help="heads of 128 (12: Wan2.1-1.3B's width, 1536)")
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--latents", default="4,32,32", help="latent frames,height,width (tokens: f*h*w/4)")
    ap.add_argument("--text", type=int, default=512, help="text tokens (Wan pads to 512)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    from vidax.core import runner as vrunner
    from vidax.models.wan import pipeline as wp

    f, h, w = (int(v) for v in a.latents.split(","))
    base = wp.PRESET_SOURCES["tiny"]
    dit = replace(base.dit, num_heads=a.dim_heads, head_dim=128, ffn_dim=a.ffn, num_layers=a.layers, text_dim=4096,
                  freq_dim=256)
    wp.PRESET_SOURCES["bench-text-kv"] = replace(base, dit=dit)
    pipe = wp.WanT2V("bench-text-kv", mesh=a.mesh)
    dit_loaded = pipe.load_dit()
    rng = np.random.default_rng(0)
    cond, uncond = (rng.standard_normal((1, a.text, 4096)).astype(np.float32) for _ in range(2))
    lat = rng.standard_normal((1, 16, f, h, w)).astype(np.float32)
    size = dict(height=h * 8, width=w * 8, num_frames=(f - 1) * 4 + 1)

    def run(flag):
        def go():
            vrunner.TEXT_KV_ONCE = flag
            pipe.sample_latents(cond, uncond, latents=lat, steps=a.steps, guidance=5.0, dit=dit_loaded, **size)
        return go

    once, per_step = run(True), run(False)
    res = paired(once, per_step, pairs=a.pairs, warmup=1)
    lo, med, hi = quartiles(res.ratios)
    tokens = f * (h // 2) * (w // 2)
    cfg = (f"Wan DiT dim {a.dim_heads * 128} ({a.dim_heads}x128 heads), FFN {a.ffn}, {a.layers} blocks, "
           f"{tokens} video + {a.text} text tokens, CFG batch 2, {a.steps} UniPC steps, mesh {a.mesh or 'one device'}")
    print(cfg)
    for x, y in zip(res.a, res.b):
        print(f"  once {x:.3f}s  per step {y:.3f}s  ratio {x / y:.3f}")
    print(f"sample stage, K/V once / per step: {med:.3f}x [{lo:.3f}-{hi:.3f}] over {len(res.ratios)} pairs "
          f"(medians {np.median(res.a):.3f}s vs {np.median(res.b):.3f}s)")
    write_json(a.json, {"config": cfg, "once_s": res.a, "per_step_s": res.b, "ratio": med, "ratio_q1": lo,
                        "ratio_q3": hi})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
