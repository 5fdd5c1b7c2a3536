"""The jitted train step: fp32 master weights, a compute dtype, AdamW + warmup-cosine + global-norm clipping, and
the router bias update.

The model is split once (`split_model`) into its graph, the trainable parameters (every `nnx.Param` except the
routers' ``e_score_correction_bias``), the router biases, and anything else. `TrainState` holds the step, the
f32 parameters, the biases and the optimizer state; `make_train_step(...)` returns ``step(state, batch) ->
(state, metrics)``, jitted with the state donated. Inside, the parameters are cast to the compute dtype (the
routers stay f32) and merged into the model; the gradient flows back to the f32 masters.

A model with `ModelConfig.scan_layers` trains the same way: its stacked parameters (leading repeat axis) are
ordinary leaves here, the optimizer treats them per layer (weight decay by a layer's rank, `decays`), and each
stacked router's bias is updated per repeat from its [repeats, E] loads (docs/scan.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm53 import dims, parallel
from glm53.layers.param import path_str
from glm53.train import routing
from glm53.train.loss import LossConfig, losses
from kernels import dispatch

BIAS = nnx.PathContains("e_score_correction_bias")
# XLA:CPU options: its YNNPACK fusions crashed (SIGSEGV in slinky::fuse_contiguous_dims) running the 6-layer tiny
# train step with jax 0.10.2, so they are off; FAST_COMPILE halves the compile time of a train step (about a
# minute for the tiny model on a loaded 2-core machine) for a slower step: what tests use.
CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
FAST_COMPILE = {**CPU_OPTIONS, "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiler_options(fast_compile: bool = False) -> dict | None:
    """The XLA options `make_train_step` / `make_eval_step` compile with on this backend (None off CPU)."""
    if jax.default_backend() != "cpu":
        return None
    return dict(FAST_COMPILE if fast_compile else CPU_OPTIONS)


TRAINABLE = nnx.All(nnx.Param, nnx.Not(BIAS))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup from 0 to `lr` over `warmup_steps`, cosine decay to `lr * end_lr_ratio` at
    `total_steps`; gradients clipped to global norm `clip_norm` (<= 0: off); weight decay on matrices only."""

    lr: float = 3e-3
    warmup_steps: int = 100
    total_steps: int = 1000
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    bias_gamma: float = 1e-3  # router bias update speed (0: off)
    compute_dtype: str = "float32"


def schedule(cfg: OptimConfig) -> optax.Schedule:
    decay = max(cfg.total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, decay, cfg.lr * cfg.end_lr_ratio)


def decays(x) -> bool:
    """Whether weight decay applies to a parameter: matrices, i.e. rank >= 2 per layer (a stacked parameter of a
    scanned LayerStack, whose logical axes start with `dims.LAYERS`, counts without its repeat axis)."""
    if not isinstance(x, nnx.Variable):
        return x.ndim >= 2
    axes = x.get_metadata().get("logical_axes") or ()
    return x.get_value().ndim - (1 if axes and axes[0] == dims.LAYERS else 0) >= 2


def decay_mask(params):
    """`decays` of every parameter (a prefix tree of `params`: one bool per Variable)."""
    return jax.tree.map(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        schedule(cfg), cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw


@struct.dataclass
class TrainState:
    step: jnp.ndarray
    params: Any  # nnx.State of the trainable f32 parameters
    biases: Any  # nnx.State of the routers' e_score_correction_bias
    opt_state: Any


def split_model(model: nnx.Module):
    """(graphdef, trainable params, router biases, rest) of an instrumented model."""
    return nnx.split(model, TRAINABLE, BIAS, ...)


def init_state(params, biases, tx: optax.GradientTransformation) -> TrainState:
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, biases=biases, opt_state=tx.init(params))


def state_shardings(state: TrainState, mesh: Mesh, rules) -> TrainState:
    """NamedShardings of a TrainState on `mesh`: the parameters and every optimizer-state subtree shaped like
    them by the parameters' rules (`glm53.parallel.state_shardings`), the step, router biases and scalars
    replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    p_sh = parallel.state_shardings(state.params, mesh, rules)
    p_def = jax.tree.structure(state.params)
    like = lambda x: jax.tree.structure(x) == p_def  # noqa: E731
    opt_sh = jax.tree.map(lambda x: p_sh if like(x) else rep, state.opt_state, is_leaf=like)
    return TrainState(
        step=rep, params=p_sh, biases=jax.tree.map(lambda _: rep, state.biases), opt_state=opt_sh
    )


def batch_sharding(mesh: Mesh, rules, batch_size: int) -> NamedSharding:
    """The batch's rows on the mesh axes of the logical "batch" axis ("data"); ValueError naming `batch_size`
    when they do not divide it."""
    axes = parallel.get_rules(rules).mesh_axes(parallel.BATCH)
    n = parallel.axis_size(mesh, axes, "batch")
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} does not split over the mesh's {axes} axes ({n} devices)")
    return NamedSharding(mesh, PartitionSpec(axes or None))


def cast_params(params, dtype):
    """Floating parameters in `dtype`, except the routers' (always f32)."""
    flat = nnx.to_flat_state(params)
    out = []
    for path, v in flat:
        x = v.get_value()
        if "router" not in path and jnp.issubdtype(x.dtype, jnp.floating):
            v = v.replace(x.astype(dtype))
        out.append((path, v))
    return nnx.from_flat_state(out)


