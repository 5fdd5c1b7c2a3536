"""Norms: RMSNorm (transformers convention), gated RMSNorm (KDA output), unweighted RMS norm (mHC), LayerNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.layers.param import param


def rms_normalize(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis, statistics in f32, result in f32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = w * cast(x / rms(x)) -- normalized in f32, cast back to x.dtype, then scaled (transformers order)."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        self.eps = eps
        self.weight = param(rngs, (dim,), (dims.NORM,), dtype, init="ones")

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        y = rms_normalize(x, self.eps).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * y


class GatedRMSNorm(nnx.Module):
    """KDA output norm: (w * x / rms(x)) * sigmoid(gate), all in f32, result cast to x.dtype."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        self.eps = eps
        self.weight = param(rngs, (dim,), (dims.NORM,), dtype, init="ones")

    def __call__(self, x: jnp.ndarray, gate: jnp.ndarray) -> jnp.ndarray:
        y = self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps)
        return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (the indexer's k_norm, eps 1e-6), statistics in f32."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32):
        self.eps = eps
        self.weight = param(rngs, (dim,), (dims.NORM,), dtype, init="ones")
        self.bias = param(rngs, (dim,), (dims.NORM,), dtype, init="zeros")

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x32 = x.astype(jnp.float32)
        mu = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
        y = (x32 - mu) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)
