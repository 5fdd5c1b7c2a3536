"""The programs `glm53.benchmarks.compile_tpu` compiles: a step of B streams x T tokens over caches of a given
context, whole (`compose="full"`: the model as it runs, a scanned LayerStack compiled once with its loop) or as
units (`compose="kinds"`: embedding + head, and one unit per distinct layer kind), with the bytes each holds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53 import parallel as S
from glm53.model import Glm53Model
from glm53.quant.qweight import QuantizedExperts
from glm53.runtime.cache import split_pool


def _expert_reads(state, slots: int) -> int:
    """Bytes one device's Mosaic expert kernels stream per step: min(slots, E) experts of every QuantizedExperts
    leaf (XLA's cost analysis counts none of the planes a Mosaic kernel reads; padded slots fetch nothing)."""
    out = 0
    for _, v in nnx.to_flat_state(state):
        q = v.get_value()
        if isinstance(q, QuantizedExperts):  # planes lead [E] or [R, E] (a scanned LayerStack's R layers)
            *reps, e = q.planes.lead_shape
            out += device_bytes(q) // e * min(slots, e)
    return out


def _split_weights(state) -> dict:
    routed = sum(
        device_bytes(v.get_value())
        for _, v in nnx.to_flat_state(state)
        if isinstance(v.get_value(), QuantizedExperts)
    )
    return dict(routed_experts=routed, non_expert=device_bytes(state) - routed)


def device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard: all are equal)."""
    return sum(
        math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
    )


def _placed(shape, dtype, axes, mesh, rules):
    """A ShapeDtypeStruct placed by logical axes (a dimension its mesh axes do not divide: replicated)."""
    axes = tuple(
        a if shape[i] % S.axis_size(mesh, rules.mesh_axes(a)) == 0 else None for i, a in enumerate(axes)
    )
    return jax.ShapeDtypeStruct(shape, dtype, sharding=S.logical_to_sharding(axes, mesh, rules, shape))


# ---------------------------------------------------------------------------------------------- programs
@dataclasses.dataclass
class Unit:
    """One compiled program: `fn(*args)` (jitted with `donate`), run `count` times per step (layers: which)."""

    name: str
    fn: Callable
    args: tuple
    donate: tuple[int, ...]
    layers: list[int]
    weights: dict
    cache: int
    prefix: str = ""  # of the parameter paths in the unit's state (args[0]): "layers.<i>." in a layer
    expert_reads: int = 0  # bytes its expert kernels read per call (`_expert_reads`)

    calls: int | None = None  # times per step when not one per layer (a loop body: its repeats beyond the first)
    pool: int = 0  # of `cache`: the page pools of paged DSA caches (shared by every stream; glm53.layers.dsa)

    @property
    def count(self) -> int:
        return self.calls if self.calls is not None else max(1, len(self.layers))


class _EmbedHead(nnx.Module):
    """The model's embedding (into the mHC streams) and head (stream mean, final norm, lm_head)."""

    def __init__(self, model: Glm53Model):
        self.embed, self.norm, self.lm_head = model.embed, model.norm, model.lm_head
        self.hc_mult = model.cfg.hc_mult

    def __call__(self, tokens_bt, x_btnd):
        e = self.embed(tokens_bt)
        x0 = jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], self.hc_mult, e.shape[-1]))
        logits = self.lm_head(self.norm(jnp.mean(x_btnd, axis=2))).astype(jnp.float32)
        return x0, logits


def _apply(graphdef):
    def fn(state, *args, **kwargs):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    return fn


def _layer_kind(layer) -> str:
    attn = layer.attn_kind + ("(shared indexer)" if getattr(layer.self_attn, "shared_indexer", False) else "")
    if layer.mlp_kind != "moe":
        return f"{attn}+{layer.mlp_kind}"
    e = layer.mlp.experts
    fmts = [
        w.format_name if isinstance(w, QuantizedExperts) else str(w.dtype)
        for w in (e.gate_proj.get_value(), e.up_proj.get_value(), e.down_proj.get_value())
    ]
    return f"{attn}+moe[{'/'.join(fmts)}]"


