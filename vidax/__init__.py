"""vidax: video diffusion transformers in JAX, run as staged, resumable steps."""

__version__ = "0.1.0"
