"""Runs of identical layers under one scan: the grouping (`layer_groups`) and the scanned unit (`LayerStack`).

The trunk is hybrid (KDA / DSA attention, dense / MoE FFN, per-layer expert formats under a quantization mix), so
only layers that trace to the same program can share a scan. A layer's *signature* is what its traced program
depends on: attention kind, FFN kind, the indexer kind of a DSA layer, and the routed-expert formats of a MoE layer
(shapes come from the config and are the same for every layer). A *group* is `repeats` consecutive copies of a
*period* of `period` consecutive layers with equal signatures, position by position:

    layers first .. first + period * repeats - 1,  layer first + r * period + j  =  repeat r, position j

A run of identical layers is the period-1 case. The release's attention pattern repeats every 4 layers
(dsa, kda, kda, kda), so its longest runs of identical layers are 3 long; grouping by period scans layers 3-42 as
10 repeats of one 4-layer period (7 + 2 under the UD-IQ3_XXS mix, whose layers 11, 12 and 44 differ). Among all
partitions of the trunk into groups, `layer_groups` picks the one that traces the fewest layer bodies (the sum of
the groups' periods), then the fewest groups; a group with one repeat is a plain layer. `ModelConfig.scan_layers`
False (the default) keeps every layer plain: the unrolled layout.

A `LayerStack` holds the period's layers once, every parameter stacked on a leading axis of `repeats` (logical axis
`glm53.dims.LAYERS`, never sharded), and runs them with `jax.lax.scan`; its caches are the period's caches stacked
the same way. Checkpoints on disk always name per-layer tensors (HF, GGUF and Orbax alike): a model is loaded
unrolled and `Glm53Model.set_scan_layers` stacks it (docs/scan.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from glm53 import dims
from glm53.config import ModelConfig
from glm53.layers import records
from glm53.quant.qweight import QuantizedExperts, expert_formats

MAX_PERIOD = 8  # the longest period searched (the release's is 4)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """`repeats` copies of the `period` layers starting at `first` (one repeat: plain layers)."""

    first: int
    period: int = 1
    repeats: int = 1

    @property
    def scanned(self) -> bool:
        return self.repeats > 1

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.first + self.period * self.repeats))

    def layer(self, r: int, j: int) -> int:
        """The trunk layer at repeat r, position j."""
        return self.first + r * self.period + j

    def where(self, layer: int) -> tuple[int, int]:
        """(repeat, position) of a trunk layer of this group."""
        k = layer - self.first
        if not 0 <= k < self.period * self.repeats:
            raise ValueError(f"layer {layer} is not in group {self.describe()}")
        return divmod(k, self.period)

    def describe(self) -> str:
        last = self.first + self.period * self.repeats - 1
        if not self.scanned:
            return f"{self.first}" if self.period == 1 else f"{self.first}-{last}"
        return f"{self.first}-{last} (scan: {self.repeats} x {self.period})"


def layer_signature(cfg: ModelConfig, quant, i: int) -> tuple:
    """What layer i's traced program depends on (module docstring)."""
    attn, mlp = cfg.layer_types[i], cfg.mlp_layer_types[i]
    indexer = cfg.indexer_types[i] if attn == "dsa" and i < len(cfg.indexer_types) else None
    formats = expert_formats(quant, cfg, i) if mlp == "moe" else None
    return attn, mlp, indexer, None if formats is None else tuple(sorted(formats.items()))


def _self_contained(sig: Sequence[tuple]) -> bool:
    """A period whose first DSA layer reuses a previous selection (a 'shared' indexer) would need it carried
    across repeats: such periods are not scanned."""
    for attn, _, indexer, _ in sig:
        if attn == "dsa":
            return indexer != "shared"
    return True


