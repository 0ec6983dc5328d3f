"""Wan2.1 / Wan2.2: DiT (T2V, I2V, TI2V, A14B experts), the Wan2.1 and Wan2.2 VAEs, the pipeline.

``vidax.models.wan.vae`` imports nothing of the pipeline, so other families reuse the VAE."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "WanTransformer3DModel": "vidax.models.wan.dit",
    "AutoencoderKLWan": "vidax.models.wan.vae",
}
