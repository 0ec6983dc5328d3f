"""Cosmos-Predict2.5 recipes: text-, image- (``--image``) and video-to-world (``--video``) in one model."""
from vidax.pipeline import Recipe, tpu

_P = "vidax.models.cosmos.pipeline:CosmosPredict"
_V5E = "tpu-v5-lite-podslice"
_V5P = "tpu-v5p-slice"
# the reference's defaults: 704x1280, 93 frames (24 latent frames), 36 steps, guidance 7, 16 fps
# 704p decodes in 256-px tiles by default (whole frames need ~18 GiB on one chip: `vidax plan`)
_NATIVE = dict(vae_tiling=True, height=704, width=1280, area=704 * 1280, num_frames=93, steps=36, guidance=7.0, fps=16)

RECIPES = [
    Recipe(
        "cosmos2.5-2b", _P, ("tiny",), dict(_NATIVE),
        description="Cosmos-Predict2.5 2B: text/image/video-to-world (latent substitution), Wan2.1 VAE, "
                    "Qwen2.5-VL all-layer text features",
        image="optional", prefer_axis="sp",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x4", 8),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
    Recipe(
        "cosmos2.5-14b", _P, ("tiny",), dict(_NATIVE, dtype="bfloat16"),
        description="Cosmos-Predict2.5 14B: text/image/video-to-world; offload the DiT blocks to fit 93 frames",
        image="optional", prefer_axis="tp",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5P, "2x2x1", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
]
