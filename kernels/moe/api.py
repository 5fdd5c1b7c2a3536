"""Routed-expert kernel api: `moe_experts` (grouped expert SwiGLU + weighted combine).

Implementations: "reference" (sort slots by expert, `jax.lax.ragged_dot` with f32 accumulation, segment-sum
combine) and "dense_einsum" (every expert on every token, masked; the oracle for tiny sizes). Pallas backends
register in `_IMPLEMENTATIONS` later. See `kernels.moe.reference` for how quantized weights will plug in.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.moe import reference
from kernels.moe.reference import clamped_swiglu

__all__ = ["moe_experts", "clamped_swiglu"]

_IMPLEMENTATIONS = {
    "reference": reference.moe_experts,
    "dense_einsum": reference.moe_experts_dense,
}


def moe_experts(
    x_td: jnp.ndarray,
    topk_ids_tk: jnp.ndarray,
    topk_w_tk: jnp.ndarray,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
    *,
    implementation: str = "reference",
) -> jnp.ndarray:
    """y[t] = sum_k topk_w[t, k] * down_e(clamped_swiglu(x[t] gate_e, x[t] up_e)), e = topk_ids[t, k].

    Args:
      x_td: tokens [T, D] (model dtype).
      topk_ids_tk: int [T, K] expert ids in [0, E]; E marks an empty slot (contributes zero).
      topk_w_tk: [T, K] routing weights (applied in f32).
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] expert weights (only ``.shape`` is read outside the matmuls).
      swiglu_limit: the SwiGLU clamp L (gate: min(a, L); up: clip(b, -L, L)).
      implementation: "reference" | "dense_einsum".
    Returns:
      [T, D] in x's dtype.
    """
    try:
        fn = _IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(
            f"moe_experts: unknown implementation {implementation!r}; valid: {sorted(_IMPLEMENTATIONS)}"
        ) from None
    if len(x_td.shape) != 2:
        raise ValueError(f"moe_experts: x_td must be [T, D], got shape {tuple(x_td.shape)}")
    t, d = x_td.shape
    if len(topk_ids_tk.shape) != 2 or topk_ids_tk.shape[0] != t:
        raise ValueError(f"moe_experts: topk_ids_tk must be [T={t}, K], got shape {tuple(topk_ids_tk.shape)}")
    if tuple(topk_w_tk.shape) != tuple(topk_ids_tk.shape):
        raise ValueError(
            f"moe_experts: topk_w_tk shape {tuple(topk_w_tk.shape)} != topk_ids_tk shape {tuple(topk_ids_tk.shape)}"
        )
    if not jnp.issubdtype(topk_ids_tk.dtype, jnp.integer):
        raise ValueError(f"moe_experts: topk_ids_tk must be integer, got {topk_ids_tk.dtype}")
    if len(w_gate.shape) != 3 or w_gate.shape[1] != d:
        raise ValueError(f"moe_experts: w_gate must be [E, D={d}, F], got shape {tuple(w_gate.shape)}")
    e, _, f = w_gate.shape
    for name, w, want in (("w_up", w_up, (e, d, f)), ("w_down", w_down, (e, f, d))):
        if tuple(w.shape) != want:
            raise ValueError(
                f"moe_experts: {name} must be {want} to match w_gate {tuple(w_gate.shape)}, "
                f"got {tuple(w.shape)}"
            )
    if not swiglu_limit > 0:
        raise ValueError(f"moe_experts: swiglu_limit must be > 0, got {swiglu_limit}")
    return fn(x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit)
