"""Routed experts in plain XLA shaped for XLA:CPU: one expert at a time, weights never gathered or transposed.

The CPU path of `kernels.moe.api.moe_experts` (the GPU keeps `kernels.moe.xla_quant`). Both forms loop over the
DISTINCT routed experts (a `lax.fori_loop` whose trip count is their number U, so no work is done for an
expert no slot was routed to) and, per expert, read its weights once:

- dense kernels [E, in, out]: `lax.dynamic_index_in_dim` of the expert, contracted in the kernel's own
  orientation (a gather + transpose of several experts, as `xla_quant` does, costs more than the matmuls
  themselves on CPU). XLA:CPU still copies that slice before the dot; the decode form also takes
  `ExpertList`s (kernels/moe/expert_list.py: one array per expert, picked by a `lax.switch`, no copy), which
  is what decode programs read on CPU (`glm53.runtime.weights.decode_state`);
- `QuantizedExperts`: the experts' planes are gathered and dequantized once, a chunk of experts at a time
  outside any loop (decode: one expert per chunk, so its f32 weights are still in cache when its matmuls read
  them; prefill: 8), each chunk skipped by a `lax.cond` when it holds no routed expert.

Forms:

- decode (`moe_experts_decode`, few routed slots): per distinct expert, all T tokens through it (a [T, D]
  matmul) and each token's output added with its combined routing weight for that expert (zero when not
  routed).
- prefill (`moe_experts_prefill`, many slots): slots sorted by expert; per distinct expert its rows run in
  tiles of `tile_rows`, then the remaining r < tile_rows rows in power-of-two tiles (one per set bit of r),
  so no row outside the expert's group is ever computed: work = the real group sizes.

Math and precision follow `kernels.moe.reference` (the tests' oracle): weights cast to x's dtype, f32
accumulation at HIGHEST precision, the SwiGLU output cast to x's dtype, routing weights applied in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from glm53.quant.qweight import QuantizedExperts
from kernels.matmul import cpu_ffi as matmul_ffi
from kernels.matmul.streamed import StreamedKernel
from kernels.matmul.streamed import usable as streamed_usable
from kernels.moe import cpu_ffi, expert_list, routing
from kernels.moe.expert_list import ExpertList
from kernels.moe.reference import clamped_swiglu

_HIGHEST = lax.Precision.HIGHEST
DEFAULT_TILE_ROWS = 64
DEFAULT_CHUNK_EXPERTS = 8  # prefill: experts dequantized per chunk
# decode: one expert at a time. Its three f32 matrices (3 MiB at the small config) are still in cache when its
# matmuls read them; a chunk of C experts writes C times that before the first matmul reads it back. Measured at
# the small config, UD-IQ3_XXS re-encoded vs dense experts, T=1 / T=8: chunk 1 1.10x / 1.46x, chunk 2 1.61x /
# 1.73x, chunk 4 1.73x / 2.27x, chunk 8 1.65x / 2.79x (this decode form with chunk_experts=C, medians of 11 / 5).
DEFAULT_DECODE_CHUNK_EXPERTS = 1


class _Source:
    """Where one expert matrix's weights come from: a dense kernel [E, in, out] indexed by expert id, or a chunk
    of dequantized experts [C, out, in] indexed by position in the chunk."""

    def __init__(self, w, transposed: bool, by_position: bool):
        self.w, self.transposed, self.by_position = w, transposed, by_position

    def matrix(self, expert: jax.Array, position: jax.Array) -> tuple[jax.Array, bool]:
        i = position if self.by_position else jnp.clip(expert, 0, self.w.shape[0] - 1)
        return lax.dynamic_index_in_dim(self.w, i, 0, keepdims=False), self.transposed


def dequantize_chunk(w: QuantizedExperts, ids: jax.Array, dtype) -> jax.Array:
    """Experts `ids` [C] of `w` dequantized as [C, out, in] in `dtype` (only their planes are gathered)."""
    return w.take(ids).dequantize_rows(jnp.float32).astype(dtype)


def _sources(ws, chunk_ids: jax.Array, dtype) -> tuple[_Source, ...]:
    """gate / up / down sources for the experts `chunk_ids` [C]: dense kernels as they are (cast), quantized
    ones dequantized for just those experts, all C at once (gather fused into the dequantization)."""
    out = []
    for w in ws:
        if isinstance(w, QuantizedExperts):
            out.append(_Source(dequantize_chunk(w, chunk_ids, dtype), True, True))
        else:
            out.append(_Source(w.astype(dtype), False, False))
    return tuple(out)


def _mm(x: jax.Array, m: tuple[jax.Array, bool]) -> jax.Array:
    """x [M, in] @ expert matrix -> f32 [M, out]."""
    w, transposed = m
    spec = "mi,oi->mo" if transposed else "mi,io->mo"
    return jnp.einsum(spec, x, w, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _ffn(x: jax.Array, mats, swiglu_limit: float) -> jax.Array:
    """down(clamped_swiglu(x gate, x up)) for one expert's matrices; f32 [M, D]."""
    g, u, d = mats
    h = clamped_swiglu(_mm(x, g), _mm(x, u), swiglu_limit)
    return _mm(h.astype(x.dtype), d)


