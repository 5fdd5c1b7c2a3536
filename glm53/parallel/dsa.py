"""Sequence-sharded DSA caches: each device holds 1/n of every stream's latent and pooled indexer keys.

With a rule set that maps ``cache_seq`` / ``cache_pools`` to mesh axes (both "tp" and "ep" do), device d of
those axes holds the contiguous positions d * S/n .. (d+1) * S/n - 1 of every stream (whole pools: S/n is a
multiple of kpool, `cache_shardings` checks it) and their pooled keys. The indexer's ring of the last 2 * kpool
per-token keys / gates (`glm53.layers.indexer.recent_rows`) is small and kept whole on every device. The cache
step of a DSA layer (`glm53.layers.dsa.DSA._sharded_step` calls `SeqShardedCache.step`) runs under shard_map:

1. write: each device writes the new tokens' latent rows (int8 + scale when the layout says so) that fall in
   its range, and the new pooled keys of its pools; every device updates the ring alike;
2. select (two-stage top-k): each device scores its own pools in blocks with a running top-k
   (`select_pools_blocked`, global pool ids), keeps its best min(K, P/n); the n candidate lists are all-gathered
   in device order and one top-k picks K. Device order is pool order, and each list is sorted by (score desc,
   id asc), so among equal scores the lower pool id comes first: exactly the single-device selection, tie
   rule included;
3. attend: every device gathers the selected rows it holds (`kernels.sparse_mla.gather.partial_attention`), and
   the partial softmaxes are combined across devices: M = max_d m_d, L = sum_d l_d e^(m_d - M),
   O = sum_d o_d e^(m_d - M), out = O / L (one pmax and two psums per layer).

Paged caches (`DSACache.paged`): the page pools are split on their page axis over the same devices, device d
holding the block of pages d * P/n .. (d+1) * P/n - 1, and a stream's i-th page is always on device i % n
(glm53.serving.pages.PagePool(devices=n) hands pages out so), so every stream is spread evenly. The page tables are
whole on every device. Each device writes the rows and pooled keys that fall in its pages, scores the table
columns d, d + n, d + 2n, ... (its pages of each stream; `select_pools_paged`), and attends over the selected rows
in its pages; the candidates are merged by (score desc, pool id asc) explicitly, since device order is no longer
pool order.

Collectives per DSA layer and step: the two all-gathers of the candidates ([B, T, K] scores and ids), the pmax
and the psums of [B, T, H, R]; the queries (q_hat, the indexer's iq) are gathered to every device by GSPMD
before the shard_map.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from glm53.layers.dsa import DSA, DSACache
from glm53.layers.indexer import append_tokens, select_pools_blocked, select_pools_paged
from glm53.parallel import rules as S
from glm53.quant.int8 import quantize_rows
from kernels.sparse_mla import gather


def _merge_partials(m, l, o, dtype, *, axis):
    """The attention of the whole sequence from each device's partial softmax (running max m, sum l, output o)
    over mesh `axis`: rescale to the global max, sum, normalize."""
    mx = jax.lax.pmax(m, axis)
    f = jnp.where(jnp.isfinite(m), jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    big_l, big_o = jax.lax.psum((l * f, o * f), axis)
    return (big_o / jnp.where(big_l > 0, big_l, 1.0)).astype(dtype)

def write_local(cache_bsx: jnp.ndarray, new_btx: jnp.ndarray, start_b: jnp.ndarray) -> jnp.ndarray:
    """Writes new rows at local rows start_b[b] + t of each stream; rows outside this shard are dropped.

    One token per stream (decode): a conditional in-place update per stream, so the shard that does not own the
    row writes nothing and no device copies its cache (a masked scatter is lowered as a select against the old
    row, which makes XLA copy the whole shard every step). Several tokens (prefill): a scatter that drops the
    rows of other shards."""
    t = new_btx.shape[1]
    if t == 1:
        for b in range(cache_bsx.shape[0]):
            s0 = start_b[b]
            row = new_btx[b : b + 1].astype(cache_bsx.dtype)
            cache_bsx = jax.lax.cond(
                (s0 >= 0) & (s0 < cache_bsx.shape[1]),
                lambda c, r=row, s0=s0, b=b: jax.lax.dynamic_update_slice(c, r, (b, s0) + (0,) * (c.ndim - 2)),
                lambda c: c,
                cache_bsx,
            )
        return cache_bsx

    def one(c, n, s0):
        idx = s0 + jnp.arange(t)
        idx = jnp.where(idx < 0, c.shape[0], idx)
        return c.at[idx].set(n.astype(c.dtype), mode="drop")

    return jax.vmap(one)(cache_bsx, new_btx, start_b)


@dataclasses.dataclass(frozen=True)
class SeqShardedCache:
    """The DSA cache step over caches split by sequence on `seq_axes` (module docstring)."""

    mesh: Mesh
    seq_axes: tuple[str, ...]
    batch_axes: tuple[str, ...]

    @property
    def shards(self) -> int:
        """Devices the caches are split over (cache lengths are rounded to whole pools per device)."""
        return S.axis_size(self.mesh, self.seq_axes, "DSA cache")

    def step(self, cache: DSACache, c_btr, index_in, selection, q_hat, start_b, *, kpool, select_tail,
             num_select, scale):  # fmt: skip
        """-> (new cache, pool ids [B, T, K], c_hat [B, T, H, R]); `index_in` = (k, gate, iq, w, ape) of the
        layer's own indexer, or None with `selection` (a shared indexer)."""
        b, t = c_btr.shape[:2]
        bspec = self.batch_axes if self.batch_axes and b % S.axis_size(self.mesh, self.batch_axes) == 0 else ()
        bsp = bspec or None
        if cache.paged:
            return self._paged_step(cache, c_btr, index_in, selection, q_hat, start_b, bsp, kpool=kpool,
                                    select_tail=select_tail, num_select=num_select, scale=scale)  # fmt: skip
        seq = self.seq_axes
        int8 = cache.latent.dtype == jnp.int8
        shared = index_in is None
        s_total = cache.latent.shape[1]

        def body(latent, lscale, rk, rg, pooled, c, index_in, sel, q, start):
            d = jax.lax.axis_index(seq)
            row0, pool0 = d * latent.shape[1], d * pooled.shape[1]
            if int8:
                cq, cs = quantize_rows(c)
                latent, lscale = write_local(latent, cq, start - row0), write_local(lscale, cs, start - row0)
            else:
                latent = write_local(latent, c, start - row0)
            q_pos = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]
            if shared:
                ids = sel
            else:
                k, g, iq, w, ape = index_in
                rk, rg, pooled = append_tokens(rk, rg, pooled, k, g, start, ape, pool_offset=pool0)
                s_loc, id_loc = select_pools_blocked(
                    iq, w, pooled, q_pos, kpool=kpool, num_select=num_select, pool_offset=pool0
                )
                s_all = jax.lax.all_gather(s_loc, seq, axis=2, tiled=True)  # device order = pool order
                id_all = jax.lax.all_gather(id_loc, seq, axis=2, tiled=True)
                top, pos = jax.lax.top_k(s_all, num_select)
                ids = jnp.where(jnp.isneginf(top), -1, jnp.take_along_axis(id_all, pos, axis=-1))

            finish = functools.partial(_merge_partials, axis=seq)

            c_hat = gather.sparse_mla(
                q, latent, ids, q_pos, kpool=kpool, scale=scale, select_tail=select_tail,
                latent_scale_bs=lscale if int8 else None, num_keys=s_total, row_offset=row0, finish=finish,
            )  # fmt: skip
            return latent, lscale, rk, rg, pooled, ids, c_hat

        rows = PartitionSpec(bsp, seq, None)
        ring = PartitionSpec(bsp, None, None)
        tok = PartitionSpec(bsp)  # leading batch, the rest whole
        index_specs = None if shared else (tok, tok, tok, tok, PartitionSpec())
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(rows, PartitionSpec(bsp, seq), ring, ring, rows, tok, index_specs, tok, tok, tok),
            out_specs=(rows, PartitionSpec(bsp, seq), ring, ring, rows, tok, tok),
            check_vma=False,
        )
        latent, lscale, rk, rg, pooled, ids, c_hat = fn(
            cache.latent, cache.latent_scale, cache.recent_k, cache.recent_gate, cache.pooled, c_btr, index_in,
            selection, q_hat, start_b,
        )  # fmt: skip
        return DSACache(latent, lscale, rk, rg, pooled), ids, c_hat

    def _paged_step(self, cache: DSACache, c_btr, index_in, selection, q_hat, start_b, bsp, *, kpool, select_tail,
                    num_select, scale):  # fmt: skip
        """`step` on paged caches (module docstring)."""
        t = c_btr.shape[1]
        seq, n = self.seq_axes, self.shards
        int8 = cache.latent.dtype == jnp.int8
        shared = index_in is None
        pt = cache.latent.shape[1]
        if cache.latent.shape[0] % n:
            raise ValueError(f"paged DSA cache: {cache.latent.shape[0]} pages do not split over {n} devices")
        num_keys = cache.pages.shape[1] * pt

        def write(pool, new, start, table, off):  # the rows whose page is in this device's block
            pos = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]
            at, here = gather.local_page_rows(table, pos, pool.shape[1], off, pool.shape[0])
            at = jnp.where(here, at, pool.shape[0] * pool.shape[1]).reshape(-1)
            flat = pool.reshape(-1, *pool.shape[2:])
            new = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
            return flat.at[at].set(new, mode="drop").reshape(pool.shape)

        def body(latent, lscale, rk, rg, pooled, table, c, index_in, sel, q, start):
            d = jax.lax.axis_index(seq)
            off = d * latent.shape[0]  # this device's first global page
            if int8:
                cq, cs = quantize_rows(c)
                latent, lscale = write(latent, cq, start, table, off), write(lscale, cs, start, table, off)
            else:
                latent = write(latent, c, start, table, off)
            q_pos = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]
            if shared:
                ids = sel
            else:
                k, g, iq, w, ape = index_in
                rk, rg, pooled = append_tokens(rk, rg, pooled, k, g, start, ape, page_table_bm=table, page_offset=off)
                s_loc, id_loc = select_pools_paged(iq, w, pooled, table, q_pos, kpool=kpool, num_select=num_select,
                                                   first=d, stride=n, page_offset=off)  # fmt: skip
                s_all = jax.lax.all_gather(s_loc, seq, axis=2, tiled=True)
                id_all = jax.lax.all_gather(id_loc, seq, axis=2, tiled=True)
                # (score desc, pool id asc): device order is not pool order under the round-robin spread
                neg, gid = jax.lax.sort((-s_all, jnp.where(id_all < 0, jnp.iinfo(jnp.int32).max, id_all)), num_keys=2)
                top, gid = -neg[..., :num_select], gid[..., :num_select]
                ids = jnp.where(jnp.isneginf(top), -1, gid)

            finish = functools.partial(_merge_partials, axis=seq)

            c_hat = gather.sparse_mla(
                q, latent, ids, q_pos, kpool=kpool, scale=scale, select_tail=select_tail,
                latent_scale_bs=lscale if int8 else None, num_keys=num_keys, finish=finish, page_table_bm=table,
                page_offset=off,
            )  # fmt: skip
            return latent, lscale, rk, rg, pooled, ids, c_hat

        pages = PartitionSpec(seq, None, None)
        ring = PartitionSpec(bsp, None, None)
        tok = PartitionSpec(bsp)
        index_specs = None if shared else (tok, tok, tok, tok, PartitionSpec())
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(pages, PartitionSpec(seq, None), ring, ring, pages, PartitionSpec(bsp, None), tok, index_specs,
                      tok, tok, tok),  # fmt: skip
            out_specs=(pages, PartitionSpec(seq, None), ring, ring, pages, tok, tok),
            check_vma=False,
        )
        latent, lscale, rk, rg, pooled, ids, c_hat = fn(
            cache.latent, cache.latent_scale, cache.recent_k, cache.recent_gate, cache.pooled, cache.pages, c_btr,
            index_in, selection, q_hat, start_b,
        )  # fmt: skip
        return DSACache(latent, lscale, rk, rg, pooled, pages=cache.pages), ids, c_hat


def seq_sharded(mesh: Mesh, rules: str | S.Rules) -> SeqShardedCache | None:
    """The cache step of `rules` on `mesh`, or None when the rules do not split DSA caches by sequence."""
    rules = S.get_rules(rules)
    seq = rules.mesh_axes(S.CACHE_SEQ, "DSA cache")
    if rules.mesh_axes(S.CACHE_POOLS, "DSA cache") != seq:
        raise S.ShardingError(
            f"rule set {rules.name!r}: cache_seq -> {seq} but cache_pools -> "
            f"{rules.mesh_axes(S.CACHE_POOLS)}; a device must hold the pooled keys of its own positions"
        )
    if S.axis_size(mesh, seq, "DSA cache") == 1:
        return None
    return SeqShardedCache(mesh, seq, rules.mesh_axes(S.BATCH, "DSA cache"))


def shard_dsa_layers(model: nnx.Module, mesh: Mesh, rules: str | S.Rules) -> nnx.Module:
    """Sets (in place) the sequence-sharded cache step on every DSA layer of `model`; returns `model`."""
    step = seq_sharded(mesh, rules)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, DSA):
            node.seq_shard = step
    return model
