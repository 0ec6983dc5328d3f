"""CogVideoX 1.0 (2B, 5B, 5B-I2V) and 1.5 (5B T2V / I2V): the joint text+video DiT, the CogVideoX
causal VAE, the pipeline (T5-XXL in float32 without a mask, DDIM / DPM v-prediction, dynamic CFG).

``vidax.models.cogvideox.vae`` and ``.dit`` import nothing of the pipeline."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "CogVideoXTransformer3DModel": "vidax.models.cogvideox.dit",
    "AutoencoderKLCogVideoX": "vidax.models.cogvideox.vae",
}
