"""CogVideoX recipes: the model ids users ask for, their native defaults, presets and pools."""
from vidax.pipeline import Recipe, tpu

_P = "vidax.models.cogvideox.pipeline:CogVideoX"
_V5E = "tpu-v5-lite-podslice"
# encode: T5-XXL (4.8B) computes in float32 on one chip (a bfloat16 checkpoint stays bfloat16 in memory);
# decode: the VAE's frame batches at 768x1360 want a whole v5e chip's memory (or --vae-tiling)
# every release decodes in the reference's tiles by default (as its model cards recommend with
# `pipe.vae.enable_tiling()`): a whole 480x720 frame batch needs ~50 GiB on one chip (`vidax plan`)
_JOBS_1_0 = {None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x2", 4), "decode": tpu(_V5E, "2x2", 4)}}
_JOBS_5B = {None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x4", 8), "decode": tpu(_V5E, "2x2", 4)}}
# 1.5 at 1360x768x81: ~45k video tokens per sample; sp over the 8 chips (dp=2 x sp=4 with CFG)
_JOBS_15 = {None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x4", 8), "decode": tpu(_V5E, "2x4", 8)}}
_T2V_OPTS = ("scheduler", "dynamic_cfg", "vae_tiling")

RECIPES = [
    Recipe("cogvideox-2b", _P, ("tiny",),
           dict(vae_tiling=True, height=480, width=720, num_frames=49, steps=50, guidance=6.0, fps=8),
           description="CogVideoX-2B text-to-video (720x480, 49 frames; 3D sin-cos positions)",
           option_names=_T2V_OPTS, stage_jobs=_JOBS_1_0, preset_sources={("tiny", False): "tiny"}),
    Recipe("cogvideox-5b", _P, ("tiny",),
           dict(dtype="bfloat16", vae_tiling=True, height=480, width=720, num_frames=49, steps=50, guidance=6.0, fps=8),
           description="CogVideoX-5B text-to-video (720x480, 49 frames; 3D rotary)",
           option_names=_T2V_OPTS, stage_jobs=_JOBS_5B, preset_sources={("tiny", False): "tiny-5b"}),
    Recipe("cogvideox-5b-i2v", _P, ("tiny",),
           dict(dtype="bfloat16", vae_tiling=True, height=480, width=720, area=480 * 720, num_frames=49, steps=50, guidance=6.0,
                fps=8),
           description="CogVideoX-5B image-to-video (720x480 fixed: learned positions; the image is resized to it)",
           option_names=_T2V_OPTS, stage_jobs=_JOBS_5B, image="required",
           preset_sources={("tiny", True): "tiny-5b-i2v"}),
    Recipe("cogvideox1.5-5b", _P, ("tiny",),
           dict(dtype="bfloat16", vae_tiling=True, height=768, width=1360, num_frames=81, steps=50, guidance=6.0, fps=16),
           description="CogVideoX1.5-5B text-to-video (1360x768, 81 frames; temporal patch 2)",
           option_names=_T2V_OPTS, stage_jobs=_JOBS_15, preset_sources={("tiny", False): "tiny-1.5"}),
    Recipe("cogvideox1.5-5b-i2v", _P, ("tiny",),
           dict(dtype="bfloat16", vae_tiling=True, area=768 * 1360, num_frames=81, steps=50, guidance=6.0, fps=16),
           description="CogVideoX1.5-5B image-to-video (about 1360x768 at the image's aspect, 81 frames; ofs)",
           option_names=_T2V_OPTS, stage_jobs=_JOBS_15, image="required",
           preset_sources={("tiny", True): "tiny-1.5-i2v"}),
]
