"""Benchmarks: ``python -m benchmarks.run --op NAME`` (see benchmarks/run.py)."""
