"""Pallas TPU kernels for routed experts whose weights are quantized planes (`glm53.quant.planes.Planes`).

Signatures (for kernels.moe.api):

    moe_decode(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, lane_tile=None, interpret=False) -> [T, D]
    moe_prefill(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, row_tile=128, lane_tile=None,
                interpret=False) -> [T, D]
    moe_experts(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, decode_max_tokens=64, ...) -> [T, D]
        (moe_decode for T <= decode_max_tokens, else moe_prefill; the argument order of kernels.moe.api)
    check_supported(gate, up, down) -> None, or NotImplementedError naming the matrix (dispatch falls back)

    x_td [T, D] (f32 / bf16); ids_tk int [T, K] in [0, E] (E = an empty slot, contributes zero); w_tk [T, K].
    gate, up: Planes of shape (F, D) with lead (E,): fields uint32 [E, words(D), F] (output rows F on lanes).
    down:     Planes of shape (D, F) with lead (E,): fields uint32 [E, words(F), D].
    Result: y[t] = sum_k w[t, k] down_e(silu(min(g, L)) * clip(u, -L, L)), g / u = gate_e / up_e (x[t]),
    e = ids[t, k], L = swiglu_limit; weights decoded to f32 then cast to x's dtype, f32 accumulation.

Formats: those of `kernels.moe.pallas_common`, freely mixed between the three matrices: IQ4_XS, Q4_K, the
gather-free IQ2_S_R / IQ3_S_R (glm53.quant.reencode), F32, F16, BF16 without any table lookup, and the GGUF
layouts of IQ2_S / IQ3_S with in-register codebook lookups (one `tpu.dynamic_gather` per 128-entry table
chunk and vreg of indices: 0.5 / 1 per 1024 weights; output rows a multiple of 128). Dequantized weights live
only in VMEM, never in HBM; `interpret=True` or a `pltpu.InterpretParams` runs the kernels on CPU.

Decode (few tokens): the distinct experts of the step are found in XLA (sorted, padded to min(T K, E) by
repeating the last one) and scalar-prefetched. Kernel 1, grid (distinct expert u, F lane block j): expert u's
gate and up tiles are DMA'd and decoded once and applied to all T tokens (resident in VMEM) on the MXU, then
the clamped SwiGLU -> h [U, T, F]. XLA scales h by the combine weight of (token, expert) (0 where the token
did not route there). Kernel 2, grid (D lane block j, u): decodes expert u's down tile once and accumulates
h_u @ W_u into y [T, D] (u is the reduction axis). Padding steps past the number of distinct experts map to
the block index of the last real step, so Pallas issues no DMA for them, and skip the body: the weight bytes
fetched per step are those of the distinct experts.

Prefill (many tokens): ragged grouped GEMM. (token, expert) slots are sorted by expert, each expert's group
padded to row tiles of `row_tile`; a tile-expert table is scalar-prefetched. Grid (lane block j, row tile i):
an expert's weight tile is decoded into a VMEM scratch at its first row tile and reused (no DMA, no decode) by
its following tiles; gate+up+SwiGLU in one kernel, down in a second; XLA applies the routing weights and sums
the slots of each token.

The activations are permuted per format (`pallas_common.permute_inputs`, a reshape + transpose) so that the
decoded rows are used in their natural decode order. `trace=True` (internal entry points) adds an int32 output
recording, per grid step, the expert whose weights the step decoded (-1: none): the counting tests read it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from glm53.quant.planes import Planes, check_planes
from kernels.moe import pallas_common as C
from kernels.moe.reference import clamped_swiglu

__all__ = ["moe_decode", "moe_prefill", "moe_experts", "check_supported", "distinct_experts", "prefill_tiles"]

_F32 = jnp.float32
_TRACE_TILE = (8, 128)  # one int32 vreg per grid step in the trace output


class _Mat(NamedTuple):
    """What a kernel body needs to know of a matrix (static; the planes themselves arrive as refs)."""

    fmt: object  # QuantFormat
    cols: int
    block_splits: int


def _mat(p: Planes) -> _Mat:
    return _Mat(p.fmt, p.cols, p.block_splits)


# ------------------------------------------------------------------------------------------------ checking


def check_supported(gate: Planes, up: Planes, down: Planes) -> None:
    """NotImplementedError for a format / layout the kernels cannot decode; ValueError for bad shapes."""
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(p, Planes):
            raise NotImplementedError(f"pallas moe: {name} must be Planes, got {type(p).__name__}")
        if len(p.lead_shape) != 1:
            raise ValueError(
                f"pallas moe: {name} planes need one leading expert axis, got lead {p.lead_shape}"
            )
        check_planes(p)
        C.check_supported(p.fmt, p.shape, p.block_splits, f"pallas moe {name} ({p.fmt.name}, {p.shape})")
    (e,), (f, d) = gate.lead_shape, gate.shape
    for name, p, want in (("up", up, (f, d)), ("down", down, (d, f))):
        if p.shape != want or p.lead_shape != (e,):
            raise ValueError(
                f"pallas moe: {name} planes are {p.lead_shape} x {p.shape}, expected ({e},) x {want} "
                f"to match gate {gate.lead_shape} x {gate.shape}"
            )


def _lane_tile(n: int, lane_tile: int | None) -> int:
    if lane_tile is not None:
        if n % lane_tile or (lane_tile % 128 and lane_tile != n):
            raise NotImplementedError(
                f"pallas moe: lane tile {lane_tile} must divide {n} and be a multiple of 128"
            )
        return lane_tile
    return next((t for t in (256, 128) if n % t == 0), n)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _params(semantics: tuple[str, ...], vmem_bytes: int) -> pltpu.CompilerParams:
    limit = min(max(32 << 20, int(1.5 * vmem_bytes)), 100 << 20)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


# --------------------------------------------------------------------------------------- in-kernel helpers


_LUT = "__codebook__"  # the refs-dict key of a codebook table input (C.lookup_table)


def _field_specs(p: Planes, tile: int, index_map) -> list[pl.BlockSpec]:
    """One BlockSpec per field: all of expert e's words, lane block j; index_map(*grid, *scalars) -> (e, j).

    Formats with a codebook get one more input, the whole [4, 128] table (fetched once).
    """

    def block(*args):
        e, j = index_map(*args)
        return e, 0, j

    specs = [pl.BlockSpec((pl.squeezed, p.fields[f.name].shape[-2], tile), block) for f in p.fmt.fields]
    if C.lookup_table(p.fmt) is not None:
        specs.append(pl.BlockSpec(C.lookup_table(p.fmt).shape, lambda *_: (0, 0)))
    return specs


def _leaves(p: Planes) -> list:
    """The kernel inputs of a matrix, in `_field_specs` order."""
    table = C.lookup_table(p.fmt)
    return [p.fields[f.name] for f in p.fmt.fields] + ([jnp.asarray(table)] if table is not None else [])


def _take_fields(p: _Mat, it) -> dict:
    refs = {f.name: next(it) for f in p.fmt.fields}
    if C.lookup_table(p.fmt) is not None:
        refs[_LUT] = next(it)
    return refs


def _vreg_lookup(lut_ref):
    """lookup(idx uint32 [rows, N]) -> lut word per element: per 128 lanes, one in-register lane gather
    (tpu.dynamic_gather) per 128-entry chunk of the table, merged by selects on the chunk number."""

    def lookup(idx):
        outs = []
        for s in range(0, idx.shape[-1], 128):
            ix = idx[:, s : s + 128]
            lane = (ix & jnp.uint32(127)).astype(jnp.int32)
            chunk = ix >> 7
            res = None
            for ch in range(lut_ref.shape[0]):
                table = jnp.broadcast_to(
                    lut_ref[pl.ds(ch, 1), :], ix.shape
                )  # [rows, 128], chunk ch in every row
                got = jnp.take_along_axis(table, lane, axis=1)
                res = got if res is None else jnp.where(chunk == jnp.uint32(ch), got, res)
            outs.append(res)
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

    return lookup


def _decode_into(wbuf_ref, p: _Mat, refs: dict) -> None:
    """Decodes a matrix tile (field refs [words, lanes]) into wbuf_ref [cols, lanes] f32, input_order rows."""

    def read(field, start, size, stride):
        rows = pl.ds(start, size) if stride == 1 else pl.ds(start, size, stride=stride)
        return refs[field][rows, :]

    lookup = _vreg_lookup(refs[_LUT]) if _LUT in refs else None
    for off, piece in C.decode_pieces(p.fmt, p.cols, p.block_splits, read, lookup):
        wbuf_ref[pl.ds(off, piece.shape[0]), :] = piece


def _dot(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """x [M, K] @ w [K, N] with w cast to x's dtype, f32 accumulation."""
    prec = jax.lax.Precision.HIGHEST if x.dtype == _F32 else jax.lax.Precision.DEFAULT
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=_F32, precision=prec)


