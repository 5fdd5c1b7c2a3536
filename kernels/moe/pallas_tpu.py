"""Pallas TPU kernels for routed experts whose weights are quantized planes: what decode and prefill share.

Entries (for kernels.moe.api, which picks one by routed slots):

    pallas_tpu_decode.moe_decode(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, lane_tile=None,
                                 interpret=False) -> [T, D]
    pallas_tpu_prefill.moe_prefill(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, row_tile=128,
                                   lane_tile=None, interpret=False) -> [T, D]
    check_supported(gate, up, down) -> None, or NotImplementedError naming the matrix

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

The activations are permuted per format (`pallas_common.permute_inputs`, a reshape + transpose) so that the
decoded rows are used in their natural decode order. `trace=True` (internal entry points) adds an int32 output
recording, per grid step, the expert whose weights the step decoded (-1: none): the counting tests read it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from glm53.quant.planes import Planes, check_planes
from kernels.moe import pallas_common as C

F32 = jnp.float32
_TRACE_TILE = (8, 128)  # one int32 vreg per grid step in the trace output
_LUT = "__codebook__"  # the refs-dict key of a codebook table input (C.lookup_table)


class Mat(NamedTuple):
    """What a kernel body needs to know of a matrix (static; the planes themselves arrive as refs)."""

    fmt: object  # QuantFormat
    cols: int
    block_splits: int


def mat(p: Planes) -> Mat:
    return Mat(p.fmt, p.cols, p.block_splits)


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


def pick_lane_tile(n: int, tile: int | None) -> int:
    """Output lanes per grid step: `tile` if given (a multiple of 128 dividing n), else 256 or 128."""
    if tile is not None:
        if n % tile or (tile % 128 and tile != n):
            raise NotImplementedError(
                f"pallas moe: lane tile {tile} must divide {n} and be a multiple of 128"
            )
        return tile
    return next((t for t in (256, 128) if n % t == 0), n)


# ------------------------------------------------------------------------------------- inputs and outputs


def field_specs(p: Planes, tile: int, index_map) -> list[pl.BlockSpec]:
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


def leaves(p: Planes) -> list:
    """The kernel inputs of a matrix, in `field_specs` order."""
    table = C.lookup_table(p.fmt)
    return [p.fields[f.name] for f in p.fmt.fields] + ([jnp.asarray(table)] if table is not None else [])


def planes_bytes(p: Planes, tile: int) -> int:
    """VMEM bytes of one lane block of a matrix's planes."""
    return sum(a.shape[-2] * tile * 4 for a in p.fields.values())


def permuted(x: jnp.ndarray, gate: Planes, up: Planes) -> tuple[jnp.ndarray, jnp.ndarray]:
    """x permuted for gate's and for up's format (the same array when the orders agree)."""
    xg = C.permute_inputs(x, gate.fmt, gate.cols)
    if C.input_order(gate.fmt, gate.cols).tolist() == C.input_order(up.fmt, up.cols).tolist():
        return xg, xg
    return xg, C.permute_inputs(x, up.fmt, up.cols)


def call(
    kernel, args, *, grid, in_specs, out_shape, out_spec, scratch, semantics, vmem_bytes, interpret, trace
):
    """`kernel` over the 2-d `grid` with two scalar-prefetch operands (args[:2]) and one output; with `trace`
    also an int32 [*grid, 8, 128] output (one vreg per grid step, see `write_trace`): (output, trace)."""
    out_shapes, out_specs = [out_shape], [out_spec]
    if trace:
        out_shapes.append(jax.ShapeDtypeStruct((*grid, *_TRACE_TILE), jnp.int32))
        out_specs.append(
            pl.BlockSpec((pl.squeezed, pl.squeezed, *_TRACE_TILE), lambda i, j, *_: (i, j, 0, 0))
        )
    limit = min(max(32 << 20, int(1.5 * vmem_bytes)), 100 << 20)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit),
        interpret=interpret,
    )(*args)
    return tuple(out) if trace else out[0]


# --------------------------------------------------------------------------------------- in-kernel helpers


def take_fields(p: Mat, it) -> dict:
    """The field refs of a matrix (and its codebook ref) from the kernel's ref iterator."""
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


def decode_into(wbuf_ref, p: Mat, refs: dict) -> None:
    """Decodes a matrix tile (field refs [words, lanes]) into wbuf_ref [cols, lanes] f32, input_order rows."""

    def read(field, start, size):
        return refs[field][pl.ds(start, size), :]

    lookup = _vreg_lookup(refs[_LUT]) if _LUT in refs else None
    for off, piece in C.decode_pieces(p.fmt, p.cols, p.block_splits, read, lookup):
        wbuf_ref[pl.ds(off, piece.shape[0]), :] = piece


def dot(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """x [M, K] @ w [K, N] with w cast to x's dtype, f32 accumulation."""
    prec = jax.lax.Precision.HIGHEST if x.dtype == F32 else jax.lax.Precision.DEFAULT
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=F32, precision=prec)


def write_trace(tr_ref, expert) -> None:
    """Records the expert a grid step decoded (-1: none) in its trace vreg."""
    tr_ref[...] = jnp.full(tr_ref.shape, expert, jnp.int32)
