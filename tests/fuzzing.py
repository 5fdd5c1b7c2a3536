"""Shared hypothesis settings for the fuzz suites (tests/test_*_fuzz.py)."""

from hypothesis import HealthCheck, settings


def fuzz(n: int) -> settings:
    """n examples, deterministic (derandomized), no deadline, no example database on disk."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
