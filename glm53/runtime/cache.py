"""Slot operations on a `glm53.model.Cache`: every array's batch axis named once (`map_rows`), and the row copies
the runtime's programs are made of (`narrow`, `put`, `move`, `write_rows`); paged caches' page pools apart from the
rows (`split_pool`, `join_pool`) and their page tables (`set_pages`).

A LayerStack's cache (glm53.layers.stack, scan_layers) holds arrays [repeats, B, ...]: its batch axis is 1, every
other cache array's is 0. `map_layers` / `map_rows` hand each array its axis, so the same slices and in-place
updates serve an unrolled and a scanned model alike (no unstacking, no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from glm53.layers.dsa import PAGED_FIELDS, DSACache
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
    every layer's cache (axis 1 in a LayerStack's stacked caches, `map_layers`) and the MTP block's. The page
    pools of a paged DSA cache (`DSACache.paged`: latent, latent_scale, pooled) have no batch axis: they are
    not rows, and keep `cache`'s (`split_pool` takes them out)."""

    def per(c, *o, lead):
        if isinstance(c, DSACache) and c.paged:
            rows = ("recent_k", "recent_gate", "pages")
            return c.replace(**{f: op(getattr(c, f), *(getattr(x, f) for x in o), axis=lead) for f in rows})
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
    """The cache with `rows` (a cache of its first b slots) written over its first b slots (donate `cache`); a
    paged cache takes `rows`' page pools (the newer)."""

    def one(a, n, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, n.astype(a.dtype), 0, axis)

    return _pools_of(map_rows(one, cache, rows), rows)


def _pools_of(cache, src):
    """`cache` with `src`'s page pools (the newer ones: a paged staging cache and the slots share one pool)."""
    if not is_paged(cache):
        return cache
    return join_pool(split_pool(cache)[0], split_pool(src)[1])


def move(cache, src, dst):
    """The cache with slot `src`'s rows (every array, every position) copied over slot `dst`'s."""

    def one(a, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis), dst, axis)

    return map_rows(one, cache)


def write_rows(cache, staging, slots):
    """The cache with staging row i written over slot `slots[i]` for every i whose slot is >= 0 (the others, a
    group's padding and cancelled rows, write nothing: slot 0's own rows back). Every array, every position; a
    paged cache's rows only, and it takes the staging's page pools (the prefill wrote its pages there)."""
    for i in range(slots.shape[0]):
        ok = slots[i] >= 0
        dst = jnp.where(ok, slots[i], 0)

        def one(a, s, axis, i=i, ok=ok, dst=dst):
            row = jax.lax.slice_in_dim(s, i, i + 1, axis=axis).astype(a.dtype)
            row = jnp.where(ok, row, jax.lax.dynamic_slice_in_dim(a, dst, 1, axis))
            return jax.lax.dynamic_update_slice_in_dim(a, row, dst, axis)

        cache = map_rows(one, cache, staging)
    return _pools_of(cache, staging)


def _each_dsa(fn, cache: Cache, *others) -> tuple:
    """(fn over every layer cache, fn over the MTP block's): fn(c, *others' entries, lead=...) as `map_layers`."""
    layers = map_layers(fn, cache.layers, *others[:1])
    mtp = fn(cache.mtp, *others[1:], lead=0) if cache.mtp is not None else None
    return layers, mtp


def split_pool(cache: Cache) -> tuple[Cache, tuple]:
    """(the cache's rows, its page pools): every paged DSA cache's latent, latent_scale and pooled taken out
    (None in the rows), so that programs can take the pools apart (donated, updated in place) while they slice
    and copy rows. A contiguous cache: (itself, a tree of Nones)."""

    def pool(c, lead):
        return tuple(getattr(c, f) for f in PAGED_FIELDS) if isinstance(c, DSACache) and c.paged else None

    def rows(c, lead):
        return c.replace(**dict.fromkeys(PAGED_FIELDS)) if isinstance(c, DSACache) and c.paged else c

    layers, mtp = _each_dsa(rows, cache)
    return cache.replace(layers=layers, mtp=mtp), _each_dsa(pool, cache)


def join_pool(rows: Cache, pool: tuple) -> Cache:
    """The whole cache again from `split_pool`'s two parts (rows of any width: a staging cache's too)."""

    def one(c, p, lead):
        return c if p is None else c.replace(**dict(zip(PAGED_FIELDS, p)))

    layers, mtp = _each_dsa(one, rows, pool[0], pool[1])
    return rows.replace(layers=layers, mtp=mtp)


def set_pages(cache: Cache, table_bm) -> Cache:
    """The cache with every paged DSA cache's page table (glm53.layers.dsa.DSACache.pages) set to table_bm
    int32 [B, M] (the same for every layer: page ids index each layer's own pool)."""

    def one(c, lead):
        if not (isinstance(c, DSACache) and c.paged):
            return c
        return c.replace(pages=jnp.broadcast_to(jnp.asarray(table_bm, jnp.int32), c.pages.shape))

    layers, mtp = _each_dsa(one, cache)
    return cache.replace(layers=layers, mtp=mtp)


def is_paged(cache: Cache) -> bool:
    """Whether the cache's DSA caches are paged."""
    found = []
    _each_dsa(lambda c, lead: found.append(isinstance(c, DSACache) and c.paged), cache)
    return any(found)
