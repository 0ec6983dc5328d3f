"""Cosmos3 recipes: Nano (Qwen3-VL-8B towers, 720p) and Edge (Nemotron-2B towers, 480p)."""
from vidax.pipeline import Recipe, tpu

_P = "vidax.models.cosmos3.pipeline:Cosmos3Omni"
_V5E = "tpu-v5-lite-podslice"
_V5P = "tpu-v5p-slice"

RECIPES = [
    Recipe(
        "cosmos3-nano", _P, ("tiny",),
        # the reference's defaults: 189 frames (~7.9 s at 24 fps), 720x1280, 35 steps, guidance 6
        # 720p decodes in 256-px tiles by default (whole frames need ~19 GiB on one chip: `vidax plan`)
        dict(dtype="bfloat16", vae_tiling=True, height=720, width=1280, area=720 * 1280, num_frames=189, steps=35,
             guidance=6.0, fps=24),
        description="Cosmos3 Nano: Mixture-of-Transformers (causal text + full-attention vision pathways), "
                    "text/image/video-to-video, Wan2.2 VAE; give structured JSON prompts",
        image="optional", prefer_axis="tp",
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5P, "2x2x1", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
    Recipe(
        "cosmos3-edge", _P, ("tiny",),
        dict(height=480, width=832, area=480 * 832, num_frames=189, steps=35, guidance=6.0, fps=24),
        description="Cosmos3 Edge (Nemotron backbone, 480p): warns on short unstructured prompts, which it "
                    "renders flat -- give the structured JSON format",
        image="optional", prefer_axis="sp",
        preset_sources={("tiny", False): "tiny-edge", ("tiny", True): "tiny-edge"},
        pipeline_kwargs={"warn_short_prompts": True},
        stage_jobs={None: {"encode": tpu(_V5E, "2x2", 4), "sample": tpu(_V5E, "2x2", 4),
                           "decode": tpu(_V5E, "2x2", 4)}},
    ),
]
