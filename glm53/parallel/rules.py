"""Device mesh and logical-to-physical sharding rules for parameters, caches and activations.

Every parameter carries logical axis names (`glm53.dims`, ``logical_axes`` metadata); a rule set maps each
logical name to mesh axes (or None: replicated). The mesh is built once from the config's ``mesh`` section
(`MeshConfig`, `make_mesh`); everything physical about placement lives here and in `glm53.parallel.moe`.

Rule sets (`RULE_SETS`, chosen by ``config.mesh.rules``):

  "tp"  `TP_RULES`, the prior art's tensor parallelism over "model": every routed expert split by its
        intermediate dimension (gate/up by output rows = plane lanes, down by input blocks = plane words, whole
        GGUF blocks per device), the shared expert and the dense FFNs likewise; KDA heads (the flattened
        head*dim axes: the head count must divide the axis, `check_config`), MLA heads, indexer heads; embedding
        and lm_head by vocabulary; the KDA recurrent state by head. Everything else is replicated.
  "ep"  `EP_RULES`, expert parallelism for comparison: whole routed experts per device (expert axis on
        "model"); the expert width is not split (the shared expert is replicated); the rest as in "tp". The
        router's expert axis follows, so its logits are gathered before the top-k.

Both put the stream (batch) axis of activations and caches on "data" (size 1 by default).

MoE layers: `shard_model` / `abstract_sharded_model` / `init_sharded_model` wrap every MoE layer in
`glm53.parallel.moe.ShardedMoE` (same parameters, same paths), which runs the routed and shared experts
under shard_map and sums them with ONE all-reduce per layer. Everything else is partitioned by GSPMD from the
parameter shardings.

Caches (`cache_shardings`): KDA recurrent state [B, H, dk, dv] by head; the KDA conv state (q | k | v
concatenated on one axis, which no block split can cut by head: GSPMD reshards it inside every KDA layer) is
replicated over "model"; the MLA latent and the pooled indexer keys are split by sequence over "model"
(``cache_seq`` / ``cache_pools``: device d holds a contiguous 1/n of every stream's positions, whole pools), and
every DSA layer runs its cache step under shard_map with a two-stage top-k (`glm53.parallel.dsa`); batch on
"data". ``TP_RULES.replace(cache_seq=None, cache_pools=None)`` replicates them instead.

Quantized routed experts (`glm53.quant.qweight.QuantizedExperts`): a plane is [expert, words (input blocks),
rows (outputs)], the axis order of the dense kernel [E, in, out], so the kernel's logical axes shard the planes.
A word axis split n ways needs `block_split_layout(planes, n)`; `prepare_planes` converts (shard_model and
friends do it), after which device i holds exactly `split_blocks(planes, n, i)`: the bytes
`glm53.quant.budget.plane_nbytes(shape, fmt, ("blocks", n))` predicts.

Collisions (two logical axes of one tensor on the same mesh axis) are rejected by `check_rules`, naming the
tensor and the axes; so are logical axes without a rule and splits that the mesh does not divide.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm53 import dims
from glm53.config import ModelConfig
from glm53.config.mesh import MeshConfig, mesh_config_from_dict
from glm53.errors import ShardingError
from glm53.layers.param import path_str
from glm53.layers.stack import StackedSlice
from glm53.quant.int8 import Int8Rows, Int8Weight
from glm53.quant.qweight import QuantizedExperts

# Logical names of activation / cache axes (parameters use the names of glm53.dims).
BATCH = "batch"  # streams
SEQ = "seq"  # tokens of an activation
CACHE_SEQ = "cache_seq"  # cached positions of the MLA latent / indexer caches
CACHE_POOLS = "cache_pools"  # pooled-key rows of the indexer cache
CONV_CHANNELS = "conv_channels"  # q | k | v channels of the KDA conv state (3 * heads * head_dim)

MeshAxes = str | tuple[str, ...] | None


# ---------------------------------------------------------------------------------------------------- rules
@dataclasses.dataclass(frozen=True)
class Rules:
    """A named map logical axis -> mesh axes (a name, a tuple of names, or None = replicated)."""

    name: str
    table: tuple[tuple[str, MeshAxes], ...]

    def __post_init__(self):
        names = [k for k, _ in self.table]
        dup = sorted({k for k in names if names.count(k) > 1})
        if dup:
            raise ShardingError(f"rules {self.name!r}: logical axes {dup} given twice")

    def as_dict(self) -> dict[str, MeshAxes]:
        return dict(self.table)

    def mesh_axes(self, logical: str | None, what: str = "tensor") -> tuple[str, ...]:
        """The mesh axes (possibly none) that logical axis `logical` is split over."""
        if logical is None:
            return ()
        table = self.as_dict()
        if logical not in table:
            raise ShardingError(f"{what}: logical axis {logical!r} has no rule in rule set {self.name!r}; "
                                f"known axes: {sorted(table)}")  # fmt: skip
        m = table[logical]
        return () if m is None else ((m,) if isinstance(m, str) else tuple(m))

    def replace(self, name: str | None = None, **overrides: MeshAxes) -> Rules:
        """A copy with some logical axes remapped, e.g. ``TP_RULES.replace(cache_seq="model")``."""
        table = self.as_dict()
        unknown = sorted(set(overrides) - set(table))
        if unknown:
            raise ShardingError(f"rules {self.name!r}: cannot override unknown logical axes {unknown}")
        table.update(overrides)
        return Rules(name or f"{self.name}*", tuple(table.items()))


def _table(split: Mapping[str, MeshAxes]) -> tuple[tuple[str, MeshAxes], ...]:
    """Every logical name (glm53.dims and the activation / cache names) -> mesh axes (None unless in `split`)."""
    names = [v for k, v in vars(dims).items() if k.isupper() and isinstance(v, str)]
    names += [BATCH, SEQ, CACHE_SEQ, CACHE_POOLS, CONV_CHANNELS]
    return tuple((n, split.get(n)) for n in names)


_COMMON = {
    dims.VOCAB: "model",
    dims.MLP: "model",
    dims.HEADS: "model",
    dims.KV_HEADS: "model",
    dims.KDA_HEADS: "model",
    dims.KDA_QKV: "model",
    dims.INDEX_HEADS: "model",
    dims.INDEX_QK: "model",
    BATCH: "data",
    CACHE_SEQ: "model",  # DSA caches split by sequence (glm53/parallel/dsa.py)
    CACHE_POOLS: "model",
}
TP_RULES = Rules("tp", _table({**_COMMON, dims.EXPERT_MLP: "model"}))
EP_RULES = Rules("ep", _table({**_COMMON, dims.EXPERT: "model"}))
RULE_SETS: dict[str, Rules] = {"tp": TP_RULES, "ep": EP_RULES}


def get_rules(rules: str | Rules) -> Rules:
    """A rule set by name ("tp" | "ep") or as given."""
    if isinstance(rules, Rules):
        return rules
    if rules not in RULE_SETS:
        raise ShardingError(f"unknown rule set {rules!r}; expected one of {sorted(RULE_SETS)}")
    return RULE_SETS[rules]


def make_mesh(
    cfg: MeshConfig | Mapping[str, Any] | None = None, devices: Sequence[Any] | None = None
) -> Mesh:
    """The device mesh of `cfg` (a MeshConfig or the config's ``mesh`` section; None: the defaults) over
    `devices` (default: all of `jax.devices()`)."""
    if cfg is None:
        cfg = MeshConfig()
    elif not isinstance(cfg, MeshConfig):
        cfg = mesh_config_from_dict(cfg)
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolved_shape(len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), cfg.axes)


def mesh_from_experiment_config(config) -> tuple[Mesh, Rules]:
    """(mesh, rules) from an experiment ConfigDict's optional ``mesh`` section (absent: the defaults)."""
    cfg = mesh_config_from_dict(config.mesh) if "mesh" in config else MeshConfig()
    return make_mesh(cfg), get_rules(cfg.rules)


def axis_size(mesh: Mesh, axes: Sequence[str], what: str = "tensor") -> int:
    """Devices along mesh axes `axes` (1 for none)."""
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ShardingError(f"{what}: mesh axes {missing} are not in the mesh {dict(mesh.shape)}")
    return math.prod(mesh.shape[a] for a in axes)


# --------------------------------------------------------------------------------------------- specs
def logical_to_spec(axes: Sequence[str | None], rules: str | Rules, what: str = "tensor") -> PartitionSpec:
    """PartitionSpec of a tensor with logical `axes`; ShardingError naming `what` on a collision."""
    rules = get_rules(rules)
    parts, seen = [], {}
    for logical in axes:
        m = rules.mesh_axes(logical, what)
        for a in m:
            if a in seen:
                raise ShardingError(
                    f"{what}: logical axes {seen[a]!r} and {logical!r} both map to mesh axis {a!r} in rule set "
                    f"{rules.name!r} (axes {tuple(axes)})"
                )
            seen[a] = logical
        parts.append(None if not m else (m[0] if len(m) == 1 else m))
    return PartitionSpec(*parts)


def logical_to_sharding(
    axes: Sequence[str | None],
    mesh: Mesh,
    rules: str | Rules,
    shape: Sequence[int] | None = None,
    what: str = "tensor",
) -> NamedSharding:
    """NamedSharding of a tensor with logical `axes` on `mesh`; with `shape`, every split dimension must divide."""
    rules = get_rules(rules)
    spec = logical_to_spec(axes, rules, what)
    for i, logical in enumerate(axes):
        n = axis_size(mesh, rules.mesh_axes(logical, what), what)
        if shape is not None and n > 1 and shape[i] % n:
            raise ShardingError(
                f"{what}: dimension {i} ({logical!r}, size {shape[i]}) does not split over mesh axes "
                f"{rules.mesh_axes(logical)} of size {n} (rule set {rules.name!r})"
            )
    return NamedSharding(mesh, spec)


# ------------------------------------------------------------------------------------------- parameters


def param_axes(var: nnx.Variable, what: str) -> tuple[str | None, ...]:
    """The logical axes of a parameter (ShardingError naming it when it has none)."""
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
        raise ShardingError(f"{what}: no logical_axes metadata (build parameters with glm53.layers.param)")
    return tuple(axes)


def value_leaf_axes(
    value, axes: tuple[str | None, ...], what: str
) -> list[tuple[Any, tuple, tuple[int, ...]]]:
    """[(leaf, logical axes of the leaf, shape whose splits must divide)] of a parameter value.

    Arrays: their own axes. QuantizedExperts: every plane [E, words, rows] takes the kernel's axes; the word axis
    must split whole input blocks. Int8Weight: values take the kernel's axes, the scale drops the input axis.
    Int8Rows (an int8 lookup table): values take the table's axes, the scale [rows] its row axis.
    A stacked parameter (leading `dims.LAYERS` axis, glm53/layers/stack.py): every leaf as its per-layer slice,
    with the unsharded repeat axis in front.
    """
    if isinstance(value, StackedSlice):  # a scanned layer's experts (inside the scan body): the stack + index
        return [*value_leaf_axes(value.stack, (dims.LAYERS, *axes), what), (value.index, (), ())]
    if axes and axes[0] == dims.LAYERS:
        inner = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), value)
        per = value_leaf_axes(inner, axes[1:], what)
        return [(leaf, (dims.LAYERS, *a), (leaf.shape[0], *d)) for leaf, (_, a, d) in zip(jax.tree.leaves(value), per)]
    if isinstance(value, QuantizedExperts):
        p = value.planes
        divide = (value.n_experts, p.n_blocks, p.rows)
        return [(leaf, axes, divide) for leaf in jax.tree.leaves(value)]
    if isinstance(value, Int8Weight):
        scale_axes = axes[:-2] + axes[-1:]
        return [
            (value.values, axes, tuple(value.values.shape)),
            (value.scale, scale_axes, tuple(value.scale.shape)),
        ]
    if isinstance(value, Int8Rows):
        return [
            (value.values, axes, tuple(value.values.shape)),
            (value.scale, axes[:1], tuple(value.scale.shape)),
        ]
    leaves = jax.tree.leaves(value)
    for leaf in leaves:
        if len(leaf.shape) != len(axes):
            raise ShardingError(f"{what}: shape {tuple(leaf.shape)} has {len(leaf.shape)} dims but logical axes "
                                f"{axes} name {len(axes)}")  # fmt: skip
    return [(leaf, axes, tuple(leaf.shape)) for leaf in leaves]