def _write_trace(tr_ref, expert) -> None:
    tr_ref[...] = jnp.full(tr_ref.shape, expert, jnp.int32)


def _planes_bytes(p: Planes, tile: int) -> int:
    return sum(a.shape[-2] * tile * 4 for a in p.fields.values())


# ------------------------------------------------------------------------------------------------- decode


def distinct_experts(ids_tk: jnp.ndarray, w_tk: jnp.ndarray, n_experts: int):
    """The step's distinct experts: (uids [U] int32, n_valid [1] int32, combine [U, T] f32), U = min(T K, E).

    uids: the distinct ids in ascending order, padded past n_valid with the last one (0 if none);
    combine[u, t] = sum_k w[t, k] [ids[t, k] == uids[u]] for u < n_valid, else 0. Ids outside [0, E) are
    empty slots.
    """
    t, k = ids_tk.shape
    u_max = min(t * k, n_experts)
    ids = ids_tk.astype(jnp.int32)
    key = jnp.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    uniq = jnp.unique(key.reshape(-1), size=u_max, fill_value=n_experts)  # ascending; E (empty) sorts last
    nv = jnp.sum(uniq < n_experts).astype(jnp.int32)
    last = uniq[jnp.maximum(nv - 1, 0)]
    slot = jnp.arange(u_max)
    uids = jnp.clip(jnp.where(slot < nv, uniq, last), 0, n_experts - 1).astype(jnp.int32)
    hit = (key[None, :, :] == uids[:, None, None]) & (slot < nv)[:, None, None]  # [U, T, K]
    combine = jnp.sum(jnp.where(hit, w_tk.astype(_F32)[None], 0.0), axis=-1)
    return uids, nv.reshape(1), combine


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
    g_refs, u_refs = _take_fields(gate, it), _take_fields(up, it)
    h_ref = next(it)
    tr_ref = next(it) if trace else None
    wbuf = next(it)
    u = pl.program_id(0)
    valid = u < nv_ref[0]

    @pl.when(valid)
    def _():
        _decode_into(wbuf, gate, g_refs)
        g = _dot(xg_ref[...], wbuf[...])  # [Tp, tile] f32
        _decode_into(wbuf, up, u_refs)
        h_ref[...] = clamped_swiglu(g, _dot(xu_ref[...], wbuf[...]), limit).astype(h_ref.dtype)

    if trace:
        _write_trace(tr_ref, jnp.where(valid, uids_ref[u], -1))


