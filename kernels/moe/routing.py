"""Slot bookkeeping shared by the routed-expert implementations: empty slots, distinct experts, sort by expert.

A routing is expert ids [T, K] (slot s = t * K + k); an id outside [0, E) is an empty slot that contributes
zero. Everything here is plain jnp with static output shapes (jit-able).
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
