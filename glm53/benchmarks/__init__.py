"""Benchmark logic behind the experiments.bench_* entry points, on one shared harness."""