def updated_biases(biases, loads: dict, gamma: float):
    """The bias state after `routing.bias_update` of each router with its step's load."""
    out = []
    for path, v in nnx.to_flat_state(biases):
        name = path_str(path[:-1])
        if gamma and name in loads:
            v = v.replace(routing.bias_update(v.get_value(), loads[name], gamma))
        out.append((path, v))
    return nnx.from_flat_state(out)


def load_stats(loads: dict) -> dict:
    """Max and min over routers and experts of load / mean load (1 = perfectly balanced)."""
    if not loads:
        return {}
    r = jnp.concatenate([(ld / jnp.maximum(jnp.mean(ld, -1, keepdims=True), 1e-9)).reshape(-1)
                         for ld in loads.values()])  # fmt: skip
    return dict(load_max=jnp.max(r), load_min=jnp.min(r))


def make_loss_fn(graphdef, rest, loss_cfg: LossConfig, compute_dtype, router_names):
    def loss_fn(params, biases, batch):
        model = nnx.merge(graphdef, cast_params(params, compute_dtype), biases, rest)
        with dispatch.differentiable():  # "auto" kernels pick their differentiable form (kernels/dispatch.py)
            return losses(model, batch, loss_cfg, router_names)

    return loss_fn


def make_train_step(
    graphdef,
    rest,
    tx,
    loss_cfg: LossConfig,
    optim: OptimConfig,
    router_names,
    *,
    jit=True,
    fast_compile=False,
    shardings: tuple[TrainState, NamedSharding] | None = None,
    with_grads: bool = False,
):
    """step(state, batch) -> (new state, metrics); metrics: loss, lm_loss, mtp_loss, balance_loss, grad_norm (before
    clipping), lr (of this step), load_max / load_min, tokens (targets of the next-token loss), and ``loads``
    {router name: f32 [E]} (the loads the bias update used; a router of a scanned LayerStack: [repeats, E] under
    its module path, `glm53.train.per_layer.expand_names` names them per layer). `shardings`: (state shardings,
    batch sharding) (`state_shardings`, `batch_sharding`) to compile the step for a mesh: the state keeps its
    shardings, the metrics come back replicated. `with_grads`: the metrics also hold ``grads``, the gradient
    state before clipping (for checks)."""
    compute_dtype = jnp.dtype(optim.compute_dtype)
    loss_fn = make_loss_fn(graphdef, rest, loss_cfg, compute_dtype, router_names)
    lr_at = schedule(optim)

    def step(state: TrainState, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.biases, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        biases = updated_biases(state.biases, aux["loads"], optim.bias_gamma)
        metrics = dict(loss=loss, lm_loss=aux["lm_loss"], mtp_loss=aux["mtp_loss"], balance_loss=aux["balance_loss"],
                       grad_norm=optax.tree.norm(grads), lr=lr_at(state.step), tokens=aux["lm_tokens"],
                       loads=aux["loads"], **load_stats(aux["loads"]))  # fmt: skip
        if with_grads:
            metrics["grads"] = grads
        return TrainState(state.step + 1, params, biases, opt_state), metrics

    if not jit:
        return step
    kw = {}
    if shardings is not None:
        state_sh, batch_sh = shardings
        rep = NamedSharding(batch_sh.mesh, PartitionSpec())
        kw = dict(in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep))
    return jax.jit(step, donate_argnums=0, compiler_options=compiler_options(fast_compile), **kw)


def make_eval_step(
    graphdef, rest, loss_cfg: LossConfig, compute_dtype, router_names=(), *, jit=True, fast_compile=False
):
    """eval(params, biases, batch) -> sums {lm_nll, lm_tokens, mtp_nll, mtp_tokens} (exact aggregation)."""
    loss_fn = make_loss_fn(graphdef, rest, loss_cfg, jnp.dtype(compute_dtype), router_names)

    def evaluate(params, biases, batch):
        _, aux = loss_fn(params, biases, batch)
        return dict(lm_nll=aux["lm_loss"] * aux["lm_tokens"], lm_tokens=aux["lm_tokens"],
                    mtp_nll=aux["mtp_loss"] * aux["mtp_tokens"], mtp_tokens=aux["mtp_tokens"])  # fmt: skip

    return jax.jit(evaluate, compiler_options=compiler_options(fast_compile)) if jit else evaluate
