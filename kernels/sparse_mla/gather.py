"""Sparse MLA that reads only the selection: gather the selected pools' latent rows, attend over them.

Per query the visible keys are at most K selected pools plus the tail, so a query reads (K + 1) * kpool latent rows
whatever the context: O(index_topk), not O(S) as the masked dense reference does. The positions are

    selected:  kpool * p + j   for every valid, distinct selected pool p (j < kpool)
    tail:      kpool * floor((q + 1) / kpool) + j                       (select_tail only)

each kept iff it is <= q and < S. A selected id is dropped when it is -1, out of range, a repeat of another slot
of the same query (the reference's mask is a set), or (with select_tail) the tail pool itself, whose visible
rows the tail already covers. Ids are sorted first, so repeats are neighbours and the gather walks the cache in
order.

The latent may be stored as int8 with one f32 scale per row (`latent_scale_bs`): only the gathered rows are
dequantized. Rows are cast to q's dtype (what the layer's reference path attends with), then the math runs in f32.

Long query runs (prefill) are processed in blocks of `q_block` queries (`lax.map`), so the gathered rows
[B, q_block, (K + 1) * kpool, R] bound the temporaries instead of growing with T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm53.quant.int8 import dequantize_rows

_HI = jax.lax.Precision.HIGHEST
Q_BLOCK = 32  # queries per block in prefill


def selection_positions(
    pool_ids_btk: jnp.ndarray, q_pos_bt: jnp.ndarray, *, kpool: int, num_keys: int, select_tail: bool
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Key positions int32 [B, T, N] (N = (K + select_tail) * kpool, clipped into range) and their validity."""
    num_pools = -(-num_keys // kpool)
    q = q_pos_bt[:, :, None]
    tail = (q + 1) // kpool  # [B, T, 1]: the query's incomplete pool
    ids = jnp.where((pool_ids_btk < 0) | (pool_ids_btk >= num_pools), num_pools, pool_ids_btk)
    if select_tail:
        ids = jnp.where(ids == tail, num_pools, ids)
    ids = jnp.sort(ids, axis=-1)
    first = jnp.concatenate([jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], axis=-1)
    ok = first & (ids < num_pools)
    if select_tail:
        ids = jnp.concatenate([ids, tail], axis=-1)
        ok = jnp.concatenate([ok, jnp.ones_like(tail, bool)], axis=-1)
    pos = ids[..., None] * kpool + jnp.arange(kpool, dtype=ids.dtype)  # [B, T, K', kpool]
    valid = ok[..., None] & (pos <= q[..., None]) & (pos < num_keys)
    b, t = q_pos_bt.shape
    pos = jnp.clip(pos, 0, num_keys - 1).astype(jnp.int32)
    return pos.reshape(b, t, -1), valid.reshape(b, t, -1)


def _attend(q_bthr, latent_bsr, scale_bs, pool_ids_btk, q_pos_bt, *, kpool, scale, select_tail):
    b, t = q_pos_bt.shape
    pos, valid = selection_positions(
        pool_ids_btk, q_pos_bt, kpool=kpool, num_keys=latent_bsr.shape[1], select_tail=select_tail
    )
    flat = pos.reshape(b, -1)
    rows = jax.vmap(lambda lat, p: lat[p])(latent_bsr, flat)  # [B, T*N, R]
    sc = None if scale_bs is None else jax.vmap(lambda s, p: s[p])(scale_bs, flat)
    kv = dequantize_rows(rows, sc, q_bthr.dtype).astype(jnp.float32).reshape(b, t, -1, rows.shape[-1])
    s = jnp.einsum("bthr,btnr->bthn", q_bthr.astype(jnp.float32), kv, precision=_HI) * scale
    m = valid[:, :, None, :]
    s = jnp.where(m, s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(m, jnp.exp(s - mx), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bthn,btnr->bthr", p, kv, precision=_HI)
    return o.astype(q_bthr.dtype)


def sparse_mla(
    q_bthr: jnp.ndarray,
    latent_bsr: jnp.ndarray,
    pool_ids_btk: jnp.ndarray,
    q_pos_bt: jnp.ndarray,
    *,
    kpool: int,
    scale: float,
    select_tail: bool = True,
    latent_scale_bs: jnp.ndarray | None = None,
    q_block: int = Q_BLOCK,
) -> jnp.ndarray:
    """Absorbed sparse MLA over the gathered selection (same contract as `reference.sparse_mla`)."""
    kw = dict(kpool=kpool, scale=scale, select_tail=select_tail)
    b, t = q_pos_bt.shape
    if t <= q_block:
        return _attend(q_bthr, latent_bsr, latent_scale_bs, pool_ids_btk, q_pos_bt, **kw)
    nb = -(-t // q_block)
    pad = nb * q_block - t

    def blocks(x):  # [B, T, ...] -> [nb, B, q_block, ...]; padded queries sit at position 0 (discarded)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nb, q_block, *x.shape[2:]), 1, 0)

    def one(args):
        q, ids, qp = args
        return _attend(q, latent_bsr, latent_scale_bs, ids, qp, **kw)

    o = jax.lax.map(one, (blocks(q_bthr), blocks(pool_ids_btk), blocks(q_pos_bt)))
    return jnp.moveaxis(o, 0, 1).reshape(b, nb * q_block, *o.shape[3:])[:, :t]