def _loop_bodies(model: Glm53Model, batch: int, tokens: int, cache, mesh, rules) -> list[Unit]:
    """One unit per scanned group: its loop alone, compiled as a program of its own. XLA's cost analysis counts a
    while loop's body once whatever its trip count, so the whole program's flops and bytes accessed miss
    (repeats - 1) iterations of every loop; each unit here measures one iteration (`calls` = repeats - 1)."""
    x = _placed((batch, tokens, model.cfg.hc_mult, model.cfg.hidden_size), jnp.bfloat16, (S.BATCH,) + (None,) * 3,
                mesh, rules)  # fmt: skip
    out = []
    for u, g in enumerate(model.groups):
        if not g.scanned:
            continue
        gd, state = nnx.split(model.layers[u])

        def body(state, x, c, start, gd=gd):
            return nnx.merge(gd, state)(x, cache=c, start_b=start)

        out.append(Unit(f"loop {g.describe()}", body, (state, x, cache.layers[u], cache.length), (2,), list(g.layers),
                        {}, 0, f"layers.{u}.", 0, calls=g.repeats - 1))  # fmt: skip
    return out


def programs(
    model: Glm53Model, batch: int, tokens: int, context: int, compose: str, mesh, rules, pages=None
) -> list[Unit]:
    """The units of one step of `batch` streams x `tokens` tokens over caches of `context` tokens (pages=
    (num_pages, page_tokens): paged DSA caches, one pool for every stream, each stream's table `context` long)."""
    cfg = model.cfg
    cache = jax.eval_shape(lambda: model.init_cache(batch, context, jnp.bfloat16, pages=pages))
    cache = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        cache,
        S.cache_shardings(cache, mesh, rules),
    )
    ids = _placed((batch, tokens), jnp.int32, (S.BATCH, None), mesh, rules)
    if compose == "full":
        gd, state = nnx.split(model)

        def step(state, ids, cache):
            return nnx.merge(gd, state)(ids, cache=cache)

        reads = _expert_reads(state, batch * tokens * cfg.num_experts_per_tok)
        units = [Unit("model", step, (state, ids, cache), (2,), [], _split_weights(state), device_bytes(cache), "", reads,
                      pool=device_bytes(split_pool(cache)[1]))]  # fmt: skip
        return units + _loop_bodies(model, batch, tokens, cache, mesh, rules)
    x = _placed(
        (batch, tokens, cfg.hc_mult, cfg.hidden_size), jnp.bfloat16, (S.BATCH,) + (None,) * 3, mesh, rules
    )
    gd, state = nnx.split(_EmbedHead(model))
    units = {"embed+head": Unit("embed+head", _apply(gd), (state, ids, x), (), [], _split_weights(state), 0)}
    selection = None
    for i, layer in enumerate(model.layers):
        gd, state = nnx.split(layer)
        fn = _apply(gd)
        shared = layer.attn_kind == "dsa" and layer.self_attn.shared_indexer
        args = (state, x, cache.layers[i], cache.length, selection if shared else None)
        leaves = jax.tree_util.tree_leaves_with_path(args)
        sig = tuple((jax.tree_util.keystr(k), a.shape, str(a.dtype), a.sharding.spec) for k, a in leaves)
        key = (_layer_kind(layer), sig)
        if key not in units:
            step = lambda state, x, c, start, sel, fn=fn: fn(state, x, cache=c, start_b=start, selection=sel)  # noqa: E731
            weights, cache_bytes = _split_weights(state), device_bytes(cache.layers[i])
            reads = _expert_reads(state, batch * tokens * cfg.num_experts_per_tok)
            units[key] = Unit(key[0], step, args, (2,), [], weights, cache_bytes, f"layers.{i}.", reads,
                              pool=device_bytes(split_pool(cache.replace(layers=(cache.layers[i],)))[1]))  # fmt: skip
        units[key].layers.append(i)
        if layer.attn_kind == "dsa" and not shared and "shared" in cfg.indexer_types[i + 1 :]:
            sel = jax.eval_shape(units[key].fn, *args)[2]
            selection = _placed(sel.shape, sel.dtype, (S.BATCH, None, None), mesh, rules)
    return list(units.values())
