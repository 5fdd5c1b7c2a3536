"""Sharded MoE dispatch: routed + shared experts under shard_map with one all-reduce per MoE layer.

`ShardedMoE` stands in for a `glm53.layers.moe.MoE` on a mesh. It holds the same submodules (router, experts,
shared_experts: the parameter paths do not change) and computes the same function:

    ids, w = router(x)                                 (replicated, GSPMD)
    on every device (shard_map over the expert axes):
      y_local = experts_local(x, ids_local, w)          this device's slice of the routed experts  [T, D]
              + shared_local(x)                         its slice of the shared expert's width     [T, D]
    y = psum(y_local)                                   ONE all-reduce per layer

Tensor parallel ("tp" rules: expert width on "model"): every device holds rows [i F/n, (i+1) F/n) of every
expert's gate/up (plane lanes) and the same input blocks of down (plane words), so y_local is a partial sum
over the intermediate dimension; the shared expert is split the same way and its partial sum joins the same
all-reduce. Expert parallel ("ep" rules: expert axis on "model"): a device holds E/n whole experts; slots
routed elsewhere become empty slots (id = local E, which every implementation of kernels.moe skips); the
shared expert is replicated and counted once (added on the first device of the expert axes only).

Any implementation of `kernels.moe.api.moe_experts` runs per device on local weights (Pallas kernels cannot be
partitioned by GSPMD); quantized planes get their local metadata via `local_planes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from glm53 import dims
from glm53.errors import ShardingError
from glm53.layers.moe import MoE
from glm53.layers.param import path_str
from glm53.layers.stack import StackedSlice
from glm53.parallel import rules as S
from glm53.parallel.rules import Rules, axis_size, get_rules
from glm53.quant import planes as P
from glm53.quant.qweight import QuantizedExperts


# ------------------------------------------------------------------------------------------------ planes
def prepare_planes(value, axes, mesh: Mesh, rules: str | Rules, what: str = "expert tensor"):
    """A QuantizedExperts whose word axis (input blocks) is split n ways -> the same weights with
    `block_splits = n` (`planes.block_split_layout`); any other value unchanged. Traceable."""
    if not isinstance(value, QuantizedExperts):
        return value
    if axes[0] == dims.LAYERS:  # stacked (a scanned LayerStack): each repeat alike
        return jax.vmap(lambda v: prepare_planes(v, axes[1:], mesh, rules, what))(value)
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


class ShardedMoE(MoE):
    """A MoE layer whose experts run under shard_map on `mesh` by `rules` (module docstring).

    Build with `ShardedMoE.wrap(moe, mesh, rules)` (or `wrap_moe_layers`); called like `MoE`, whose `__call__`
    it inherits: only `routed_and_shared` is replaced.
    """

    def __init__(self, router, experts, shared_experts, mesh: Mesh, rules: S.Rules):
        self.router = router
        self.experts = experts
        self.shared_experts = shared_experts
        self.mesh = mesh
        self.rules = rules
        what = "MoE expert dispatch"
        self.expert_axes = rules.mesh_axes(dims.EXPERT, what)  # routed experts split over these (EP)
        self.width_axes = rules.mesh_axes(dims.EXPERT_MLP, what)  # expert width split over these (TP)
        self.batch_axes = rules.mesh_axes(S.BATCH, what)
        for a in self.expert_axes + self.width_axes + self.batch_axes:
            S.axis_size(mesh, (a,), what)

    @classmethod
    def wrap(cls, moe: MoE, mesh: Mesh, rules: str | S.Rules) -> ShardedMoE:
        return cls(moe.router, moe.experts, moe.shared_experts, mesh, S.get_rules(rules))

    # ------------------------------------------------------------------------------------------------ specs
    def _specs(self, module: nnx.Module) -> nnx.State:
        """PartitionSpecs (the pytree of the module's state) of every parameter leaf by the rules."""

        def one(path, var):
            what = f"parameter {path_str(path)}"
            leaves = S.value_leaf_axes(var.get_value(), S.param_axes(var, what), what)
            specs = [S.logical_to_spec(axes, self.rules, what) for _, axes, _ in leaves]
            return var.replace(value=jax.tree.unflatten(jax.tree.structure(var.get_value()), specs))

        flat = nnx.to_flat_state(nnx.state(module))
        return nnx.from_flat_state([(p, one(p, v)) for p, v in flat])

    def _localize(self, state: nnx.State) -> nnx.State:
        """Quantized planes inside shard_map: local arrays, so give them their local shape metadata."""

        def one(path, var):
            value = var.get_value()
            stacked = isinstance(value, StackedSlice)  # a scanned layer's experts: the stack + its index
            q = value.stack if stacked else value
            if not isinstance(q, QuantizedExperts):
                return var
            what = f"parameter {path_str(path)}"
            axes = S.param_axes(var, what)
            n_blocks = S.axis_size(self.mesh, self.rules.mesh_axes(axes[1], what), what)
            n_rows = S.axis_size(self.mesh, self.rules.mesh_axes(axes[2], what), what)
            q = QuantizedExperts(local_planes(q.planes, n_rows, n_blocks))
            return var.replace(value=StackedSlice(q, value.index) if stacked else q)

        flat = nnx.to_flat_state(state)
        return nnx.from_flat_state([(p, one(p, v)) for p, v in flat])

    # ---------------------------------------------------------------------------------------------- forward
    def routed_and_shared(self, x_td, ids_tk, w_tk):
        n_tok = x_td.shape[0]
        rows = self.batch_axes if n_tok % S.axis_size(self.mesh, self.batch_axes) == 0 else ()
        row_spec = PartitionSpec(rows or None, None)
        e_gd, e_state = nnx.split(self.experts)
        shared = self.shared_experts
        s_gd, s_state = (None, None) if shared is None else nnx.split(shared)
        s_specs = None if shared is None else self._specs(shared)
        n_local = self.experts.gate_proj.get_value().shape[0] // S.axis_size(self.mesh, self.expert_axes)
        reduce_axes = self.expert_axes + self.width_axes

        def body(x, ids, w, e_state, s_state):
            experts = nnx.merge(e_gd, self._localize(e_state))
            first = None  # EP: the shared expert is added on the first device of the expert axes only
            if self.expert_axes:  # EP: keep the slots routed to this device's experts, the rest are empty
                lo = jax.lax.axis_index(self.expert_axes) * n_local
                mine = (ids >= lo) & (ids < lo + n_local)
                ids = jnp.where(mine, ids - lo, n_local)
                first = jax.lax.axis_index(self.expert_axes) == 0
            y = experts(x, ids, w)
            if s_state is not None:
                ys = nnx.merge(s_gd, s_state)(x)
                y = y + (ys if first is None else jnp.where(first, ys, jnp.zeros_like(ys)))
            return jax.lax.psum(y, reduce_axes) if reduce_axes else y

        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(row_spec, row_spec, row_spec, self._specs(self.experts), s_specs),
            out_specs=row_spec,
            check_vma=False,
        )
        return fn(x_td, ids_tk, w_tk, e_state, s_state)


def wrap_moe_layers(model: nnx.Module, mesh: Mesh, rules: str | S.Rules) -> nnx.Module:
    """Replaces (in place) every `MoE` submodule of `model` by a `ShardedMoE` over the same parameters and
    returns `model` (a `MoE` itself comes back wrapped)."""
    rules = S.get_rules(rules)
    if isinstance(model, ShardedMoE):
        return model
    if isinstance(model, MoE):
        return ShardedMoE.wrap(model, mesh, rules)
    found = [
        (path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, MoE) and not isinstance(node, ShardedMoE)
    ]
    for path, moe in found:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        wrapped = ShardedMoE.wrap(moe, mesh, rules)
        if isinstance(path[-1], int):
            parent[path[-1]] = wrapped
        else:
            setattr(parent, path[-1], wrapped)
    return model
