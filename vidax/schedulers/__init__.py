"""Noise schedulers."""
