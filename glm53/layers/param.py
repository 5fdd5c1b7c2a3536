"""Parameter helpers: every parameter carries its logical axis names as ``logical_axes`` metadata; parameter
paths (the tuples `nnx` uses) print as dotted strings."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Path = tuple[str | int, ...]  # an nnx parameter path, e.g. ("layers", 3, "mlp", "experts", "gate_proj")


def path_str(path: Path) -> str:
    """("layers", 3, "mlp") -> "layers.3.mlp"."""
    return ".".join(str(p) for p in path)


def is_routed_expert(path: Path) -> bool:
    """Whether a parameter path is a routed-expert matrix (``...mlp.experts.{gate,up,down}_proj``)."""
    return len(path) >= 3 and tuple(path[-3:-1]) == ("mlp", "experts")


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