def _value_shardings(value, axes, mesh: Mesh, rules: Rules, what: str):
    """The value's pytree with every array leaf replaced by its NamedSharding."""
    leaves = value_leaf_axes(value, axes, what)
    shardings = [logical_to_sharding(a, mesh, rules, divide, what) for _, a, divide in leaves]
    return jax.tree.unflatten(jax.tree.structure(value), shardings)


def check_rules(model_or_state, rules: str | Rules, mesh: Mesh | None = None) -> dict[str, PartitionSpec]:
    """Checks `rules` against every parameter of a model (or nnx.State); returns {path: PartitionSpec}.

    Raises one ShardingError listing every tensor with a collision (two logical axes on one mesh axis), an axis
    without a rule, a rank that differs from its logical axes, or (with `mesh`) a split that does not divide.
    """
    rules = get_rules(rules)
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    specs, problems = {}, []
    for path, var in nnx.to_flat_state(state):
        what = f"parameter {path_str(path)}"
        try:
            axes = param_axes(var, what)
            specs[path_str(path)] = logical_to_spec(axes, rules, what)
            if mesh is not None:
                _value_shardings(var.get_value(), axes, mesh, rules, what)
            else:
                value_leaf_axes(var.get_value(), axes, what)
        except ShardingError as e:
            problems.append(str(e))
    if problems:
        raise ShardingError(
            f"rule set {rules.name!r}: {len(problems)} problem(s):\n  " + "\n  ".join(problems)
        )
    return specs


