"""Shared model math: layers, norms, attention, rotary embeddings, timestep embeddings."""
