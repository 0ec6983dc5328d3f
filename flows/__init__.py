"""Prefect flows over the vidax stages."""