def layer_groups(cfg: ModelConfig, quant=None) -> tuple[LayerGroup, ...]:
    """The trunk's groups in layer order (module docstring): every layer plain unless `cfg.scan_layers`."""
    n = cfg.num_hidden_layers
    if not cfg.scan_layers:
        return tuple(LayerGroup(i) for i in range(n))
    sig = [layer_signature(cfg, quant, i) for i in range(n)]

    @functools.cache
    def best(i: int) -> tuple[tuple[int, int], tuple[LayerGroup, ...]]:
        """((traced layers, groups), groups) of the best partition of layers i..n-1."""
        if i == n:
            return (0, 0), ()
        (cost, count), rest = best(i + 1)
        choice = ((cost + 1, count + 1), (LayerGroup(i), *rest))
        for p in range(1, min(MAX_PERIOD, n - i) + 1):
            unit = sig[i : i + p]
            if not _self_contained(unit):
                continue
            r = 1
            while sig[i + r * p : i + (r + 1) * p] == unit:
                r += 1
            for reps in range(2, r + 1):
                (cost, count), rest = best(i + p * reps)
                cand = ((cost + p, count + 1), (LayerGroup(i, p, reps), *rest))
                if cand[0] < choice[0]:
                    choice = cand
        return choice

    return best(0)[1]


def describe_groups(groups: Sequence[LayerGroup]) -> str:
    """One line: how many layer bodies are traced and the groups, e.g. "layers: 14 traced for 45 (0-2 (scan: 3 x
    1), 3-10 (scan: 2 x 4), 11, ...)"."""
    n = sum(g.period * g.repeats for g in groups)
    traced = sum(g.period if g.scanned else g.period * g.repeats for g in groups)
    if not any(g.scanned for g in groups):
        return f"layers: {n} unrolled (scan_layers off)"
    return f"layers: {traced} traced for {n} ({', '.join(g.describe() for g in groups)})"


# --------------------------------------------------------------------------------------------- stacking
def _stack_leaf(xs: Sequence):
    """Stacks equal arrays (or ShapeDtypeStructs) on a new, unsharded leading axis."""
    x0 = xs[0]
    if isinstance(x0, jax.core.Tracer):  # before `.sharding`: a tracer's builds an error text (0.1 s a leaf)
        return jnp.stack(xs)
    sharding = getattr(x0, "sharding", None)
    out = None
    if isinstance(sharding, NamedSharding):
        out = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    if isinstance(x0, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *x0.shape), x0.dtype, sharding=out)
    if out is not None:
        return jax.jit(lambda *a: jnp.stack(a), out_shardings=out)(*xs)
    return jnp.stack(xs)


def _slice_leaf(x, r: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
    return x[r]


def _with_axes(state: nnx.State, fn) -> nnx.State:
    """Every variable of `state` with its logical_axes metadata replaced by fn(axes) (None stays None)."""
    out = []
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata().get("logical_axes")
        out.append((path, var if axes is None else var.replace(logical_axes=fn(tuple(axes)))))
    return nnx.from_flat_state(out)


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
    """One module of the first's structure whose every variable stacks the modules' values on a leading axis."""
    graphdef, first = nnx.split(modules[0])
    states = [first] + [nnx.split(m)[1] for m in modules[1:]]
    leaves0, tree0 = jax.tree.flatten(first)
    for m, s in zip(modules[1:], states[1:]):
        if jax.tree.structure(s) != tree0:
            raise ValueError(f"stack_modules: {type(m).__name__} differs in structure from the first module")
    columns = zip(*(jax.tree.leaves(s) for s in states))
    stacked = jax.tree.unflatten(tree0, [_stack_leaf(c) for c in columns])
    del leaves0
    return nnx.merge(graphdef, _with_axes(stacked, lambda a: (dims.LAYERS, *a)))


def slice_state(state: nnx.State, r) -> nnx.State:
    """Repeat r of a stacked state (r may be traced), its leading LAYERS axis dropped from the metadata."""
    return _with_axes(jax.tree.map(lambda x: _slice_leaf(x, r), state), _drop_layers)


def _drop_layers(axes: tuple) -> tuple:
    if not axes or axes[0] != dims.LAYERS:
        raise ValueError(f"not a stacked parameter: logical axes {axes}")
    return axes[1:]


def unstack_module(module: nnx.Module, repeats: int) -> list[nnx.Module]:
    """The `repeats` modules a stacked module was built from (values sliced; static attributes shared)."""
    graphdef, state = nnx.split(module)
    return [nnx.merge(graphdef, slice_state(state, r)) for r in range(repeats)]


def layer_paths(path: Sequence, groups: Sequence[LayerGroup]) -> list[tuple[tuple, int | None]]:
    """[(per-layer path, repeat r or None)] of a model parameter path (keys; digit strings read as indices): one
    entry per trunk layer it covers (``layers.<u>.period.<j>.X`` -> ``layers.<group.layer(r, j)>.X`` for every
    repeat r; a plain unit's ``layers.<u>.X`` -> ``layers.<first>.X``), r None when the value has no repeat axis.
    ValueError for a path into a LayerStack that is not under its period."""
    path = tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in path)
    if len(path) < 2 or path[0] != "layers" or not isinstance(path[1], int):
        return [(path, None)]
    g = groups[path[1]]
    if not g.scanned:
        return [(("layers", g.first, *path[2:]), None)]
    if len(path) < 4 or path[2] != "period" or not isinstance(path[3], int):
        raise ValueError(f"{'.'.join(map(str, path))}: not a path inside the LayerStack of layers {g.describe()}")
    return [(("layers", g.layer(r, path[3]), *path[4:]), r) for r in range(g.repeats)]


