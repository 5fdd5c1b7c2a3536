"""Per-device bytes of the caches of one context set: the model's own cache pytree (`Glm53Model.init_cache`, built
abstractly) placed by `glm53.parallel.shard.cache_shardings` under a placement's rules, each leaf stored as a
`CacheLayout` says (the prior art's int8 latent and pooled indexer keys, or the model's bf16 DSACache)."""

from __future__ import annotations

import dataclasses
import math

from glm53.config import ModelConfig
from glm53.layers.dsa import DSACache
from glm53.layers.kda import KDACache
from glm53.memory.inventory import abstract_cache
from glm53.memory.placement import DTYPE_BYTES, INT8_SCALE_BYTES, Placement, budget_mesh, get_placement
from glm53.parallel.shard import cache_shardings


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Cache storage of one context set (one stream).

    latent: "int8" (512 int8 + one f32 absmax scale per token, the prior art) or "bf16".
    indexer: "pooled" (one pooled key per pool + the per-token key / gate of the last 2 * kpool positions only,
      on every device: the layout of glm53/layers/dsa.py DSACache) or "full" (a per-token key and gate for
      every position as well: the model's layout before the serving caches).
    """

    latent: str = "int8"
    indexer: str = "pooled"
    index_dtype: str = "bf16"
    kda_state_dtype: str = "f32"
    conv_dtype: str = "bf16"
    include_mtp: bool = False

    def __post_init__(self):
        if self.latent not in ("int8", "bf16"):
            raise ValueError(f"cache latent must be 'int8' or 'bf16', got {self.latent!r}")
        if self.indexer not in ("pooled", "full"):
            raise ValueError(f"cache indexer must be 'pooled' or 'full', got {self.indexer!r}")
        for f in ("index_dtype", "kda_state_dtype", "conv_dtype"):
            if getattr(self, f) not in DTYPE_BYTES:
                raise ValueError(f"cache {f} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, f)!r}")


def context_set_bytes(
    cfg: ModelConfig,
    context: int,
    devices: int,
    layout: CacheLayout = CacheLayout(),
    placement: str | Placement = "prior_art",
) -> dict:
    """Bytes ONE device holds for one stream of `context` tokens, per cache component: the model's cache
    pytree (`Glm53Model.init_cache`) placed by `cache_shardings` under the placement's rules, its leaves
    stored as `layout` says."""
    if context < 1 or devices < 1:
        raise ValueError(f"context and devices must be >= 1, got {context}, {devices}")
    p = get_placement(placement)
    cache = abstract_cache(cfg, context, with_mtp=layout.include_mtp)
    try:
        shardings = cache_shardings(cache, budget_mesh(devices), p.rules)
    except ValueError as e:
        raise ValueError(f"--context={context} over {devices} devices ({p.name} placement): {e}") from None

    def held(a, sharding) -> int:
        return math.prod(sharding.shard_shape(a.shape))

    ib = DTYPE_BYTES[layout.index_dtype]
    latent_row = cfg.kv_lora_rank + INT8_SCALE_BYTES if layout.latent == "int8" else 2 * cfg.kv_lora_rank
    out = dict.fromkeys(
        ("kda_state", "kda_conv", "mla_latent", "indexer_pooled_keys", "indexer_keys_gates"), 0
    )
    for c, s in _layer_caches(cache, shardings):
        if isinstance(c, KDACache):
            out["kda_state"] += held(c.state, s.state) * DTYPE_BYTES[layout.kda_state_dtype]
            out["kda_conv"] += held(c.conv_state, s.conv_state) * DTYPE_BYTES[layout.conv_dtype]
        elif isinstance(c, DSACache):
            # latent rows held: [B = 1, S] (or [repeats, 1, S] stacked), split like the sequence
            rows = math.prod(s.latent.shard_shape(c.latent.shape)[:-1])
            out["mla_latent"] += rows * latent_row
            out["indexer_pooled_keys"] += held(c.pooled, s.pooled) * ib
            if not c.recent_k.shape[-2]:  # a layer sharing its indexer holds no indexer rows
                continue
            if layout.indexer == "full":  # a key and a gate for every position, split like the latent
                out["indexer_keys_gates"] += rows * 2 * cfg.index_head_dim * ib
            else:  # the model's ring of the last 2 * kpool positions, whole on every device
                out["indexer_keys_gates"] += (held(c.recent_k, s.recent_k) + held(c.recent_gate, s.recent_gate)) * ib
    return out


def _layer_caches(cache, shardings):
    """(layer cache, its shardings) of every trunk layer and the MTP block; a scanned model's stacked entry (a
    tuple over period positions, arrays [repeats, ...]) gives one pair per position, which counts every repeat."""
    for c, s in zip((*cache.layers, cache.mtp), (*shardings.layers, shardings.mtp)):
        yield from zip(c, s) if isinstance(c, tuple) else [(c, s)]
