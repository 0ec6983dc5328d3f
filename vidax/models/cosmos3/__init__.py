"""Cosmos3 (Nano, Edge): the ``Cosmos3OmniTransformer`` Mixture-of-Transformers (a causal text
pathway and a full-attention vision pathway over one sequence, separate weights per modality, no
AdaLN), the release's structured prompt format, the pipeline on the Wan2.2 VAE (48 channels).

Video generation only: sound and action generation are not ported."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "Cosmos3OmniTransformer": "vidax.models.cosmos3.mot",
}
