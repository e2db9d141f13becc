"""Benchmarks: `python -m mlxdist.bench NAME`. Outside the product's import path."""