def _down_decode_kernel(uids_ref, nv_ref, h_ref, *refs, down, trace):
    it = iter(refs)
    d_refs = _take_fields(down, it)
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
        _decode_into(wbuf, down, d_refs)
        y_ref[...] += _dot(h_ref[...], wbuf[...])

    if trace:
        _write_trace(tr_ref, jnp.where(valid, uids_ref[u], -1))


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
    tile = _lane_tile(f, lane_tile)
    nj = f // tile
    w_map, out_map, _, _ = _decode_maps(nj)
    same_x = xu is xg
    xs = [xg] if same_x else [xg, xu]
    in_specs = [pl.BlockSpec((tp, d), lambda u, j, *_: (0, 0)) for _ in xs]
    in_specs += _field_specs(gate, tile, w_map) + _field_specs(up, tile, w_map)
    out_shape = [jax.ShapeDtypeStruct((u_max, tp, f), _F32)]
    out_specs = [pl.BlockSpec((pl.squeezed, tp, tile), out_map)]
    if trace:
        out_shape.append(jax.ShapeDtypeStruct((u_max, nj, *_TRACE_TILE), jnp.int32))
        out_specs.append(
            pl.BlockSpec((pl.squeezed, pl.squeezed, *_TRACE_TILE), lambda u, j, *_: (u, j, 0, 0))
        )
    vmem = 2 * (len(xs) * tp * d * xg.dtype.itemsize + _planes_bytes(gate, tile) + _planes_bytes(up, tile))
    vmem += d * tile * 4 + 2 * tp * tile * 4
    kernel = functools.partial(
        _gate_up_decode_kernel,
        gate=_mat(gate),
        up=_mat(up),
        same_x=same_x,
        limit=float(swiglu_limit),
        trace=trace,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(u_max, nj),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((d, tile), _F32)],
        ),
        compiler_params=_params(("arbitrary", "arbitrary"), vmem),
        interpret=interpret,
    )(uids, nv, *xs, *_leaves(gate), *_leaves(up))
    return tuple(out) if trace else out[0]


