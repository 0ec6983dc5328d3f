"""Cosmos-Predict2.5 (2B, 14B): the ``CosmosTransformer3DModel`` DiT, its Qwen2.5-VL text features
(every layer's hidden states, normalised and concatenated), the pipeline (text-, image- and
video-to-world by latent substitution) on the Wan2.1 VAE.

Cosmos3 (the Mixture-of-Transformers omni model) is the sibling family ``vidax.models.cosmos3``."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "CosmosTransformer3DModel": "vidax.models.cosmos.dit",
}
