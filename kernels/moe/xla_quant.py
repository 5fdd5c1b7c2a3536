"""Routed experts in plain XLA with quantized (or dense) weights: cost per DISTINCT expert, not per weight tensor.

This is the GPU / CPU path of `kernels.moe.api.moe_experts`. Weights are `glm53.quant.qweight.QuantizedExperts`
or dense kernels [E, in, out]; every expert weight reaches the math through `dequantize_experts` (gather the
experts' planes on the expert axis, dequantize just those), so a step never dequantizes an expert no slot was
routed to.

- decode (`moe_experts_decode`, few routed slots): the distinct routed experts are found (`jnp.unique` with a
  static bound min(T*K, E)) and processed `experts_per_step` at a time in a loop whose trip count is dynamic,
  ceil(U / experts_per_step) for U distinct experts: per step, gather + dequantize those experts' gate/up/down,
  run them on all T tokens and add each token's output with its combined routing weight for that expert (zero
  when not routed). Dequantized experts per call: experts_per_step * ceil(U / experts_per_step).
- prefill (`moe_experts_prefill`, many slots): slots sorted by expert; a loop over the distinct experts
  dequantizes each expert once and runs its rows in tiles of `tile_rows` (dynamic tile count per expert).

Math and precision follow `kernels.moe.reference`: weights cast to x's dtype, matmuls at HIGHEST precision
with f32 accumulation, the SwiGLU output cast to x's dtype, routing weights applied and summed in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from glm53.quant.qweight import QuantizedExperts
from kernels.moe import routing
from kernels.moe.reference import clamped_swiglu

_HIGHEST = lax.Precision.HIGHEST
DEFAULT_EXPERTS_PER_STEP = 8
DEFAULT_TILE_ROWS = 128


def dequantize_experts(w, ids: jax.Array, dtype) -> jax.Array:
    """Experts `ids` [n] of `w` (QuantizedExperts or dense [E, in, out]) as [n, out, in] in `dtype`.

    Only the n experts' planes are gathered and dequantized (the count the decode test checks).
    """
    if isinstance(w, QuantizedExperts):
        return w.take(ids).dequantize_rows(jnp.float32).astype(dtype)
    ids = jnp.clip(ids.astype(jnp.int32), 0, w.shape[0] - 1)
    return jnp.swapaxes(jnp.take(w, ids, axis=0), -1, -2).astype(dtype)


def _mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _ffn(spec_in: str, spec_out: str, x: jax.Array, wg, wu, wd, swiglu_limit: float) -> jax.Array:
    """down(clamped_swiglu(x gate, x up)) in f32, x's dtype between the matmuls (einsum specs in / out)."""
    h = clamped_swiglu(_mm(spec_in, x, wg), _mm(spec_in, x, wu), swiglu_limit)
    return _mm(spec_out, h.astype(x.dtype), wd)


def moe_experts_decode(
    x_td: jax.Array,
    topk_ids_tk: jax.Array,
    topk_w_tk: jax.Array,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
    *,
    experts_per_step: int = DEFAULT_EXPERTS_PER_STEP,
) -> jax.Array:
    """`moe_experts` for few routed slots; each distinct routed expert is dequantized once per call."""
    t, k = topk_ids_tk.shape
    e, d = w_gate.shape[0], x_td.shape[1]
    if t * k == 0:
        return jnp.zeros_like(x_td)
    c = max(1, min(experts_per_step, e, t * k))
    uniq, n_u = routing.distinct_experts(topk_ids_tk, e)
    n_pad = -(-uniq.shape[0] // c) * c
    uniq = jnp.concatenate([uniq, jnp.full((n_pad - uniq.shape[0],), e, jnp.int32)])  # [n_pad]
    ids_tk = routing.clean_ids(topk_ids_tk, e).reshape(t, k)
    w_tk = topk_w_tk.astype(jnp.float32)

    def step(i, y_td):
        u_c = lax.dynamic_slice(uniq, (i * c,), (c,))  # [C] expert ids (E = padding)
        hit = (ids_tk[:, :, None] == u_c[None, None, :]) & (u_c < e)[None, None, :]  # [T, K, C]
        comb_tc = jnp.sum(jnp.where(hit, w_tk[:, :, None], 0.0), axis=1)  # [T, C] routing weight per expert
        wg, wu, wd = (dequantize_experts(w, u_c, x_td.dtype) for w in (w_gate, w_up, w_down))  # [C, out, in]
        o = _ffn("td,cfd->ctf", "ctf,cdf->ctd", x_td, wg, wu, wd, swiglu_limit)  # [C, T, D] f32
        return y_td + jnp.einsum("tc,ctd->td", comb_tc, o, precision=_HIGHEST)

    n_steps = (n_u + c - 1) // c
    y = lax.fori_loop(0, n_steps, step, jnp.zeros((t, d), jnp.float32))
    return y.astype(x_td.dtype)


def moe_experts_prefill(
    x_td: jax.Array,
    topk_ids_tk: jax.Array,
    topk_w_tk: jax.Array,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
    *,
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> jax.Array:
    """`moe_experts` for many routed slots: sort by expert, dequantize each routed expert once, tile its rows."""
    t, k = topk_ids_tk.shape
    e, d = w_gate.shape[0], x_td.shape[1]
    s = t * k
    if s == 0:
        return jnp.zeros_like(x_td)
    tm = max(1, min(tile_rows, s))
    flat, order, sizes, starts = routing.sort_by_expert(topk_ids_tk, e)  # [S], [S], [E], [E]
    tok = (order // k).astype(jnp.int32)  # token of each sorted slot
    xs = jnp.concatenate([x_td[tok], jnp.zeros((tm, d), x_td.dtype)])  # [S + tm, D]
    routed = jnp.nonzero(sizes > 0, size=e, fill_value=e)[0].astype(jnp.int32)  # [E], E = padding
    n_u = jnp.sum(sizes > 0).astype(jnp.int32)

    def expert(i, out):
        ex = routed[i][None]  # [1]
        wg, wu, wd = (dequantize_experts(w, ex, x_td.dtype)[0] for w in (w_gate, w_up, w_down))  # [out, in]
        size, start = sizes[ex[0]], starts[ex[0]]

        def tile(j, out):
            r0 = start + j * tm
            xt = lax.dynamic_slice(xs, (r0, 0), (tm, d))  # [tm, D]
            o = _ffn("md,fd->mf", "mf,df->md", xt, wg, wu, wd, swiglu_limit)  # [tm, D] f32
            mine = (j * tm + jnp.arange(tm)) < size  # rows of this expert
            old = lax.dynamic_slice(out, (r0, 0), (tm, d))
            return lax.dynamic_update_slice(out, jnp.where(mine[:, None], o, old), (r0, 0))

        return lax.fori_loop(0, (size + tm - 1) // tm, tile, out)

    out = lax.fori_loop(0, n_u, expert, jnp.zeros((s + tm, d), jnp.float32))  # [S + tm, D] sorted rows
    w_sorted = jnp.where(flat[order] < e, topk_w_tk.reshape(s).astype(jnp.float32)[order], 0.0)
    y = jax.ops.segment_sum(out[:s] * w_sorted[:, None], tok, num_segments=t)  # [T, D] f32
    return y.astype(x_td.dtype)