def down_decode(hs, uids, nv, down: Planes, *, lane_tile=None, interpret=False, trace=False):
    """y [Tp, D] f32 = sum_{u < nv} hs[u] @ down_u^T; hs [U, Tp, F] permuted for down's format.

    With trace: also int32 [D / tile, U, 8, 128] (decoded expert or -1 per grid step).
    """
    u_max, tp, f = hs.shape
    d = down.rows
    tile = _lane_tile(d, lane_tile)
    nj = d // tile
    _, _, w_map, h_map = _decode_maps(nj)
    in_specs = [pl.BlockSpec((pl.squeezed, tp, f), h_map)] + _field_specs(down, tile, w_map)
    out_shape = [jax.ShapeDtypeStruct((tp, d), _F32)]
    out_specs = [pl.BlockSpec((tp, tile), lambda j, u, *_: (0, j))]
    if trace:
        out_shape.append(jax.ShapeDtypeStruct((nj, u_max, *_TRACE_TILE), jnp.int32))
        out_specs.append(
            pl.BlockSpec((pl.squeezed, pl.squeezed, *_TRACE_TILE), lambda j, u, *_: (j, u, 0, 0))
        )
    vmem = 2 * (tp * f * hs.dtype.itemsize + _planes_bytes(down, tile)) + f * tile * 4 + 2 * tp * tile * 4
    out = pl.pallas_call(
        functools.partial(_down_decode_kernel, down=_mat(down), trace=trace),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(nj, u_max),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((f, tile), _F32)],
        ),
        compiler_params=_params(("parallel", "arbitrary"), vmem),
        interpret=interpret,
    )(uids, nv, hs, *_leaves(down))
    return tuple(out) if trace else out[0]


def _pad_rows(x: jnp.ndarray, rows: int) -> jnp.ndarray:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _permuted(x: jnp.ndarray, gate: Planes, up: Planes) -> tuple[jnp.ndarray, jnp.ndarray]:
    """x permuted for gate's and for up's format (the same array when the orders agree)."""
    xg = C.permute_inputs(x, gate.fmt, gate.cols)
    if C.input_order(gate.fmt, gate.cols).tolist() == C.input_order(up.fmt, up.cols).tolist():
        return xg, xg
    return xg, C.permute_inputs(x, up.fmt, up.cols)


