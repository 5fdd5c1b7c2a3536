"""Pallas TPU routed experts for few tokens (decode): cost follows the distinct experts of the step.

The distinct experts of the step are found in XLA (sorted, padded to min(T K, E) by repeating the last one)
and scalar-prefetched. Kernel 1, grid (distinct expert u, F lane block j): expert u's gate and up tiles are
DMA'd and decoded once and applied to all T tokens (resident in VMEM) on the MXU, then the clamped SwiGLU ->
h [U, T, F]. XLA scales h by the combine weight of (token, expert) (0 where the token did not route there).
Kernel 2, grid (D lane block j, u): decodes expert u's down tile once and accumulates h_u @ W_u into y [T, D]
(u is the reduction axis). Padding steps past the number of distinct experts map to the block index of the
last real step, so Pallas issues no DMA for them, and skip the body: the weight bytes fetched per step are
those of the distinct experts. Shapes, formats and tracing: `kernels.moe.pallas_tpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from glm53.quant.planes import Planes
from kernels.moe import pallas_common as C
from kernels.moe import routing
from kernels.moe.pallas_tpu import (
    F32,
    call,
    check_supported,
    decode_into,
    dot,
    field_specs,
    leaves,
    mat,
    permuted,
    pick_lane_tile,
    planes_bytes,
    take_fields,
    write_trace,
)
from kernels.moe.reference import clamped_swiglu

__all__ = ["moe_decode", "distinct_experts", "gate_up_decode", "down_decode"]


distinct_experts = routing.expert_combine  # moved to routing (shared with pallas_gpu_decode)


def _decode_maps(n_lane_blocks: int):
    """Index maps of the decode kernels; past n_valid a step repeats the last real step's block index."""

    def last(nv_ref):
        return jnp.maximum(nv_ref[0] - 1, 0)

    def gate_up_weight(u, j, uids_ref, nv_ref):  # grid (u, j)
        ok = u < nv_ref[0]
        return uids_ref[jnp.minimum(u, last(nv_ref))], jnp.where(ok, j, n_lane_blocks - 1)

    def gate_up_out(u, j, uids_ref, nv_ref):
        ok = u < nv_ref[0]
        return jnp.minimum(u, last(nv_ref)), 0, jnp.where(ok, j, n_lane_blocks - 1)

    def down_weight(j, u, uids_ref, nv_ref):  # grid (j, u)
        return uids_ref[jnp.minimum(u, last(nv_ref))], j

    def down_h(j, u, uids_ref, nv_ref):
        return jnp.minimum(u, last(nv_ref)), 0, 0

    return gate_up_weight, gate_up_out, down_weight, down_h


def _gate_up_decode_kernel(uids_ref, nv_ref, *refs, gate, up, same_x, limit, trace):
    it = iter(refs)
    xg_ref = next(it)
    xu_ref = xg_ref if same_x else next(it)
    g_refs, u_refs = take_fields(gate, it), take_fields(up, it)
    h_ref = next(it)
    tr_ref = next(it) if trace else None
    wbuf = next(it)
    u = pl.program_id(0)
    valid = u < nv_ref[0]

    @pl.when(valid)
    def _():
        decode_into(wbuf, gate, g_refs)
        g = dot(xg_ref[...], wbuf[...])  # [Tp, tile] f32
        decode_into(wbuf, up, u_refs)
        h_ref[...] = clamped_swiglu(g, dot(xu_ref[...], wbuf[...]), limit).astype(h_ref.dtype)

    if trace:
        write_trace(tr_ref, jnp.where(valid, uids_ref[u], -1))


def _down_decode_kernel(uids_ref, nv_ref, h_ref, *refs, down, trace):
    it = iter(refs)
    d_refs = take_fields(down, it)
    y_ref = next(it)
    tr_ref = next(it) if trace else None
    wbuf = next(it)
    u = pl.program_id(1)
    valid = u < nv_ref[0]

    @pl.when(u == 0)
    def _():
        y_ref[...] = jnp.zeros_like(y_ref)

    @pl.when(valid)
    def _():
        decode_into(wbuf, down, d_refs)
        y_ref[...] += dot(h_ref[...], wbuf[...])

    if trace:
        write_trace(tr_ref, jnp.where(valid, uids_ref[u], -1))


