"""Sparse MLA kernel api: attention restricted to the keys a KPool indexer selected.

  * `sparse_mla`  -- absorbed (latent) form, the decode path: queries already multiplied by W_uk
                     ([B, T, H, kv_lora]) attend over the latent cache ([B, S, kv_lora]) used as key AND value;
                     the output [B, T, H, kv_lora] is then multiplied by W_uv by the caller.
  * `sparse_mha`  -- expanded form (per-head k = c W_uk, v = c W_uv), optional for prefill.
  * `selection_mask` -- the boolean [B, T, S] visibility mask of a selection (for tests and mask-based backends).

A selection is index-shaped so block-sparse backends can gather whole pools: ``pool_ids_btk`` int32
[B, T, K] (selected pool p covers keys kpool*p .. kpool*p + kpool-1; -1 = empty slot; order irrelevant) plus
``q_pos_bt`` int32 [B, T], the absolute position of each query, from which causality and the always-visible
tail {kpool*floor((q+1)/kpool) .. q} follow. Every implementation accumulates in f32 and returns q's dtype.

The latent cache may be stored as int8 with one f32 scale per cached row (`latent_scale_bs` [B, S]); every
implementation dequantizes it and casts the rows to q's dtype before its f32 math.

Paged caches: with `page_table_bm` int32 [B, M] the latent is a pool of pages [P, page_tokens, R] shared by all
streams (scales [P, page_tokens]); stream b's position s is row s % page_tokens of page table[b, s // page_tokens],
so each stream holds S = M * page_tokens positions. Every implementation takes it ("reference" reads each stream's
pages whole, "gather" only the selected rows through the table); the result is the contiguous cache's.

Implementations of `sparse_mla`: "reference" (masked dense attention over every cached row, the oracle),
"gather" (`gather.py`: gathers the selected pools' rows only, O(index_topk) rows per query) and "auto": what
`_AUTO` names for the backend ("gather" on every backend), except that a "gather" whose selection's rows
((K + 1) * kpool) are no fewer than the cached rows S runs "reference" (a small cache is read whole faster than
gathered). A named implementation that cannot take the inputs raises
NotImplementedError, only "auto" falls back (`kernels.dispatch`). `sparse_mha` has the reference only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import dispatch
from kernels.sparse_mla import gather, reference

_MLA = {"reference": reference.sparse_mla, "gather": gather.sparse_mla}
_MHA = {"reference": reference.sparse_mha}
_AUTO: dict[str, str] = {"cpu": "gather", "gpu": "gather", "tpu": "gather"}  # backend -> what "auto" runs
AUTO_BY_BACKEND = _AUTO  # public: what "auto" picks per backend (glm53.config.kernels, the entry points' start-up block)
IMPLEMENTATIONS = (dispatch.AUTO, *_MLA)  # the names `sparse_mla`'s `implementation=` takes

selection_mask = reference.selection_mask
paged_view = reference.paged_view


def _check_selection(op: str, b: int, t: int, pool_ids_btk: jnp.ndarray, q_pos_bt: jnp.ndarray, kpool: int):
    if pool_ids_btk.ndim != 3 or pool_ids_btk.shape[:2] != (b, t):
        raise ValueError(f"{op}: pool_ids_btk must be [B={b}, T={t}, K], got shape {pool_ids_btk.shape}")
    if q_pos_bt.shape != (b, t):
        raise ValueError(f"{op}: q_pos_bt must be [B={b}, T={t}], got shape {q_pos_bt.shape}")
    if not jnp.issubdtype(pool_ids_btk.dtype, jnp.integer) or not jnp.issubdtype(q_pos_bt.dtype, jnp.integer):
        raise ValueError(
            f"{op}: pool_ids_btk / q_pos_bt must be integer, got {pool_ids_btk.dtype} / {q_pos_bt.dtype}"
        )
    if kpool < 1:
        raise ValueError(f"{op}: kpool must be >= 1, got {kpool}")


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
    implementation: str = "reference",
) -> jnp.ndarray:
    """Absorbed sparse MLA: c_hat [B, T, H, R] = sum over selected keys s of softmax(scale * q_hat.c_s) c_s.

    Args:
      q_bthr: absorbed queries (W_uk^T q per head) [B, T, H, R=kv_lora].
      latent_bsr: normalized latent cache [B, S, R] (float, or int8 with `latent_scale_bs` f32 [B, S]);
        positions beyond a query's position are never read.
      pool_ids_btk, q_pos_bt, kpool, select_tail: the selection (module docstring).
      scale: softmax scale (1/sqrt(qk_nope_head_dim) for GLM-5.3, not 1/sqrt(R)).
      page_table_bm: int32 [B, M] page ids (a paged latent [P, page_tokens, R]; module docstring), or None.
    """
    if q_bthr.ndim != 4 or latent_bsr.ndim != 3:
        raise ValueError(
            f"sparse_mla: need q [B,T,H,R] and latent [B,S,R], got {q_bthr.shape} / {latent_bsr.shape}"
        )
    b, t, _, r = q_bthr.shape
    paged = page_table_bm is not None
    if paged and (page_table_bm.ndim != 2 or page_table_bm.shape[0] != b
                  or not jnp.issubdtype(page_table_bm.dtype, jnp.integer)):  # fmt: skip
        raise ValueError(f"sparse_mla: page_table_bm must be integer [B={b}, M], got {page_table_bm.shape} "
                         f"{page_table_bm.dtype}")  # fmt: skip
    if (not paged and latent_bsr.shape[0] != b) or latent_bsr.shape[2] != r:
        raise ValueError(f"sparse_mla: latent {latent_bsr.shape} does not match queries {q_bthr.shape}")
    num_keys = page_table_bm.shape[1] * latent_bsr.shape[1] if paged else latent_bsr.shape[1]
    _check_selection("sparse_mla", b, t, pool_ids_btk, q_pos_bt, kpool)
    int8 = latent_bsr.dtype == jnp.int8
    if int8 != (latent_scale_bs is not None):
        raise ValueError(
            f"sparse_mla: an int8 latent needs latent_scale_bs and a float one must not have it; got latent "
            f"{latent_bsr.dtype} with latent_scale_bs {None if latent_scale_bs is None else latent_scale_bs.shape}"
        )
    if int8 and latent_scale_bs.shape != latent_bsr.shape[:2]:
        raise ValueError(
            f"sparse_mla: latent_scale_bs must be [B, S] = {latent_bsr.shape[:2]}, got {latent_scale_bs.shape}"
        )
    if not int8 and not jnp.issubdtype(latent_bsr.dtype, jnp.floating):
        raise ValueError(f"sparse_mla: the latent must be floating or int8, got {latent_bsr.dtype}")
    kw = dict(kpool=kpool, scale=scale, select_tail=select_tail, latent_scale_bs=latent_scale_bs,
              page_table_bm=page_table_bm)  # fmt: skip
    auto = dict(_AUTO)
    backend = jax.default_backend()
    if auto.get(backend) == "gather" and (pool_ids_btk.shape[2] + select_tail) * kpool >= num_keys:
        auto[backend] = "reference"  # the selection's rows are no fewer than the cache's: read the cache whole
    return dispatch.call(
        "sparse_mla", implementation, _MLA, auto, q_bthr, latent_bsr, pool_ids_btk, q_pos_bt, **kw
    )


def gathered_rows(num_select: int, kpool: int, select_tail: bool, num_keys: int) -> int:
    """Latent rows one query reads under "auto": the gathered selection, or every row when that is fewer."""
    return min((num_select + select_tail) * kpool, num_keys)


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
    implementation: str = "reference",
) -> jnp.ndarray:
    """Expanded sparse MLA: o [B, T, H, E] with per-head keys k [B, S, H, C] and values v [B, S, H, E]."""
    if q_bthc.ndim != 4 or k_bshc.ndim != 4 or v_bshe.ndim != 4:
        raise ValueError(f"sparse_mha: need 4-d q/k/v, got {q_bthc.shape} / {k_bshc.shape} / {v_bshe.shape}")
    b, t, h, c = q_bthc.shape
    if k_bshc.shape[0] != b or k_bshc.shape[2:] != (h, c) or v_bshe.shape[:3] != k_bshc.shape[:3]:
        raise ValueError(f"sparse_mha: q {q_bthc.shape}, k {k_bshc.shape}, v {v_bshe.shape} do not match")
    _check_selection("sparse_mha", b, t, pool_ids_btk, q_pos_bt, kpool)
    kw = dict(kpool=kpool, scale=scale, select_tail=select_tail)
    args = (q_bthc, k_bshc, v_bshe, pool_ids_btk, q_pos_bt)
    auto = {b: name for b, name in _AUTO.items() if name in _MHA}  # "gather" is absorbed-form only
    return dispatch.call("sparse_mha", implementation, _MHA, auto, *args, **kw)
