"""HunyuanVideo 1.5 recipes: the model ids users ask for, their defaults (the releases' 121 frames,
50 steps, guidance 6, shift 5 at 480p / 9 for 720p T2V / 7 for 720p I2V, 24 fps), presets and pools.

Text-to-video sizes are the reference's 16:9 bucket at the release's target size (480p: 848x480,
720p: 1280x720); image-to-video sizes are the image's aspect bucket at the target size (the
pipeline's rule, :class:`~vidax.models.hunyuanvideo15.pipeline.BucketGeometry`; ``area``, the target
size squared, only sizes the sequence-parallel fallback)."""
from vidax.pipeline import Recipe, tpu

_T2V = "vidax.models.hunyuanvideo15.pipeline:HunyuanVideo15T2V"
_I2V = "vidax.models.hunyuanvideo15.pipeline:HunyuanVideo15I2V"
_V5E = "tpu-v5-lite-podslice"
_OPTS = ("shift", "vae_tiling", "vae_chunk")
# encode: the Qwen2.5-VL-7B text tower in float32 (30 GB) sharded over 8 chips; sample: the 8.3B DiT
# (17 GB in bf16) with CFG on dp=2 and its 16 heads over 4; decode: the 32-channel VAE, one stage per
# 256-px tile (on by default), 4 latent frames (16 video frames) per call carrying the causal state:
# 8.0 GiB peak on one chip at 720p x 121 frames (`vidax plan`; all 121 frames at once needed ~24 GiB)
_POOLS = {None: {"encode": tpu(_V5E, "2x4", 8), "sample": tpu(_V5E, "2x4", 8), "decode": tpu(_V5E, "2x2", 4)}}
_I2V_TINY = {("tiny", True): "tiny-i2v"}

RECIPES = [
    Recipe(
        "hunyuanvideo1.5-480p-t2v", _T2V, ("tiny",),
        dict(vae_tiling=True, height=480, width=848, num_frames=121, steps=50, guidance=6.0, shift=5.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 text-to-video, 8.3B (480p, 121 frames)", prefer_axis="tp",
        stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo1.5-480p-i2v", _I2V, ("tiny",),
        dict(vae_tiling=True, area=640 * 640, num_frames=121, steps=50, guidance=6.0, shift=5.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 image-to-video, 8.3B (480p; SigLIP tokens + first-frame latent)",
        prefer_axis="tp", image="required", preset_sources=_I2V_TINY, stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo1.5-720p-t2v", _T2V, ("tiny",),
        dict(vae_tiling=True, height=720, width=1280, num_frames=121, steps=50, guidance=6.0, shift=9.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 text-to-video, 8.3B (720p, 121 frames)", prefer_axis="tp",
        stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo1.5-720p-i2v", _I2V, ("tiny",),
        dict(vae_tiling=True, area=960 * 960, num_frames=121, steps=50, guidance=6.0, shift=7.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 image-to-video, 8.3B (720p; SigLIP tokens + first-frame latent)",
        prefer_axis="tp", image="required", preset_sources=_I2V_TINY, stage_jobs=_POOLS,
    ),
]
