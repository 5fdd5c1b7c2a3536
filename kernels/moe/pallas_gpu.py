"""Pallas GPU (Mosaic GPU) kernels for routed experts whose weights are quantized planes: what decode and
prefill share.

Entries (for kernels.moe.api, which picks one by routed slots):

    pallas_gpu_decode.moe_decode(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, lane_tile=128,
                                 token_group=8, split_k=None, interpret=False) -> [T, D]
    pallas_gpu_prefill.moe_prefill(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, *, row_tile=16,
                                   lane_tile=128, interpret=False) -> [T, D]
    check_supported(gate, up, down) -> None, or NotImplementedError naming the matrix

Planes, shapes and the result are those of `kernels.moe.pallas_tpu` (gate / up: Planes (F, D) with lead (E,),
down: (D, F); y[t] = sum_k w[t, k] down_e(silu(min(g, L)) * clip(u, -L, L))); f32 accumulation.

One kernel, `grouped_matvec`, does all the work: grid (program g, lane block j, K split s); program g multiplies
the rows x[xid[g]] ([rows, K], f32) by the matrices of expert eid[g] (eid / xid read from GMEM in the kernel:
Mosaic GPU has no scalar prefetch) for output lanes j * tile .. + tile, reading each plane word of the expert's
lane block straight from HBM into registers once, decoding it there (shifts, masks, selects, bitcasts: no table, no
gather, nothing written back), and accumulating x[t, k] * w[k, lanes] in f32 registers (CUDA-core FMAs, one
accumulator vector per row and matrix); an epilogue (the clamped SwiGLU of gate and up, or nothing) runs on
the accumulators and the program writes its [rows, tile] block once. Programs g >= n_valid do nothing. With a
K split (`pick_split`: few programs, as in decode at one stream) each program covers 1/S of the inputs and XLA
sums the f32 partials and runs the epilogue. Decode runs it over (distinct expert, token group); prefill over
row tiles of slots sorted by expert. On the GPU it is a `plgpu.kernel` (one warpgroup per program).

Mosaic GPU in jax 0.10.2 lowers no dot_general (only wgmma / tcgen05 on swizzled SMEM tiles), no gather and
no broadcast of [1, N] to [R, N] in its register layouts, so the 2-D decoders of `pallas_common` do not lower
as they are: the decoders here are its formats restated on 1-D lane vectors (one plane word per lane, the
warpgroup-strided layout), reusing its element-wise helpers. The loop over a matrix's words is a fori_loop
(small kernels, fast lowering); its input index is computed per word, so the activations need no permutation.

Formats (`SUPPORTED`, from `glm53.quant.registry`): IQ4_XS, Q4_K, Q8_0, IQ2_S_R, IQ3_S_R (the gather-free
IQ2_S / IQ3_S of glm53.quant.reencode), BF16, F16, F32, freely mixed. The GGUF codebook layouts IQ2_S / IQ3_S
(a table lookup per 8 weights) and every other format raise NotImplementedError (`auto` then falls back to the reference).

`interpret=True` runs the same kernel body as a `pl.pallas_call` grid in Pallas' generic interpreter on CPU (the
static flag also leaves out `plgpu.layout_cast`, which has no CPU rule). Lowered for CUDA (e.g. `jax.export(..., platforms=["cuda"])` on
any host) they become `mosaic_gpu_v2` custom calls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from glm53.quant import registry
from glm53.quant.planes import Planes, check_planes
from kernels.moe import pallas_common as C

F32 = jnp.float32
_U32 = jnp.uint32
SUPPORTED = registry.formats_for("pallas_gpu")  # `_DECODERS` below names exactly these (tested)
_DENSE_UNIT = 16  # inputs per loop step of the dense formats


# ------------------------------------------------------------------------------------------------ checking


def check_matrix(p: Planes, tile: int, what: str) -> None:
    if not isinstance(p, Planes):
        raise NotImplementedError(f"pallas_gpu moe: {what} must be Planes, got {type(p).__name__}")
    if p.fmt.name not in SUPPORTED:
        raise NotImplementedError(
            f"pallas_gpu moe: {what}: no GPU decoder for {p.fmt.name}; supported: {', '.join(SUPPORTED)}"
        )
    if len(p.lead_shape) != 1:
        raise ValueError(f"pallas_gpu moe: {what} planes need one leading expert axis, got {p.lead_shape}")
    check_planes(p)
    rows, cols = p.shape
    if rows % tile:
        raise NotImplementedError(f"pallas_gpu moe: {what}: {rows} output rows are not a multiple of {tile}")
    if registry.entry(p.fmt.name).dense and cols % (_DENSE_UNIT * p.block_splits):
        raise NotImplementedError(
            f"pallas_gpu moe: {what}: {p.fmt.name} needs a multiple of {_DENSE_UNIT} inputs per block group, "
            f"got {cols} in {p.block_splits}"
        )


def check_supported(gate: Planes, up: Planes, down: Planes, tile: int = 128) -> None:
    """NotImplementedError for a format / layout / shape the kernels cannot run; ValueError for bad shapes."""
    if tile % 128:
        raise NotImplementedError(f"pallas_gpu moe: lane tile {tile} must be a multiple of 128")
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        check_matrix(p, tile, name)
    (e,), (f, d) = gate.lead_shape, gate.shape
    for name, p, want in (("up", up, (f, d)), ("down", down, (d, f))):
        if p.shape != want or p.lead_shape != (e,):
            raise ValueError(
                f"pallas_gpu moe: {name} planes are {p.lead_shape} x {p.shape}, expected ({e},) x {want} "
                f"to match gate {gate.lead_shape} x {gate.shape}"
            )


# -------------------------------------------------------------------------------- 1-D decoders (per step)
# A decoder step: dec(word, half16, g) -> [(input index within the unit (int32 scalar), f32 [lanes])].
#   word(field, i): uint32 [lanes], word i (int32 scalar, may be traced) of the unit's share of `field`;
#   half16(field): uint32 [lanes], the unit's 16-bit value of a paired 2-byte field;
#   g: uint32 scalar, the step within the unit.


def _u(v) -> jnp.ndarray:
    return jnp.asarray(v).astype(_U32)


def _i(v) -> jnp.ndarray:
    return jnp.asarray(v).astype(jnp.int32)


def _dec_iq4_xs(word, half16, g):
    d = C.f16_bits_to_f32(half16("d"))
    ib, jj = g >> 2, g & _U32(3)  # qs word g = 4 ib + jj
    ls = ((word("scales_l", 0) >> (ib << 2)) & _U32(15)) | (
        ((half16("scales_h") >> (ib << 1)) & _U32(3)) << 4
    )
    scale = d * (C._to_f32(ls) - F32(32.0))
    q = word("qs", _i(g))
    out = []
    for h in range(2):
        for bb in range(4):  # nibble h of byte bb: input 32 ib + 16 h + 4 jj + bb
            code = (q >> _U32(8 * bb + 4 * h)) & _U32(15)
            out.append((_i(32 * ib + 16 * h + 4 * jj + bb), scale * C._iq4_levels(code)))
    return out


def _dec_q4_k(word, half16, g):
    d, dmin = C.f16_bits_to_f32(half16("d")), C.f16_bits_to_f32(half16("dmin"))
    s0, s1, s2 = (word("scales", i) for i in range(3))
    c, jj = g >> 3, g & _U32(7)  # qs word g = 8 c + jj
    q = word("qs", _i(g))
    out = []
    for k in range(2):  # nibble k: sub-block 2 c + k
        sc, mn = C.q4k_sub(s0, s1, s2, (c << 1) + _U32(k))
        dl, ml = d * C._to_f32(sc), dmin * C._to_f32(mn)
        for bb in range(4):  # input 64 c + 32 k + 4 jj + bb
            code = C._to_f32((q >> _U32(8 * bb + 4 * k)) & _U32(15))
            out.append((_i(64 * c + 32 * k + 4 * jj + bb), dl * code - ml))
    return out


def _dec_q8_0(word, half16, g):
    d = C.f16_bits_to_f32(half16("d"))
    q = word("qs", _i(g))
    return [
        (_i(4 * g + bb), d * (C._to_f32(((q >> _U32(8 * bb)) & _U32(255)) ^ _U32(0x80)) - F32(128.0)))
        for bb in range(4)
    ]


def _dec_iq2_s_r(word, half16, g):
    d = C.f16_bits_to_f32(half16("d"))
    s4 = (word("scales", _i(g >> 3)) >> ((g & _U32(7)) << 2)) & _U32(15)  # scale of inputs 16 g .. + 15
    db = d * (F32(0.5) + C._to_f32(s4)) * F32(0.25)
    sg = word("signs", _i(g >> 1)) >> ((g & _U32(1)) << 4)
    lev = word("levels", _i(g))
    out = []
    for q in range(16):  # input 16 g + q
        val = db * C._level((lev >> _U32(2 * q)) & _U32(3))
        out.append((_i(16 * g + q), C._flip_sign(val, (sg >> _U32(q)) & _U32(1))))
    return out


def _dec_iq3_s_r(word, half16, g):
    d = C.f16_bits_to_f32(half16("d"))
    s4 = (word("scales", 0) >> ((g >> 2) << 2)) & _U32(15)  # code word g lies in sub-block g // 4
    db = d * (F32(1.0) + F32(2.0) * C._to_f32(s4))
    cw = word("codes", _i(g))
    return [
        (_i(8 * g + q), db * (F32(2.0) * C._to_f32((cw >> _U32(4 * q)) & _U32(15)) - F32(15.0)))
        for q in range(8)
    ]


def _dec_half_words(to_f32):
    def dec(word, half16, g):
        out = []
        for i in range(_DENSE_UNIT // 2):  # word i: inputs 2 i (low half), 2 i + 1 (high half)
            w = word("w", i)
            lo, hi = to_f32(w)
            out += [(_i(2 * i), lo), (_i(2 * i + 1), hi)]
        return out

    return dec


def _bf16_pair(w):
    return lax.bitcast_convert_type(w << 16, F32), lax.bitcast_convert_type(w & _U32(0xFFFF0000), F32)


def _f16_pair(w):
    return C.f16_bits_to_f32(w & _U32(0xFFFF)), C.f16_bits_to_f32(w >> 16)


def _dec_f32(word, half16, g):
    return [(_i(i), lax.bitcast_convert_type(word("w", i), F32)) for i in range(_DENSE_UNIT)]


# format -> (decoder, steps per unit)
_DECODERS: dict[str, tuple[Callable, int]] = {
    "IQ4_XS": (_dec_iq4_xs, 32),
    "Q4_K": (_dec_q4_k, 32),
    "Q8_0": (_dec_q8_0, 8),
    "IQ2_S_R": (_dec_iq2_s_r, 16),
    "IQ3_S_R": (_dec_iq3_s_r, 32),
    "BF16": (_dec_half_words(_bf16_pair), 1),
    "F16": (_dec_half_words(_f16_pair), 1),
    "F32": (_dec_f32, 1),
}


def unit_layout(p: Planes) -> tuple[int, dict[str, int]]:
    """(inputs per unit, words per unit of each unpaired field) of a matrix; units are blocks, or 16 inputs of
    the dense formats."""
    if registry.entry(p.fmt.name).dense:
        return _DENSE_UNIT, {"w": _DENSE_UNIT * (4 if p.fmt.name == "F32" else 2) // 4}
    return p.fmt.block_size, {f.name: f.nbytes // 4 for f in p.fmt.fields if f.nbytes % 4 == 0}


def _paired_word(b, n_blocks: int, block_splits: int):
    """(word, half) of block b (int32 scalar, traced) in a paired 2-byte field: `C.paired_position` traced."""
    k = n_blocks // block_splits
    kp = math.ceil(k / 2)
    grp = b // k
    r = b - grp * k
    return grp * kp + r // 2, _u(r & 1)


def decode_matrix(p: Planes, expert: int = 0) -> jnp.ndarray:
    """f32 [cols, rows]: W^T of one expert (input order), decoded by the kernel's per-step decoders on whole
    plane rows (plain jnp, vmapped over the steps: the tests' numerical check of the decoders the kernel runs)."""
    dec, steps = _DECODERS[p.fmt.name]
    unit, wpu = unit_layout(p)
    n_units = p.cols // unit
    planes = {k: jnp.asarray(v[expert]) for k, v in p.fields.items()}

    def step(q):
        b, g = q // steps, q % steps

        def word(field, i):
            return planes[field][b * wpu[field] + i]

        def half16(field):
            w, half = _paired_word(b, n_units, p.block_splits)
            return (planes[field][w] >> (half << 4)) & _U32(0xFFFF)

        pieces = dec(word, half16, _u(g))
        return jnp.stack([b * unit + k for k, _ in pieces]), jnp.stack([v for _, v in pieces])

    ks, vals = jax.vmap(step)(jnp.arange(n_units * steps, dtype=jnp.int32))
    return jnp.zeros((p.cols, p.rows), F32).at[ks.reshape(-1)].set(vals.reshape(-1, p.rows))


# ------------------------------------------------------------------------------------------- the kernel


def _strided_zeros(n: int, interpret: bool) -> jnp.ndarray:
    z = jnp.zeros((n,), F32)
    return z if interpret else plgpu.layout_cast(z, plgpu.Layout.WG_STRIDED((n,), vec_size=1))


def _matvec(p: Planes, refs: dict, e, lanes, x_ref, xi, split, n_split: int, rows: int, tile: int, interpret):
    """[rows] f32 [tile] accumulators: x[xi, t, ks] @ W_e^T[ks, lanes] for t < rows, ks the inputs of K split
    `split` (traced) of `n_split` (whole units each)."""
    dec, steps = _DECODERS[p.fmt.name]
    unit, wpu = unit_layout(p)
    n_units = p.cols // unit
    n_steps = n_units // n_split * steps

    def body(q, accs):
        q = q + split * n_steps
        b, g = q // steps, q % steps

        def word(field, i):
            return refs[field][e, b * wpu[field] + i, lanes]

        def half16(field):
            w, half = _paired_word(b, n_units, p.block_splits)
            return (refs[field][e, w, lanes] >> (half << 4)) & _U32(0xFFFF)

        pieces = dec(word, half16, _u(g))
        out = []
        for t, acc in enumerate(accs):
            for k, w in pieces:
                acc = acc + x_ref[xi, t, b * unit + k] * w
            out.append(acc)
        return tuple(out)

    init = tuple(_strided_zeros(tile, interpret) for _ in range(rows))
    return lax.fori_loop(0, n_steps, body, init)


def _kernel(eid_ref, xid_ref, nv_ref, x_ref, *refs, mats, rows, tile, n_split, epilogue, interpret):
    it = iter(refs)
    mat_refs = [{f.name: next(it) for f in p.fmt.fields} for p in mats]
    o_refs = list(it)  # one output (the epilogue's) when n_split == 1, else one per matrix
    if interpret:  # Pallas' generic interpreter runs a pallas_call grid
        g, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:  # plgpu.kernel's grid axes
        g, j, split = lax.axis_index("g"), lax.axis_index("j"), lax.axis_index("s")

    @pl.when(g < nv_ref[0])
    def _():
        e, xi = eid_ref[g], xid_ref[g]
        lanes = pl.ds(pl.multiple_of(j * tile, tile), tile)
        accs = [
            _matvec(p, r, e, lanes, x_ref, xi, split, n_split, rows, tile, interpret)
            for p, r in zip(mats, mat_refs)
        ]
        if n_split == 1:
            for t, v in enumerate(epilogue(*accs)):
                o_refs[0][g, t, lanes] = v
        else:
            for o_ref, acc in zip(o_refs, accs):
                for t, v in enumerate(acc):
                    o_ref[split, g, t, lanes] = v


def swiglu_epilogue(limit: float):
    """gate / up accumulators -> silu(min(g, L)) * clip(u, -L, L) per row (exp and divide: no logistic op)."""

    def epi(gs, us):
        out = []
        for a, b in zip(gs, us):
            a = jnp.minimum(a, F32(limit))
            out.append(a / (F32(1.0) + jnp.exp(-a)) * jnp.minimum(jnp.maximum(b, F32(-limit)), F32(limit)))
        return out

    return epi


def identity_epilogue(accs):
    return list(accs)


def pick_split(mats: list[Planes], programs: int, target: int = 2048, most: int = 16) -> int:
    """K splits for `programs` programs: doubled while it divides every matrix's units, stays <= `most` and
    programs x splits <= `target` (about 4 waves of 4 warpgroups on each of an H200's 132 SMs)."""
    units = [p.cols // unit_layout(p)[0] for p in mats]
    s = 1
    while 2 * s <= most and programs * 2 * s <= target and all(u % (2 * s) == 0 for u in units):
        s *= 2
    return s


def grouped_matvec(
    x: jnp.ndarray,
    eid: jnp.ndarray,
    xid: jnp.ndarray,
    n_valid: jnp.ndarray,
    mats: list[Planes],
    *,
    epilogue: Callable = identity_epilogue,
    tile: int = 128,
    split_k: int = 1,
    interpret: bool = False,
) -> jnp.ndarray:
    """out [G, R, N] f32: out[g] = epilogue(x[xid[g]] @ W_m[eid[g]]^T for W_m in mats) for g < n_valid[0].

    x [NX, R, K] f32; eid / xid int32 [G]; n_valid int32 [1]; mats: Planes of one shape (N, K) and lead (E,).
    split_k > 1 (dividing every matrix's units) adds a grid axis over K: each program accumulates its share of
    the inputs, XLA sums the f32 partial products [split_k, G, R, N] per matrix and applies the epilogue (more
    programs when G x N / tile alone cannot fill the GPU: decode at one or two streams). Blocks g >= n_valid are
    not written (their contents are undefined).
    """
    nx, rows, k = x.shape
    (grid_g,) = eid.shape
    n = mats[0].rows
    for p in mats:
        if p.shape != (n, k):
            raise ValueError(f"pallas_gpu grouped_matvec: matrix {p.shape} does not match x's K={k}, N={n}")
        if (p.cols // unit_layout(p)[0]) % split_k:
            raise ValueError(
                f"pallas_gpu grouped_matvec: split_k={split_k} does not divide {p.fmt.name}'s units"
            )
    leaves = [p.fields[f.name] for p in mats for f in p.fmt.fields]
    kernel = functools.partial(
        _kernel,
        mats=list(mats),
        rows=rows,
        tile=tile,
        n_split=split_k,
        epilogue=epilogue,
        interpret=bool(interpret),
    )
    args = (eid.astype(jnp.int32), xid.astype(jnp.int32), n_valid.astype(jnp.int32), x.astype(F32), *leaves)
    if split_k == 1:
        out_type = [jax.ShapeDtypeStruct((grid_g, rows, n), F32)]
    else:
        out_type = [jax.ShapeDtypeStruct((split_k, grid_g, rows, n), F32) for _ in mats]
    grid = (grid_g, n // tile, split_k)
    if interpret:
        # The same body on CPU: a pallas_call grid over whole-array refs, run by Pallas' generic (HLO)
        # interpreter. (The Mosaic GPU interpreter, InterpretGPUParams, also runs plgpu.kernel, but simulates
        # every memory access through a host callback: a minute for the smallest test case.)
        any_ref = pl.BlockSpec(memory_space=pl.ANY)
        outs = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[any_ref] * len(args),
            out_specs=[any_ref] * len(out_type),
            out_shape=out_type,
            interpret=True,
        )(*args)
    else:
        outs = plgpu.kernel(kernel, out_type=out_type, grid=grid, grid_names=("g", "j", "s"))(*args)
    if split_k == 1:
        return outs[0]
    (out,) = epilogue(*[[o.sum(axis=0)] for o in outs])
    return out