# ------------------------------------------------------------------------------------------ in-place reads
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StackedSlice:
    """Repeat `index` of a stacked routed-expert kernel, left unsliced: what a scanned layer's experts see.

    A slice of a stack taken inside the scan body is a copy of the whole slice (XLA cannot hand a custom call a
    window of a buffer), i.e. every step would copy all E experts of every layer where the expert kernels read
    only the K routed ones. Kernels that fetch experts by id (Pallas TPU / GPU) read the stack in place instead
    (`merged` + ids offset by index * E); every other implementation takes the slice (`take`).

    stack: QuantizedExperts whose planes lead [R, E], or an array [R, E, ...]; index: int32 scalar.
    """

    stack: Any
    index: Any

    @property
    def repeats(self) -> int:
        return int(jax.tree.leaves(self.stack)[0].shape[0])

    @property
    def n_experts(self) -> int:
        return int(jax.tree.leaves(self.stack)[0].shape[1])

    @property
    def shape(self) -> tuple[int, ...]:
        """The per-layer dense kernel shape [E, in, out]."""
        if isinstance(self.stack, QuantizedExperts):
            return (self.n_experts, self.stack.planes.cols, self.stack.planes.rows)
        return tuple(self.stack.shape[1:])

    def take(self):
        """The layer's kernel (a copy of the slice)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, keepdims=False), self.stack)

    def merged(self, ids_tk: jax.Array) -> tuple[Any, jax.Array]:
        """(the stack as one kernel of R * E experts (a reshape, no copy), ids of this repeat's experts in it;
        the empty-slot id E becomes R * E)."""
        r, e = self.repeats, self.n_experts
        merged = jax.tree.map(lambda a: a.reshape(r * e, *a.shape[2:]), self.stack)
        ids = jnp.where(ids_tk >= e, r * e, ids_tk + self.index * e).astype(ids_tk.dtype)
        return merged, ids


def in_place_experts(path) -> bool:
    """Whether a period-relative parameter path is a routed-expert kernel (read in place, `StackedSlice`)."""
    return len(path) >= 3 and tuple(path[-3:-1]) == ("mlp", "experts")


# ------------------------------------------------------------------------------------------------ module
class LayerStack(nnx.Module):
    """`group.repeats` repeats of the `group.period` DecoderLayers of `group`, run by one `jax.lax.scan`.

    period[j] is a DecoderLayer whose parameters have a leading axis of `repeats` (repeat r = trunk layer
    group.layer(r, j)); static attributes (layer kinds, layer_idx, kernels) are those of repeat 0's layers.
    Its cache is a tuple over positions j of that layer kind's cache with a leading repeat axis.
    """

    def __init__(self, layers: Sequence[nnx.Module], group: LayerGroup):
        if len(layers) != group.period * group.repeats:
            raise ValueError(f"LayerStack {group.describe()}: got {len(layers)} layers")
        self.group = group
        self.period = nnx.List(
            [stack_modules([layers[r * group.period + j] for r in range(group.repeats)]) for j in range(group.period)]
        )

    def unstack(self) -> list[nnx.Module]:
        """The group's layers as plain DecoderLayers, in layer order (copies of the values)."""
        g = self.group
        cols = [unstack_module(m, g.repeats) for m in self.period]
        out = []
        for r in range(g.repeats):
            for j in range(g.period):
                layer = cols[j][r]
                layer.layer_idx = g.layer(r, j)
                _set_layer_idx(layer, g.layer(r, j))
                out.append(layer)
        return out

    def layer(self, i: int) -> nnx.Module:
        """Trunk layer i as a plain DecoderLayer (a sliced copy of its parameters)."""
        r, j = self.group.where(i)
        graphdef, state = nnx.split(self.period[j])
        layer = nnx.merge(graphdef, slice_state(state, r))
        _set_layer_idx(layer, i)
        return layer

    def init_cache(self, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, pages=None) -> tuple:
        reps = self.group.repeats
        return tuple(
            jax.tree.map(lambda x: jnp.broadcast_to(x, (reps, *x.shape)),
                         m.init_cache(cfg, batch, max_len, dtype, pages=pages))  # fmt: skip
            for m in self.period
        )

    def __call__(self, x_btnd, *, cache=None, start_b=None, selection=None):
        """Streams -> streams through every layer of the group; returns (streams, stacked caches or None,
        selection): the last DSA layer's indexer selection (or the one passed in when the period has none)."""
        graphdef, state = nnx.split(self.period)
        has_dsa = any(m.attn_kind == "dsa" for m in self.period)
        flat = list(nnx.to_flat_state(state))
        experts = [(p, v) for p, v in flat if in_place_experts(p)]  # closed over whole: StackedSlice
        scanned = nnx.from_flat_state([(p, v) for p, v in flat if not in_place_experts(p)])

        def body(carry, xs):
            x, caches = carry
            r, st = xs
            pieces = list(nnx.to_flat_state(_with_axes(st, _drop_layers)))
            for p, v in experts:
                axes = v.get_metadata().get("logical_axes")
                pieces.append((p, v.replace(value=StackedSlice(v.get_value(), r), logical_axes=_drop_layers(axes))))
            period = nnx.merge(graphdef, nnx.from_flat_state(pieces))
            new, sel = [], None
            with records.scan_records() as rec:
                for j, layer in enumerate(period):
                    c = None if caches is None else _index(caches[j], r)
                    x, c, sel = layer(x, cache=c, start_b=start_b, selection=sel)
                    new.append(None if caches is None else _update(caches[j], c, r))
            return (x, None if caches is None else tuple(new)), (sel if has_dsa else None, rec)

        # The caches ride in the carry, each layer's read and written back at its repeat: a loop-carried buffer is
        # updated in place, where scanning them as xs -> ys would hold a second copy of the group's caches.
        steps = jnp.arange(self.group.repeats, dtype=jnp.int32)
        with jax.named_scope(f"scan_layers_{self.group.first}"):  # names the loop in jaxprs, HLO and profiles
            (x_btnd, caches), (sels, rec) = jax.lax.scan(body, (x_btnd, cache), (steps, scanned))
        records.add_records(rec)
        return x_btnd, caches, (sels[-1] if has_dsa else selection)


def _index(cache, r):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), cache)


def _update(stacked, cache, r):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), r, 0), stacked, cache)


def _set_layer_idx(layer: nnx.Module, i: int) -> None:
    """A sliced layer names its own trunk layer (error messages, expert formats)."""
    layer.layer_idx = i
    attn = getattr(layer, "self_attn", None)
    if attn is not None and hasattr(attn, "layer_idx"):
        attn.layer_idx = i
