"""HunyuanVideo 1.0 (text-to-video and image-to-video): the dual-/single-stream DiT, its causal 3D
VAE, the prompt conditioning (Llama hidden states after the prompt template + CLIP-L pooled text),
the pipelines. ``dit`` and ``vae`` import nothing of the pipeline, so other families reuse them."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "HunyuanVideoTransformer3DModel": "vidax.models.hunyuanvideo.dit",
    "AutoencoderKLHunyuanVideo": "vidax.models.hunyuanvideo.vae",
}
