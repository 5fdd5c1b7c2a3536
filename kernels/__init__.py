"""Kernels of glm53: one folder per op, each with api.py (implementation=), reference.py and backends;
dispatch.py holds the rule every api follows (named implementations raise, only "auto" falls back)."""
