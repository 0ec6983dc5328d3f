"""Where a VAE's convs stand against torch's, per conv shape: a 3x3 'same' conv of N frames at H x H
px, C -> C channels, as XLA's conv on its own kernels and on YNNPACK, as one matmul of the im2col
patches (the copy not counted) on YNNPACK, oneDNN and XLA's own kernels, and as torch's conv2d and
matmul; medians of ``--runs`` calls each, in GFLOP/s, printed as a Markdown table.

    python -m benchmarks.conv_rates [--runs 7]

The XLA variants differ only in compile options (``xla_cpu_experimental_ynn_fusion_type``,
``xla_cpu_use_onednn`` + ``xla_cpu_experimental_onednn_fusion_type``), so the table also says which
kernel library a conv or a dot would gain from on this machine.
"""
from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.harness import _once  # imports no jax: the platform below still applies

os.environ.setdefault("JAX_PLATFORMS", "cpu")

SHAPES = ((4, 32, 128), (5, 16, 256), (3, 8, 512), (2, 64, 128))  # (frames, px, channels)
_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
CONV_OPTIONS = {"XLA conv (own kernels)": _NO_YNN, "XLA conv (YNNPACK)": {}}
DOT_OPTIONS = {"patches: YNNPACK": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
               "patches: oneDNN": {**_NO_YNN, "xla_cpu_use_onednn": True,
                                   "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
               "patches: XLA's own": _NO_YNN}


def _median_s(fn, runs: int) -> float:
    fn(), fn()  # compile, warm up
    return statistics.median(_once(fn) for _ in range(runs))


def rates(frames: int, px: int, ch: int, runs: int) -> dict[str, float]:
    """GFLOP/s of each way of computing the conv of one shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((frames, px, px, ch), dtype=np.float32)
    w = rng.standard_normal((3, 3, ch, ch), dtype=np.float32)
    patches = rng.standard_normal((frames * px * px, 9 * ch), dtype=np.float32)
    gflop = 2 * frames * px * px * 9 * ch * ch / 1e9
    out = {}

    def conv(a, b):
        return jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            precision=jax.lax.Precision.HIGHEST)

    for name, opts in CONV_OPTIONS.items():
        f, xa, wa = jax.jit(conv, compiler_options=opts), jnp.asarray(x), jnp.asarray(w)
        out[name] = gflop / _median_s(lambda f=f, xa=xa, wa=wa: f(xa, wa).block_until_ready(), runs)
    for name, opts in DOT_OPTIONS.items():
        f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST), compiler_options=opts)
        pa, wa = jnp.asarray(patches), jnp.asarray(w.reshape(9 * ch, ch))
        out[name] = gflop / _median_s(lambda f=f, pa=pa, wa=wa: f(pa, wa).block_until_ready(), runs)
    tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    tw = torch.from_numpy(w).permute(3, 2, 0, 1).contiguous()
    tp, tm = torch.from_numpy(patches), torch.from_numpy(w.reshape(9 * ch, ch))
    with torch.no_grad():
        out["torch conv2d"] = gflop / _median_s(lambda: torch.nn.functional.conv2d(tx, tw, padding=1), runs)
        out["torch matmul"] = gflop / _median_s(lambda: tp @ tm, runs)
    return out


def _runs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """``--shapes``: comma-separated FRAMESxPXxCHANNELS, each a positive integer."""
    out = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not FRAMESxPXxCHANNELS (positive integers, e.g. 4x32x128)")
        out.append(tuple(int(p) for p in parts))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=_runs, default=7, help="timed calls per way (a positive integer)")
    p.add_argument("--shapes", type=_shapes, default=",".join("x".join(map(str, s)) for s in SHAPES),
                   help="comma-separated FRAMESxPXxCHANNELS, e.g. 4x32x128")
    a = p.parse_args(argv)
    rows = [(s, rates(*s, a.runs)) for s in a.shapes]
    names = list(rows[0][1])
    print("| N x H x H, C | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for (n, h, c), r in rows:
        print(f"| {n} x {h} x {h}, {c} | " + " | ".join((f"{r[k]:.0f}" if r[k] >= 10 else f"{r[k]:.2g}") for k in names) + " |")


if __name__ == "__main__":
    main()
