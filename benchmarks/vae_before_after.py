"""A family's VAE decode, this tree against another checkout of vidax (e.g. ``/work/main``, before a
change), as interleaved pairs in one process: both sides are XLA programs, so the machine's load
(and torch's different response to it) cannot tilt the ratio.

    python -m benchmarks.vae_before_after --old /path/to/vidax-checkout --family hunyuanvideo [--pairs 5]

The old side's family VAE module and ``vidax/core/conv.py`` are loaded from ``--old`` under other
names (the rest of vidax is this tree's). Families: hunyuanvideo (released widths 128-256-512-512,
latents 2x8x8), cogvideox (released widths 128-256-256-512, latents 3x8x8), ltx-video and ltx2 (the
shipped ``vae/config.json`` of ``ltx-video-0.9`` and ``ltx2-t2v``, latents 2x2x2).
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
    ap.add_argument("--family", default="hunyuanvideo", choices=["hunyuanvideo", "cogvideox", "ltx-video", "ltx2"])
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args(argv)
    root = Path(a.old)
    if not (root / "vidax/core/conv.py").exists():
        print(f"--old {root}: no vidax/core/conv.py there", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import torch

    from benchmarks.harness import matmul_roof, paired
    from tests.refutil import perturb
    from vidax import compat

    adapters = dict(compat._ADAPTERS)
    conv_old = _load("_vidax_conv_old", root / "vidax/core/conv.py")
    module = "ltx" if a.family.startswith("ltx") else a.family
    old = _load(f"_vidax_{module}_vae_old", root / f"vidax/models/{module}/vae.py")
    old.vconv = conv_old
    compat._ADAPTERS.clear()
    compat._ADAPTERS.update(adapters)  # the old module registered its compat loader: this tree's again
    torch.manual_seed(0)
    if a.family == "hunyuanvideo":
        from diffusers import AutoencoderKLHunyuanVideo

        from vidax.models.hunyuanvideo import vae as new

        ref = perturb(AutoencoderKLHunyuanVideo(latent_channels=16))
        shape, cfg_of = (1, 16, 2, 8, 8), lambda m, c: m.HunyuanVAEConfig.from_diffusers(c)
    elif module == "ltx":
        import diffusers

        from benchmarks.harness import shipped_config
        from vidax.models.ltx import vae as new

        release = {"ltx-video": "ltx-video-0.9", "ltx2": "ltx2-t2v"}[a.family]
        conf = shipped_config(release)
        ref = perturb(getattr(diffusers, conf["_class_name"]).from_config(conf))
        shape, cfg_of = (1, conf["latent_channels"], 2, 2, 2), lambda m, c: m.LTXVAEConfig.from_diffusers(c)
    else:
        from diffusers import AutoencoderKLCogVideoX

        from vidax.models.cogvideox import vae as new

        ref = perturb(AutoencoderKLCogVideoX(block_out_channels=(128, 256, 256, 512), latent_channels=16,
                                             layers_per_block=3, norm_num_groups=32))
        shape, cfg_of = (1, 16, 3, 8, 8), lambda m, c: m.CogVideoXVAEConfig.from_diffusers(c)
    import tempfile

    folder = tempfile.mkdtemp(prefix="vidax-bench-before-after-")
    ref.save_pretrained(folder)
    conf = compat.read_config(folder)
    z = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    def decoder(m):  # the module's decode of z, loaded from the folder
        if module != "ltx":
            vae = m.load_vae(folder, cfg_of(m, conf))
            return lambda: np.asarray(m.decode(vae, z))
        import jax

        state, cfg, _ = m.load_vae(folder, cfg_of(m, conf), encoder=False)
        state = jax.device_put(state)
        return lambda: np.asarray(m.decode(state, cfg, z))

    run_new, run_old = decoder(new), decoder(old)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)  # both sides loaded (a released-width LTX-2 VAE is 5 GB)
    diff = float(np.abs(run_new() - run_old()).max())
    res = paired(run_new, run_old, pairs=a.pairs, roof=matmul_roof())
    s = res.summary()
    print(f"{a.family} VAE decode, released widths, latents {shape[2:]}: this tree {s['a_s']:.3f} s, {root} "
          f"{s['b_s']:.3f} s, new / old {s['ratio']:.2f}x [{s['ratio_q1']:.2f}-{s['ratio_q3']:.2f}], "
          f"{s['pairs']} pairs, roof {s['roof_gflops']:.0f} GFLOP/s; max |new - old| {diff:.2e}; per pair "
          f"{[round(r, 2) for r in res.ratios]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
