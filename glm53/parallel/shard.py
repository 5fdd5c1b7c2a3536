"""Placing a model and its caches on a mesh by the rules of `glm53.parallel.rules`.

`shard_model` / `abstract_sharded_model` / `init_sharded_model` place every parameter by its logical axes
(quantized planes re-laid out first, `glm53.parallel.moe.prepare_planes`) and wrap every MoE layer in
`glm53.parallel.moe.ShardedMoE`; `cache_shardings` / `shard_cache` place a `glm53.model.Cache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm53 import dims
from glm53.errors import ShardingError
from glm53.layers.dsa import DSACache
from glm53.layers.kda import KDACache
from glm53.model import Cache
from glm53.parallel import distributed
from glm53.parallel.dsa import shard_dsa_layers
from glm53.parallel.moe import prepare_planes, wrap_moe_layers
from glm53.parallel.rules import (
    BATCH,
    CACHE_POOLS,
    CACHE_SEQ,
    CONV_CHANNELS,
    Rules,
    _value_shardings,
    axis_size,
    check_rules,
    get_rules,
    logical_to_sharding,
    param_axes,
    path_str,
)


# --------------------------------------------------------------------------------------------- placement
def _map_params(fn: Callable[[str, nnx.Variable], Any], state: nnx.State) -> nnx.State:
    flat = nnx.to_flat_state(state)
    return nnx.from_flat_state([(path, fn(f"parameter {path_str(path)}", var)) for path, var in flat])


def _prepare_state(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    def one(what, var):
        return var.replace(value=prepare_planes(var.get_value(), param_axes(var, what), mesh, rules, what))

    return _map_params(one, state)


def state_shardings(state: nnx.State, mesh: Mesh, rules: str | Rules) -> nnx.State:
    """A State shaped like `state` whose array leaves are their NamedShardings (for `jax.device_put` or
    `jax.jit(out_shardings=...)`). `state` may be abstract. Quantized planes must already be prepared."""
    rules = get_rules(rules)
    check_rules(state, rules, mesh)

    def one(what, var):
        return var.replace(value=_value_shardings(var.get_value(), param_axes(var, what), mesh, rules, what))

    return _map_params(one, state)


def _dispatch(model: nnx.Module, mesh: Mesh, rules: Rules, moe_dispatch: bool) -> nnx.Module:
    shard_dsa_layers(model, mesh, rules)  # DSA caches split by sequence: the cache step under shard_map
    if not moe_dispatch:
        return model
    return wrap_moe_layers(model, mesh, rules)


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: str | Rules, *, moe_dispatch: bool = True
) -> nnx.Module:
    """A copy of `model` with every parameter placed by its rule (quantized planes re-laid out first) and, with
    `moe_dispatch`, every MoE layer wrapped in `ShardedMoE`. `model` itself is left as it is."""
    rules = get_rules(rules)
    graphdef, state = nnx.split(model)
    state = _prepare_state(state, mesh, rules)
    state = distributed.device_put(state, state_shardings(state, mesh, rules))  # several processes: via the host
    return _dispatch(nnx.merge(graphdef, state), mesh, rules, moe_dispatch)


def abstract_sharded_model(
    build: Callable[[], nnx.Module], mesh: Mesh, rules: str | Rules, *, moe_dispatch: bool = True
) -> nnx.Module:
    """`nnx.eval_shape(build)` whose parameters are ShapeDtypeStructs carrying their NamedShardings (what the
    checkpoint loaders' `put` receives), quantized planes in their sharded layout, MoE layers wrapped."""
    rules = get_rules(rules)
    graphdef, state = nnx.split(nnx.eval_shape(build))
    state = jax.eval_shape(lambda s: _prepare_state(s, mesh, rules), state)
    shardings = state_shardings(state, mesh, rules)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
    return _dispatch(nnx.merge(graphdef, state), mesh, rules, moe_dispatch)


def init_sharded_model(
    build: Callable[[], nnx.Module], mesh: Mesh, rules: str | Rules, *, moe_dispatch: bool = True
) -> nnx.Module:
    """`build()` initialized directly into its shardings (one jit with out_shardings: no whole copy anywhere)."""
    rules = get_rules(rules)
    graphdef, state = nnx.split(nnx.eval_shape(build))
    state = jax.eval_shape(lambda s: _prepare_state(s, mesh, rules), state)
    shardings = state_shardings(state, mesh, rules)
    state = jax.jit(lambda: _prepare_state(nnx.state(build()), mesh, rules), out_shardings=shardings)()
    return _dispatch(nnx.merge(graphdef, state), mesh, rules, moe_dispatch)


# ------------------------------------------------------------------------------------------------ caches
def cache_shardings(cache, mesh: Mesh, rules: str | Rules):
    """NamedShardings (the pytree of `cache`, a `glm53.model.Cache`, possibly abstract) by the cache rules of
    the module docstring. A batch that the "data" axis does not divide stays replicated. A scanned model's stacked
    entry of `cache.layers` gets each layer kind's shardings behind an unsharded leading repeat axis."""
    rules = get_rules(rules)
    if not isinstance(cache, Cache):
        raise ShardingError(f"cache_shardings: expected a glm53.model.Cache, got {type(cache).__name__}")
    n_batch = axis_size(mesh, rules.mesh_axes(BATCH), "cache batch")

    def sh(axes, a, what):
        if a.size == 0:  # an empty leaf (a float latent's scales, a shared indexer's rows): replicated, as jit places it
            return logical_to_sharding((None,) * a.ndim, mesh, rules, a.shape, what)
        if a.shape[0] % n_batch:
            axes = (None, *axes[1:])
        return logical_to_sharding(axes, mesh, rules, a.shape, what)

    def layer(c, i):
        if c is None:
            return None
        if isinstance(c, tuple):  # a LayerStack's caches (glm53.layers.stack): per period position, every array
            # with a leading repeat axis, never sharded; the other axes as one layer's of that kind
            return tuple(
                jax.tree.map(_stacked, layer(jax.tree.map(_one_repeat, cj), f"{i} (stacked, position {j})"))
                for j, cj in enumerate(c)
            )
        if isinstance(c, KDACache):  # conv_state [B, K-1, 3*H*d], state [B, H, dk, dv]
            return KDACache(
                conv_state=sh((BATCH, None, CONV_CHANNELS), c.conv_state, f"KDA cache {i} conv_state"),
                state=sh((BATCH, dims.KDA_HEADS, None, None), c.state, f"KDA cache {i} state"),
            )
        if isinstance(c, DSACache) and c.paged:  # page pools [P, pt, ...] split on their page axis; tables whole
            n_seq = axis_size(mesh, rules.mesh_axes(CACHE_SEQ), "DSA cache")
            if c.latent.shape[0] % n_seq:
                raise ShardingError(f"DSA cache {i}: {c.latent.shape[0]} pages do not split over the {n_seq} devices "
                                    f"of cache_seq (rule set {rules.name!r}); use a multiple of {n_seq} pages")  # fmt: skip
            def pool(axes, a, what):  # no batch axis: the page axis leads
                return logical_to_sharding(axes if a.size else (None,) * a.ndim, mesh, rules, a.shape, what)

            return DSACache(
                latent=pool((CACHE_SEQ, None, None), c.latent, f"DSA cache {i} latent pages"),
                latent_scale=pool((CACHE_SEQ, None), c.latent_scale, f"DSA cache {i} latent_scale pages"),
                recent_k=sh((BATCH, None, None), c.recent_k, f"DSA cache {i} recent_k"),
                recent_gate=sh((BATCH, None, None), c.recent_gate, f"DSA cache {i} recent_gate"),
                pooled=pool((CACHE_SEQ, None, None), c.pooled, f"DSA cache {i} pooled pages"),
                pages=sh((BATCH, None), c.pages, f"DSA cache {i} pages"),
            )
        if isinstance(c, DSACache):  # latent [B, S, R], latent_scale [B, S | 0], recent [B, W, C], pooled [B, P, C]
            n_seq = axis_size(mesh, rules.mesh_axes(CACHE_SEQ), "DSA cache")
            n_pools = axis_size(mesh, rules.mesh_axes(CACHE_POOLS), "DSA cache")
            if c.pooled.shape[1] and (c.pooled.shape[1] % max(n_seq, n_pools) or n_seq not in (1, n_pools)):
                raise ShardingError(
                    f"DSA cache {i}: {c.pooled.shape[1]} pools of {c.latent.shape[1] // c.pooled.shape[1]} "
                    f"tokens do not split over {n_seq} x {n_pools} devices (cache_seq / cache_pools of rule set "
                    f"{rules.name!r}): each device holds whole pools; round the context up to a multiple of "
                    f"{max(n_seq, n_pools) * (c.latent.shape[1] // c.pooled.shape[1])} tokens"
                )
            return DSACache(
                latent=sh((BATCH, CACHE_SEQ, None), c.latent, f"DSA cache {i} latent"),
                latent_scale=sh((BATCH, CACHE_SEQ), c.latent_scale, f"DSA cache {i} latent_scale"),
                recent_k=sh((BATCH, None, None), c.recent_k, f"DSA cache {i} recent_k"),
                recent_gate=sh((BATCH, None, None), c.recent_gate, f"DSA cache {i} recent_gate"),
                pooled=sh((BATCH, CACHE_POOLS, None), c.pooled, f"DSA cache {i} pooled"),
            )
        raise ShardingError(f"cache layer {i}: unknown cache type {type(c).__name__}")

    return Cache(
        length=sh((BATCH,), cache.length, "cache length"),
        layers=tuple(layer(c, i) for i, c in enumerate(cache.layers)),
        mtp=layer(cache.mtp, "mtp"),
    )


def _one_repeat(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)


def _stacked(s: NamedSharding) -> NamedSharding:
    return NamedSharding(s.mesh, PartitionSpec(None, *s.spec))


def shard_cache(cache, mesh: Mesh, rules: str | Rules):
    """`cache` placed by `cache_shardings`."""
    return distributed.device_put(cache, cache_shardings(cache, mesh, rules))
