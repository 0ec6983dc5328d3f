"""A test-only model family with what Wan lacks: embedded guidance (no CFG batch), 8k+1 frames,
audio latents, an audio decode stage and a sound track. It exercises the pipeline protocol through
the stages exactly as a real family would (registered with ``VIDAX_FAMILIES=tests.toyfamily.recipes``).
Its "model" is a few lines of JAX, so runs take a second."""
