"""Oracles for tests and benchmarks (transformers in PyTorch); not imported by the modeling code."""
