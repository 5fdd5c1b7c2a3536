"""Pallas TPU routed experts for many tokens (prefill): a ragged grouped GEMM, each expert tile decoded once.

(token, expert) slots are sorted by expert, each expert's group padded to row tiles of `row_tile`; a
tile-expert table is scalar-prefetched. Grid (lane block j, row tile i): an expert's weight tile is decoded
into a VMEM scratch at its first row tile and reused (no DMA, no decode) by its following tiles; gate+up+SwiGLU
in one kernel, down in a second; XLA applies the routing weights and sums the slots of each token. Shapes,
formats and tracing: `kernels.moe.pallas_tpu`.
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

__all__ = ["moe_prefill", "prefill_tiles"]


def prefill_tiles(ids_tk: jnp.ndarray, n_experts: int, row_tile: int):
    """Slots sorted by expert and padded to row tiles (XLA, jit-able).

    Returns a dict: tile_expert [NT] int32 (expert of each row tile; tiles past n_tiles repeat the last real
    one), n_tiles [1] int32 (real tiles), row_token [NT * row_tile] int32 (token of each padded row, -1 for
    padding), dest [T K] int32 (padded row of each slot, flat slot order t * K + k; -1 for empty slots).
    NT = G + (T K - G) // row_tile with G = min(E, T K): the most row tiles any routing can need.
    """
    t, k = ids_tk.shape
    s, tm = t * k, row_tile
    key, order, sizes, g_off = routing.sort_by_expert(ids_tk, n_experts)  # [S], [S], [E], [E]
    tiles = (sizes + tm - 1) // tm  # [E]
    t_end = jnp.cumsum(tiles)
    t_off = t_end - tiles
    nvt = t_end[-1].astype(jnp.int32)
    g = min(n_experts, s)
    nt = g + (s - g) // tm
    i = jnp.arange(nt)
    te = jnp.searchsorted(t_end, jnp.minimum(i, jnp.maximum(nvt - 1, 0)), side="right")
    te = jnp.clip(te, 0, n_experts - 1).astype(jnp.int32)
    rows = jnp.arange(nt * tm)
    e_row = te[rows // tm]
    rank = rows - t_off[e_row] * tm  # position within the expert's group
    ok = (rows // tm < nvt) & (rank < sizes[e_row])
    src = jnp.clip(g_off[e_row] + rank, 0, s - 1)
    row_token = jnp.where(ok, order[src] // k, -1).astype(jnp.int32)
    q = jnp.arange(s)  # sorted position
    e_sorted = jnp.minimum(key[order], n_experts - 1)
    dest_sorted = jnp.where(key[order] < n_experts, t_off[e_sorted] * tm + q - g_off[e_sorted], -1)
    dest = jnp.zeros((s,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))
    return {"tile_expert": te, "n_tiles": nvt.reshape(1), "row_token": row_token, "dest": dest}


def _prefill_maps():
    def tile(i, nvt_ref):
        return jnp.minimum(i, jnp.maximum(nvt_ref[0] - 1, 0))

    def weight(j, i, te_ref, nvt_ref):  # grid (j, i)
        return te_ref[tile(i, nvt_ref)], j

    def rows_in(j, i, te_ref, nvt_ref):
        return tile(i, nvt_ref), 0

    def rows_out(j, i, te_ref, nvt_ref):
        return tile(i, nvt_ref), j

    return weight, rows_in, rows_out


def _fresh(te_ref, nvt_ref):
    """(valid, fresh): the row tile is real / its expert differs from the last tile's (or j just began)."""
    i = pl.program_id(1)
    valid = i < nvt_ref[0]
    return valid, valid & ((i == 0) | (te_ref[i] != te_ref[jnp.maximum(i - 1, 0)]))


def _cast_buf(wbuf, cbuf):
    if cbuf is not None:
        cbuf[...] = wbuf[...].astype(cbuf.dtype)


def _gate_up_prefill_kernel(te_ref, nvt_ref, *refs, gate, up, same_x, limit, trace, cast):
    it = iter(refs)
    xg_ref = next(it)
    xu_ref = xg_ref if same_x else next(it)
    g_refs, u_refs = take_fields(gate, it), take_fields(up, it)
    h_ref = next(it)
    tr_ref = next(it) if trace else None
    wg, wu = next(it), next(it)
    cg, cu = (next(it), next(it)) if cast else (None, None)
    valid, fresh = _fresh(te_ref, nvt_ref)

    @pl.when(fresh)
    def _():
        decode_into(wg, gate, g_refs)
        decode_into(wu, up, u_refs)
        _cast_buf(wg, cg)
        _cast_buf(wu, cu)

    @pl.when(valid)
    def _():
        g = dot(xg_ref[...], (cg if cast else wg)[...])  # [tm, tile] f32
        u = dot(xu_ref[...], (cu if cast else wu)[...])
        h_ref[...] = clamped_swiglu(g, u, limit).astype(h_ref.dtype)

    if trace:
        write_trace(tr_ref, jnp.where(fresh, te_ref[pl.program_id(1)], -1))