def _decode_impl(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, lane_tile, interpret, trace):
    check_supported(gate, up, down)
    t, _ = x_td.shape
    e, f = gate.lead_shape[0], gate.rows
    uids, nv, combine = distinct_experts(ids_tk, w_tk, e)  # combine [U, T]
    tp = _round_up(t, 8)
    xg, xu = _permuted(_pad_rows(x_td, tp), gate, up)
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


# ------------------------------------------------------------------------------------------------ prefill


def prefill_tiles(ids_tk: jnp.ndarray, n_experts: int, row_tile: int):
    """Slots sorted by expert and padded to row tiles (XLA, jit-able).

    Returns a dict: tile_expert [NT] int32 (expert of each row tile; tiles past n_tiles repeat the last real
    one), n_tiles [1] int32 (real tiles), row_token [NT * row_tile] int32 (token of each padded row, -1 for
    padding),
    dest [T K] int32 (padded row of each slot, flat slot order t * K + k; -1 for empty slots).
    NT = G + (T K - G) // row_tile with G = min(E, T K): the most row tiles any routing can need.
    """
    t, k = ids_tk.shape
    s, tm = t * k, row_tile
    ids = ids_tk.reshape(s).astype(jnp.int32)
    key = jnp.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    order = jnp.argsort(key, stable=True)  # [S] slots sorted by expert, empty slots last
    sizes = jnp.bincount(key, length=n_experts + 1)[:n_experts].astype(jnp.int32)  # [E]
    g_off = jnp.cumsum(sizes) - sizes  # first sorted position of each expert
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
    g_refs, u_refs = _take_fields(gate, it), _take_fields(up, it)
    h_ref = next(it)
    tr_ref = next(it) if trace else None
    wg, wu = next(it), next(it)
    cg, cu = (next(it), next(it)) if cast else (None, None)
    valid, fresh = _fresh(te_ref, nvt_ref)

    @pl.when(fresh)
    def _():
        _decode_into(wg, gate, g_refs)
        _decode_into(wu, up, u_refs)
        _cast_buf(wg, cg)
        _cast_buf(wu, cu)

    @pl.when(valid)
    def _():
        g = _dot(xg_ref[...], (cg if cast else wg)[...])  # [tm, tile] f32
        u = _dot(xu_ref[...], (cu if cast else wu)[...])
        h_ref[...] = clamped_swiglu(g, u, limit).astype(h_ref.dtype)

    if trace:
        _write_trace(tr_ref, jnp.where(fresh, te_ref[pl.program_id(1)], -1))


def _down_prefill_kernel(te_ref, nvt_ref, h_ref, *refs, down, trace, cast):
    it = iter(refs)
    d_refs = _take_fields(down, it)
    o_ref = next(it)
    tr_ref = next(it) if trace else None
    wd = next(it)
    cd = next(it) if cast else None
    valid, fresh = _fresh(te_ref, nvt_ref)

    @pl.when(fresh)
    def _():
        _decode_into(wd, down, d_refs)
        _cast_buf(wd, cd)

    @pl.when(valid)
    def _():
        o_ref[...] = _dot(h_ref[...], (cd if cast else wd)[...])

    if trace:
        _write_trace(tr_ref, jnp.where(fresh, te_ref[pl.program_id(1)], -1))


