"""LTX recipes: the model ids users ask for, their defaults, presets and pools."""
from vidax.pipeline import Recipe, tpu

_V5E = "tpu-v5-lite-podslice"
_LTX1 = ("guidance_rescale", "decode_timestep", "decode_noise_scale", "vae_tiling")

RECIPES = [
    Recipe(
        "ltx-video-0.9", "vidax.models.ltx.pipeline:LTXVideo", ("tiny",),
        dict(height=512, width=704, num_frames=161, steps=50, guidance=3.0, fps=25),
        option_names=_LTX1, description="LTX-Video 0.9.x text-to-video (T5-XXL with its mask; 2B and 13B DiTs)",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x2", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
    Recipe(
        "ltx-video-0.9-i2v", "vidax.models.ltx.pipeline:LTXVideoI2V", ("tiny",),
        dict(height=512, width=704, area=512 * 704, num_frames=161, steps=50, guidance=3.0, fps=25),
        option_names=_LTX1, image="required",
        description="LTX-Video 0.9.x image-to-video (the first latent frame is the image's, kept at timestep 0)",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x2", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
]
