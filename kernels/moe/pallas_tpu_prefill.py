"""Pallas TPU routed experts for many tokens (prefill): a ragged grouped GEMM, each expert tile decoded once.

(token, expert) slots are sorted by expert, each expert's group padded to row tiles of `row_tile`; a
tile-expert table is scalar-prefetched. Grid (lane block j, row tile i): an expert's weight tile is decoded
into a VMEM scratch at its first row tile and reused (no DMA, no decode) by its following tiles; gate+up+SwiGLU
in one kernel, down in a second; XLA applies the routing weights and sums the slots of each token. The down
kernel and that sum run a window of output columns at a time when the per-slot f32 output would exceed
`OUT_CHUNK_BYTES` (`_down_by_columns`: the same arithmetic, bit for bit, with one window live). Shapes, formats and
tracing: `kernels.moe.pallas_tpu`.
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


prefill_tiles = routing.prefill_tiles  # moved to routing (shared with pallas_gpu_prefill)


def _prefill_maps(shifted: bool = False):
    """Index maps of grid (lane block j, row tile i). shifted: the call computes a window of the output lanes
    whose first lane block is nvt_ref[1] (`_down_by_columns`); the weights' lane block is then j + nvt_ref[1]."""

    def tile(i, nvt_ref):
        return jnp.minimum(i, jnp.maximum(nvt_ref[0] - 1, 0))

    def weight(j, i, te_ref, nvt_ref):  # grid (j, i)
        return te_ref[tile(i, nvt_ref)], (j + nvt_ref[1] if shifted else j)

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
    kernel,
    rows: list,
    mats: list[Planes],
    te,
    nvt,
    *,
    n_out,
    out_dtype,
    tm,
    lane_tile,
    interpret,
    trace,
    n_cols=None,
):
    """pallas_call over grid (lane block j of n_out, row tile i): rows [M, K] inputs, weights `mats`.

    n_cols (a multiple of the lane tile): compute only output lanes [nvt[1] * tile, + n_cols), nvt = [n_tiles,
    first lane block] (a traced window, so one kernel serves every window: `_down_by_columns`)."""
    m, kin = rows[0].shape
    tile = pick_lane_tile(n_out, lane_tile)
    shifted = n_cols is not None
    nj, nt = (n_cols if shifted else n_out) // tile, m // tm
    w_map, in_map, out_map = _prefill_maps(shifted)
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
        out_shape=jax.ShapeDtypeStruct((m, nj * tile), out_dtype),
        out_spec=pl.BlockSpec((tm, tile), out_map),
        scratch=scratch,
        semantics=("parallel", "arbitrary"),
        vmem_bytes=vmem,
        interpret=interpret,
        trace=trace,
    )


def _gather_rows(x: jnp.ndarray, row_token: jnp.ndarray) -> jnp.ndarray:
    """x [T, D] -> [M, D]: row r = x[row_token[r]], zero where row_token < 0.

    One gather from x with a zero row appended (padding rows read it): a gather followed by a select held two
    [M, D] buffers at once on TPU (XLA did not fuse them; 2 x 413 MiB at 2048 tokens on the release)."""
    t = x.shape[0]
    x_pad = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return x_pad[jnp.where(row_token >= 0, row_token, t)]


def _prefill_impl(
    x_td,
    ids_tk,
    w_tk,
    gate,
    up,
    down,
    swiglu_limit,
    row_tile,
    lane_tile,
    interpret,
    trace,
    out_chunk_bytes=None,
):
    check_supported(gate, up, down)
    out_chunk_bytes = OUT_CHUNK_BYTES if out_chunk_bytes is None else out_chunk_bytes
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
    dest = meta["dest"]  # [T K]
    ok = dest >= 0

    def combine(o):
        """o [M, n] f32 (padding tiles' rows unwritten) -> y [T, n]: the routing-weighted sum of the slots."""
        contrib = jnp.where(ok[:, None], o[jnp.maximum(dest, 0)] * w_tk.reshape(-1, 1).astype(F32), 0.0)
        return contrib.reshape(t, k, o.shape[1]).sum(axis=1).astype(x_td.dtype)

    y, dn_trace = _down_by_columns(
        dn_kernel, hp, down, te, nvt, combine, d=d, out_chunk_bytes=out_chunk_bytes, **common
    )
    return (y, {**meta, "gate_up": gu_trace, "down": dn_trace}) if trace else y


