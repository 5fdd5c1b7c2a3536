"""Kernels of glm53: one folder per op, each with api.py (implementation=), reference.py and backends."""
