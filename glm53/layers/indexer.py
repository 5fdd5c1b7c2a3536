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

All state lives in the DSA cache (dsa.DSACache: index_k, index_gate, pooled), so prefill in pieces and decode
select exactly what one-shot prefill selects.
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


def update_pooled(
    pooled_bpc: jnp.ndarray,
    index_k_bsc: jnp.ndarray,
    index_gate_bsc: jnp.ndarray,
    start_b: jnp.ndarray,
    num_new: int,
    ape_jc: jnp.ndarray,
) -> jnp.ndarray:
    """Recomputes the pooled keys of every pool touched by tokens start_b .. start_b+num_new-1.

    Pools that are still incomplete get a value too, but are never candidates; they are recomputed by the call
    that completes them, so stale cache rows beyond the stream's length never leak into a selection.
    """
    kpool = ape_jc.shape[0]
    num_pools, c = pooled_bpc.shape[1], pooled_bpc.shape[2]
    # Pools touched by num_new consecutive tokens starting anywhere: at most ceil((num_new-1)/kpool) + 1.
    n = min(num_pools, (num_new - 1 + kpool - 1) // kpool + 1)
    p0_b = jnp.clip(start_b // kpool, 0, num_pools - n)  # clipping only re-pools earlier complete pools

    def one(pooled_pc, k_sc, g_sc, p0):
        k_njc = jax.lax.dynamic_slice_in_dim(k_sc, p0 * kpool, n * kpool, axis=0).reshape(n, kpool, c)
        g_njc = jax.lax.dynamic_slice_in_dim(g_sc, p0 * kpool, n * kpool, axis=0).reshape(n, kpool, c)
        new_nc = pool_keys(k_njc[None], g_njc[None], ape_jc)[0]
        return jax.lax.dynamic_update_slice_in_dim(pooled_pc, new_nc.astype(pooled_pc.dtype), p0, axis=0)

    return jax.vmap(one)(pooled_bpc, index_k_bsc, index_gate_bsc, p0_b)


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
    """Top-`num_select` candidate pools per query -> pool ids int32 [B, T, num_select] in score order, -1 = none.

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
        index_k_bsc: jnp.ndarray,
        index_gate_bsc: jnp.ndarray,
        pooled_bpc: jnp.ndarray,
        start_b: jnp.ndarray,
    ) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]]:
        """Appends the new tokens to the indexer cache and selects pools for each of them.

        Args:
          x_btd: the layer input u (after input_layernorm) [B, T, D]; q_res_btr: RMSNorm(q_a(u)) [B, T, q_lora].
          index_k_bsc, index_gate_bsc [B, S, C], pooled_bpc [B, S/kpool, C]: this layer's indexer cache.
          start_b: int32 [B], position of token 0 of each stream.
        Returns:
          pool_ids int32 [B, T, min(topk/kpool, S/kpool)] (-1 = empty), and the updated (index_k, index_gate, pooled).
        """
        b, t, _ = x_btd.shape
        s = index_k_bsc.shape[1]
        if s % self.kpool or pooled_bpc.shape[1] != s // self.kpool:
            raise ValueError(
                f"Indexer: cache index_k has {s} rows and pooled {pooled_bpc.shape[1]}; need a multiple of "
                f"index_kpool={self.kpool} and pooled rows = rows / kpool"
            )
        k, gate = self.token_state(x_btd)
        index_k_bsc = write_at(index_k_bsc, k, start_b)
        index_gate_bsc = write_at(index_gate_bsc, gate, start_b)
        pooled_bpc = update_pooled(
            pooled_bpc, index_k_bsc, index_gate_bsc, start_b, t, self.compress_ape[...]
        )

        iq_bthc = self.wq_b(q_res_btr).reshape(b, t, self.n_heads, self.head_dim)
        w_bth = self.weights_proj(x_btd).astype(jnp.float32) * self.n_heads**-0.5
        scores = pool_scores(iq_bthc, w_bth, pooled_bpc)
        q_pos_bt = start_b[:, None] + jnp.arange(t, dtype=start_b.dtype)[None, :]
        ids = select_pools(
            scores, q_pos_bt, kpool=self.kpool, num_select=self.num_select(pooled_bpc.shape[1])
        )
        return ids, (index_k_bsc, index_gate_bsc, pooled_bpc)
