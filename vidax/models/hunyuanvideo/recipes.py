"""HunyuanVideo 1.0 recipes: the model ids users ask for, their defaults (the releases' 720p x 129
frames, 50 steps, embedded guidance 6, shift 7), presets and pools."""
from vidax.pipeline import Recipe, tpu

_T2V = "vidax.models.hunyuanvideo.pipeline:HunyuanVideoT2V"
_I2V = "vidax.models.hunyuanvideo.pipeline:HunyuanVideoI2V"
_V5E = "tpu-v5-lite-podslice"
# encode: the Llama-3-8B (I2V: LLaVA) tower in float32 (32 GB) sharded over 8 chips; sample: the 13B
# DiT (26 GB in bf16) split over 8 chips, offloading per pool when the 129-frame activations need
# the room; decode: temporal tiles of the VAE in 256-px spatial tiles
_POOLS = {None: {"encode": tpu(_V5E, "2x4", 8), "sample": tpu(_V5E, "2x4", 8), "decode": tpu(_V5E, "2x2", 4)}}

RECIPES = [
    Recipe(
        "hunyuanvideo-t2v", _T2V, ("tiny",),
        dict(dtype="bfloat16", height=720, width=1280, num_frames=129, steps=50, guidance=6.0, shift=7.0, fps=24),
        description="HunyuanVideo 1.0 text-to-video, 13B (720p, 129 frames; embedded guidance)", prefer_axis="tp",
        stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo-i2v", _I2V, ("tiny",),
        dict(dtype="bfloat16", area=720 * 1280, num_frames=129, steps=50, guidance=6.0, shift=7.0, fps=24),
        description="HunyuanVideo-I2V 13B: first-frame token replacement, LLaVA prompt with the image (720p)",
        prefer_axis="tp", image="required", preset_sources={("tiny", True): "tiny-i2v"}, stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo-i2v-33ch", _I2V, ("tiny",),
        dict(dtype="bfloat16", area=720 * 1280, num_frames=129, steps=50, guidance=1.0, shift=7.0, fps=24),
        description="HunyuanVideo-I2V-33ch 13B: image latent concatenated on channels, first 4 frames dropped (720p)",
        prefer_axis="tp", image="required", preset_sources={("tiny", True): "tiny-i2v-33ch"}, stage_jobs=_POOLS,
    ),
]
