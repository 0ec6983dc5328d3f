"""Benchmark cases of each model family (``CASES`` in ``<family>.py``; see ``benchmarks/run.py``)."""