def _down_prefill_kernel(te_ref, nvt_ref, h_ref, *refs, down, trace, cast):
    it = iter(refs)
    d_refs = take_fields(down, it)
    o_ref = next(it)
    tr_ref = next(it) if trace else None
    wd = next(it)
    cd = next(it) if cast else None
    valid, fresh = _fresh(te_ref, nvt_ref)

    @pl.when(fresh)
    def _():
        decode_into(wd, down, d_refs)
        _cast_buf(wd, cd)

    @pl.when(valid)
    def _():
        o_ref[...] = dot(h_ref[...], (cd if cast else wd)[...])

    if trace:
        write_trace(tr_ref, jnp.where(fresh, te_ref[pl.program_id(1)], -1))


def _grouped_call(
    kernel, rows: list, mats: list[Planes], te, nvt, *, n_out, out_dtype, tm, lane_tile, interpret, trace
):
    """pallas_call over grid (lane block j of n_out, row tile i): rows [M, K] inputs, weights `mats`."""
    m, kin = rows[0].shape
    tile = pick_lane_tile(n_out, lane_tile)
    nj, nt = n_out // tile, m // tm
    w_map, in_map, out_map = _prefill_maps()
    in_specs = [pl.BlockSpec((tm, kin), in_map) for _ in rows]
    for p in mats:
        in_specs += field_specs(p, tile, w_map)
    cast = rows[0].dtype != F32
    scratch = [pltpu.VMEM((kin, tile), F32) for _ in mats]
    scratch += [pltpu.VMEM((kin, tile), rows[0].dtype) for _ in mats] if cast else []
    vmem = 2 * (len(rows) * tm * kin * rows[0].dtype.itemsize + sum(planes_bytes(p, tile) for p in mats))
    vmem += len(mats) * kin * tile * (4 + (rows[0].dtype.itemsize if cast else 0)) + 2 * tm * tile * 4
    return call(
        functools.partial(kernel, trace=trace, cast=cast),
        (te, nvt, *rows, *[a for p in mats for a in leaves(p)]),
        grid=(nj, nt),
        in_specs=in_specs,
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        out_spec=pl.BlockSpec((tm, tile), out_map),
        scratch=scratch,
        semantics=("parallel", "arbitrary"),
        vmem_bytes=vmem,
        interpret=interpret,
        trace=trace,
    )


def _gather_rows(x: jnp.ndarray, row_token: jnp.ndarray) -> jnp.ndarray:
    """x [T, D] -> [M, D]: row r = x[row_token[r]], zero where row_token < 0."""
    return jnp.where((row_token >= 0)[:, None], x[jnp.maximum(row_token, 0)], jnp.zeros((), x.dtype))


def _prefill_impl(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, row_tile, lane_tile, interpret, trace):
    check_supported(gate, up, down)
    sub = 32 // jnp.dtype(x_td.dtype).itemsize  # sublane tile of the activation dtype: 8 (f32), 16 (bf16)
    if row_tile % sub:
        raise NotImplementedError(
            f"pallas moe: row tile {row_tile} must be a multiple of {sub} for {x_td.dtype}"
        )
    t, k = ids_tk.shape
    e, f, d = gate.lead_shape[0], gate.rows, gate.cols
    meta = prefill_tiles(ids_tk, e, row_tile)
    te, nvt = meta["tile_expert"], meta["n_tiles"]
    xg, xu = permuted(x_td, gate, up)
    rows = [_gather_rows(xg, meta["row_token"])]
    if xu is not xg:
        rows.append(_gather_rows(xu, meta["row_token"]))
    common = dict(tm=row_tile, lane_tile=lane_tile, interpret=interpret, trace=trace)
    gu_kernel = functools.partial(
        _gate_up_prefill_kernel,
        gate=mat(gate),
        up=mat(up),
        same_x=len(rows) == 1,
        limit=float(swiglu_limit),
    )
    gu = _grouped_call(gu_kernel, rows, [gate, up], te, nvt, n_out=f, out_dtype=x_td.dtype, **common)
    h, gu_trace = gu if trace else (gu, None)  # h [M, F]
    hp = C.permute_inputs(h, down.fmt, f)
    dn_kernel = functools.partial(_down_prefill_kernel, down=mat(down))
    dn = _grouped_call(dn_kernel, [hp], [down], te, nvt, n_out=d, out_dtype=F32, **common)
    o, dn_trace = dn if trace else (dn, None)  # o [M, D] f32, rows of padding tiles unwritten
    dest = meta["dest"]  # [T K]
    ok = dest >= 0
    contrib = jnp.where(ok[:, None], o[jnp.maximum(dest, 0)] * w_tk.reshape(-1, 1).astype(F32), 0.0)
    y = contrib.reshape(t, k, d).sum(axis=1).astype(x_td.dtype)
    return (y, {**meta, "gate_up": gu_trace, "down": dn_trace}) if trace else y


def moe_prefill(
    x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, row_tile=128, lane_tile=None, interpret=False
):
    """Routed experts for many tokens (prefill): ragged grouped GEMM, each expert tile decoded once. [T, D].

    row_tile: slot rows per grid step (a multiple of 8 for f32, 16 for bf16 activations); lane_tile and
    interpret: as in `moe_decode`.
    """
    return _prefill_impl(
        x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, row_tile, lane_tile, interpret, False
    )
