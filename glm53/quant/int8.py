"""Int8 per-output-channel weight storage for large dense matrices.

`Int8Weight` is a pytree leaf-pair (int8 values + f32 scale per output channel) that can stand in for the value
of a Linear ``kernel`` Param: ``kernel[...]`` returns the dequantized matrix, so code that reads the kernel
directly keeps working, and `Linear` multiplies by the int8 values and rescales the product instead.

    w[..., i, o] ~= values[..., i, o] * scale[..., o]        values in [-127, 127]

`Int8Rows` is the same for a lookup table (the embedding): int8 rows + one f32 scale per row; a lookup gathers
int8 rows and dequantizes only those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class _Int8Array:
    """What an int8 leaf (`values` + `scale`, `dequantize`) shows of the dense array it stands in for: its shape,
    and ``leaf[...]`` / ``leaf.astype(dtype)`` dequantizing it whole."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    def __getitem__(self, idx) -> jax.Array:
        return self.dequantize()[idx]

    def astype(self, dtype) -> jax.Array:
        return self.dequantize(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight(_Int8Array):
    """Symmetric int8 matrix [..., in, out] with one f32 scale per output column [..., out]."""

    values: jax.Array  # int8 [..., in, out]
    scale: jax.Array  # f32 [..., out]
    dtype: np.dtype = dataclasses.field(default=np.dtype(np.float32), metadata=dict(static=True))

    def dequantize(self, dtype=None) -> jax.Array:
        """values * scale in f32, cast to `dtype` (default: the dtype the weight was quantized from)."""
        w = self.values.astype(jnp.float32) * self.scale.astype(jnp.float32)[..., None, :]
        return w.astype(self.dtype if dtype is None else dtype)

    def matmul(self, x: jax.Array, *, precision=None) -> jax.Array:
        """x @ w for x [..., in]: the product with the int8 values (in x.dtype) times the column scales."""
        y = jnp.matmul(x, self.values.astype(x.dtype), precision=precision)
        return y * self.scale.astype(x.dtype)


def quantize_int8(w: np.ndarray, dtype=None) -> Int8Weight:
    """Host-side symmetric per-output-channel quantization of w [..., in, out] (numpy, any float dtype).

    scale[o] = max_i |w[i, o]| / 127 (1 for an all-zero column); values = round(w / scale) in [-127, 127].
    `dtype` records the dtype `dequantize()` returns by default (default: w's dtype).
    """
    w32 = np.asarray(w, dtype=np.float32)
    if w32.ndim < 2:
        raise ValueError(f"quantize_int8: need a matrix [..., in, out], got shape {w32.shape}")
    amax = np.max(np.abs(w32), axis=-2)  # [..., out]
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(w32 / scale[..., None, :]), -127, 127).astype(np.int8)
    return Int8Weight(values, scale, np.dtype(w.dtype if dtype is None else dtype))


# ----------------------------------------------------------------------------------- cached rows (the MLA latent)
def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row (traced): x [..., R] -> (values int8 [..., R], scale f32 [...]).

    scale = max |x| / 127 over the row (1 for an all-zero row), values = round(x / scale) in [-127, 127]: the
    MLA latent cache's int8 layout (one scale per cached token)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(x32 / scale[..., None]), -127, 127).astype(jnp.int8)
    return values, scale


def dequantize_rows(values: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """values [..., R] (int8 with scale [...], or already floating with scale None) as `dtype`."""
    if scale is None:
        return values.astype(dtype)
    return (values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


# ----------------------------------------------------------------------------------- looked-up rows (the embedding)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Rows(_Int8Array):
    """Symmetric int8 table [R, C] with one f32 scale per row [R]: a lookup table (the embedding) stored as the
    memory budget says (`glm53.memory.weights.STORAGE["embedding"]`). `take(ids)` gathers the int8 rows and their
    scales and dequantizes only those; ``table[...]`` dequantizes the whole table.

        w[r, c] ~= values[r, c] * scale[r]        values in [-127, 127]
    """

    values: jax.Array  # int8 [R, C]
    scale: jax.Array  # f32 [R]
    dtype: np.dtype = dataclasses.field(default=np.dtype(np.float32), metadata=dict(static=True))

    def dequantize(self, dtype=None) -> jax.Array:
        """values * scale in f32, cast to `dtype` (default: the dtype the table was quantized from)."""
        return dequantize_rows(self.values, self.scale, self.dtype if dtype is None else dtype)

    def take(self, ids: jax.Array, dtype=None) -> jax.Array:
        """Rows `ids` [...] -> [..., C]: the int8 rows and their scales gathered, then dequantized (in f32, cast
        to `dtype`, default the table's): what `jnp.take(w, ids, axis=0)` is for the dense table."""
        values = jnp.take(self.values, ids, axis=0)
        scale = jnp.take(self.scale, ids, axis=0)
        return dequantize_rows(values, scale, self.dtype if dtype is None else dtype)


def quantize_int8_rows(w, dtype=None) -> Int8Rows:
    """Symmetric per-row quantization of a table w [R, C] (`quantize_rows`: scale[r] = max_c |w[r, c]| / 127, 1 for
    an all-zero row). `dtype` records the dtype `dequantize()` / `take()` return by default (default: w's)."""
    if np.ndim(w) != 2:
        raise ValueError(f"quantize_int8_rows: need a table [rows, cols], got shape {np.shape(w)}")
    values, scale = quantize_rows(jnp.asarray(w, jnp.float32))
    return Int8Rows(values, scale, np.dtype(w.dtype if dtype is None else dtype))
