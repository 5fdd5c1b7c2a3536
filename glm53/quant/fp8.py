"""FP8 e4m3 weights with 128x128 block scales (`weight_scale_inv`), the HF release checkpoint's format.

A weight `w` [..., out, in] (float8_e4m3fn, or its raw uint8 bits) comes with `weight_scale_inv`
[..., ceil(out / 128), ceil(in / 128)]; the real weight is w[i, j] * scale_inv[i // 128, j // 128]. Edge blocks
may be partial. The product is formed in f32 (exact fp8 -> f32 conversion, one rounding) and then cast to the
requested dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = (128, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand(s: jax.Array, axis: int, block: int, size: int) -> jax.Array:
    """Repeats each entry of `s` along `axis` `block` times and trims to `size` (partial last block)."""
    return lax.slice_in_dim(jnp.repeat(s, block, axis=axis), 0, size, axis=axis)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def _dequantize(w: jax.Array, s: jax.Array, block: tuple[int, int], dtype: np.dtype) -> jax.Array:
    if w.dtype == jnp.uint8:
        w = lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
    rows, cols = w.shape[-2:]
    s = _expand(_expand(s.astype(jnp.float32), -2, block[0], rows), -1, block[1], cols)  # [..., rows, cols]
    return (w.astype(jnp.float32) * s).astype(dtype)


def dequantize_fp8(
    weight: jax.Array | np.ndarray,
    scale_inv: jax.Array | np.ndarray,
    *,
    block: tuple[int, int] = BLOCK,
    dtype=jnp.float32,
    name: str = "weight",
) -> jax.Array:
    """FP8 e4m3 `weight` [..., out, in] x block scales `scale_inv` [..., ceil(out/b0), ceil(in/b1)] -> `dtype`.

    `weight` is float8_e4m3fn or uint8 (its bits); `scale_inv` is f32/bf16/f16. `name` labels errors. Jit-able.
    """
    wdt = jnp.dtype(weight.dtype)
    if wdt not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)):
        raise ValueError(f"{name}: FP8 weight must be float8_e4m3fn or uint8 bits, got {wdt}")
    if weight.ndim < 2:
        raise ValueError(
            f"{name}: FP8 weight must be at least 2-D [..., out, in], got shape {tuple(weight.shape)}"
        )
    if not jnp.issubdtype(jnp.dtype(scale_inv.dtype), jnp.floating):
        raise ValueError(f"{name}.weight_scale_inv must be floating point, got {scale_inv.dtype}")
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], _cdiv(rows, block[0]), _cdiv(cols, block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}: weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
            f"with {block[0]}x{block[1]} blocks (expected {want})"
        )
    return _dequantize(jnp.asarray(weight), jnp.asarray(scale_inv), tuple(block), np.dtype(dtype))