def gate_up_decode(
    xg, xu, uids, nv, gate: Planes, up: Planes, *, swiglu_limit, lane_tile=None, interpret=False, trace=False
):
    """h [U, Tp, F] f32 = clamped SwiGLU of x @ gate_u^T, x @ up_u^T for each distinct expert u < nv.

    xg / xu: [Tp, D] (Tp a multiple of 8) permuted by `permute_inputs` for gate's / up's format (xu may be
    xg).
    Rows u >= nv of h are not written. With trace: also int32 [U, F / tile, 8, 128] (decoded expert or -1).
    """
    tp, d = xg.shape
    u_max, f = uids.shape[0], gate.rows
    tile = pick_lane_tile(f, lane_tile)
    nj = f // tile
    w_map, out_map, _, _ = _decode_maps(nj)
    same_x = xu is xg
    xs = [xg] if same_x else [xg, xu]
    in_specs = [pl.BlockSpec((tp, d), lambda u, j, *_: (0, 0)) for _ in xs]
    in_specs += field_specs(gate, tile, w_map) + field_specs(up, tile, w_map)
    vmem = 2 * (len(xs) * tp * d * xg.dtype.itemsize + planes_bytes(gate, tile) + planes_bytes(up, tile))
    vmem += d * tile * 4 + 2 * tp * tile * 4
    kernel = functools.partial(
        _gate_up_decode_kernel,
        gate=mat(gate),
        up=mat(up),
        same_x=same_x,
        limit=float(swiglu_limit),
        trace=trace,
    )
    return call(
        kernel,
        (uids, nv, *xs, *leaves(gate), *leaves(up)),
        grid=(u_max, nj),
        in_specs=in_specs,
        out_shape=jax.ShapeDtypeStruct((u_max, tp, f), F32),
        out_spec=pl.BlockSpec((pl.squeezed, tp, tile), out_map),
        scratch=[pltpu.VMEM((d, tile), F32)],
        semantics=("arbitrary", "arbitrary"),
        vmem_bytes=vmem,
        interpret=interpret,
        trace=trace,
    )


def down_decode(hs, uids, nv, down: Planes, *, lane_tile=None, interpret=False, trace=False):
    """y [Tp, D] f32 = sum_{u < nv} hs[u] @ down_u^T; hs [U, Tp, F] permuted for down's format.

    With trace: also int32 [D / tile, U, 8, 128] (decoded expert or -1 per grid step).
    """
    u_max, tp, f = hs.shape
    d = down.rows
    tile = pick_lane_tile(d, lane_tile)
    nj = d // tile
    _, _, w_map, h_map = _decode_maps(nj)
    vmem = 2 * (tp * f * hs.dtype.itemsize + planes_bytes(down, tile)) + f * tile * 4 + 2 * tp * tile * 4
    return call(
        functools.partial(_down_decode_kernel, down=mat(down), trace=trace),
        (uids, nv, hs, *leaves(down)),
        grid=(nj, u_max),
        in_specs=[pl.BlockSpec((pl.squeezed, tp, f), h_map)] + field_specs(down, tile, w_map),
        out_shape=jax.ShapeDtypeStruct((tp, d), F32),
        out_spec=pl.BlockSpec((tp, tile), lambda j, u, *_: (0, j)),
        scratch=[pltpu.VMEM((f, tile), F32)],
        semantics=("parallel", "arbitrary"),
        vmem_bytes=vmem,
        interpret=interpret,
        trace=trace,
    )


def _pad_rows(x: jnp.ndarray, rows: int) -> jnp.ndarray:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _decode_impl(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, lane_tile, interpret, trace):
    check_supported(gate, up, down)
    t, _ = x_td.shape
    e, f = gate.lead_shape[0], gate.rows
    uids, nv, combine = distinct_experts(ids_tk, w_tk, e)  # combine [U, T]
    tp = -(-t // 8) * 8
    xg, xu = permuted(_pad_rows(x_td, tp), gate, up)
    gu = gate_up_decode(
        xg,
        xu,
        uids,
        nv,
        gate,
        up,
        swiglu_limit=swiglu_limit,
        lane_tile=lane_tile,
        interpret=interpret,
        trace=trace,
    )
    h, gu_trace = gu if trace else (gu, None)  # h [U, Tp, F] f32, rows u >= nv unwritten
    valid = (jnp.arange(uids.shape[0]) < nv[0])[:, None, None]
    hs = jnp.where(valid, h * _pad_rows(combine.T, tp).T[:, :, None], 0.0).astype(x_td.dtype)
    hs = C.permute_inputs(hs, down.fmt, f)
    dn = down_decode(hs, uids, nv, down, lane_tile=lane_tile, interpret=interpret, trace=trace)
    y, dn_trace = dn if trace else (dn, None)
    y = y[:t].astype(x_td.dtype)
    return (y, {"uids": uids, "n_valid": nv, "gate_up": gu_trace, "down": dn_trace}) if trace else y


def moe_decode(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, lane_tile=None, interpret=False):
    """Routed experts for a few tokens (decode): cost follows the distinct experts of the step. [T, D].

    lane_tile: output lanes per grid step (default 256 or 128, whichever divides); interpret: False, True or a
    `pltpu.InterpretParams` (runs on CPU).
    """
    return _decode_impl(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, lane_tile, interpret, False)
