"""Benchmarks (`python -m bench.<name>`)."""
