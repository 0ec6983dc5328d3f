"""Store-to-store pipeline stages (prompt encode, sampling, decode, mux)."""
