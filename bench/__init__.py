"""Benchmarks (not part of the package): ``python -m bench.locks``."""
