"""Mixture of experts: sigmoid top-k router with selection bias (noaux_tc), routed experts, shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.config import ModelConfig, QuantConfig
from glm53.layers.mlp import MLP
from glm53.layers.param import param
from glm53.layers.stack import StackedSlice
from glm53.quant.qweight import QuantizedExperts, expert_formats
from kernels import dispatch
from kernels.moe import api as moe_api


class Router(nnx.Module):
    """Top-k sigmoid router. kernel [D, E] and e_score_correction_bias [E] are kept in f32.

    scores = sigmoid(x @ kernel) in f32; experts are chosen by scores + bias (the bias only steers selection),
    restricted to the best `topk_group` of `n_group` expert groups (a group scores the sum of its top-2 biased
    scores); weights = scores[chosen] (/ (sum + 1e-20) if norm_topk_prob) * routed_scaling_factor, f32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        del dtype  # the router is always f32
        self.top_k = cfg.num_experts_per_tok
        self.n_experts = cfg.n_routed_experts
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.kernel = param(rngs, (cfg.hidden_size, self.n_experts), (dims.EMBED, dims.EXPERT), jnp.float32)
        self.e_score_correction_bias = param(
            rngs, (self.n_experts,), (dims.EXPERT,), jnp.float32, init="zeros"
        )

    def __call__(self, x_td: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x [..., D] -> (topk_ids [..., K] int32, topk_weights [..., K] f32), ids sorted by biased score."""
        logits = jnp.matmul(
            x_td.astype(jnp.float32),
            self.kernel[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        scores = jax.nn.sigmoid(logits)  # [..., E]
        choice = scores + self.e_score_correction_bias[...].astype(jnp.float32)
        if self.topk_group < self.n_group:  # group-limited routing (a no-op when every group is kept)
            g = self.n_group
            grouped = choice.reshape(*choice.shape[:-1], g, self.n_experts // g)  # [..., G, E/G]
            top2 = jax.lax.top_k(grouped, min(2, self.n_experts // g))[0]
            _, keep = jax.lax.top_k(jnp.sum(top2, axis=-1), self.topk_group)  # [..., topk_group]
            group_mask = jnp.sum(jax.nn.one_hot(keep, g, dtype=jnp.bool_), axis=-2, dtype=jnp.int32) > 0
            expert_mask = jnp.repeat(group_mask, self.n_experts // g, axis=-1)  # [..., E]
            choice = jnp.where(expert_mask, choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, self.top_k)  # [..., K]
        w = jnp.take_along_axis(scores, ids, axis=-1)
        if self.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return ids.astype(jnp.int32), w * self.routed_scaling_factor


IN_PLACE = ("pallas_tpu", "pallas_gpu")  # expert kernels that fetch experts by id (DMA): no slice copies


class Experts(nnx.Module):
    """Routed experts: gate_proj, up_proj [E, D, F]; down_proj [E, F, D] (per-expert kernels [in, out]).

    With `formats` ({"gate", "up", "down"} -> GGUF format) each parameter holds a
    `glm53.quant.qweight.QuantizedExperts` of that kernel shape (stored as `layout`) instead of an array; its
    logical axes are the dense kernel's and name the planes' axes (expert, input words, output rows).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        implementation: str = dispatch.AUTO,
        formats: dict[str, str] | None = None,
        layout: str = "planes",
        decode_max_slots: int = moe_api.DEFAULT_DECODE_MAX_SLOTS,
    ):
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.swiglu_limit = cfg.swiglu_limit
        self.implementation = implementation
        self.decode_max_slots = decode_max_slots
        shapes = {
            "gate": ((e, d, f), (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP)),
            "up": ((e, d, f), (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP)),
            "down": ((e, f, d), (dims.EXPERT, dims.EXPERT_MLP, dims.EMBED)),
        }
        for m, (shape, axes) in shapes.items():
            if formats is None:
                p = param(rngs, shape, axes, dtype)
            else:
                p = nnx.Param(
                    QuantizedExperts.random(rngs.params(), shape, formats[m], layout), logical_axes=axes
                )
            setattr(self, f"{m}_proj", p)

    def __call__(self, x_td: jnp.ndarray, topk_ids_tk: jnp.ndarray, topk_w_tk: jnp.ndarray) -> jnp.ndarray:
        """x [T, D] with routing [T, K] -> weighted sum of the chosen experts' outputs [T, D] in x's dtype."""
        ws = (self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value())
        if any(isinstance(w, StackedSlice) for w in ws):  # a scanned layer (glm53/layers/stack.py)
            n_slots = topk_ids_tk.shape[0] * topk_ids_tk.shape[1]
            name = moe_api.select_implementation(self.implementation, n_slots, self.decode_max_slots)
            # Decode kernels fetch the routed experts by id: they read the stack where it lies. A prefill kernel
            # pads every expert's rows to whole tiles, so on the merged stack (R x E experts) its row buffer
            # would grow R-fold: prefill takes the layer's slice (one layer's planes, copied once per step).
            if name.startswith(IN_PLACE) and name.endswith("_decode"):
                ws, ids = zip(*(w.merged(topk_ids_tk) for w in ws))
                topk_ids_tk = ids[0]
            else:
                ws = tuple(w.take() for w in ws)
        # decode programs' wrapped weights (glm53.runtime.weights.decode_state) go to the api as they are: it
        # unwraps them for every implementation but the one that reads them (kernels.moe.api.READS_DECODE_WEIGHTS)
        return moe_api.moe_experts(
            x_td,
            topk_ids_tk,
            topk_w_tk,
            *ws,
            self.swiglu_limit,
            implementation=self.implementation,
            decode_max_slots=self.decode_max_slots,
        )


class MoE(nnx.Module):
    """y = sum_k w_k Expert_{id_k}(x) + SharedExpert(x) (no gate on the shared expert; none if n_shared_experts=0)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        implementation: str = dispatch.AUTO,
        quant: QuantConfig | None = None,
        layer_idx: int | None = None,
    ):
        """quant / layer_idx: routed-expert storage of this layer (layer_idx None: the MTP block)."""
        self.router = Router(cfg, rngs=rngs)
        q = (
            {}
            if quant is None
            else dict(
                formats=expert_formats(quant, cfg, layer_idx),
                layout=quant.layout,
                decode_max_slots=quant.decode_max_slots,
            )
        )
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype, implementation=implementation, **q)
        width = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = (
            MLP(cfg, width, rngs=rngs, dtype=dtype, mlp_axis=dims.EXPERT_MLP) if width else None
        )

    def __call__(self, x_btd: jnp.ndarray, *, return_routing: bool = False):
        """x [..., D] -> y [..., D] in x's dtype; with return_routing also (ids [..., K] int32, weights [..., K])."""
        lead, d = x_btd.shape[:-1], x_btd.shape[-1]
        x_td = x_btd.reshape(-1, d)
        ids, w = self.router(x_td)
        y = self.routed_and_shared(x_td, ids, w).reshape(*lead, d)
        if return_routing:
            k = ids.shape[-1]
            return y, (ids.reshape(*lead, k), w.reshape(*lead, k))
        return y

    def routed_and_shared(self, x_td: jnp.ndarray, ids_tk: jnp.ndarray, w_tk: jnp.ndarray) -> jnp.ndarray:
        """Routed experts' weighted sum plus the shared expert, [T, D] (the part a sharded MoE distributes)."""
        y = self.experts(x_td, ids_tk, w_tk)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_td)
        return y
