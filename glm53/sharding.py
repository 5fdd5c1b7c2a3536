"""Device mesh and logical-to-physical sharding rules for parameters, caches and activations.

Every parameter carries logical axis names (`glm53.dims`, ``logical_axes`` metadata); a rule set maps each
logical name to mesh axes (or None: replicated). The mesh is built once from the config's ``mesh`` section
(`MeshConfig`, `make_mesh`); everything physical about placement lives here and in `glm53.expert_dispatch`.

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
`glm53.expert_dispatch.ShardedMoE` (same parameters, same paths), which runs the routed and shared experts
under shard_map and sums them with ONE all-reduce per layer. Everything else is partitioned by GSPMD from the
parameter shardings.

Caches (`cache_shardings`): KDA recurrent state [B, H, dk, dv] by head; the KDA conv state (q | k | v
concatenated on one axis, which no block split can cut by head: GSPMD reshards it inside every KDA layer) and
the MLA latent / indexer caches are replicated over "model", batch on "data". The prior art sequence-shards the
latent and indexer caches (pool p on device p mod n, two-stage top-k); here that is the override
``TP_RULES.replace(cache_seq="model", cache_pools="model")``, correct but gathered whole at every step until the
indexer and sparse-MLA kernels run under shard_map. `glm53.memory` budgets them sequence-sharded.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm53 import dims
from glm53.config import ConfigError, ModelConfig
from glm53.quant import planes as P
from glm53.quant.int8 import Int8Weight
from glm53.quant.qweight import QuantizedExperts

# Logical names of activation / cache axes (parameters use the names of glm53.dims).
BATCH = "batch"  # streams
SEQ = "seq"  # tokens of an activation
CACHE_SEQ = "cache_seq"  # cached positions of the MLA latent / indexer caches
CACHE_POOLS = "cache_pools"  # pooled-key rows of the indexer cache
CONV_CHANNELS = "conv_channels"  # q | k | v channels of the KDA conv state (3 * heads * head_dim)

MeshAxes = str | tuple[str, ...] | None


class ShardingError(ValueError):
    """A rule set cannot shard a tensor (collision, unknown axis, indivisible dimension); the message names it."""


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


# ---------------------------------------------------------------------------------------------------- mesh
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ``mesh`` section of an experiment config.

    axes: mesh axis names. shape: devices per axis, at most one -1 (= the remaining devices); the default puts
    every device on "model". rules: the rule set, a key of `RULE_SETS` ("tp" | "ep").
    """

    axes: tuple[str, ...] = ("data", "model")
    shape: tuple[int, ...] = (1, -1)
    rules: str = "tp"

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "shape", tuple(self.shape))
        if (
            not self.axes
            or len(set(self.axes)) != len(self.axes)
            or not all(isinstance(a, str) for a in self.axes)
        ):
            raise ConfigError(f"config field 'mesh.axes': need distinct axis names, got {self.axes!r}")
        if len(self.shape) != len(self.axes):
            raise ConfigError(f"config field 'mesh.shape': {self.shape!r} has {len(self.shape)} entries for axes "
                              f"{self.axes!r}")  # fmt: skip
        ok = all(isinstance(s, int) and not isinstance(s, bool) and (s >= 1 or s == -1) for s in self.shape)
        if not ok or self.shape.count(-1) > 1:
            raise ConfigError(f"config field 'mesh.shape': sizes must be positive with at most one -1, got "
                              f"{self.shape!r}")  # fmt: skip
        if self.rules not in RULE_SETS:
            raise ConfigError(f"config field 'mesh.rules': unknown rule set {self.rules!r}; expected one of "
                              f"{sorted(RULE_SETS)}")  # fmt: skip

    def resolved_shape(self, n_devices: int) -> tuple[int, ...]:
        """`shape` with the -1 filled in for `n_devices` devices (ConfigError when they do not fit exactly)."""
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if n_devices % known:
                raise ConfigError(
                    f"config field 'mesh.shape': {self.shape!r} does not divide {n_devices} devices"
                )
            return tuple(n_devices // known if s == -1 else s for s in self.shape)
        if known != n_devices:
            raise ConfigError(
                f"config field 'mesh.shape': {self.shape!r} holds {known} devices, have {n_devices}"
            )
        return self.shape

    @property
    def rule_set(self) -> Rules:
        return RULE_SETS[self.rules]


def mesh_config_from_dict(d: Mapping[str, Any] | Any) -> MeshConfig:
    """MeshConfig from the ``mesh`` ConfigDict / dict; unknown keys are an error."""
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    if not isinstance(d, Mapping):
        raise ConfigError(f"mesh config: expected a mapping, got {d!r}")
    fields = {f.name for f in dataclasses.fields(MeshConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"mesh config: unknown keys {unknown}; valid keys are {sorted(fields)}")
    return MeshConfig(**d)


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
    return make_mesh(cfg), cfg.rule_set


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
def path_str(path) -> str:
    return ".".join(str(p) for p in path)


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
    """
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


# ------------------------------------------------------------------------------------------------ planes
def prepare_planes(value, axes, mesh: Mesh, rules: str | Rules, what: str = "expert tensor"):
    """A QuantizedExperts whose word axis (input blocks) is split n ways -> the same weights with
    `block_splits = n` (`planes.block_split_layout`); any other value unchanged. Traceable."""
    if not isinstance(value, QuantizedExperts):
        return value
    n = axis_size(mesh, get_rules(rules).mesh_axes(axes[1], what), what)
    planes = value.planes
    if n == 1 or planes.block_splits == n:
        return value
    if planes.n_blocks % n:
        raise ShardingError(f"{what}: {planes.n_blocks} input blocks ({value.format_name}) do not split over {n} "
                            f"devices (whole blocks per device)")  # fmt: skip
    if planes.block_splits != 1:
        raise ShardingError(f"{what}: planes have block_splits={planes.block_splits}, need 1 or {n}")
    return QuantizedExperts(P.block_split_layout(planes, n))


def local_planes(planes, n_rows: int = 1, n_blocks: int = 1):
    """Planes metadata of one device's shard (inside shard_map, where the plane arrays are already local):
    rows / n_rows outputs and input blocks / n_blocks (block_splits / n_blocks groups)."""
    rows, cols = planes.shape
    s = planes.block_splits
    if n_blocks > 1 and s % n_blocks:
        raise ShardingError(f"{planes.fmt.name} planes: block_splits={s} does not split over {n_blocks} devices "
                            "(use prepare_planes)")  # fmt: skip
    return P.Planes(
        planes.fields, planes.fmt, (rows // n_rows, cols // n_blocks), s // n_blocks if n_blocks > 1 else s
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
    if not moe_dispatch:
        return model
    from glm53.expert_dispatch import wrap_moe_layers

    return wrap_moe_layers(model, mesh, rules)


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: str | Rules, *, moe_dispatch: bool = True
) -> nnx.Module:
    """A copy of `model` with every parameter placed by its rule (quantized planes re-laid out first) and, with
    `moe_dispatch`, every MoE layer wrapped in `expert_dispatch.ShardedMoE`. `model` itself is left as it is."""
    rules = get_rules(rules)
    graphdef, state = nnx.split(model)
    state = _prepare_state(state, mesh, rules)
    state = jax.device_put(state, state_shardings(state, mesh, rules))
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
    the module docstring. A batch that the "data" axis does not divide stays replicated."""
    from glm53.layers.dsa import DSACache
    from glm53.layers.kda import KDACache
    from glm53.model import Cache

    rules = get_rules(rules)
    if not isinstance(cache, Cache):
        raise ShardingError(f"cache_shardings: expected a glm53.model.Cache, got {type(cache).__name__}")
    n_batch = axis_size(mesh, rules.mesh_axes(BATCH), "cache batch")

    def sh(axes, a, what):
        if a.shape[0] % n_batch:
            axes = (None, *axes[1:])
        return logical_to_sharding(axes, mesh, rules, a.shape, what)

    def layer(c, i):
        if c is None:
            return None
        if isinstance(c, KDACache):  # conv_state [B, K-1, 3*H*d], state [B, H, dk, dv]
            return KDACache(
                conv_state=sh((BATCH, None, CONV_CHANNELS), c.conv_state, f"KDA cache {i} conv_state"),
                state=sh((BATCH, dims.KDA_HEADS, None, None), c.state, f"KDA cache {i} state"),
            )
        if isinstance(
            c, DSACache
        ):  # latent [B, S, R], index_k / index_gate [B, S, C], pooled [B, S/kpool, C]
            return DSACache(
                latent=sh((BATCH, CACHE_SEQ, None), c.latent, f"DSA cache {i} latent"),
                index_k=sh((BATCH, CACHE_SEQ, None), c.index_k, f"DSA cache {i} index_k"),
                index_gate=sh((BATCH, CACHE_SEQ, None), c.index_gate, f"DSA cache {i} index_gate"),
                pooled=sh((BATCH, CACHE_POOLS, None), c.pooled, f"DSA cache {i} pooled"),
            )
        raise ShardingError(f"cache layer {i}: unknown cache type {type(c).__name__}")

    return Cache(
        length=sh((BATCH,), cache.length, "cache length"),
        layers=tuple(layer(c, i) for i, c in enumerate(cache.layers)),
        mtp=layer(cache.mtp, "mtp"),
    )


def shard_cache(cache, mesh: Mesh, rules: str | Rules):
    """`cache` placed by `cache_shardings`."""
    return jax.device_put(cache, cache_shardings(cache, mesh, rules))


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
