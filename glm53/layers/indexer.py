"""KPool lightning indexer of the DSA layers: picks, per query, which 4-token pools of keys MLA may attend to.

Per token s the indexer caches a key k_s = LayerNorm(u_s W_k) and a pooling gate g_s = u_s W_gate (both
[index_head_dim]). Pools are anchored at position 0: pool p = tokens {kpool*p .. kpool*p + kpool-1}. Once complete, a
pool is summarized by one pooled key, a per-channel softmax-weighted mean of its members:

    pk_p[c] = sum_{j<kpool} softmax_j(g_{kpool*p+j}[c] + ape[j, c]) * k_{kpool*p+j}[c]

A query at position t with indexer queries iq_t[h] = (q_res_t W_iq)[h] and head weights w_t = u_t W_w / sqrt(ih)
scores every pool as  score_t,p = sum_h w_t[h] * relu(iq_t[h] . pk_p / sqrt(index_head_dim)).
Candidates are complete pools whose last token is <= t; the top min(index_topk / kpool, #pools) candidates are
selected. The tail {kpool*floor((t+1)/kpool) .. t} (the query's incomplete pool) is always visible; it is not part
of the returned pool ids but implied by the query position (kernels/sparse_mla applies it).

Ties: among equal scores the pool with the LOWER index wins (``jax.lax.top_k`` order). Exact ties practically
only occur between pools whose every head score is clipped to 0 by the relu; torch.topk / ggml may break such
ties differently.

All state lives in the DSA cache (dsa.DSACache): the pooled key of every pool, and the per-token keys and gates
of the last 2 * kpool positions only (a ring, `recent_rows`: what later steps read, the open pool's members),
so prefill in pieces and decode select exactly what one-shot prefill selects. Pools are scored in blocks with a
running top-k (`select_pools_blocked`), so the temporaries do not grow with context x queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.config import ModelConfig
from glm53.layers.linear import Linear
from glm53.layers.norm import LayerNorm
from glm53.layers.param import param


def write_at(cache_bsc: jnp.ndarray, new_btc: jnp.ndarray, start_b: jnp.ndarray) -> jnp.ndarray:
    """Writes new_btc into rows start_b[b] .. start_b[b]+T-1 of each stream's cache (cast to the cache dtype).

    The caller guarantees start_b + T <= S (out-of-range writes would be clamped by XLA, not raised).
    """

    def one(c_sc, n_tc, s):
        return jax.lax.dynamic_update_slice_in_dim(c_sc, n_tc.astype(c_sc.dtype), s, axis=0)

    return jax.vmap(one)(cache_bsc, new_btc, start_b)


def pool_keys(k_bpjc: jnp.ndarray, gate_bpjc: jnp.ndarray, ape_jc: jnp.ndarray) -> jnp.ndarray:
    """Pooled keys [B, P, C] f32 of complete pools: per-channel softmax over the j < kpool members."""
    logits = gate_bpjc.astype(jnp.float32) + ape_jc.astype(jnp.float32)
    p = jax.nn.softmax(logits, axis=2)
    return jnp.sum(p * k_bpjc.astype(jnp.float32), axis=2)


def recent_rows(kpool: int) -> int:
    """Rows of the per-token key / gate ring: the last 2 * kpool positions (slot = position mod 2 * kpool).

    Later steps read only the members of the open (incomplete) pool; the second pool's worth keeps them alive
    when a step writes tokens that are then rolled back (a rejected speculative draft may cross a pool
    boundary: up to kpool + 1 rejected tokens leave the open pool's accepted members in the ring)."""
    return 2 * kpool


def append_tokens(
    recent_k_bwc: jnp.ndarray,
    recent_gate_bwc: jnp.ndarray,
    pooled_bpc: jnp.ndarray,
    k_btc: jnp.ndarray,
    gate_btc: jnp.ndarray,
    start_b: jnp.ndarray,
    ape_jc: jnp.ndarray,
    pool_offset: int | jnp.ndarray = 0,
    page_table_bm: jnp.ndarray | None = None,
    page_offset: int | jnp.ndarray = 0,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Appends T tokens at positions start_b .. start_b+T-1: (recent_k, recent_gate, pooled) updated.
    `pooled_bpc` holds pools pool_offset .. pool_offset + P - 1 (a sequence shard; pools outside are dropped).
    With `page_table_bm` [B, M] it is a page pool [num_pages, pools per page, C] instead: stream b's pool q is
    row q % ppp of page table[b, q // ppp] (pools past the table's M * ppp are dropped; a device's block of a
    sharded pool holds global pages page_offset .. page_offset + num_pages - 1, the others' pools are dropped).

    Every pool the tokens touch gets its pooled key recomputed from its members: the open pool's earlier members
    come from the ring, the rest are the new tokens (cast to the cache dtype first, as if read back from a
    per-token cache). Pools that are still incomplete get a value too, but are never candidates; the call that
    completes them recomputes them, so rows of rolled-back or stale positions never reach a selection. Pools
    past the cache's end are dropped.
    """
    kpool, c = ape_jc.shape
    w = recent_k_bwc.shape[1]
    t = k_btc.shape[1]
    n = (kpool - 1 + t + kpool - 1) // kpool  # pools touched by T tokens starting anywhere in a pool
    dtype = recent_k_bwc.dtype

    def one(rk_wc, rg_wc, k_tc, g_tc, s):
        a0 = (s // kpool) * kpool  # first position of the pool holding position s
        k_tc, g_tc = k_tc.astype(dtype), g_tc.astype(dtype)
        slots = (a0 + jnp.arange(kpool)) % w

        def members(ring_wc, new_tc):  # positions a0 .. a0 + n*kpool - 1: ring rows before s, then the new ones
            buf = jnp.zeros((n * kpool, c), dtype).at[:kpool].set(ring_wc[slots])
            return jax.lax.dynamic_update_slice_in_dim(buf, new_tc, s - a0, axis=0).reshape(n, kpool, c)

        new_nc = pool_keys(members(rk_wc, k_tc)[None], members(rg_wc, g_tc)[None], ape_jc)[0]
        # ring slot i: the latest position P <= s+T-1 with P = i (mod w); from the new tokens when P >= s
        end = s + t - 1
        j = end - (end - jnp.arange(w)) % w - s
        take = (j >= 0)[:, None]
        jj = jnp.clip(j, 0, t - 1)
        return jnp.where(take, k_tc[jj], rk_wc), jnp.where(take, g_tc[jj], rg_wc), new_nc

    rk, rg, new_bnc = jax.vmap(one)(recent_k_bwc, recent_gate_bwc, k_btc, gate_btc, start_b)
    pools_bn = (start_b // kpool)[:, None] + jnp.arange(n)  # the pools the tokens touched, in stream order
    new_bnc = new_bnc.astype(pooled_bpc.dtype)
    if page_table_bm is not None:
        ppp = pooled_bpc.shape[1]
        page = jnp.take_along_axis(page_table_bm, jnp.clip(pools_bn // ppp, 0, page_table_bm.shape[1] - 1), axis=1)
        page = page - page_offset
        keep = (pools_bn < page_table_bm.shape[1] * ppp) & (page >= 0) & (page < pooled_bpc.shape[0])
        flat = jnp.where(keep, page * ppp + pools_bn % ppp, pooled_bpc.size)
        pooled = pooled_bpc.reshape(-1, c).at[flat.reshape(-1)].set(new_bnc.reshape(-1, c), mode="drop")
        return rk, rg, pooled.reshape(pooled_bpc.shape)
    rows = pools_bn - pool_offset
    rows = jnp.where(rows < 0, pooled_bpc.shape[1], rows)  # a negative row is another shard's: dropped
    pooled = jax.vmap(lambda p_pc, r, v: p_pc.at[r].set(v, mode="drop"))(pooled_bpc, rows, new_bnc)
    return rk, rg, pooled


def pool_scores(iq_bthc: jnp.ndarray, w_bth: jnp.ndarray, pooled_bpc: jnp.ndarray) -> jnp.ndarray:
    """Index scores [B, T, P] f32: sum_h w[h] * relu(iq[h] . pk_p / sqrt(C)) (w already scaled by 1/sqrt(H))."""
    c = iq_bthc.shape[-1]
    s_bthp = jnp.einsum(
        "bthc,bpc->bthp",
        iq_bthc.astype(jnp.float32),
        pooled_bpc.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    s_bthp = jax.nn.relu(s_bthp * c**-0.5)
    return jnp.einsum("bth,bthp->btp", w_bth.astype(jnp.float32), s_bthp, precision=jax.lax.Precision.HIGHEST)


def select_pools(
    scores_btp: jnp.ndarray, q_pos_bt: jnp.ndarray, *, kpool: int, num_select: int
) -> jnp.ndarray:
    """Top-`num_select` candidate pools per query -> pool ids int32 [B, T, num_select] in score order, -1 = none:
    one top-k over every pool's scores (the layers run `select_pools_blocked`; this is its one-shot oracle).

    A pool p is a candidate for a query at position q iff it is complete at q: kpool*p + kpool-1 <= q.
    Ties go to the lower pool index.
    """
    num_pools = scores_btp.shape[-1]
    p = jnp.arange(num_pools)
    cand_btp = p[None, None, :] < ((q_pos_bt[:, :, None] + 1) // kpool)
    masked = jnp.where(cand_btp, scores_btp, -jnp.inf)
    _, ids = jax.lax.top_k(masked, num_select)
    ok = jnp.take_along_axis(cand_btp, ids, axis=-1)
    return jnp.where(ok, ids, -1).astype(jnp.int32)


def block_pools(num_pools: int, num_queries: int, n_heads: int, budget: int = 1 << 24) -> int:
    """Pools scored per block: the [B, T, H, block] f32 head scores stay under `budget` elements per stream
    (64 MiB), at least 512 pools, at most all of them."""
    return max(1, min(num_pools, max(512, budget // max(1, num_queries * n_heads))))


def select_pools_blocked(
    iq_bthc: jnp.ndarray,
    w_bth: jnp.ndarray,
    pooled_bpc: jnp.ndarray,
    q_pos_bt: jnp.ndarray,
    *,
    kpool: int,
    num_select: int,
    block: int | None = None,
    pool_offset: int | jnp.ndarray = 0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`select_pools(pool_scores(...))` scored in blocks of pools with a running top-k: the temporaries are
    [B, T, H, block], not [B, T, H, P]. Returns (scores f32 [B, T, k], pool ids int32 [B, T, k]) with
    k = min(num_select, P), ids -1 (score -inf) where there is no candidate.

    The same selection as the one-shot form, tie rule included: the running best (sorted by score, ties by lower
    id) is placed before each block (ascending ids, all higher), and `lax.top_k` keeps the earlier of equal values.
    `pool_offset`: the global id of pooled row 0 (a sequence shard's first pool).
    """
    b, t = q_pos_bt.shape
    num_pools = pooled_bpc.shape[1]
    k = min(num_select, num_pools)
    block = block_pools(num_pools, t, iq_bthc.shape[2]) if block is None else min(block, num_pools)
    nb = -(-num_pools // block)
    pooled = jnp.pad(pooled_bpc, [(0, 0), (0, nb * block - num_pools), (0, 0)])
    limit_bt = (q_pos_bt + 1) // kpool  # candidates: global id < limit

    def step(carry, i):
        best_s, best_id = carry
        blk = jax.lax.dynamic_slice_in_dim(pooled, i * block, block, axis=1)
        s = pool_scores(iq_bthc, w_bth, blk)  # [B, T, block]
        local = i * block + jnp.arange(block)
        gid = pool_offset + local
        cand = (gid[None, None, :] < limit_bt[:, :, None]) & (local < num_pools)[None, None, :]
        s = jnp.where(cand, s, -jnp.inf)
        ids = jnp.where(cand, gid, -1).astype(jnp.int32)
        all_s = jnp.concatenate([best_s, s], axis=-1)
        all_id = jnp.concatenate([best_id, jnp.broadcast_to(ids, s.shape)], axis=-1)
        top_s, pos = jax.lax.top_k(all_s, k)
        return (top_s, jnp.take_along_axis(all_id, pos, axis=-1)), None

    init = (jnp.full((b, t, k), -jnp.inf, jnp.float32), jnp.full((b, t, k), -1, jnp.int32))
    if nb == 1:
        (s, ids), _ = step(init, 0)
    else:
        (s, ids), _ = jax.lax.scan(step, init, jnp.arange(nb))
    return s, jnp.where(jnp.isneginf(s), -1, ids)


def select_pools_paged(
    iq_bthc: jnp.ndarray,
    w_bth: jnp.ndarray,
    pooled_pxc: jnp.ndarray,
    page_table_bm: jnp.ndarray,
    q_pos_bt: jnp.ndarray,
    *,
    kpool: int,
    num_select: int,
    block_pages: int | None = None,
    first: int | jnp.ndarray = 0,
    stride: int = 1,
    page_offset: int | jnp.ndarray = 0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`select_pools_blocked` over a paged pool [P, ppp, C] read through the page table [B, M]: the same blocks,
    running top-k and tie rule, but each block's pooled keys are gathered from its pages, and the loop stops after
    the last block holding a candidate of any query (a `while_loop`): the work follows the streams' lengths, not
    the table's width M * ppp (a table may cover the model's whole context). `block_pages`: pages per block.

    A device of a sharded pool (glm53.parallel.dsa) scores the table columns first, first + stride, ... (the
    pages a stream keeps on it) from its block of pages page_offset .. page_offset + P - 1 (a page outside it is
    never a candidate here); pool ids stay global (column i's pools are i * ppp .. i * ppp + ppp - 1)."""
    b, t = q_pos_bt.shape
    m, ppp = page_table_bm.shape[1], pooled_pxc.shape[1]
    k = min(num_select, m * ppp)
    m_local = -(-m // stride)  # the columns this call scores
    if block_pages is None:
        block_pages = max(1, block_pools(m_local * ppp, t, iq_bthc.shape[2]) // ppp)
    block_pages = min(block_pages, m_local)
    block = block_pages * ppp
    nb_max = -(-m_local // block_pages)
    cols = first + stride * jnp.arange(nb_max * block_pages)  # the logical page index of each local column
    table = jnp.take(page_table_bm, jnp.clip(cols, 0, m - 1), axis=1)  # [B, nb_max * block_pages]
    limit_bt = (q_pos_bt + 1) // kpool  # candidates: pool id < limit
    need = -(-jnp.max(limit_bt) // ppp)  # pages holding a candidate of any query
    nb = jnp.minimum(-(-jnp.maximum(need - first, 0) // (stride * block_pages)), nb_max)

    def body(i, carry):
        best_s, best_id = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, axis=1) - page_offset
        here = (pages >= 0) & (pages < pooled_pxc.shape[0])  # [B, block_pages]
        blk = pooled_pxc[jnp.clip(pages, 0, pooled_pxc.shape[0] - 1)].reshape(b, block, pooled_pxc.shape[2])
        s = pool_scores(iq_bthc, w_bth, blk)  # [B, T, block]
        col = jax.lax.dynamic_slice_in_dim(cols, i * block_pages, block_pages)
        gid = (col[:, None] * ppp + jnp.arange(ppp)).reshape(-1)  # [block] global pool ids
        ok = jnp.repeat(here, ppp, axis=1) & (gid < m * ppp)[None, :]  # [B, block]
        cand = (gid[None, None, :] < limit_bt[:, :, None]) & ok[:, None, :]
        s = jnp.where(cand, s, -jnp.inf)
        ids = jnp.where(cand, gid, -1).astype(jnp.int32)
        top_s, pos = jax.lax.top_k(jnp.concatenate([best_s, s], axis=-1), k)
        all_id = jnp.concatenate([best_id, jnp.broadcast_to(ids, s.shape)], axis=-1)
        return top_s, jnp.take_along_axis(all_id, pos, axis=-1)

    init = (jnp.full((b, t, k), -jnp.inf, jnp.float32), jnp.full((b, t, k), -1, jnp.int32))
    s, ids = jax.lax.fori_loop(0, nb, body, init)
    return s, jnp.where(jnp.isneginf(s), -1, ids)


class Indexer(nnx.Module):
    """The KPool lightning indexer (HF ``Glm5NextTextIndexer``); weights are [in, out] (HF transposed)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, ih, c = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.head_dim = ih, c
        self.kpool = cfg.index_kpool
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, ih * c, (dims.Q_LORA, dims.INDEX_QK), rngs=rngs, dtype=dtype)
        self.wk = Linear(d, c, (dims.EMBED, dims.INDEX_HEAD_DIM), rngs=rngs, dtype=dtype)
        self.k_norm = LayerNorm(c, cfg.index_norm_eps, rngs=rngs, dtype=dtype)
        self.weights_proj = Linear(d, ih, (dims.EMBED, dims.INDEX_HEADS), rngs=rngs, dtype=dtype)
        # HF index_kpool_compress_gate [C, D] (transposed here) and index_kpool_compress_ape [kpool, C]; HF init.
        self.compress_gate = param(rngs, (d, c), (dims.EMBED, dims.INDEX_HEAD_DIM), dtype, init="ones")
        self.compress_ape = param(
            rngs, (self.kpool, c), (dims.KPOOL, dims.INDEX_HEAD_DIM), dtype, init="zeros"
        )

    def token_state(self, x_btd: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """Per-token cache entries: key k [B, T, C] (after k_norm) and pooling gate [B, T, C]."""
        k = self.k_norm(self.wk(x_btd))
        gate = jnp.matmul(x_btd, self.compress_gate[...].astype(x_btd.dtype))
        return k, gate

    def num_select(self, num_pools: int) -> int:
        """How many pools a query selects when the cache holds `num_pools` pools."""
        return min(self.topk // self.kpool, num_pools)

    def __call__(
        self,
        x_btd: jnp.ndarray,
        q_res_btr: jnp.ndarray,
        recent_k_bwc: jnp.ndarray,
        recent_gate_bwc: jnp.ndarray,
        pooled_bpc: jnp.ndarray,
        start_b: jnp.ndarray,
        page_table_bm: jnp.ndarray | None = None,
    ) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]]:
        """Appends the new tokens to the indexer cache and selects pools for each of them.

        Args:
          x_btd: the layer input u (after input_layernorm) [B, T, D]; q_res_btr: RMSNorm(q_a(u)) [B, T, q_lora].
          recent_k_bwc, recent_gate_bwc [B, 2*kpool, C] (the ring of `recent_rows`), pooled_bpc [B, P, C]: this
            layer's indexer cache.
          start_b: int32 [B], position of token 0 of each stream.
          page_table_bm: int32 [B, M] when pooled_bpc is a page pool [P, ppp, C] (a paged cache), else None.
        Returns:
          pool_ids int32 [B, T, min(topk/kpool, P)] (-1 = empty), and the updated (recent_k, recent_gate, pooled).
        """
        w = recent_rows(self.kpool)
        if recent_k_bwc.shape[1] != w or recent_gate_bwc.shape[1] != w:
            raise ValueError(
                f"Indexer: the cache's recent_k / recent_gate have {recent_k_bwc.shape[1]} / "
                f"{recent_gate_bwc.shape[1]} rows; this layout keeps the last 2*index_kpool = {w} positions "
                "(a cache of another layout?)"
            )
        k, gate, iq_bthc, w_bth = self.project(x_btd, q_res_btr)
        num_pools = pooled_bpc.shape[1] * (1 if page_table_bm is None else page_table_bm.shape[1])
        return index_step(
            recent_k_bwc, recent_gate_bwc, pooled_bpc, k, gate, iq_bthc, w_bth, start_b, self.compress_ape[...],
            kpool=self.kpool, num_select=self.num_select(num_pools), page_table_bm=page_table_bm,
        )  # fmt: skip

    def project(self, x_btd: jnp.ndarray, q_res_btr: jnp.ndarray):
        """The new tokens' cache entries and queries: key k [B, T, C], gate [B, T, C], indexer queries
        iq [B, T, H, C] and head weights w [B, T, H] f32 (scaled by 1/sqrt(H))."""
        b, t, _ = x_btd.shape
        k, gate = self.token_state(x_btd)
        iq_bthc = self.wq_b(q_res_btr).reshape(b, t, self.n_heads, self.head_dim)
        w_bth = self.weights_proj(x_btd).astype(jnp.float32) * self.n_heads**-0.5
        return k, gate, iq_bthc, w_bth


def index_step(
    recent_k_bwc, recent_gate_bwc, pooled_bpc, k_btc, gate_btc, iq_bthc, w_bth, start_b, ape_jc, *, kpool, num_select,
    page_table_bm=None,
):  # fmt: skip
    """The indexer's cache step on one device: append the tokens (`append_tokens`), select pools for each
    (`select_pools_blocked`; a paged pool through its table, `select_pools_paged`). Returns
    (pool ids [B, T, num_select], (recent_k, recent_gate, pooled))."""
    recent_k_bwc, recent_gate_bwc, pooled_bpc = append_tokens(
        recent_k_bwc, recent_gate_bwc, pooled_bpc, k_btc, gate_btc, start_b, ape_jc, page_table_bm=page_table_bm
    )
    t = k_btc.shape[1]
    q_pos_bt = start_b[:, None] + jnp.arange(t, dtype=start_b.dtype)[None, :]
    if page_table_bm is None:
        _, ids = select_pools_blocked(iq_bthc, w_bth, pooled_bpc, q_pos_bt, kpool=kpool, num_select=num_select)
    else:
        _, ids = select_pools_paged(
            iq_bthc, w_bth, pooled_bpc, page_table_bm, q_pos_bt, kpool=kpool, num_select=num_select
        )
    return ids, (recent_k_bwc, recent_gate_bwc, pooled_bpc)
