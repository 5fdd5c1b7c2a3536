"""Dense FFN with GLM-5.3's clamped SwiGLU (dense layers 0-2 and the MoE shared expert)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.config import ModelConfig
from glm53.layers.linear import Linear
from kernels.moe.api import clamped_swiglu


class MLP(nnx.Module):
    """y = down(silu(min(gate(x), L)) * clip(up(x), -L, L)), L = cfg.swiglu_limit.

    gate_proj, up_proj: [D, F]; down_proj: [F, D]. F defaults to cfg.intermediate_size (dense layers); the MoE
    shared expert passes F = moe_intermediate_size * n_shared_experts and `mlp_axis=dims.EXPERT_MLP`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        intermediate_size: int | None = None,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        mlp_axis: str = dims.MLP,
    ):
        d = cfg.hidden_size
        f = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.swiglu_limit = cfg.swiglu_limit
        self.gate_proj = Linear(d, f, (dims.EMBED, mlp_axis), rngs=rngs, dtype=dtype)
        self.up_proj = Linear(d, f, (dims.EMBED, mlp_axis), rngs=rngs, dtype=dtype)
        self.down_proj = Linear(f, d, (mlp_axis, dims.EMBED), rngs=rngs, dtype=dtype)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """x [..., D] -> [..., D] in x's dtype."""
        h = clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit)
        return self.down_proj(h)
