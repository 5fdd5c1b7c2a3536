"""GLM-5.3-Flash in JAX / Flax NNX."""

__version__ = "0.1.0"