def check_config(cfg: ModelConfig, mesh: Mesh, rules: str | Rules) -> None:
    """Raises one ShardingError listing every head count / width the rule's mesh axes do not divide (the
    flattened KDA / indexer head*dim axes must split whole heads, which `check_rules` cannot see)."""
    rules = get_rules(rules)
    checks = [
        (dims.KDA_QKV, "linear_num_heads", cfg.linear_num_heads),
        (dims.KDA_HEADS, "linear_num_heads", cfg.linear_num_heads),
        (dims.HEADS, "num_attention_heads", cfg.num_attention_heads),
        (dims.INDEX_QK, "index_n_heads", cfg.index_n_heads),
        (dims.VOCAB, "vocab_size", cfg.vocab_size),
        (dims.MLP, "intermediate_size", cfg.intermediate_size),
        (dims.EXPERT_MLP, "moe_intermediate_size", cfg.moe_intermediate_size),
        (dims.EXPERT, "n_routed_experts", cfg.n_routed_experts),
    ]
    problems = []
    for logical, field, value in checks:
        n = axis_size(mesh, rules.mesh_axes(logical), f"config field {field!r}")
        if value % n:
            problems.append(f"config field {field!r} = {value} does not split over {n} devices "
                            f"({logical!r} -> {rules.mesh_axes(logical)} in rule set {rules.name!r})")  # fmt: skip
    if problems:
        raise ShardingError("; ".join(dict.fromkeys(problems)))


# ------------------------------------------------------------------------------------------- activations
def constrain(x: jax.Array, axes: Sequence[str | None], mesh: Mesh, rules: str | Rules) -> jax.Array:
    """`jax.lax.with_sharding_constraint` of an activation by logical axis names (inside jit). A dimension
    that its mesh axes do not divide (e.g. one stream on a "data" axis of 2) is left unconstrained."""
    rules = get_rules(rules)
    axes = tuple(a if x.shape[i] % axis_size(mesh, rules.mesh_axes(a), "activation") == 0 else None
                 for i, a in enumerate(axes))  # fmt: skip
    return jax.lax.with_sharding_constraint(x, logical_to_sharding(axes, mesh, rules, x.shape, "activation"))


def device_nbytes(x) -> list[int]:
    """Bytes each addressable device holds of x (an array or a pytree of arrays), in mesh device order."""
    leaves = jax.tree.leaves(x)
    out: dict[Any, int] = {}
    for leaf in leaves:
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + int(s.data.nbytes)
    return list(out.values())
