"""Pure-jnp reference for sparse MLA attention over KPool selections (f32 accumulation; the oracle).

A selection is given in index form: per query, up to K selected pool ids (``-1`` = empty slot) plus the query's
absolute position. The visible keys of query (b, t) are

    { s : s // kpool in pool_ids[b, t] }  U  tail(t)  (tail only if ``select_tail``),  intersected with s <= q_pos,
    tail(t) = { kpool * floor((q_pos + 1) / kpool) .. q_pos }   (the tokens of the query's incomplete pool).

The reference materializes that set as a boolean mask [B, T, S] and runs a masked softmax attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm53.quant.int8 import dequantize_rows

_HI = jax.lax.Precision.HIGHEST


def selection_mask(
    pool_ids_btk: jnp.ndarray,
    q_pos_bt: jnp.ndarray,
    *,
    kpool: int,
    num_keys: int,
    select_tail: bool = True,
) -> jnp.ndarray:
    """Visible-key mask bool [B, T, S=num_keys] of a KPool selection (see the module docstring)."""
    b, t, _ = pool_ids_btk.shape
    num_pools = -(-num_keys // kpool)
    # Scatter the selected pool ids into a [B, T, P] membership table; -1 (and out-of-range ids) are dropped.
    ids = jnp.where(pool_ids_btk < 0, num_pools, pool_ids_btk)
    bi = jnp.arange(b)[:, None, None]
    ti = jnp.arange(t)[None, :, None]
    sel_btp = jnp.zeros((b, t, num_pools), jnp.bool_).at[bi, ti, ids].set(True, mode="drop")
    s = jnp.arange(num_keys)
    mask = sel_btp[:, :, s // kpool]  # [B, T, S]
    q = q_pos_bt[:, :, None]
    if select_tail:
        tail_start = kpool * ((q + 1) // kpool)
        mask = mask | (s >= tail_start)
    return mask & (s <= q)


def masked_attention(
    q_bthc: jnp.ndarray,
    k_bsgc: jnp.ndarray,
    v_bsge: jnp.ndarray,
    mask_bts: jnp.ndarray,
    *,
    scale: float,
) -> jnp.ndarray:
    """softmax(scale * q.k over the keys where mask is True) @ v, per head; f32 math, output in q's dtype.

    k/v carry g = 1 shared head (MQA, the absorbed MLA form: k = v = latent) or g = H heads (expanded MHA form).
    A query with no visible key gets a zero output.
    """
    h, g = q_bthc.shape[2], k_bsgc.shape[2]
    if g not in (1, h):
        raise ValueError(f"masked_attention: k/v have {g} heads, queries {h}; need 1 or {h}")
    q = q_bthc.astype(jnp.float32)
    if g == 1:  # one shared head: contract it as it is (a broadcast to H heads is materialised by XLA:CPU, [B, S,
        # H, R] per step, which grows with the batch and the context)
        k, v = k_bsgc[:, :, 0].astype(jnp.float32), v_bsge[:, :, 0].astype(jnp.float32)
        s_bhts = jnp.einsum("bthc,bsc->bhts", q, k, precision=_HI) * scale
    else:
        k, v = k_bsgc.astype(jnp.float32), v_bsge.astype(jnp.float32)
        s_bhts = jnp.einsum("bthc,bshc->bhts", q, k, precision=_HI) * scale
    m = mask_bts[:, None]
    s_bhts = jnp.where(m, s_bhts, -jnp.inf)
    mx = jnp.max(s_bhts, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(m, jnp.exp(s_bhts - mx), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bhts,bse->bthe" if g == 1 else "bhts,bshe->bthe", p, v, precision=_HI)
    return o.astype(q_bthc.dtype)


def paged_view(pool_p, page_table_bm: jnp.ndarray) -> jnp.ndarray:
    """Each stream's rows in position order, [B, M * page_tokens, ...], of a page pool [P, page_tokens, ...]
    read through the page table [B, M] (the whole logical cache: the dense paths' and the oracle's view)."""
    b, m = page_table_bm.shape
    return pool_p[page_table_bm].reshape(b, m * pool_p.shape[1], *pool_p.shape[2:])


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
    page_table_bm: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Absorbed-form sparse MLA: c_hat[b,t,h] = sum_s softmax_s(scale * q_hat.c_s) c_s over the selected keys.
    An int8 latent (with `latent_scale_bs`) is dequantized whole, every row cast to q's dtype. A paged latent
    (`page_table_bm`) is read whole through the table (`paged_view`)."""
    if page_table_bm is not None:
        latent_bsr = paged_view(latent_bsr, page_table_bm)
        latent_scale_bs = None if latent_scale_bs is None else paged_view(latent_scale_bs, page_table_bm)
    latent_bsr = dequantize_rows(latent_bsr, latent_scale_bs, q_bthr.dtype)
    mask = selection_mask(
        pool_ids_btk, q_pos_bt, kpool=kpool, num_keys=latent_bsr.shape[1], select_tail=select_tail
    )
    kv = latent_bsr[:, :, None, :]  # [B, S, 1, R]: one shared key/value head
    return masked_attention(q_bthr, kv, kv, mask, scale=scale)


def sparse_mha(
    q_bthc: jnp.ndarray,
    k_bshc: jnp.ndarray,
    v_bshe: jnp.ndarray,
    pool_ids_btk: jnp.ndarray,
    q_pos_bt: jnp.ndarray,
    *,
    kpool: int,
    scale: float,
    select_tail: bool = True,
) -> jnp.ndarray:
    """Expanded-form sparse MLA (per-head keys/values), same selection semantics as `sparse_mla`."""
    mask = selection_mask(
        pool_ids_btk, q_pos_bt, kpool=kpool, num_keys=k_bshc.shape[1], select_tail=select_tail
    )
    return masked_attention(q_bthc, k_bshc, v_bshe, mask, scale=scale)
