"""Parameter helpers: every parameter carries its logical axis names as ``logical_axes`` metadata."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype=jnp.float32,
    init: str | float = "normal",
    std: float = 0.02,
) -> nnx.Param:
    """Creates an `nnx.Param` of `shape` tagged with `axes` (one logical name per dim).

    init: "normal" (N(0, std^2), needs rngs), "zeros", "ones", or a float constant.
    """
    shape = tuple(int(s) for s in shape)
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"param: {len(axes)} axis names {axes} for shape {shape}")
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif isinstance(init, (int, float)):
        value = jnp.full(shape, float(init), jnp.float32)
    else:
        raise ValueError(f"param: unknown init {init!r}")
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names of a parameter (None when it has none)."""
    return variable.get_metadata().get("logical_axes")