def _for_each_expert(experts: jax.Array, n_u: jax.Array, ws, dtype, chunk: int, process, carry):
    """carry = process(expert id, (gate, up, down) matrices, carry) for experts[0 .. n_u - 1].

    Quantized weights are dequantized `chunk` experts at a time, outside any loop (XLA:CPU runs a
    dequantization fused into a loop body several times slower, measured), each chunk inside a `lax.cond`
    that skips it when it holds no routed expert; dense weights are indexed directly. experts: int32 [n],
    n_u <= n valid.
    """
    n = experts.shape[0]
    quantized = any(isinstance(w, QuantizedExperts) for w in ws)
    c = max(1, min(chunk, n)) if quantized else n
    n_pad = -(-n // c) * c
    e_pad = jnp.concatenate([experts, jnp.broadcast_to(experts[:1], (n_pad - n,))])

    for j in range(n_pad // c):

        def run(carry, j=j):
            srcs = _sources(ws, lax.dynamic_slice_in_dim(e_pad, j * c, c), dtype)

            def one(i, carry):
                ex = e_pad[i]
                return process(ex, tuple(s.matrix(ex, i - j * c) for s in srcs), carry)

            return lax.fori_loop(j * c, jnp.minimum(n_u, (j + 1) * c), one, carry)

        carry = run(carry) if j == 0 and c == n else lax.cond(j * c < n_u, run, lambda c_: c_, carry)
    return carry


def moe_experts_decode(
    x_td: jax.Array,
    topk_ids_tk: jax.Array,
    topk_w_tk: jax.Array,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
    *,
    chunk_experts: int = DEFAULT_DECODE_CHUNK_EXPERTS,
    ffi: bool | None = None,
) -> jax.Array:
    """`moe_experts` for few routed slots: each distinct routed expert read (dequantized) once, all T tokens
    through it, outputs combined with the routing weights. Quantized experts are dequantized `chunk_experts`
    at a time (default one: see DEFAULT_DECODE_CHUNK_EXPERTS), each chunk skipped when past the U distinct
    experts.

    ffi: None (default): when gate / up / down are all QuantizedExperts the C++ kernel decodes
    (`kernels.moe.cpu_ffi`, `_decode_ffi`) if it is available and takes their formats, else the XLA path runs;
    True: the kernel or NotImplementedError; False: the XLA path."""
    t, k = topk_ids_tk.shape
    e, d = w_gate.shape[0], x_td.shape[1]
    if t * k == 0:
        return jnp.zeros_like(x_td)
    streamed = [isinstance(w, StreamedKernel) for w in (w_gate, w_up, w_down)]
    if any(streamed):  # decode_state's wrapping: the row-matmul kernel on the routed rows (f32 only)
        arrays = tuple(w.unwrap() if isinstance(w, StreamedKernel) else w for w in (w_gate, w_up, w_down))
        xla = functools.partial(moe_experts_decode, chunk_experts=chunk_experts, ffi=False)
        if all(streamed) and ffi is not False and streamed_usable(x_td, arrays[0], t):
            args = (x_td, topk_ids_tk, topk_w_tk, *arrays, swiglu_limit)
            return lax.platform_dependent(*args, cpu=_by_slot, default=xla)
        return xla(x_td, topk_ids_tk, topk_w_tk, *arrays, swiglu_limit)
    if ffi is not False:
        reason = _ffi_unsupported((w_gate, w_up, w_down))
        if reason is None:
            args = (x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit)
            xla = functools.partial(moe_experts_decode, chunk_experts=chunk_experts, ffi=False)
            # a fresh partial per trace: a traced branch is cached by function, and the threads may change
            ffi_fn = functools.partial(_decode_ffi, threads=cpu_ffi.default_threads())
            return lax.platform_dependent(*args, cpu=ffi_fn, default=xla)
        if ffi:
            raise NotImplementedError(f"the CPU quantized-expert kernel cannot run: {reason}")
    uniq, n_u = routing.distinct_experts(topk_ids_tk, e)
    ids_tk = routing.clean_ids(topk_ids_tk, e).reshape(t, k)
    w_tk = topk_w_tk.astype(jnp.float32)

    def process(ex, mats, y_td):
        comb_t = jnp.sum(jnp.where(ids_tk == ex, w_tk, 0.0), axis=1)  # [T] routing weight on this expert
        return y_td + comb_t[:, None] * _ffn(x_td, mats, swiglu_limit)

    ws = (w_gate, w_up, w_down)
    y0 = jnp.zeros((t, d), jnp.float32)
    if all(isinstance(w, ExpertList) for w in ws):  # separate expert arrays: read in place (expert_list.py)
        y = expert_list.for_each_expert(uniq, n_u, ws, x_td.dtype, process, y0)
    else:
        ws = tuple(w.stacked() if isinstance(w, ExpertList) else w for w in ws)
        y = _for_each_expert(uniq, n_u, ws, x_td.dtype, chunk_experts, process, y0)
    return y.astype(x_td.dtype)


def _ffi_unsupported(ws) -> str | None:
    """None when the C++ kernel takes gate / up / down `ws`, else why not."""
    if not all(isinstance(w, QuantizedExperts) for w in ws):
        return f"it needs QuantizedExperts for gate/up/down, got {[type(w).__name__ for w in ws]}"
    for w in ws:
        reason = cpu_ffi.unsupported_reason(w.planes)
        if reason is not None:
            return reason
    if not cpu_ffi.available():
        return "disabled" if not cpu_ffi.enabled() else "the kernel did not build (see the warning)"
    return None


def _decode_ffi(x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit, *, threads: int):
    """The decode form on the C++ kernel: one call per matrix over the distinct routed experts (ids = E for
    padding give zeros), x cast to f32, the SwiGLU output cast to x's dtype as the reference does."""
    t, k = topk_ids_tk.shape
    e = w_gate.shape[0]
    uniq, _ = routing.distinct_experts(topk_ids_tk, e)  # [n], padded with E
    ids_tk = routing.clean_ids(topk_ids_tk, e).reshape(t, k)
    comb_tn = jnp.sum(
        jnp.where(
            (ids_tk[:, :, None] == uniq[None, None, :]) & (uniq < e)[None, None, :],
            topk_w_tk.astype(jnp.float32)[:, :, None],
            0.0,
        ),
        axis=1,
    )
    x = x_td.astype(jnp.float32)[None]  # [1, T, D]
    g = cpu_ffi.qmatvec(x, uniq, w_gate.planes, threads)  # [n, T, F]
    u = cpu_ffi.qmatvec(x, uniq, w_up.planes, threads)
    h = clamped_swiglu(g, u, swiglu_limit).astype(x_td.dtype).astype(jnp.float32)
    o = cpu_ffi.qmatvec(h, uniq, w_down.planes, threads)  # [n, T, D]
    y = jnp.einsum("tn,ntd->td", comb_tn, o, precision=_HIGHEST)
    return y.astype(x_td.dtype)


def _by_slot(x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit):
    """The decode form of dense f32 experts on the row-matmul kernel (kernels/matmul): only the routed rows.
    The T*K slots are sorted by expert, one row each; the kernel reads each expert once per run of equal ids
    (empty slots, id E, sort last and give zeros)."""
    t, k = topk_ids_tk.shape
    e = w_gate.shape[0]
    flat = routing.clean_ids(topk_ids_tk, e)
    order = jnp.argsort(flat, stable=True)
    ids = flat[order]  # [S] sorted
    tok = (order // k).astype(jnp.int32)
    w_s = jnp.where(ids < e, topk_w_tk.reshape(-1).astype(jnp.float32)[order], 0.0)
    x = x_td.astype(jnp.float32)[tok][:, None]  # [S, 1, D]
    g = matmul_ffi.row_matmul(x, ids, w_gate)  # [S, 1, F]
    u = matmul_ffi.row_matmul(x, ids, w_up)
    h = clamped_swiglu(g, u, swiglu_limit).astype(x_td.dtype).astype(jnp.float32)
    o = matmul_ffi.row_matmul(h, ids, w_down)[:, 0]  # [S, D]
    y = jax.ops.segment_sum(o * w_s[:, None], tok, num_segments=t)
    return y.astype(x_td.dtype)


def _tile_sizes(tile_rows: int) -> tuple[int, ...]:
    """The power-of-two remainder tiles below `tile_rows`, largest first."""
    return tuple(1 << b for b in reversed(range(max(1, tile_rows).bit_length())) if (1 << b) < tile_rows)


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
    chunk_experts: int = DEFAULT_CHUNK_EXPERTS,
) -> jax.Array:
    """`moe_experts` for many routed slots: sort by expert; per distinct expert (read / dequantized once) its
    rows in full tiles of `tile_rows`, the rest in power-of-two tiles: only the real group rows are computed."""
    t, k = topk_ids_tk.shape
    e, d = w_gate.shape[0], x_td.shape[1]
    s = t * k
    if s == 0:
        return jnp.zeros_like(x_td)
    tm = max(1, min(tile_rows, s))
    flat, order, sizes, starts = routing.sort_by_expert(topk_ids_tk, e)  # [S], [S], [E], [E]
    tok = (order // k).astype(jnp.int32)  # token of each sorted slot
    w_sorted = jnp.where(flat[order] < e, topk_w_tk.reshape(s).astype(jnp.float32)[order], 0.0)
    # sorted rows, padded so that every static-size slice starting inside [0, S) stays in bounds
    xs = jnp.concatenate([x_td[tok], jnp.zeros((tm, d), x_td.dtype)])  # [S + tm, D]
    n = min(s, e)
    routed = jnp.nonzero(sizes > 0, size=n, fill_value=0)[0].astype(jnp.int32)  # [n]
    n_u = jnp.sum(sizes > 0).astype(jnp.int32)

    def rows(mats, r0, m, out):
        o = _ffn(lax.dynamic_slice_in_dim(xs, r0, m), mats, swiglu_limit)  # [m, D] f32
        return lax.dynamic_update_slice_in_dim(out, o, r0, 0)

    def process(ex, mats, out):
        size, start = sizes[ex], starts[ex]
        n_full = size // tm
        out = lax.fori_loop(0, n_full, lambda j, o: rows(mats, start + j * tm, tm, o), out)
        r0 = start + n_full * tm
        for m in _tile_sizes(tm):  # the remainder size % tm, one tile per set bit
            take = (size % tm) & m != 0
            out, r0 = lax.cond(
                take, lambda o, r, m=m: (rows(mats, r, m, o), r + m), lambda o, r: (o, r), out, r0
            )
        return out

    ws = (w_gate, w_up, w_down)
    out = jnp.zeros((s + tm, d), jnp.float32)  # [S + tm, D] sorted rows
    out = _for_each_expert(routed, n_u, ws, x_td.dtype, chunk_experts, process, out)
    y = jax.ops.segment_sum(out[:s] * w_sorted[:, None], tok, num_segments=t)  # [T, D] f32
    return y.astype(x_td.dtype)
