"""The GLM-5.3-Flash text model: embedding copied into the mHC streams, the hybrid decoder stack, the stream mean,
the final norm and an untied lm_head; plus the MTP block (layer 45) used as a speculative drafter.

    e = Embed[ids]                  [B, T, D]
    x = broadcast e to n streams    [B, T, n, D]
    x = DecoderLayer_l(x) for l in layers (KDA / DSA attention, dense / MoE FFN, per cfg.layer_types)
    h = RMSNorm(mean over streams of x)
    logits = h @ lm_head            [B, T, V] (f32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from glm53 import dims
from glm53.config import ModelConfig, QuantConfig
from glm53.config.kernels import KernelConfig, check_expert_kernel, kernel_config
from glm53.layers.block import DecoderLayer
from glm53.layers.linear import Linear
from glm53.layers.mtp import MTPBlock
from glm53.layers.norm import RMSNorm
from glm53.layers.param import param
from glm53.layers.stack import LayerGroup, LayerStack, describe_groups, layer_groups
from glm53.quant.int8 import Int8Rows


@struct.dataclass
class Cache:
    """Decode state of B streams: `length` [B] tokens already processed per stream, one cache per trunk layer
    (KDACache / DSACache), and the MTP block's DSA cache (or None)."""

    length: jnp.ndarray
    layers: tuple[Any, ...]
    mtp: Any = None

    @property
    def batch(self) -> int:
        return self.length.shape[0]


