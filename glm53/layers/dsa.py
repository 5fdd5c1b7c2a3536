"""DSA layer: NoPE multi-head latent attention (MLA) restricted to the keys a KPool indexer selects.

    q_res = RMSNorm(u W_qa)            q = q_res W_qb -> [H, nope]
    c     = RMSNorm(u W_kva)           [kv_lora]   (the only attention tensor cached)
    k_h = c W_uk[h], v_h = c W_uv[h]   (kv_b_proj split per head: first nope columns K, next v columns V)
    out_h = softmax_{selected causal s}(q_h . k_h,s / sqrt(nope)) v_h,   y = concat_h(out_h) W_o

Attention runs in the absorbed form by default (q_hat_h = W_uk[h] q_h, scores q_hat . c / sqrt(nope),
c_hat = sum p c, out_h = c_hat W_uv[h]), via kernels/sparse_mla; decode (T == 1) always does. The expanded
form can be chosen for prefill with ``attn_form="expanded"``.

Call: ``y_btd, new_cache, pool_ids_btk = layer(x_btd, cache=cache, start_b=start_b, selection=None)``.
``pool_ids_btk`` (int32 [B, T, K], -1 = empty) is the indexer's selection; a layer whose indexer type is
"shared" has no indexer and must be given the previous full layer's selection as ``selection`` (it returns it
unchanged). With ``cache=None`` the layer processes a fresh sequence (start 0) and returns ``None`` as cache.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx, struct

from glm53 import dims
from glm53.config import ModelConfig
from glm53.layers.indexer import Indexer, recent_rows, write_at
from glm53.layers.linear import Linear
from glm53.layers.norm import RMSNorm
from glm53.quant.int8 import dequantize_rows, quantize_rows
from kernels import dispatch
from kernels.sparse_mla import api as sparse_mla_api
from kernels.sparse_mla.gather import page_rows

ATTN_FORMS = ("absorbed", "expanded")


@struct.dataclass
class DSACache:
    """Per-layer DSA decode state; S = max_len rounded up to a multiple of index_kpool, W = 2 * index_kpool.

    latent [B, S, kv_lora] (normalized c; float, or int8 with latent_scale [B, S] f32: one absmax scale per
    token; the config's ``latent_cache_dtype``), latent_scale [B, 0] when the latent is float;
    recent_k / recent_gate [B, W, index_head_dim]: the indexer key (after k_norm) and pooling gate of the last W
    positions (a ring, slot = position mod W; `indexer.recent_rows`); pooled [B, S / kpool, index_head_dim]:
    one pooled key per pool. A layer without its own indexer ("shared") holds zero-row index arrays
    (``init_cache(..., with_indexer=False)``).

    Paged (`pages` int32 [B, M], not None): latent, latent_scale and pooled are page pools shared by every
    stream, [num_pages, page_tokens, kv_lora], [num_pages, page_tokens | 0], [num_pages, page_tokens / kpool,
    index_head_dim]; stream b's position s is row s % page_tokens of page pages[b, s // page_tokens] (its pool q:
    row q % (page_tokens / kpool) of page pages[b, q // (page_tokens / kpool)]), so a stream holds up to
    S = M * page_tokens positions. recent_k / recent_gate and `pages` stay per stream. Which pages a stream
    holds is the host's business (glm53.serving.pages); every layer's pages row of a stream is the same.
    """

    latent: jnp.ndarray
    latent_scale: jnp.ndarray
    recent_k: jnp.ndarray
    recent_gate: jnp.ndarray
    pooled: jnp.ndarray
    pages: jnp.ndarray | None = None

    @property
    def paged(self) -> bool:
        return self.pages is not None

    @property
    def page_tokens(self) -> int:
        """Positions per page (paged), or the whole length (contiguous: one page per stream)."""
        return self.latent.shape[1]

    @property
    def batch(self) -> int:
        return (self.pages if self.paged else self.latent).shape[0]

    @property
    def max_len(self) -> int:
        return self.latent.shape[1] * (self.pages.shape[1] if self.paged else 1)


PAGED_FIELDS = ("latent", "latent_scale", "pooled")  # the arrays a paged DSACache holds as page pools


def write_paged(pool_p: jnp.ndarray, pages_bm: jnp.ndarray, new_bt: jnp.ndarray, start_b: jnp.ndarray) -> jnp.ndarray:
    """A page pool [P, page_tokens, ...] with stream b's rows new_bt[b] written at positions start_b[b] + t,
    through the page table (the paged `write_at`; the caller keeps the positions inside the table)."""
    b, t = new_bt.shape[:2]
    pos = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    at = page_rows(pages_bm, pos, pool_p.shape[1]).reshape(-1)
    flat = pool_p.reshape(-1, *pool_p.shape[2:])
    return flat.at[at].set(new_bt.reshape(b * t, *new_bt.shape[2:]).astype(pool_p.dtype)).reshape(pool_p.shape)


def latent_dtype(cfg: ModelConfig, dtype) -> jnp.dtype:
    """The dtype the latent cache is stored in: the config's ``latent_cache_dtype``, "auto" = `dtype`."""
    return jnp.dtype(dtype if cfg.latent_cache_dtype == "auto" else cfg.latent_cache_dtype)


def check_pages(cfg: ModelConfig, pages: tuple[int, int]) -> tuple[int, int]:
    """(num_pages, page_tokens) checked: ValueError naming them unless both are >= 1 and page_tokens is a multiple
    of index_kpool (no pool straddles two pages)."""
    try:
        num_pages, page_tokens = (int(v) for v in pages)
    except (TypeError, ValueError):
        raise ValueError(f"DSA init_cache: pages must be (num_pages, page_tokens), got {pages!r}") from None
    if num_pages < 1 or page_tokens < 1 or page_tokens % cfg.index_kpool:
        raise ValueError(
            f"DSA init_cache: pages=(num_pages={num_pages}, page_tokens={page_tokens}): both >= 1 and page_tokens "
            f"a multiple of index_kpool={cfg.index_kpool}"
        )
    return num_pages, page_tokens


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, with_indexer: bool = True, seq_shards: int = 1,
    pages: tuple[int, int] | None = None,
) -> DSACache:  # fmt: skip
    """An empty DSA cache for `batch` streams of up to `max_len` tokens (rounded up to a multiple of kpool, and of
    kpool * seq_shards so that `seq_shards` devices hold whole pools); `dtype` for the indexer rows (and the
    latent when ``latent_cache_dtype`` is "auto"). pages=(num_pages, page_tokens): a paged cache (`DSACache`)
    of that pool, every stream's table ceil(max_len / page_tokens) entries of page 0 (a scratch page: the host's
    page pool never hands it out)."""
    if batch < 1 or max_len < 1 or seq_shards < 1:
        raise ValueError(f"DSA init_cache: batch, max_len, seq_shards must be >= 1, got {batch}, {max_len}, {seq_shards}")
    kp = cfg.index_kpool
    c = cfg.index_head_dim
    w = recent_rows(kp) if with_indexer else 0
    lat = latent_dtype(cfg, dtype)
    if pages is not None:
        num_pages, pt = check_pages(cfg, pages)
        if num_pages % seq_shards:
            raise ValueError(f"DSA init_cache: num_pages={num_pages} must split over the {seq_shards} sequence "
                             "shards the layer runs on (each holds a block of pages)")  # fmt: skip
        lead, s, table = num_pages, pt, jnp.zeros((batch, -(-max_len // pt)), jnp.int32)
    else:
        lead, s, table = batch, -(-max_len // (kp * seq_shards)) * kp * seq_shards, None
    return DSACache(
        latent=jnp.zeros((lead, s, cfg.kv_lora_rank), lat),
        latent_scale=jnp.ones((lead, s if lat == jnp.int8 else 0), jnp.float32),
        recent_k=jnp.zeros((batch, w, c), dtype),
        recent_gate=jnp.zeros((batch, w, c), dtype),
        pooled=jnp.zeros((lead, s // kp if with_indexer else 0, c), dtype),
        pages=table,
    )


def check_cache(cfg: ModelConfig, cache: DSACache, what: str, *, with_indexer: bool = True) -> None:
    """ValueError naming the tensor when `cache` is not of this config's layout (e.g. a cache of another
    ``latent_cache_dtype`` or an older per-token indexer layout restored into this model)."""
    lat, want = cache.latent.dtype, cfg.latent_cache_dtype
    b, s = cache.latent.shape[:2]  # paged: (num_pages, page_tokens)
    if (want == "int8") != (lat == jnp.int8) or (want not in ("auto", "int8") and lat != jnp.dtype(want)):
        raise ValueError(
            f"{what}: latent is stored as {lat} but the config's latent_cache_dtype is {want!r} "
            "(a cache of another layout; build it with this model's init_cache)"
        )
    scale_rows = s if lat == jnp.int8 else 0
    if cache.latent_scale.shape != (b, scale_rows):
        raise ValueError(f"{what}: latent_scale has shape {cache.latent_scale.shape}, expected {(b, scale_rows)}")
    kp = cfg.index_kpool
    w, p = (recent_rows(kp), s // kp) if with_indexer else (0, 0)
    for name in ("recent_k", "recent_gate"):
        rows = getattr(cache, name).shape[1]
        if rows != w:
            raise ValueError(
                f"{what}: {name} has {rows} rows; this layout keeps the last 2*index_kpool = {w} positions "
                "(a cache of another layout?)"
            )
    if cache.pooled.shape[1] != p:
        raise ValueError(f"{what}: pooled has {cache.pooled.shape[1]} rows, expected {p} (max_len {s} / kpool)")
    if cache.paged:
        if cache.pages.ndim != 2 or cache.pages.dtype != jnp.int32 or cache.recent_k.shape[0] != cache.pages.shape[0]:
            raise ValueError(f"{what}: pages must be int32 [B, M] for the cache's {cache.recent_k.shape[0]} streams, "
                             f"got {cache.pages.dtype} {cache.pages.shape}")  # fmt: skip
        if s % kp:
            raise ValueError(f"{what}: pages of {s} tokens; page_tokens must be a multiple of index_kpool={kp}")


def is_shared_indexer(cfg: ModelConfig, layer_idx: int | None) -> bool:
    """True when trunk layer `layer_idx` reuses the previous full layer's selection (None: the MTP block)."""
    return (
        layer_idx is not None
        and layer_idx < len(cfg.indexer_types)
        and cfg.indexer_types[layer_idx] == "shared"
    )


class DSA(nnx.Module):
    """NoPE MLA with the KPool sparse indexer (HF ``Glm5NextTextAttention``); weights are [in, out]."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        layer_idx: int | None = None,
        attn_form: str = "absorbed",
        implementation: str = dispatch.AUTO,
    ):
        if attn_form not in ATTN_FORMS:
            raise ValueError(f"DSA: attn_form must be one of {ATTN_FORMS}, got {attn_form!r}")
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.attn_form = attn_form
        self.implementation = implementation
        self.num_heads, self.nope, self.v_dim = h, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        self.q_a_proj = Linear(d, cfg.q_lora_rank, (dims.EMBED, dims.Q_LORA), rngs=rngs, dtype=dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps, rngs=rngs, dtype=dtype)
        self.q_b_proj = Linear(
            cfg.q_lora_rank, h * self.nope, (dims.Q_LORA, dims.HEADS), rngs=rngs, dtype=dtype
        )
        self.kv_a_proj = Linear(d, self.kv_lora, (dims.EMBED, dims.KV_LORA), rngs=rngs, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps, rngs=rngs, dtype=dtype)
        self.kv_b_proj = Linear(
            self.kv_lora, h * (self.nope + self.v_dim), (dims.KV_LORA, dims.HEADS), rngs=rngs, dtype=dtype
        )
        self.o_proj = Linear(h * self.v_dim, d, (dims.HEADS, dims.EMBED), rngs=rngs, dtype=dtype)
        self.shared_indexer = is_shared_indexer(cfg, layer_idx)
        self.indexer = None if self.shared_indexer else Indexer(cfg, rngs=rngs, dtype=dtype)
        # The cache step on sequence-sharded caches (None: one device or GSPMD). Set by
        # glm53.parallel.dsa.shard_dsa_layers: an object whose `step` writes the new rows, selects and attends
        # under shard_map (the layer only calls it, so it does not depend on the parallel package).
        self.seq_shard = None

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, *, pages=None) -> DSACache:
        """This layer's empty cache (`init_cache`; pages=(num_pages, page_tokens): paged), its length rounded for
        the sequence shards it runs on."""
        shards = 1 if self.seq_shard is None else self.seq_shard.shards
        return init_cache(
            self.cfg, batch, max_len, dtype, with_indexer=not self.shared_indexer, seq_shards=shards, pages=pages
        )

    def _w_uk_uv(self, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
        """kv_b_proj split per head: W_uk [R, H, nope], W_uv [R, H, v]."""
        w = self.kv_b_proj.kernel[...].astype(dtype)
        w = w.reshape(self.kv_lora, self.num_heads, self.nope + self.v_dim)
        return w[..., : self.nope], w[..., self.nope :]

    def __call__(
        self,
        x_btd: jnp.ndarray,
        *,
        cache: DSACache | None = None,
        start_b: jnp.ndarray | None = None,
        selection: jnp.ndarray | None = None,
    ) -> tuple[jnp.ndarray, DSACache | None, jnp.ndarray]:
        """Attends the T new tokens of each stream (positions start_b + t) over its cached and new keys.

        Args:
          x_btd: layer input u [B, T, D]; cache: this layer's DSACache or None (fresh sequence, start 0);
          start_b: int32 [B] tokens already in each stream's cache (default 0);
          selection: pool ids [B, T, K] from the previous full layer (required iff this layer is "shared").
        Returns:
          y_btd [B, T, D], the updated cache (None when cache was None), the selection pool ids [B, T, K].
        """
        b, t, _ = x_btd.shape
        fresh = cache is None
        if fresh:
            cache = init_cache(self.cfg, b, t, x_btd.dtype, with_indexer=not self.shared_indexer)
        if start_b is None:
            start_b = jnp.zeros((b,), jnp.int32)
        start_b = jnp.asarray(start_b, jnp.int32)
        if start_b.shape != (b,):
            raise ValueError(
                f"DSA layer {self.layer_idx}: start_b must be int32 [B={b}], got shape {start_b.shape}"
            )
        if cache.batch != b:
            raise ValueError(f"DSA layer {self.layer_idx}: cache batch {cache.batch} != input batch {b}")
        check_cache(self.cfg, cache, f"DSA layer {self.layer_idx} cache", with_indexer=not self.shared_indexer)
        if t > cache.max_len:
            raise ValueError(
                f"DSA layer {self.layer_idx}: {t} new tokens exceed the cache length {cache.max_len}"
            )

        q_res = self.q_a_layernorm(self.q_a_proj(x_btd))  # [B, T, q_lora]
        q_bthc = self.q_b_proj(q_res).reshape(b, t, self.num_heads, self.nope)
        c_btr = self.kv_a_layernorm(self.kv_a_proj(x_btd))
        if self.shared_indexer:
            if selection is None:
                raise ValueError(
                    f"DSA layer {self.layer_idx}: indexer_types says 'shared'; pass the previous full layer's "
                    "selection as `selection=`"
                )
            if selection.ndim != 3 or selection.shape[:2] != (b, t):
                raise ValueError(
                    f"DSA layer {self.layer_idx}: selection must be pool ids [B={b}, T={t}, K], "
                    f"got shape {selection.shape}"
                )
        if not fresh and self.seq_shard is not None:
            return self._sharded_step(x_btd, q_res, q_bthc, c_btr, cache, start_b, selection)
        table = cache.pages  # None: contiguous
        write = write_at if table is None else (lambda pool, new, st: write_paged(pool, table, new, st))
        if cache.latent.dtype == jnp.int8:
            c_q, c_scale = quantize_rows(c_btr)
            latent, latent_scale = write(cache.latent, c_q, start_b), write(cache.latent_scale, c_scale, start_b)
        else:
            latent, latent_scale = write(cache.latent, c_btr, start_b), cache.latent_scale  # [B, S, R] / pages
        scale_bs = latent_scale if cache.latent.dtype == jnp.int8 else None
        if self.shared_indexer:
            pool_ids, index_state = selection, (cache.recent_k, cache.recent_gate, cache.pooled)
        else:
            pool_ids, index_state = self.indexer(
                x_btd, q_res, cache.recent_k, cache.recent_gate, cache.pooled, start_b, page_table_bm=table
            )
        new_cache = DSACache(latent, latent_scale, *index_state, pages=table)

        q_pos_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        kw = dict(
            kpool=self.cfg.index_kpool,
            select_tail=self.cfg.index_kpool_always_select_tail,
            scale=self.nope**-0.5,  # qk_head_dim^-0.5, also in the absorbed form
            implementation=self.implementation,
        )
        w_uk, w_uv = self._w_uk_uv(x_btd.dtype)
        if self.attn_form == "absorbed" or t == 1:
            q_hat = jnp.einsum("bthc,rhc->bthr", q_bthc, w_uk)  # [B, T, H, R]
            # the kernel reads the stored latent (rows cast to q's dtype; an int8 latent dequantized per row)
            c_hat = sparse_mla_api.sparse_mla(
                q_hat, latent, pool_ids, q_pos_bt, latent_scale_bs=scale_bs, page_table_bm=table, **kw
            )
            o_bthe = jnp.einsum("bthr,rhe->bthe", c_hat, w_uv)
        else:
            if table is not None:  # the dense form reads every stream's rows in order
                latent = sparse_mla_api.paged_view(latent, table)
                scale_bs = None if scale_bs is None else sparse_mla_api.paged_view(scale_bs, table)
            lat_bsr = dequantize_rows(latent, scale_bs, x_btd.dtype)
            k_bshc = jnp.einsum("bsr,rhc->bshc", lat_bsr, w_uk)
            v_bshe = jnp.einsum("bsr,rhe->bshe", lat_bsr, w_uv)
            o_bthe = sparse_mla_api.sparse_mha(q_bthc, k_bshc, v_bshe, pool_ids, q_pos_bt, **kw)
        y = self.o_proj(o_bthe.reshape(b, t, self.num_heads * self.v_dim))
        return y, (None if fresh else new_cache), pool_ids

    def _sharded_step(self, x_btd, q_res, q_bthc, c_btr, cache, start_b, selection):
        """The cache step on sequence-sharded caches (`self.seq_shard`), absorbed form."""
        b, t, _ = x_btd.shape
        if self.attn_form != "absorbed" and t > 1:
            raise NotImplementedError(
                f"DSA layer {self.layer_idx}: attn_form='expanded' needs the whole latent; sequence-sharded "
                "caches run the absorbed form"
            )
        w_uk, w_uv = self._w_uk_uv(x_btd.dtype)
        q_hat = jnp.einsum("bthc,rhc->bthr", q_bthc, w_uk)
        index_in = None if self.shared_indexer else (*self.indexer.project(x_btd, q_res), self.indexer.compress_ape[...])
        new_cache, pool_ids, c_hat = self.seq_shard.step(
            cache, c_btr, index_in, selection, q_hat, start_b,
            kpool=self.cfg.index_kpool, select_tail=self.cfg.index_kpool_always_select_tail,
            num_select=None if self.shared_indexer else self.indexer.num_select(
                cache.pooled.shape[1] * (cache.pages.shape[1] if cache.paged else 1)),
            scale=self.nope**-0.5,
        )  # fmt: skip
        o_bthe = jnp.einsum("bthr,rhe->bthe", c_hat, w_uv)
        y = self.o_proj(o_bthe.reshape(b, t, self.num_heads * self.v_dim))
        return y, new_cache, pool_ids
