"""vidax vs the PyTorch references, same machine, same run.

    make bench            # or: python -m benchmarks.run [--quick]

Measures DiT forward, VAE decode and text encode at a small config, prints a markdown table
(times, vidax/reference speed ratio, achieved GFLOP/s against a measured matmul peak) and writes
``benchmarks/results/latest.json``. FLOPs are XLA's cost analysis of the vidax program (the same
math as the reference), so both columns use one count.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _median_time(fn, repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matmul_peak(n: int = 2048, repeat: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    t = _median_time(lambda: f(a, a).block_until_ready(), repeat)
    return 2 * n**3 / t / 1e9


def bench_dit(repeat):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import WanTransformer3DModel

    from tests.refutil import perturb
    from vidax.models.wan import dit

    heads, hd, layers, ffn, text_dim, lt = 8, 64, 4, 2048, 4096, 512
    f, h, w = 8, 32, 32
    ref = perturb(WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=hd, in_channels=16, out_channels=16,
                                        text_dim=text_dim, ffn_dim=ffn, num_layers=layers))
    cfg = dit.WanDiTConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    from vidax.weights import load_params

    params = jax.device_put(load_params(sd, dit.diffusers_keymap(cfg), dit.param_shapes(cfg)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, f, h, w)).astype(np.float32)
    ctx = rng.standard_normal((1, lt, text_dim)).astype(np.float32)
    t = np.array([500.0], np.float32)
    fwd = jax.jit(dit.forward, static_argnums=1)
    xj, cj, tj = jnp.asarray(x.transpose(0, 2, 3, 4, 1)), jnp.asarray(ctx), jnp.asarray(t)
    tv = _median_time(lambda: fwd(params, cfg, xj, tj, cj).block_until_ready(), repeat)
    xt, ct, tt = torch.from_numpy(x), torch.from_numpy(ctx), torch.from_numpy(t)

    def run_ref():
        with torch.no_grad():
            ref(hidden_states=xt, timestep=tt, encoder_hidden_states=ct, return_dict=False)

    tr = _median_time(run_ref, repeat)
    n, d = f * (h // 2) * (w // 2), heads * hd
    per_block = 2 * n * d * d * 4 + 4 * n * n * d + 2 * n * d * d * 2 + 2 * lt * d * d * 2 + 4 * n * lt * d + 4 * n * d * ffn
    fl = layers * per_block + 2 * lt * (text_dim * d + d * d) + 2 * n * (16 * 4 * d + d * 64)
    return dict(name="DiT forward", shape=f"{layers} blocks, dim {heads*hd}, {heads} heads, latents {f}x{h}x{w}, text {lt}",
                vidax_s=tv, ref_s=tr, flops=fl, ref="diffusers WanTransformer3DModel")


def bench_text(repeat):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.refutil import perturb
    from vidax.text import t5

    hc = UMT5Config(vocab_size=4096, d_model=512, d_kv=64, d_ff=1024, num_layers=4, num_heads=8,
                    feed_forward_proj="gated-gelu", dropout_rate=0.0)
    ref = perturb(UMT5EncoderModel(hc))
    cfg = t5.T5Config.from_hf(hc.to_dict())
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    params = jax.device_put(t5.load_params_from(sd, cfg))
    L = 512
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 4096, (1, L)).astype(np.int64)
    mask = np.zeros((1, L), np.int64)
    mask[:, :200] = 1
    enc = jax.jit(t5.encode, static_argnums=1)
    ij, mj = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    tv = _median_time(lambda: enc(params, cfg, ij, mj).block_until_ready(), repeat)
    it, mt = torch.from_numpy(ids), torch.from_numpy(mask)

    def run_ref():
        with torch.no_grad():
            ref(input_ids=it, attention_mask=mt)

    tr = _median_time(run_ref, repeat)
    d, inner, ff = 512, 8 * 64, 1024
    fl = 4 * (2 * L * d * inner * 4 + 4 * L * L * inner + 2 * L * d * ff * 3)
    return dict(name="Text encode (UMT5)", shape=f"4 layers, d_model 512, 8 heads, {L} tokens",
                vidax_s=tv, ref_s=tr, flops=fl, ref="transformers UMT5EncoderModel")


def bench_vae(repeat):
    import jax
    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan

    from tests.refutil import perturb
    from vidax.models.wan import vae

    ref = perturb(AutoencoderKLWan(base_dim=32, z_dim=16))
    cfg = vae.WanVAEConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    from vidax.weights import load_params

    params = jax.device_put(vae.state_from_pure(cfg, load_params(sd, vae.diffusers_keymap(cfg), vae.param_shapes(cfg))))
    f, h, w = 3, 16, 16
    z = np.random.default_rng(0).standard_normal((1, 16, f, h, w)).astype(np.float32)
    tv = _median_time(lambda: np.asarray(vae.decode(params, cfg, z)), repeat)
    zt = torch.from_numpy(z)

    def run_ref():
        with torch.no_grad():
            ref.decode(zt, return_dict=False)

    tr = _median_time(run_ref, repeat)
    return dict(name="VAE decode", shape=f"base_dim 32, z 16, latents {f}x{h}x{w} -> {4*(f-1)+1}x{8*h}x{8*w} px",
                vidax_s=tv, ref_s=tr, flops=None, ref="diffusers AutoencoderKLWan")


def table(rows, peak):
    out = [
        "| component | config | vidax (s) | reference (s) | speed-up vs reference | vidax GFLOP/s | % of matmul peak |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gf = r["flops"] / r["vidax_s"] / 1e9 if r.get("flops") else None
        out.append(
            f"| {r['name']} | {r['shape']} | {r['vidax_s']:.3f} | {r['ref_s']:.3f} | {r['ref_s'] / r['vidax_s']:.2f}x | "
            + (f"{gf:.1f} | {100 * gf / peak:.0f}% |" if gf else "n/a | n/a |")
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=["dit", "vae", "text"])
    ap.add_argument("--out", default="benchmarks/results/latest.json")
    a = ap.parse_args(argv)
    import jax
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    peak = matmul_peak()
    fns = {"dit": bench_dit, "vae": bench_vae, "text": bench_text,
           "scale": lambda r: __import__("benchmarks.scale", fromlist=["bench_entry"]).bench_entry(r)}
    rows = []
    for k in a.only:
        print(f"benchmarking {k} ...", file=sys.stderr, flush=True)
        rows.append(fns[k](a.repeat))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, JAX {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}"
    md = table(rows, peak)
    print(f"\nMachine: {machine}; measured fp32 matmul peak {peak:.1f} GFLOP/s (JAX, 2048^3)\n")
    print(md)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine, "matmul_peak_gflops": peak, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
