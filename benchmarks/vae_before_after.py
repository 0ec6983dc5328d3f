"""A family's VAE decode, this tree against another checkout of vidax (e.g. ``/work/main``, before a
change), as interleaved pairs in one process: both sides are XLA programs, so the machine's load
(and torch's different response to it) cannot tilt the ratio.

    python -m benchmarks.vae_before_after --old /path/to/vidax-checkout --family hunyuanvideo [--pairs 5]

The old side's family VAE module and ``vidax/core/conv.py`` are loaded from ``--old`` under other
names (the rest of vidax is this tree's). Families: hunyuanvideo (released widths, latents 2x8x8).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="root of the other vidax checkout")
    ap.add_argument("--family", default="hunyuanvideo", choices=["hunyuanvideo"])
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args(argv)
    root = Path(a.old)
    if not (root / "vidax/core/conv.py").exists():
        print(f"--old {root}: no vidax/core/conv.py there", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    from benchmarks.families.hunyuanvideo import _save
    from benchmarks.harness import matmul_roof, paired
    from tests.refutil import perturb
    from vidax.models.hunyuanvideo import vae as new

    conv_old = _load("_vidax_conv_old", root / "vidax/core/conv.py")
    old = _load("_vidax_hv_vae_old", root / "vidax/models/hunyuanvideo/vae.py")
    old.vconv = conv_old
    torch.manual_seed(0)
    folder = _save(perturb(AutoencoderKLHunyuanVideo(latent_channels=16)))
    vn = new.load_vae(folder, new.HunyuanVAEConfig.from_diffusers(new.compat.read_config(folder)))
    vo = old.load_vae(folder, old.HunyuanVAEConfig.from_diffusers(new.compat.read_config(folder)))
    z = np.random.default_rng(0).standard_normal((1, 16, 2, 8, 8)).astype(np.float32)
    diff = float(np.abs(new.decode(vn, z) - old.decode(vo, z)).max())
    res = paired(lambda: new.decode(vn, z), lambda: old.decode(vo, z), pairs=a.pairs, roof=matmul_roof())
    s = res.summary()
    print(f"{a.family} VAE decode, released widths, latents 2x8x8: this tree {s['a_s']:.3f} s, {root} "
          f"{s['b_s']:.3f} s, new / old {s['ratio']:.2f}x [{s['ratio_q1']:.2f}-{s['ratio_q3']:.2f}], "
          f"{s['pairs']} pairs, roof {s['roof_gflops']:.0f} GFLOP/s; max |new - old| {diff:.2e}; per pair "
          f"{[round(r, 2) for r in res.ratios]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
