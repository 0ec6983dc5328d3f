"""VAE encodes against diffusers, every family whose pipelines encode images or clips (image-to-video,
video-to-world; Cosmos-Predict2.5 encodes with Wan2.1's VAE): the released widths, float32 both
sides, one clip of random pixels in [-1, 1] encoded to its posterior mean.

Each case builds the reference from diffusers' class, perturbs it (``tests.refutil.perturb``), saves it
with ``save_pretrained`` and loads that folder through ``vidax.compat``, so both sides hold the same
weights; the vidax callable returns ``encode(x)`` (host numpy) and the reference
``encode(x).latent_dist.mean`` (``tests/test_benchmarks_vae_encode.py`` checks, at narrow widths, that
the two agree: both sides do the same work).

    python -m benchmarks.run --only vae_encode --pairs 7
"""
from __future__ import annotations

import tempfile

import numpy as np

from benchmarks.harness import shipped_config


#: family -> (diffusers class, released config (a callable: some are read from the shipped files),
#: a narrow config (tests), the clip encoded at the released widths [F, H, W], at the narrow ones)
FAMILIES = {
    "wan": ("AutoencoderKLWan", lambda: dict(base_dim=96, z_dim=16), dict(base_dim=16, z_dim=16),
            (5, 128, 128), (5, 32, 32)),
    "cogvideox": ("AutoencoderKLCogVideoX",
                  lambda: dict(block_out_channels=(128, 256, 256, 512), latent_channels=16, layers_per_block=3,
                               norm_num_groups=32),
                  dict(block_out_channels=(32, 64, 64, 64), latent_channels=16, layers_per_block=1, norm_num_groups=8),
                  (9, 64, 64), (9, 32, 32)),
    "hunyuanvideo": ("AutoencoderKLHunyuanVideo", lambda: dict(latent_channels=16),
                     dict(latent_channels=16, block_out_channels=(32, 64, 64, 64), layers_per_block=1),
                     (5, 64, 64), (5, 32, 32)),
    "hunyuanvideo15": ("AutoencoderKLHunyuanVideo15",
                       lambda: dict(latent_channels=32, block_out_channels=(128, 256, 512, 1024, 1024),
                                    layers_per_block=2),
                       dict(latent_channels=32, block_out_channels=(32, 64, 64, 128, 128), layers_per_block=1),
                       (5, 64, 64), (5, 32, 32)),
    "ltx_video_09": ("AutoencoderKLLTXVideo", lambda: shipped_config("ltx-video-0.9"),
                     dict(latent_channels=32, block_out_channels=(32, 64, 64, 64), layers_per_block=(1, 1, 1, 1, 1),
                          decoder_block_out_channels=(32, 64, 64, 64), decoder_layers_per_block=(1, 1, 1, 1, 1)),
                     (9, 128, 128), (9, 64, 64)),
    "ltx2_t2v": ("AutoencoderKLLTX2Video", lambda: shipped_config("ltx2-t2v"),
                 dict(latent_channels=32, block_out_channels=(32, 64, 64, 64), layers_per_block=(1, 1, 1, 1, 1),
                      decoder_block_out_channels=(32, 64, 128), decoder_layers_per_block=(1, 1, 1, 1),
                      spatial_compression_ratio=32, temporal_compression_ratio=8),
                 (9, 128, 128), (9, 64, 64)),
}


def _case(family: str):
    cls_name, released, narrow_cfg, clip, narrow_clip = FAMILIES[family]

    def case(narrow: bool = False):
        """The encode of one clip, vidax against diffusers (``narrow``: the test's small widths)."""
        import diffusers
        import torch

        from tests.refutil import perturb
        from vidax import compat

        torch.manual_seed(0)
        cfg = dict(narrow_cfg) if narrow else released()
        ref = perturb(getattr(diffusers, cls_name).from_config(cfg))
        with tempfile.TemporaryDirectory(prefix=f"vidax-bench-enc-{family}-") as d:  # read whole: removed after
            ref.save_pretrained(d)
            ours = compat.load_pretrained(d)
        f, h, w = narrow_clip if narrow else clip
        x = np.random.default_rng(0).uniform(-1.0, 1.0, (1, 3, f, h, w)).astype(np.float32)
        xt = torch.from_numpy(x)

        def reference():
            with torch.no_grad():
                return ref.encode(xt).latent_dist.mean.numpy()

        return dict(component=f"VAE encode (vs diffusers `{cls_name}`)",
                    config=f"{'narrow' if narrow else 'released'} widths, clip {f}x{h}x{w} px -> posterior mean",
                    vidax=lambda: np.asarray(ours.encode(x)), reference=reference)

    case.__name__ = f"vae_encode_real_width_{family}"
    return case


CASES = [_case(f) for f in FAMILIES]
