"""Wan recipes: the model ids users ask for, their defaults, presets and pools."""
from vidax.pipeline import Recipe, tpu

_T2V = "vidax.models.wan.pipeline:WanT2V"
_I2V = "vidax.models.wan.pipeline:WanI2V"
_V5E = "tpu-v5-lite-podslice"
# 720p recipes decode in 256-pixel tiles by default: a whole 720p frame's decode needs ~18 GiB on one
# chip (`vidax plan`), a tile ~1.6 GiB; `--vae-tiling false` gives the reference's whole-frame decode.
#: the pools of the 14B DiTs (T2V, I2V, each A14B expert) and of the 5B
_POOL_14B = {None: {"encode": tpu(_V5E, "2x4", 8), "sample": tpu(_V5E, "2x4", 8), "decode": tpu(_V5E, "2x4", 8)}}
_POOL_5B = {None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x4", 8), "decode": tpu(_V5E, "2x2", 4)}}
_ONE = ("shift", "scheduler", "vae_tiling")  # one DiT
_TWO = ("shift", "scheduler", "guidance_2", "vae_tiling")  # A14B: high- and low-noise experts

RECIPES = [
    Recipe(
        "wan2.1-t2v-1.3b", _T2V, ("tiny", "1.3b"),
        dict(height=480, width=832, num_frames=81, steps=50, guidance=5.0, shift=3.0, fps=16),
        option_names=_ONE, description="Wan2.1 text-to-video, 1.3B (480p)", default=True,
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x4", 8),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
    Recipe(
        "wan2.1-t2v-14b", _T2V, ("tiny", "14b"),
        dict(dtype="bfloat16", vae_tiling=True, height=720, width=1280, num_frames=81, steps=50, guidance=5.0, shift=5.0, fps=16),
        option_names=_ONE, description="Wan2.1 text-to-video, 14B (720p)", prefer_axis="tp",
        stage_jobs=_POOL_14B,
    ),
    Recipe(
        "wan2.1-i2v-480p", _I2V, ("tiny",),
        dict(dtype="bfloat16", area=480 * 832, num_frames=81, steps=40, guidance=5.0, shift=3.0, fps=16),
        option_names=_ONE, description="Wan2.1 image-to-video 14B, 480p (CLIP image cross-attention)", prefer_axis="tp",
        image="required", preset_sources={("tiny", True): "tiny-i2v"}, stage_jobs=_POOL_14B,
    ),
    Recipe(
        "wan2.1-i2v-720p", _I2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, area=720 * 1280, num_frames=81, steps=40, guidance=5.0, shift=5.0, fps=16),
        option_names=_ONE, description="Wan2.1 image-to-video 14B, 720p (CLIP image cross-attention)", prefer_axis="tp",
        image="required", preset_sources={("tiny", True): "tiny-i2v"}, stage_jobs=_POOL_14B,
    ),
    Recipe(
        "wan2.2-ti2v-5b", _T2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, height=704, width=1280, area=704 * 1280, num_frames=121, steps=50, guidance=5.0,
             shift=5.0, fps=24),
        option_names=_ONE, description="Wan2.2 TI2V-5B: text- or image-to-video, 720p/24fps (latent substitution)",
        image="optional", preset_sources={("tiny", False): "tiny-ti2v", ("tiny", True): "tiny-ti2v-i2v"},
        stage_jobs=_POOL_5B,
    ),
    Recipe(
        "wan2.2-t2v-a14b", _T2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, height=720, width=1280, num_frames=81, steps=40, guidance=4.0, guidance_2=3.0,
             shift=12.0, fps=16),
        option_names=_TWO, description="Wan2.2 text-to-video A14B: high- and low-noise experts", prefer_axis="tp",
        preset_sources={("tiny", False): "tiny-a14b"}, stage_jobs=_POOL_14B,
    ),
    Recipe(
        "wan2.2-i2v-a14b", _I2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, area=720 * 1280, num_frames=81, steps=40, guidance=3.5, guidance_2=3.5,
             shift=5.0, fps=16),
        option_names=_TWO, description="Wan2.2 image-to-video A14B: high- and low-noise experts", prefer_axis="tp",
        image="required", preset_sources={("tiny", True): "tiny-a14b-i2v"}, stage_jobs=_POOL_14B,
    ),
]
