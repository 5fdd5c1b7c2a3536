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
dequantized. A paged latent (`page_table_bm` given: the latent is a pool of pages [P, page_tokens, R] and stream b's
position s lives in page table[b, s // page_tokens], row s % page_tokens) is read through the table: the gather
takes the same rows, only their addresses change. Rows are cast to q's dtype (what the layer's reference path attends with), then the math runs in f32.

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


def page_rows(page_table_bm: jnp.ndarray, pos_bn: jnp.ndarray, page_tokens: int) -> jnp.ndarray:
    """Rows int32 [B, N] of a flattened page pool [P * page_tokens, ...] holding stream b's positions pos_bn[b]; a
    position past the table (a speculative draft's at the context's end) maps to page 0, the scratch page."""
    page = jnp.take_along_axis(page_table_bm, pos_bn // page_tokens, axis=1, mode="fill", fill_value=0)
    return (page * page_tokens + pos_bn % page_tokens).astype(jnp.int32)


def local_page_rows(page_table_bm, pos_bn, page_tokens: int, page_offset, local_pages: int):
    """(rows into this device's flattened block of pages, whether the page is in the block): the block holds
    global pages page_offset .. page_offset + local_pages - 1 (a page pool sharded on its page axis)."""
    page = jnp.take_along_axis(page_table_bm, pos_bn // page_tokens, axis=1, mode="fill", fill_value=0) - page_offset
    here = (page >= 0) & (page < local_pages)
    return (jnp.clip(page, 0, local_pages - 1) * page_tokens + pos_bn % page_tokens).astype(jnp.int32), here


def partial_attention(
    q_bthr, latent_bsr, scale_bs, pool_ids_btk, q_pos_bt, *, kpool, scale, select_tail, num_keys=None, row_offset=0,
    page_table_bm=None, page_offset=0,
):  # fmt: skip
    """Attention over the selected rows that this latent holds: (m, l, o) with m [B, T, H, 1] the max score (-inf
    where no row is visible here), l the sum of exp(score - m), o [B, T, H, R] the unnormalised weighted rows.

    `latent_bsr` holds rows row_offset .. row_offset + S_local - 1 of a cache of `num_keys` rows (default: all
    of them, offset 0): a sequence shard computes its part, and `combine` (or a cross-device reduction of the
    same formula) finishes the softmax. With `page_table_bm` [B, M] the latent is a page pool [P, pt, R] (scales
    [P, pt]) holding M * pt positions per stream; a device's block of a sharded pool holds global pages
    page_offset .. page_offset + P - 1 (rows on other devices' pages are not visible here)."""
    b, t = q_pos_bt.shape
    paged = page_table_bm is not None
    pt = latent_bsr.shape[1]
    s_local = page_table_bm.shape[1] * pt if paged else latent_bsr.shape[1]
    num_keys = s_local if num_keys is None else num_keys
    pos, valid = selection_positions(
        pool_ids_btk, q_pos_bt, kpool=kpool, num_keys=num_keys, select_tail=select_tail
    )
    local = pos - row_offset
    valid = valid & (local >= 0) & (local < s_local)
    flat = jnp.clip(local, 0, s_local - 1).reshape(b, -1)
    if paged:  # the same positions, read through the page table from the flattened pool
        at, here = local_page_rows(page_table_bm, flat, pt, page_offset, latent_bsr.shape[0])
        valid = valid & here.reshape(valid.shape)
        rows = latent_bsr.reshape(-1, latent_bsr.shape[-1])[at]  # [B, T*N, R]
        sc = None if scale_bs is None else scale_bs.reshape(-1)[at]
    else:
        rows = jax.vmap(lambda lat, p: lat[p])(latent_bsr, flat)  # [B, T*N, R]
        sc = None if scale_bs is None else jax.vmap(lambda s, p: s[p])(scale_bs, flat)
    kv = dequantize_rows(rows, sc, q_bthr.dtype).astype(jnp.float32).reshape(b, t, -1, rows.shape[-1])
    s = jnp.einsum("bthr,btnr->bthn", q_bthr.astype(jnp.float32), kv, precision=_HI) * scale
    m = valid[:, :, None, :]
    s = jnp.where(m, s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(m, jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    return mx, jnp.sum(p, axis=-1, keepdims=True), jnp.einsum("bthn,btnr->bthr", p, kv, precision=_HI)


def combine(m, l, o, dtype):
    """The softmax output of one partial attention (no visible key: zeros)."""
    del m
    return (o / jnp.where(l > 0, l, 1.0)).astype(dtype)


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
    num_keys: int | None = None,
    row_offset=0,
    finish=None,
    page_table_bm: jnp.ndarray | None = None,
    page_offset=0,
) -> jnp.ndarray:
    """Absorbed sparse MLA over the gathered selection (same contract as `reference.sparse_mla`).

    Sequence shards pass `num_keys` (the whole cache's rows), `row_offset` (their first row) and `finish`
    (m, l, o, dtype) -> output, which combines the shards' partial softmaxes (default: `combine`, one shard)."""
    finish = combine if finish is None else finish
    kw = dict(kpool=kpool, scale=scale, select_tail=select_tail, num_keys=num_keys, row_offset=row_offset,
              page_table_bm=page_table_bm, page_offset=page_offset)  # fmt: skip

    def attend(q, ids, qp):
        m, l, o = partial_attention(q, latent_bsr, latent_scale_bs, ids, qp, **kw)
        return finish(m, l, o, q.dtype)

    b, t = q_pos_bt.shape
    if t <= q_block:
        return attend(q_bthr, pool_ids_btk, q_pos_bt)
    nb = -(-t // q_block)
    pad = nb * q_block - t

    def blocks(x):  # [B, T, ...] -> [nb, B, q_block, ...]; padded queries sit at position 0 (discarded)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nb, q_block, *x.shape[2:]), 1, 0)

    o = jax.lax.map(lambda a: attend(*a), (blocks(q_bthr), blocks(pool_ids_btk), blocks(q_pos_bt)))
    return jnp.moveaxis(o, 0, 1).reshape(b, nb * q_block, *o.shape[3:])[:, :t]
