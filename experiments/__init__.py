"""Thin absl entry points: python -m experiments.NAME --flags."""
