"""Where the Wan VAE decode's time goes at the released widths (base_dim 96, z 16; 2 latent frames at
16x16 -> 5x128x128 px), vidax vs diffusers on this CPU.

1. The whole decode, paired (vidax, diffusers, ...): the ratio the README reports.
2. Every convolution diffusers' decoder runs (shapes from ``torch.profiler``'s record_shapes), each
   timed alone, paired, as PyTorch's ``conv3d`` / ``conv2d`` (oneDNN) and as the XLA program vidax
   runs for it on CPU (time taps folded into channels, one 2-D conv; also XLA's native 3-D conv).
   Summed over the calls, the convs' share of each decode and the gap they explain.

    python -m benchmarks.vae_profile [--pairs 5] [--json benchmarks/results/vae_profile.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter

import numpy as np

from benchmarks.harness import paired, write_json


def _conv_calls(ref, z) -> Counter:
    """(input shape, weight shape) of every convolution the reference decoder runs -> count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        ref.decode(torch.from_numpy(z), return_dict=False)
    calls = Counter()
    for ev in prof.events():
        if ev.name == "aten::convolution" and ev.input_shapes and len(ev.input_shapes[1]) in (4, 5):
            calls[(tuple(ev.input_shapes[0]), tuple(ev.input_shapes[1]))] += 1
    return calls


def _programs(x_shape, w_shape):
    """(torch conv, vidax's CPU program, XLA native conv) for one VALID, stride-1 convolution."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    pad = 0 if len(x_shape) == 5 else w_shape[-1] // 2  # the causal 3-D convs come padded; the 2-D ones pad

    def ref():
        with torch.no_grad():
            (F.conv3d if len(x_shape) == 5 else F.conv2d)(xt, wt, padding=pad)

    hi = jax.lax.Precision.HIGHEST
    if len(x_shape) == 5:  # [N, C, T, H, W] x [O, C, kt, kh, kw]
        n, c, t, h, wd = x_shape
        o, _, kt, kh, kw = w_shape
        xj = jnp.asarray(x.transpose(0, 2, 3, 4, 1))  # NTHWC
        wn = jnp.asarray(w.transpose(2, 3, 4, 1, 0))  # kt kh kw C O
        wf = jnp.asarray(w.transpose(3, 4, 2, 1, 0).reshape(kh, kw, kt * c, o))  # taps folded into channels

        @jax.jit
        def fold(x, w):
            taps = jnp.concatenate([x[:, i:t - kt + 1 + i] for i in range(kt)], axis=-1)  # [N, T', H, W, kt C]
            y = jax.lax.conv_general_dilated(taps.reshape(-1, h, wd, kt * c), w, (1, 1), "VALID",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=hi)
            return y

        @jax.jit
        def native(x, w):
            return jax.lax.conv_general_dilated(x, w, (1, 1, 1), "VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                                precision=hi)

        return ref, lambda: fold(xj, wf).block_until_ready(), lambda: native(xj, wn).block_until_ready()
    xj = jnp.asarray(x.transpose(0, 2, 3, 1))
    wj = jnp.asarray(w.transpose(2, 3, 1, 0))

    @jax.jit
    def two(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), [(pad, pad)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            precision=hi)

    f = lambda: two(xj, wj).block_until_ready()  # noqa: E731
    return ref, f, f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/results/vae_profile.json")
    a = ap.parse_args(argv)
    import torch

    from benchmarks.core import vae_decode_real_width

    case = vae_decode_real_width()
    whole = paired(case["vidax"], case["reference"], pairs=a.pairs)
    ratio = statistics.median(x / y for x, y in zip(whole.a, whole.b))
    t_vx, t_ref = statistics.median(whole.a), statistics.median(whole.b)
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    ref = AutoencoderKLWan(base_dim=96, z_dim=16).eval()
    z = np.random.default_rng(0).standard_normal((1, 16, 2, 16, 16)).astype(np.float32)
    calls = _conv_calls(ref, z)
    rows, tot = [], dict(ref=0.0, fold=0.0, native=0.0)
    for (xs, ws), count in sorted(calls.items(), key=lambda kv: -np.prod(kv[0][0][1:]) * np.prod(kv[0][1])):
        r, fold, native = _programs(xs, ws)
        p = paired(fold, r, pairs=a.pairs)
        pn = paired(native, r, pairs=max(3, a.pairs // 2))
        t_r, t_f, t_n = (statistics.median(v) for v in (p.b, p.a, pn.a))
        for k, v in (("ref", t_r), ("fold", t_f), ("native", t_n)):
            tot[k] += count * v
        rows.append(dict(input=list(xs), weight=list(ws), calls=count, torch_ms=1e3 * t_r, vidax_ms=1e3 * t_f,
                         xla_native_ms=1e3 * t_n, ratio=statistics.median(x / y for x, y in zip(p.a, p.b))))
    print(f"whole decode: vidax {t_vx:.3f} s, diffusers {t_ref:.3f} s, paired ratio {ratio:.2f}x ({len(whole.a)} pairs)")
    print("| conv input [N, C, T, H, W] | weight | calls | PyTorch ms | vidax (XLA, folded) ms | XLA native 3-D ms | "
          "vidax / PyTorch |\n|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['input']} | {r['weight']} | {r['calls']} | {r['torch_ms']:.2f} | {r['vidax_ms']:.2f} | "
              f"{r['xla_native_ms']:.2f} | {r['ratio']:.2f}x |")
    print(f"| **all convs** | | {sum(calls.values())} | {1e3 * tot['ref']:.0f} | {1e3 * tot['fold']:.0f} | "
          f"{1e3 * tot['native']:.0f} | {tot['fold'] / tot['ref']:.2f}x |")
    print(f"convs: {100 * tot['ref'] / t_ref:.0f}% of diffusers' decode, {100 * tot['fold'] / t_vx:.0f}% of vidax's; "
          f"the convs' gap ({1e3 * (tot['fold'] - tot['ref']):.0f} ms) vs the whole decode's "
          f"({1e3 * (t_vx - t_ref):.0f} ms)")
    write_json(a.json, dict(whole=dict(vidax=t_vx, reference=t_ref, ratio=ratio), convs=rows,
                            totals={k: v for k, v in tot.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
