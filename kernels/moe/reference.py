"""Pure-jnp routed-expert references: a sorted grouped-matmul path and a dense all-experts oracle.

Weight arguments: plain arrays w_gate / w_up [E, D, F] and w_down [E, F, D] (kernels stored [in, out] per expert),
or `glm53.quant.qweight.QuantizedExperts` of those kernel shapes. Every contraction with an expert weight goes
through exactly one of two functions, `grouped_matmul` (sorted path) and `expert_einsum` (dense path), which
dequantize a QuantizedExperts whole (every expert, f32 values cast to x's dtype) before the matmul: this is the
oracle, not a fast path (see `kernels.moe.xla_quant`). The routing / sort / combine code only reads ``w.shape``.
With dense weights and fewer slots than experts (decode), `moe_experts` instead gathers each slot's expert
matrices (`moe_experts_gathered`).

Slot ids must lie in [0, E]; an id equal to E marks an empty slot that contributes zero (useful for capacity
dropping or expert-parallel shards). Activations stay in x's dtype between matmuls; matmuls accumulate in f32;
routing weights are applied and slots summed in f32, the result is cast to x's dtype once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm53.quant.qweight import QuantizedExperts
from kernels.moe import routing

_HIGHEST = jax.lax.Precision.HIGHEST


def clamped_swiglu(a: jnp.ndarray, b: jnp.ndarray, limit: float) -> jnp.ndarray:
    """silu(min(a, limit)) * clip(b, -limit, limit) -- GLM-5.3's clamped SwiGLU (gate a, up b)."""
    return jax.nn.silu(jnp.minimum(a, limit)) * jnp.clip(b, -limit, limit)


def dense_weight(w, dtype) -> jnp.ndarray:
    """An expert weight as a dense kernel [E, in, out] of `dtype` (a QuantizedExperts is dequantized whole)."""
    if isinstance(w, QuantizedExperts):
        return w.dequantize(jnp.float32).astype(dtype)
    return w.astype(dtype)


def grouped_matmul(x_md: jnp.ndarray, w_ekn, group_sizes_e: jnp.ndarray) -> jnp.ndarray:
    """Rows of x_md [M, K] sorted by expert times their expert's w_ekn [E, K, N]; f32 [M, N].

    group_sizes_e [E] int32: rows per expert, in order; rows past sum(group_sizes) come out zero.
    """
    # bf16 operands at DEFAULT: the products are exact in the f32 accumulator, and TPU's ragged_dot (a Mosaic
    # kernel) rejects a higher precision for them.
    prec = _HIGHEST if x_md.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.ragged_dot(
        x_md,
        dense_weight(w_ekn, x_md.dtype),
        group_sizes_e,
        precision=prec,
        preferred_element_type=jnp.float32,
    )


def expert_einsum(spec: str, x: jnp.ndarray, w) -> jnp.ndarray:
    """einsum(spec, x, w) against an expert weight w [E, ...], f32 result (dense oracle path)."""
    return jnp.einsum(
        spec, x, dense_weight(w, x.dtype), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def moe_experts(
    x_td: jnp.ndarray,
    topk_ids_tk: jnp.ndarray,
    topk_w_tk: jnp.ndarray,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
) -> jnp.ndarray:
    """sum_k w[t,k] * Expert_{ids[t,k]}(x[t]) via sort-by-expert + ragged_dot; [T, D] in x's dtype.

    With dense weights and fewer routed slots than experts (T*K < E: decode), each slot's expert weights are
    gathered instead (`moe_experts_gathered`): ragged_dot may cost as much as every expert on every row.
    """
    t, k = topk_ids_tk.shape
    e = w_gate.shape[0]
    if t * k < e and not any(isinstance(w, QuantizedExperts) for w in (w_gate, w_up, w_down)):
        return moe_experts_gathered(x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit)
    ids, order, group_sizes, _ = routing.sort_by_expert(topk_ids_tk, e)  # slot s = token * k + j
    tok = (order // k).astype(jnp.int32)  # token of each sorted slot
    xs = x_td[tok]  # [T*K, D]
    g = grouped_matmul(xs, w_gate, group_sizes)  # [T*K, F] f32
    u = grouped_matmul(xs, w_up, group_sizes)
    h = clamped_swiglu(g, u, swiglu_limit).astype(x_td.dtype)
    o = grouped_matmul(h, w_down, group_sizes)  # [T*K, D] f32
    w_sorted = topk_w_tk.reshape(t * k).astype(jnp.float32)[order]
    w_sorted = jnp.where(ids[order] < e, w_sorted, 0.0)
    y = jax.ops.segment_sum(o * w_sorted[:, None], tok, num_segments=t)  # [T, D] f32
    return y.astype(x_td.dtype)


def moe_experts_gathered(
    x_td: jnp.ndarray,
    topk_ids_tk: jnp.ndarray,
    topk_w_tk: jnp.ndarray,
    w_gate: jnp.ndarray,
    w_up: jnp.ndarray,
    w_down: jnp.ndarray,
    swiglu_limit: float,
) -> jnp.ndarray:
    """Same result as `moe_experts` with dense weights by gathering one expert's weights per routed slot
    (T*K expert matrices read: the cheap path for few slots)."""
    t, k = topk_ids_tk.shape
    e = w_gate.shape[0]
    ids = routing.clean_ids(topk_ids_tk, e)  # slot s = token * k + j
    safe = jnp.where(ids < e, ids, 0)  # empty slots (id E) read expert 0 and get weight 0
    xs = jnp.repeat(x_td, k, axis=0)  # [T*K, D]

    def mm(spec, a, w):  # against each slot's expert matrix w[ids[s]]
        return jnp.einsum(
            spec, a, w[safe].astype(a.dtype), precision=_HIGHEST, preferred_element_type=jnp.float32
        )

    h = clamped_swiglu(mm("sd,sdf->sf", xs, w_gate), mm("sd,sdf->sf", xs, w_up), swiglu_limit)
    o = mm("sf,sfd->sd", h.astype(x_td.dtype), w_down)  # [T*K, D] f32
    w_s = jnp.where(ids < e, topk_w_tk.reshape(t * k).astype(jnp.float32), 0.0)
    y = jnp.sum((o * w_s[:, None]).reshape(t, k, -1), axis=1)  # [T, D] f32
    return y.astype(x_td.dtype)


def moe_experts_dense(
    x_td: jnp.ndarray,
    topk_ids_tk: jnp.ndarray,
    topk_w_tk: jnp.ndarray,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
) -> jnp.ndarray:
    """Same result as `moe_experts` by running every expert on every token (O(E*T) work: tiny sizes only)."""
    e = w_gate.shape[0]
    g = expert_einsum("td,edf->etf", x_td, w_gate)  # [E, T, F] f32
    u = expert_einsum("td,edf->etf", x_td, w_up)
    h = clamped_swiglu(g, u, swiglu_limit).astype(x_td.dtype)
    o = expert_einsum("etf,efd->etd", h, w_down)  # [E, T, D] f32
    # combine[t, e] = sum_k w[t, k] * [ids[t, k] == e]; one_hot of id E is all zeros.
    combine = jnp.einsum(
        "tke,tk->te", jax.nn.one_hot(topk_ids_tk, e, dtype=jnp.float32), topk_w_tk.astype(jnp.float32)
    )
    y = jnp.einsum("te,etd->td", combine, o, precision=_HIGHEST)
    return y.astype(x_td.dtype)
