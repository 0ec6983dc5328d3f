"""Prefect flows over the vidax stages (see flows/flows.py); `vidax submit` lives in flows/cli.py."""
