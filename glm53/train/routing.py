"""Router statistics for training: expert loads, the auxiliary-loss-free bias update, the sequence-wise balance loss.

The model's MoE layers are left as they are; `instrument_routers(model)` swaps each `Router` (trunk MoE layers and
the MTP block) for a `RecordingRouter` that holds the *same* parameters under the same names and routes
identically, and, inside a `record_routing()` block, also records each call's chosen expert ids and normalized
affinities. The loss function reads them to count loads and to form the balance loss.

Auxiliary-loss-free balancing (DeepSeek-V3, as the GLM-5 release trains): after each step, for every router,
``bias_e += gamma * sign(mean_e' load_e' - load_e)``, with ``load_e`` the number of (token, slot) assignments to
expert e in that step (padding excluded). The bias only steers selection, so it receives no gradient and is
kept out of the optimizer.

Sequence-wise balance loss (optional, small): per sequence and router, ``sum_e f_e P_e`` with
``f_e = E / (K T) * #{t: e in topk(t)}`` and ``P_e = mean_t s_{t,e} / sum_e' s_{t,e'}`` (s = sigmoid affinities),
over the sequence's valid tokens; averaged over sequences and routers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.layers import records
from glm53.layers.moe import Router
from glm53.layers.param import path_str


class RecordingRouter(Router):
    """`Router` with the parameters of `router` (shared, not copied) that records (ids [N, K], affinities [N, E]
    normalized per token) under `name` into the active `record_routing()` block."""

    def __init__(self, router: Router, name: str):  # not super().__init__: that would create new parameters
        self.top_k = router.top_k
        self.n_experts = router.n_experts
        self.n_group = router.n_group
        self.topk_group = router.topk_group
        self.norm_topk_prob = router.norm_topk_prob
        self.routed_scaling_factor = router.routed_scaling_factor
        self.kernel = router.kernel
        self.e_score_correction_bias = router.e_score_correction_bias
        self.name = name

    def __call__(self, x_td: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        ids, w = super().__call__(x_td)
        if records.active() is not None:
            logits = jnp.matmul(x_td.astype(jnp.float32), self.kernel[...].astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST)  # fmt: skip
            s = jax.nn.sigmoid(logits)
            records.record(self.name, (
                ids.reshape(-1, self.top_k),
                (s / jnp.sum(s, -1, keepdims=True)).reshape(-1, s.shape[-1]),
            ))  # fmt: skip
        return ids, w


def instrument_routers(model: nnx.Module) -> list[str]:
    """Replaces every `Router` in `model` (in place) by a `RecordingRouter`; returns the routers' names (their
    module paths, e.g. ``layers.3.mlp.router``, ``mtp.mlp.router``) in call order. Idempotent.

    On a model with scanned layers (`ModelConfig.scan_layers`) a LayerStack's router is one module, named once
    (e.g. ``layers.2.period.1.mlp.router``), and records ids [R, N, K] / affinities [R, N, E], one per repeat;
    `glm53.train.per_layer.expand_names` turns such names and values into per-layer ones (``layers.<i>...``)."""
    names = []
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, Router) and path and path[-1] == "router":
            name = path_str(path)
            if not isinstance(node, RecordingRouter):
                parent = model
                for p in path[:-1]:
                    parent = parent[p] if isinstance(p, int) else getattr(parent, p)
                parent.router = RecordingRouter(node, name)
            else:
                node.name = name  # instrumented before `set_scan_layers` moved it: renamed to its new path
            names.append(name)
    return sorted(
        names, key=lambda n: (n.startswith("mtp"), [int(p) if p.isdigit() else p for p in n.split(".")])
    )


@contextlib.contextmanager
def record_routing() -> Iterator[dict[str, tuple[jnp.ndarray, jnp.ndarray]]]:
    """{router name: (ids [N, K], normalized affinities [N, E])} of every RecordingRouter called in the block."""
    with records.recording() as rec:
        yield rec


def expert_load(ids_nk: jnp.ndarray, valid_n: jnp.ndarray, n_experts: int) -> jnp.ndarray:
    """Assignments per expert, f32 [E]: sum over valid tokens n and slots k of [ids[n, k] == e]."""
    onehot = jax.nn.one_hot(ids_nk, n_experts, dtype=jnp.float32)  # [N, K, E]
    return jnp.einsum("nke,n->e", onehot, valid_n.astype(jnp.float32))


def bias_update(bias_e: jnp.ndarray, load_e: jnp.ndarray, gamma: float) -> jnp.ndarray:
    """bias + gamma * sign(mean(load) - load) (f32); leading axes (a scanned router's repeats) are separate
    routers."""
    return bias_e + gamma * jnp.sign(jnp.mean(load_e, -1, keepdims=True) - load_e).astype(bias_e.dtype)


def sequence_balance_loss(ids_btk: jnp.ndarray, probs_bte: jnp.ndarray, valid_bt: jnp.ndarray) -> jnp.ndarray:
    """Mean over sequences of sum_e f_e P_e (module docstring); sequences without valid tokens count zero."""
    k, e = ids_btk.shape[-1], probs_bte.shape[-1]
    v = valid_bt.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(v, axis=1), 1.0)  # [B]
    counts = jnp.einsum("btke,bt->be", jax.nn.one_hot(ids_btk, e, dtype=jnp.float32), v)
    f = counts * (e / k) / n[:, None]
    p = jnp.einsum("bte,bt->be", probs_bte, v) / n[:, None]
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def router_params(model: nnx.Module) -> dict[str, RecordingRouter]:
    """{name: RecordingRouter} of an instrumented model."""
    return {node.name: node for _, node in nnx.iter_graph(model) if isinstance(node, RecordingRouter)}