# The down projection's output o [M, D] is f32 per padded slot row: M = (G + (T K - G) // row_tile) row tiles of
# row_tile rows (G = min(E, T K): every expert's group is padded to whole tiles), so at 2048 tokens x 8 slots on
# the release (E = 288, D = 4096) it is 52,864 x 4096 f32 = 826 MiB, plus the [T K, D] f32 weighted slots the
# combine gathers from it (256 MiB): together most of the 2048-token prefill's temporaries (they made the whole
# program miss the v5e's HBM, 2026-12-04). Computed and combined a window of output columns at a time, in a loop
# whose body holds one window, o never exists whole: each output element is computed exactly as before (the
# kernel's grid simply stops at the window's lane blocks; every lane block is still decoded and multiplied once,
# and the combine is per column), so the result is bit for bit the same.
# f32 bytes of one window of o (the release at 2048 tokens: 8 windows of 512 columns)
OUT_CHUNK_BYTES = 128 << 20


def _down_by_columns(
    kernel, hp, down, te, nvt, combine, *, d, out_chunk_bytes, tm, lane_tile, interpret, trace
):
    """combine(o) of o = the down kernel's [M, d] f32 output, computed in windows of columns no bigger than
    `out_chunk_bytes` (a `lax.scan` over windows: one kernel, one window of o live). (y [T, d], trace or None)."""
    m = hp.shape[0]
    tile = pick_lane_tile(d, lane_tile)
    nj = d // tile
    per_block = m * tile * 4  # f32 bytes of one lane block of o
    blocks = max(1, min(nj, out_chunk_bytes // per_block))
    while nj % blocks:  # windows of equal width
        blocks -= 1
    common = dict(tm=tm, lane_tile=lane_tile, interpret=interpret, trace=trace)
    if blocks == nj:
        out = _grouped_call(kernel, [hp], [down], te, nvt, n_out=d, out_dtype=F32, **common)
        o, tr = out if trace else (out, None)
        return combine(o), tr

    def window(_, c):
        first = jnp.reshape(c * blocks, (1,)).astype(nvt.dtype)
        out = _grouped_call(
            kernel, [hp], [down], te, jnp.concatenate([nvt, first]), n_out=d, out_dtype=F32,
            n_cols=blocks * tile, **common,
        )  # fmt: skip
        o, tr = out if trace else (out, None)
        return None, (combine(o), tr)

    _, (ys, trs) = jax.lax.scan(window, None, jnp.arange(nj // blocks, dtype=jnp.int32))
    y = jnp.moveaxis(ys, 0, 1).reshape(ys.shape[1], d)  # [windows, T, w] -> [T, d]
    if trs is not None:  # [windows, blocks, NT, ...] -> [nj, NT, ...]: the one-call trace
        trs = trs.reshape(nj, *trs.shape[2:])
    return y, trs


def moe_prefill(
    x_td,
    ids_tk,
    w_tk,
    gate,
    up,
    down,
    swiglu_limit,
    *,
    row_tile=128,
    lane_tile=None,
    interpret=False,
    out_chunk_bytes=None,
):
    """Routed experts for many tokens (prefill): ragged grouped GEMM, each expert tile decoded once. [T, D].

    row_tile: slot rows per grid step (a multiple of 8 for f32, 16 for bf16 activations); lane_tile and
    interpret: as in `moe_decode`; out_chunk_bytes: the most f32 bytes of the down projection's per-slot output
    held at once (default `OUT_CHUNK_BYTES`, `_down_by_columns`).
    """
    return _prefill_impl(
        x_td,
        ids_tk,
        w_tk,
        gate,
        up,
        down,
        swiglu_limit,
        row_tile,
        lane_tile,
        interpret,
        False,
        out_chunk_bytes,
    )
