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
_MEANFLOW_TINY = {("tiny", True): "tiny-i2v-meanflow"}

RECIPES = [
    Recipe(
        "hunyuanvideo1.5-480p-t2v", _T2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, height=480, width=848, num_frames=121, steps=50, guidance=6.0, shift=5.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 text-to-video, 8.3B (480p, 121 frames)", prefer_axis="tp",
        stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo1.5-480p-i2v", _I2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, area=640 * 640, num_frames=121, steps=50, guidance=6.0, shift=5.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 image-to-video, 8.3B (480p; SigLIP tokens + first-frame latent)",
        prefer_axis="tp", image="required", preset_sources=_I2V_TINY, stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo1.5-720p-t2v", _T2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, height=720, width=1280, num_frames=121, steps=50, guidance=6.0, shift=9.0,
             fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 text-to-video, 8.3B (720p, 121 frames)", prefer_axis="tp",
        stage_jobs=_POOLS,
    ),
    Recipe(
        "hunyuanvideo1.5-720p-i2v", _I2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, area=960 * 960, num_frames=121, steps=50, guidance=6.0, shift=7.0, fps=24),
        option_names=_OPTS, description="HunyuanVideo 1.5 image-to-video, 8.3B (720p; SigLIP tokens + first-frame latent)",
        prefer_axis="tp", image="required", preset_sources=_I2V_TINY, stage_jobs=_POOLS,
    ),
    # CFG-distilled releases (`<res>_<task>_distilled`): the same DiT trained to need no
    # unconditional pass; diffusers' conversion gives them guidance 1 (no negative batch) and the
    # base release's shift; 50 steps (the pipelines' and the original generate.py's default)
    *[Recipe(
        f"hunyuanvideo1.5-{res}-{task}-distilled", _I2V if task == "i2v" else _T2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, **size, num_frames=121, steps=50, guidance=1.0, shift=shift, fps=24),
        option_names=_OPTS, prefer_axis="tp", stage_jobs=_POOLS,
        description=f"HunyuanVideo 1.5 {'image' if task == 'i2v' else 'text'}-to-video, 8.3B, CFG-distilled ({res})",
        **(dict(image="required", preset_sources=_I2V_TINY) if task == "i2v" else {}),
    ) for res, task, size, shift in (
        ("480p", "t2v", dict(height=480, width=848), 5.0), ("480p", "i2v", dict(area=640 * 640), 5.0),
        ("720p", "t2v", dict(height=720, width=1280), 9.0), ("720p", "i2v", dict(area=960 * 960), 7.0))],
    # the step-distilled 480p image-to-video release (`480p_i2v_step_distilled`): a meanflow DiT
    # (`timestep_r`: the next timestep), guidance 1 and shift 7 as diffusers converts it; 8 steps
    # (the model card: "8 or 12 steps recommended", 4 faster at some quality cost)
    Recipe(
        "hunyuanvideo1.5-480p-i2v-step-distilled", _I2V, ("tiny",),
        dict(dtype="bfloat16", vae_tiling=True, area=640 * 640, num_frames=121, steps=8, guidance=1.0, shift=7.0, fps=24),
        option_names=_OPTS, prefer_axis="tp", image="required", preset_sources=_MEANFLOW_TINY, stage_jobs=_POOLS,
        description="HunyuanVideo 1.5 image-to-video, 8.3B, step-distilled meanflow (480p, 8 steps)",
    ),
]
