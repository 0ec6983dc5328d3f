"""LTX recipes: the model ids users ask for, their defaults, presets and pools."""
from vidax.pipeline import Recipe, tpu

_V5E = "tpu-v5-lite-podslice"
_LTX1 = ("guidance_rescale", "decode_timestep", "decode_noise_scale", "vae_tiling")

RECIPES = [
    Recipe(
        "ltx-video-0.9", "vidax.models.ltx.ltxv:LTXVideo", ("tiny",),
        dict(height=512, width=704, num_frames=161, steps=50, guidance=3.0, fps=25),
        option_names=_LTX1, description="LTX-Video 0.9.x text-to-video (T5-XXL with its mask; 2B and 13B DiTs)",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x2", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
    Recipe(
        "ltx-video-0.9-i2v", "vidax.models.ltx.ltxv:LTXVideoI2V", ("tiny",),
        dict(height=512, width=704, area=512 * 704, num_frames=161, steps=50, guidance=3.0, fps=25),
        option_names=_LTX1, image="required",
        description="LTX-Video 0.9.x image-to-video (the first latent frame is the image's, kept at timestep 0)",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x2", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
]

_LTX2 = ("audio", "audio_guidance", "stg_scale", "audio_stg_scale", "stg_blocks", "modality_scale", "audio_modality_scale",
         "guidance_rescale", "audio_guidance_rescale", "use_cross_timestep", "decode_timestep", "decode_noise_scale",
         "vae_tiling", "vae_decoder", "decoder_steps")
# LTX-2's 19B DiT (LTX-2.5: 22B) is sharded over tp on a 2x4 slice (38 GB of bf16 weights; chunked offload bounds
# the activations of 1216x704x121, as the seed measured: chunk 8 of 48 blocks); Gemma 3 12B encodes on a 2x4 slice
# (float32, sharded over tp) and the VAE tiles, the audio and the diffusion decoder (tp) decode on one too
RECIPES += [
    Recipe(
        "ltx2-t2v", "vidax.models.ltx.ltx2:LTX2", ("tiny",),
        dict(dtype="bfloat16", height=704, width=1216, num_frames=121, steps=30, guidance=3.0, fps=24),
        option_names=_LTX2, prefer_axis="tp",
        description="LTX-2.x text-to-audio+video (Gemma 3, audio and video streams, mp4 with sound; LTX-2.5 too)",
        stage_jobs={None: {"encode": tpu(_V5E, "2x4", 8), "sample": tpu(_V5E, "2x4", 8),
                           "decode": tpu(_V5E, "2x4", 8)}},
    ),
    Recipe(
        "ltx2-i2v", "vidax.models.ltx.ltx2:LTX2I2V", ("tiny",),
        dict(dtype="bfloat16", height=704, width=1216, area=704 * 1216, num_frames=121, steps=30, guidance=3.0, fps=24),
        option_names=_LTX2 + ("image_crf",), image="required", prefer_axis="tp",
        description="LTX-2.x image-to-audio+video (first latent frame from the image, per-token timesteps)",
        stage_jobs={None: {"encode": tpu(_V5E, "2x4", 8), "sample": tpu(_V5E, "2x4", 8),
                           "decode": tpu(_V5E, "2x4", 8)}},
    ),
]