def _grouped_call(
    kernel, rows: list, mats: list[Planes], te, nvt, *, n_out, out_dtype, tm, lane_tile, interpret, trace
):
    """pallas_call over grid (lane block j of n_out, row tile i): rows [M, K] inputs, weights `mats`."""
    m, kin = rows[0].shape
    tile = _lane_tile(n_out, lane_tile)
    nj, nt = n_out // tile, m // tm
    w_map, in_map, out_map = _prefill_maps()
    in_specs = [pl.BlockSpec((tm, kin), in_map) for _ in rows]
    for p in mats:
        in_specs += _field_specs(p, tile, w_map)
    out_shape = [jax.ShapeDtypeStruct((m, n_out), out_dtype)]
    out_specs = [pl.BlockSpec((tm, tile), out_map)]
    if trace:
        out_shape.append(jax.ShapeDtypeStruct((nj, nt, *_TRACE_TILE), jnp.int32))
        out_specs.append(
            pl.BlockSpec((pl.squeezed, pl.squeezed, *_TRACE_TILE), lambda j, i, *_: (j, i, 0, 0))
        )
    cast = rows[0].dtype != _F32
    scratch = [pltpu.VMEM((kin, tile), _F32) for _ in mats]
    scratch += [pltpu.VMEM((kin, tile), rows[0].dtype) for _ in mats] if cast else []
    vmem = 2 * (len(rows) * tm * kin * rows[0].dtype.itemsize + sum(_planes_bytes(p, tile) for p in mats))
    vmem += len(mats) * kin * tile * (4 + (rows[0].dtype.itemsize if cast else 0)) + 2 * tm * tile * 4
    leaves = [a for p in mats for a in _leaves(p)]
    out = pl.pallas_call(
        functools.partial(kernel, trace=trace, cast=cast),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(nj, nt),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=_params(("parallel", "arbitrary"), vmem),
        interpret=interpret,
    )(te, nvt, *rows, *leaves)
    return tuple(out) if trace else out[0]


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
    xg, xu = _permuted(x_td, gate, up)
    rows = [_gather_rows(xg, meta["row_token"])]
    if xu is not xg:
        rows.append(_gather_rows(xu, meta["row_token"]))
    common = dict(tm=row_tile, lane_tile=lane_tile, interpret=interpret, trace=trace)
    gu_kernel = functools.partial(
        _gate_up_prefill_kernel,
        gate=_mat(gate),
        up=_mat(up),
        same_x=len(rows) == 1,
        limit=float(swiglu_limit),
    )
    gu = _grouped_call(gu_kernel, rows, [gate, up], te, nvt, n_out=f, out_dtype=x_td.dtype, **common)
    h, gu_trace = gu if trace else (gu, None)  # h [M, F]
    hp = C.permute_inputs(h, down.fmt, f)
    dn_kernel = functools.partial(_down_prefill_kernel, down=_mat(down))
    dn = _grouped_call(dn_kernel, [hp], [down], te, nvt, n_out=d, out_dtype=_F32, **common)
    o, dn_trace = dn if trace else (dn, None)  # o [M, D] f32, rows of padding tiles unwritten
    dest = meta["dest"]  # [T K]
    ok = dest >= 0
    contrib = jnp.where(ok[:, None], o[jnp.maximum(dest, 0)] * w_tk.reshape(-1, 1).astype(_F32), 0.0)
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


def moe_experts(
    x_td,
    ids_tk,
    w_tk,
    gate,
    up,
    down,
    swiglu_limit,
    *,
    decode_max_tokens=64,
    row_tile=128,
    lane_tile=None,
    interpret=False,
):
    """`moe_decode` for at most `decode_max_tokens` tokens, else `moe_prefill`. [T, D] in x's dtype."""
    if x_td.shape[0] <= decode_max_tokens:
        return moe_decode(
            x_td,
            ids_tk,
            w_tk,
            gate,
            up,
            down,
            swiglu_limit=swiglu_limit,
            lane_tile=lane_tile,
            interpret=interpret,
        )
    return moe_prefill(
        x_td,
        ids_tk,
        w_tk,
        gate,
        up,
        down,
        swiglu_limit=swiglu_limit,
        row_tile=row_tile,
        lane_tile=lane_tile,
        interpret=interpret,
    )