class Embed(nnx.Module):
    """Token embedding: table [V, D] (vocabulary-split by the rules). The table may hold a
    `glm53.quant.int8.Int8Rows` (int8 rows + f32 scale per row, as the memory budget stores it; the compiled
    model's option): a lookup then gathers int8 rows and dequantizes only those."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embedding = param(rngs, (vocab, dim), (dims.VOCAB, dims.EMBED), dtype, std=0.02)

    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        w = self.embedding.get_value()
        if isinstance(w, Int8Rows):
            return w.take(ids)
        return jnp.take(self.embedding[...], ids, axis=0)


class Glm53Model(nnx.Module):
    """GLM-5.3-Flash text model (`Glm5NextForConditionalGeneration`'s language part + the MTP block).

    Args:
      cfg: the model config.
      dtype: parameter (and compute) dtype.
      kernels: the implementation of each kernel op: a `glm53.config.kernels.KernelConfig`, or a mapping of
        some ops validated into one (e.g. {"moe": "reference"}); None: KernelConfig() (every op "auto", the
        backend's best). Kept as `self.kernels`.
      with_mtp: build the MTP block when cfg.num_nextn_predict_layers > 0.
      quant: routed-expert storage (QuantizedExperts per glm53.quant.qweight.expert_formats).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        kernels: KernelConfig | dict[str, str] | None = None,
        with_mtp: bool = True,
        quant: QuantConfig | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        kernels = kernel_config(kernels)
        check_expert_kernel(kernels, quant, cfg.num_moe_layers)
        self.kernels = kernels
        self.quant = quant
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        layers = [
            DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, kernels=kernels, quant=quant)
            for i in range(cfg.num_hidden_layers)
        ]  # built one by one (the same random values whatever the grouping), then grouped
        self.groups = layer_groups(cfg, quant)
        self.layers = nnx.List(_units(layers, self.groups))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
        self.lm_head = Linear(
            cfg.hidden_size, cfg.vocab_size, (dims.EMBED, dims.VOCAB), rngs=rngs, dtype=dtype
        )
        mtp = None
        if with_mtp and cfg.num_nextn_predict_layers > 0:
            mtp = MTPBlock(cfg, rngs=rngs, dtype=dtype, kernels=kernels, quant=quant)
        self.mtp = nnx.data(mtp)

    # ------------------------------------------------------------------------------------------------ caches
    def set_latent_cache_dtype(self, value: str) -> None:
        """Switches how every DSA cache stores its latent (`ModelConfig.latent_cache_dtype`, a serving layout,
        not part of the weights): the config of the model and of each of its modules is replaced."""
        cfg = self.cfg.replace(latent_cache_dtype=value)  # validated: a ConfigError names the field
        for _, m in nnx.iter_modules(self):
            if isinstance(getattr(m, "cfg", None), ModelConfig):
                m.cfg = cfg

    def set_scan_layers(self, value: bool) -> None:
        """Regroups the trunk (`ModelConfig.scan_layers`, a runtime layout): True stacks every group of
        `glm53.layers.stack.layer_groups` into a LayerStack, False unrolls them. Values move, none change."""
        cfg = self.cfg.replace(scan_layers=bool(value))
        groups = layer_groups(cfg, self.quant)
        if groups != self.groups:
            self.layers = nnx.List(_units(self.unrolled_layers(), groups))
            self.groups = groups
        for _, m in nnx.iter_modules(self):
            if isinstance(getattr(m, "cfg", None), ModelConfig):
                m.cfg = cfg

    def unrolled_layers(self) -> list[DecoderLayer]:
        """The trunk's layers in order as plain DecoderLayers (a stacked group's are sliced copies)."""
        out = []
        for unit in self.layers:
            out.extend(unit.unstack() if isinstance(unit, LayerStack) else [unit])
        return out

    def layer(self, i: int) -> DecoderLayer:
        """Trunk layer i as a plain DecoderLayer (itself when unrolled, a sliced copy when stacked)."""
        u, g = self.unit_of(i)
        unit = self.layers[u]
        return unit.layer(i) if isinstance(unit, LayerStack) else unit

    def unit_of(self, i: int) -> tuple[int, LayerGroup]:
        """(index in self.layers, group) of trunk layer i."""
        for u, g in enumerate(self.groups):
            if i in g.layers:
                return u, g
        raise IndexError(f"layer {i}: the model has {self.cfg.num_hidden_layers} trunk layers")

    def init_cache(self, batch: int, max_len: int, dtype=None, *, pages: tuple[int, int] | None = None) -> Cache:
        """An empty cache for `batch` streams of up to `max_len` tokens each (one entry of `layers` per unit of
        self.layers: a layer's cache, or a LayerStack's per-position caches stacked over its repeats).
        pages=(num_pages, page_tokens): the DSA caches are paged (glm53.layers.dsa.DSACache: every DSA layer a
        pool of num_pages pages, each stream's table of ceil(max_len / page_tokens) entries all page 0, the
        scratch page; glm53.runtime.cache.set_pages fills them); KDA states stay per stream."""
        dtype = dtype or self.dtype
        layers = tuple(layer.init_cache(self.cfg, batch, max_len, dtype, pages=pages) for layer in self.layers)
        mtp = None if self.mtp is None else self.mtp.init_cache(batch, max_len, dtype, pages=pages)
        return Cache(length=jnp.zeros((batch,), jnp.int32), layers=layers, mtp=mtp)

    # ------------------------------------------------------------------------------------------------ forward
    def hidden(self, tokens_bt: jnp.ndarray, *, cache: Cache | None = None):
        """Final-normed hidden states h [B, T, D] and the updated cache (None when `cache` is None).

        Token t of stream b sits at absolute position cache.length[b] + t.
        """
        b, t = tokens_bt.shape
        start_b = jnp.zeros((b,), jnp.int32) if cache is None else cache.length
        if cache is not None:
            check_cache_layout(self, cache)
        e = self.embed(tokens_bt)
        x = jnp.broadcast_to(e[:, :, None, :], (b, t, self.cfg.hc_mult, e.shape[-1]))
        selection = None
        new_layers = []
        for u, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[u]
            x, layer_cache, selection = layer(x, cache=layer_cache, start_b=start_b, selection=selection)
            new_layers.append(layer_cache)
        h = self.norm(jnp.mean(x, axis=2))
        if cache is None:
            return h, None
        return h, cache.replace(length=cache.length + t, layers=tuple(new_layers))

    def logits(self, h_btd: jnp.ndarray) -> jnp.ndarray:
        return self.lm_head(h_btd).astype(jnp.float32)

    def __call__(self, tokens_bt: jnp.ndarray, *, cache: Cache | None = None):
        """Logits [B, T, V] (f32) of the next token at every position, and the updated cache."""
        h, cache = self.hidden(tokens_bt, cache=cache)
        return self.logits(h), cache

    def mtp_logits(self, h_btd: jnp.ndarray, next_tokens_bt: jnp.ndarray, *, cache: Cache, last_only=False):
        """MTP draft: logits for the token after `next_tokens` from the trunk's hidden states `h` at the same
        positions (h at position p, next_tokens = token p+1 -> logits for token p+2). Uses and updates
        cache.mtp at positions cache.length - T .. cache.length - 1 (call after the trunk consumed those positions).
        last_only: the logits [B, 1, V] of the last position only.
        """
        if self.mtp is None:
            raise ValueError("this model was built without the MTP block")
        t = h_btd.shape[1]
        start_b = cache.length - t
        e = self.embed(next_tokens_bt)
        x, mtp_cache = self.mtp(h_btd, e, cache=cache.mtp, start_b=start_b)
        return self.logits(x[:, -1:] if last_only else x), cache.replace(mtp=mtp_cache)


def _units(layers: list, groups) -> list:
    """self.layers of a grouping: a plain layer per one-repeat group's layer, a LayerStack per scanned group."""
    out = []
    for g in groups:
        ls = layers[g.first : g.first + g.period * g.repeats]
        out.extend([LayerStack(ls, g)] if g.scanned else ls)
    return out


def check_cache_layout(model: Glm53Model, cache: Cache) -> None:
    """ValueError when `cache` was made for another grouping of the layers (`ModelConfig.scan_layers`)."""
    kinds = tuple(isinstance(c, tuple) for c in cache.layers)
    if kinds != tuple(g.scanned for g in model.groups):
        raise ValueError(
            f"cache: {len(cache.layers)} layer entries ({sum(kinds)} stacked) but the model runs "
            f"{describe_groups(model.groups)}; make the cache with this model's init_cache (scan_layers="
            f"{model.cfg.scan_layers})"
        )


def layer_cache(model: Glm53Model, cache: Cache, i: int):
    """Trunk layer i's cache in `cache` (a slice of its LayerStack's stacked cache when scanned)."""
    u, g = model.unit_of(i)
    if not g.scanned:
        return cache.layers[u]
    r, j = g.where(i)
    return jax.tree.map(lambda x: x[r], cache.layers[u][j])


def count_params(model: nnx.Module) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
