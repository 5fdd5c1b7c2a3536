"""Slot operations on a `glm53.model.Cache`: every array's batch axis named once (`map_rows`), and the row copies
the runtime's programs are made of (`narrow`, `put`, `move`, `write_rows`).

A LayerStack's cache (glm53.layers.stack, scan_layers) holds arrays [repeats, B, ...]: its batch axis is 1, every
other cache array's is 0. `map_layers` / `map_rows` hand each array its axis, so the same slices and in-place
updates serve an unrolled and a scanned model alike (no unstacking, no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from glm53.model import Cache


def map_layers(fn, layers: tuple, *others: tuple) -> tuple:
    """fn(layer cache, *the others' entries at the same place, lead=...) for every layer cache of a `Cache.layers`
    tuple. A LayerStack's entry (glm53.layers.stack: a tuple over its period positions of caches whose arrays are
    [repeats, B, ...]) gives fn each position's cache with lead=1, a plain layer's cache comes with lead=0: fn's
    batch axis is `lead`, its sequence axis lead + 1. The stack is read and written where it lies (no unstacking,
    no copy): the same slices and in-place updates as an unrolled cache's, one axis further."""

    def one(c, *o):
        if isinstance(c, tuple):
            return tuple(fn(cj, *oj, lead=1) for cj, *oj in zip(c, *o))
        return fn(c, *o, lead=0)

    return tuple(one(c, *o) for c, *o in zip(layers, *others))


def map_rows(op, cache: Cache, *others: Cache) -> Cache:
    """`cache` with op(a, *the others' arrays at the same place, axis=a's batch axis) on every array: its length,
    every layer's cache (axis 1 in a LayerStack's stacked caches, `map_layers`) and the MTP block's."""

    def per(c, *o, lead):
        return jax.tree.map(lambda a, *b: op(a, *b, axis=lead), c, *o)

    return cache.replace(
        length=op(cache.length, *(o.length for o in others), axis=0),
        layers=map_layers(per, cache.layers, *(o.layers for o in others)),
        mtp=per(cache.mtp, *(o.mtp for o in others), lead=0),
    )


def narrow(decode: Callable, b: int) -> Callable:
    """`decode(state, cache, *rows)` (every `rows` argument has b rows) on the first b rows of a wider cache,
    which it only reads: -> (out, the b rows' new cache), which `put` writes back (a second program)."""

    def run(state, cache, *rows):
        return decode(state, map_rows(lambda a, axis: jax.lax.slice_in_dim(a, 0, b, axis=axis), cache), *rows)

    return run


def put(cache, rows):
    """The cache with `rows` (a cache of its first b slots) written over its first b slots (donate `cache`)."""

    def one(a, n, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, n.astype(a.dtype), 0, axis)

    return map_rows(one, cache, rows)


def move(cache, src, dst):
    """The cache with slot `src`'s rows (every array, every position) copied over slot `dst`'s."""

    def one(a, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis), dst, axis)

    return map_rows(one, cache)


def write_rows(cache, staging, slots):
    """The cache with staging row i written over slot `slots[i]` for every i whose slot is >= 0 (the others, a
    group's padding and cancelled rows, write nothing: slot 0's own rows back). Every array, every position."""
    for i in range(slots.shape[0]):
        ok = slots[i] >= 0
        dst = jnp.where(ok, slots[i], 0)

        def one(a, s, axis, i=i, ok=ok, dst=dst):
            row = jax.lax.slice_in_dim(s, i, i + 1, axis=axis).astype(a.dtype)
            row = jnp.where(ok, row, jax.lax.dynamic_slice_in_dim(a, dst, 1, axis))
            return jax.lax.dynamic_update_slice_in_dim(a, row, dst, axis)

        cache = map_rows(one, cache, staging)
    return cache
