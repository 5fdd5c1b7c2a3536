"""Slot bookkeeping shared by the routed-expert implementations: empty slots, distinct experts, sort by expert.

A routing is expert ids [T, K] (slot s = t * K + k); an id outside [0, E) is an empty slot that contributes
zero. Everything here is plain jnp with static output shapes (jit-able); the Pallas backends (TPU and GPU) build
their grids from `expert_combine` (decode) and `prefill_tiles` (prefill).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clean_ids(topk_ids_tk: jax.Array, n_experts: int) -> jax.Array:
    """Flat slot ids int32 [T*K], anything outside [0, E) mapped to E (the empty slot)."""
    flat = topk_ids_tk.reshape(-1).astype(jnp.int32)
    return jnp.where((flat >= 0) & (flat < n_experts), flat, n_experts)


def distinct_experts(topk_ids_tk: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(ids [max(1, min(T*K, E))] of the distinct routed experts ascending, padded with E; their count U)."""
    t, k = topk_ids_tk.shape
    n_max = max(1, min(t * k, n_experts))
    uniq = jnp.unique(clean_ids(topk_ids_tk, n_experts), size=n_max, fill_value=n_experts)
    return uniq, jnp.sum(uniq < n_experts).astype(jnp.int32)


def sort_by_expert(
    topk_ids_tk: jax.Array, n_experts: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(flat, order, sizes, starts): `clean_ids`; the slots sorted by expert (stable, empty slots last) [T*K];
    rows per expert [E] int32 (empty slots not counted); first sorted row of each expert [E]."""
    flat = clean_ids(topk_ids_tk, n_experts)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    return flat, order, sizes, jnp.cumsum(sizes) - sizes


def expert_combine(ids_tk: jax.Array, w_tk: jax.Array, n_experts: int):
    """The step's distinct experts: (uids [U] int32, n_valid [1] int32, combine [U, T] f32), U = min(T K, E).

    uids: the distinct ids in ascending order, padded past n_valid with the last one (0 if none);
    combine[u, t] = sum_k w[t, k] [ids[t, k] == uids[u]] for u < n_valid, else 0. Ids outside [0, E) are
    empty slots.
    """
    t, k = ids_tk.shape
    uniq, nv = distinct_experts(ids_tk, n_experts)  # ascending; E (empty) sorts last
    key = clean_ids(ids_tk, n_experts).reshape(t, k)
    last = uniq[jnp.maximum(nv - 1, 0)]
    slot = jnp.arange(uniq.shape[0])
    uids = jnp.clip(jnp.where(slot < nv, uniq, last), 0, n_experts - 1).astype(jnp.int32)
    hit = (key[None, :, :] == uids[:, None, None]) & (slot < nv)[:, None, None]  # [U, T, K]
    combine = jnp.sum(jnp.where(hit, w_tk.astype(jnp.float32)[None], 0.0), axis=-1)
    return uids, nv.reshape(1), combine


def prefill_tiles(ids_tk: jax.Array, n_experts: int, row_tile: int):
    """Slots sorted by expert and padded to row tiles (XLA, jit-able).

    Returns a dict: tile_expert [NT] int32 (expert of each row tile; tiles past n_tiles repeat the last real
    one), n_tiles [1] int32 (real tiles), row_token [NT * row_tile] int32 (token of each padded row, -1 for
    padding), dest [T K] int32 (padded row of each slot, flat slot order t * K + k; -1 for empty slots).
    NT = G + (T K - G) // row_tile with G = min(E, T K): the most row tiles any routing can need.
    """
    t, k = ids_tk.shape
    s, tm = t * k, row_tile
    key, order, sizes, g_off = sort_by_expert(ids_tk, n_experts)  # [S], [S], [E], [E]
    tiles = (sizes + tm - 1) // tm  # [E]
    t_end = jnp.cumsum(tiles)
    t_off = t_end - tiles
    nvt = t_end[-1].astype(jnp.int32)
    g = min(n_experts, s)
    nt = g + (s - g) // tm
    i = jnp.arange(nt)
    te = jnp.searchsorted(t_end, jnp.minimum(i, jnp.maximum(nvt - 1, 0)), side="right")
    te = jnp.clip(te, 0, n_experts - 1).astype(jnp.int32)
    rows = jnp.arange(nt * tm)
    e_row = te[rows // tm]
    rank = rows - t_off[e_row] * tm  # position within the expert's group
    ok = (rows // tm < nvt) & (rank < sizes[e_row])
    src = jnp.clip(g_off[e_row] + rank, 0, s - 1)
    row_token = jnp.where(ok, order[src] // k, -1).astype(jnp.int32)
    q = jnp.arange(s)  # sorted position
    e_sorted = jnp.minimum(key[order], n_experts - 1)
    dest_sorted = jnp.where(key[order] < n_experts, t_off[e_sorted] * tm + q - g_off[e_sorted], -1)
    dest = jnp.zeros((s,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))
    return {"tile_expert": te, "n_tiles": nvt.reshape(1), "row_token": row_token, "dest": dest}
