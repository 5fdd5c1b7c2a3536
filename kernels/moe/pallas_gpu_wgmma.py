"""Pallas GPU (Mosaic GPU) prefill on the tensor cores: a ragged grouped GEMM whose expert tiles are decoded into
shared memory and fed to `plgpu.wgmma` (bf16 x bf16 -> f32), after tokamax's quantized ragged_dot.

Programs (row tile i of 64 slots sorted by expert, lane block j of TN = 32 outputs): `plgpu.emit_pipeline` TMA-copies,
per K chunk, the activation tile [64, CK] (bf16, swizzled) and the chunk's plane words of expert te[i] (the main
field as a [64 words, TN] tile in the WGMMA register layout, the scale fields as small [w, TN] blocks); the
chunk is decoded in registers (per-row scales from per-block column vectors broadcast over the rows of their
block, row iota for the per-row shifts) into a [CK, TN] bf16 tile in shared memory, and one wgmma accumulates
x_tile @ tile into the f32 accumulator. Gate and up share the activation tile (the same format, hence the same
input order) and end in the clamped SwiGLU on the accumulators; down runs the same way on h. A chunk's rows are
in the format's decode order (piece-major: every word's first code, then its second, ...), so the activations
are permuted once in XLA (`input_order`). Nothing dequantized reaches HBM.

Formats (`SUPPORTED`, from `glm53.quant.registry`; gate and up of one format, down any of them): IQ4_XS, Q4_K,
IQ3_S_R (two blocks a chunk, CK 512), IQ2_S_R (four blocks, CK 1024 in two pipeline steps of 8 pieces), Q8_0
(eight blocks, CK 256), BF16 (128 inputs). `supports(gate, up, down)` says whether this path applies;
`kernels.moe.pallas_gpu_prefill` falls back to its CUDA-core kernel otherwise. `interpret=True` runs the kernels
in the Mosaic GPU interpreter (`InterpretGPUParams`: simulates TMA, barriers and wgmma on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not exported in jax 0.10.2
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from glm53.quant import registry
from glm53.quant.planes import Planes
from kernels.moe import pallas_common as C

F32, BF16, U32 = jnp.float32, jnp.bfloat16, jnp.uint32
ROWS = 64  # slots per row tile: the wgmma M
# pieces decoded per pipeline step: a [512, TN] bf16 tile (IQ2_S_R's 16 pieces take two steps)
STEP_PIECES = 8
TN = 32  # output lanes per program (wgmma N; the bf16 tiles' rows are then 64 bytes: swizzle 64)
WORDS = 64  # rows of the main field per chunk (the WGMMA register layout's tile height)


@dataclasses.dataclass(frozen=True)
class Spec:
    main: str  # the field read as a [64, TN] word tile
    blocks: int  # blocks per chunk
    pieces: int  # [64, TN] pieces per chunk (CK = 64 * pieces)
    decode: Callable  # decode(q, r, vec) -> [f32 [64, TN]] * pieces; see _iq4_xs
    order: Callable  # order(s, r) -> input index within the chunk of piece s, row r (numpy ints)


def _f16(v):
    return C.f16_bits_to_f32(v & U32(0xFFFF))


def _by_block(vec, field, r, shift, n):
    """[64, TN]: row r's word of a one-word-per-block `field` (n blocks a chunk; row r lies in block r >> shift)."""
    out = vec(field, 0)
    for b in range(1, n):
        out = jnp.where((r >> U32(shift)) == U32(b), vec(field, b), out)
    return out


def _paired(vec, field, r, shift, n):
    """[64, TN]: row r's 16-bit value of a paired 2-byte field (block b = r >> shift of n, word b // 2)."""
    blk = r >> U32(shift)
    return (_by_block(vec, field, r >> U32(1), shift, max(1, n // 2)) >> ((blk & U32(1)) << 4)) & U32(0xFFFF)


def _iq4_xs(q, r, vec):  # 2 blocks: row r = word 32 blk + 4 ib + jj
    d = _f16(_paired(vec, "d", r, 5, 2))
    sh = _paired(vec, "scales_h", r, 5, 2)
    sl = _by_block(vec, "scales_l", r, 5, 2)
    ib = (r >> U32(2)) & U32(7)
    ls = ((sl >> (ib << 2)) & U32(15)) | (((sh >> (ib << 1)) & U32(3)) << 4)
    scale = d * (C._to_f32(ls) - F32(32.0))
    return [scale * C._iq4_levels((q >> U32(8 * (s // 2) + 4 * (s % 2))) & U32(15)) for s in range(8)]


def _q4_k(q, r, vec):  # 2 blocks: row r = word 32 blk + 8 c + jj
    d, dmin = _f16(_paired(vec, "d", r, 5, 2)), _f16(_paired(vec, "dmin", r, 5, 2))
    s0, s1, s2 = (_by_block(lambda f, b, i=i: vec(f, 3 * b + i), "scales", r, 5, 2) for i in range(3))
    c = (r >> U32(3)) & U32(3)
    out = []
    for s in range(8):  # s = 2 bb + k: nibble k of byte bb, sub-block 2 c + k
        bb, k = s // 2, s % 2
        sc, mn = C.q4k_sub(s0, s1, s2, (c << 1) + U32(k))
        code = C._to_f32((q >> U32(8 * bb + 4 * k)) & U32(15))
        out.append(d * C._to_f32(sc) * code - dmin * C._to_f32(mn))
    return out


def _iq3_s_r(q, r, vec):  # 2 blocks: row r = code word 32 blk + kk
    d = _f16(_paired(vec, "d", r, 5, 2))
    sc = _by_block(vec, "scales", r, 5, 2)
    db = d * (F32(1.0) + F32(2.0) * C._to_f32((sc >> (((r & U32(31)) >> U32(2)) << 2)) & U32(15)))
    return [db * (F32(2.0) * C._to_f32((q >> U32(4 * s)) & U32(15)) - F32(15.0)) for s in range(8)]


def _iq2_s_r(q, r, vec):  # 4 blocks: row r = levels word 16 blk + rr
    d = _f16(_paired(vec, "d", r, 4, 4))
    s4 = (_by_block(vec, "scales", r, 3, 8) >> ((r & U32(7)) << 2)) & U32(15)  # scales word 2 blk + rr // 8
    db = d * (F32(0.5) + C._to_f32(s4)) * F32(0.25)
    sg = _by_block(vec, "signs", r, 1, 32) >> ((r & U32(1)) << 4)  # signs word 8 blk + rr // 2
    return [
        C._flip_sign(db * C._level((q >> U32(2 * s)) & U32(3)), (sg >> U32(s)) & U32(1)) for s in range(16)
    ]


def _q8_0(q, r, vec):  # 8 blocks: row r = word 8 blk + jj
    d = _f16(_paired(vec, "d", r, 3, 8))
    return [d * (C._to_f32(((q >> U32(8 * s)) & U32(255)) ^ U32(0x80)) - F32(128.0)) for s in range(4)]


def _bf16(q, r, vec):  # row r = word r: inputs 2 r (low half), 2 r + 1 (high half)
    return [lax.bitcast_convert_type(q << 16, F32), lax.bitcast_convert_type(q & U32(0xFFFF0000), F32)]


SPECS = {
    "IQ4_XS": Spec("qs", 2, 8, _iq4_xs, lambda s, r: 256 * (r // 32) + 32 * (r // 4 % 8) + 16 * (s % 2) + 4 * (r % 4) + s // 2),
    "Q4_K": Spec("qs", 2, 8, _q4_k, lambda s, r: 256 * (r // 32) + 64 * (r // 8 % 4) + 32 * (s % 2) + 4 * (r % 8) + s // 2),
    "IQ3_S_R": Spec("codes", 2, 8, _iq3_s_r, lambda s, r: 256 * (r // 32) + 8 * (r % 32) + s),
    "IQ2_S_R": Spec("levels", 4, 16, _iq2_s_r, lambda s, r: 256 * (r // 16) + 16 * (r % 16) + s),
    "Q8_0": Spec("qs", 8, 4, _q8_0, lambda s, r: 32 * (r // 8) + 4 * (r % 8) + s),
    "BF16": Spec("w", 128, 2, _bf16, lambda s, r: 2 * r + s),
}  # fmt: skip
SUPPORTED = registry.formats_for("pallas_gpu_wgmma")  # SPECS names exactly these (tests/test_expert_formats.py)


def chunk_inputs(p: Planes) -> int:
    return ROWS * SPECS[p.fmt.name].pieces


def _steps_per_chunk(p: Planes) -> int:
    return max(1, SPECS[p.fmt.name].pieces // STEP_PIECES)


def input_order(p: Planes) -> np.ndarray:
    """int [cols]: column k' of the permuted activations holds input order[k'] (chunk by chunk, piece-major)."""
    spec = SPECS[p.fmt.name]
    s, r = np.meshgrid(np.arange(spec.pieces), np.arange(WORDS), indexing="ij")
    within = spec.order(s, r).reshape(-1)  # [CK], piece-major
    ck = within.size
    return (np.arange(p.cols // ck)[:, None] * ck + within[None, :]).reshape(-1)


def supports(gate: Planes, up: Planes, down: Planes) -> str | None:
    """None when the tensor-core prefill can run these matrices, else the reason it cannot."""
    if gate.fmt.name != up.fmt.name:
        return f"gate {gate.fmt.name} and up {up.fmt.name} differ (they share the activation tile)"
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        if p.fmt.name not in SUPPORTED:
            return f"{name}: no tensor-core decoder for {p.fmt.name} (have {', '.join(SUPPORTED)})"
        if p.rows % TN or p.cols % (chunk_inputs(p) * p.block_splits):
            return f"{name}: {p.shape} in {p.block_splits} block groups does not tile by {TN} x {chunk_inputs(p)}"
    return None


def decode_chunk(name: str, fields) -> list[jnp.ndarray]:
    """One chunk's pieces (f32 [64, N] each, piece-major decode order) from its words (field -> uint32
    [words of the chunk, N], arrays or refs), as the kernel decodes them in interpret mode."""
    spec = SPECS[name]
    main = fields[spec.main][...]
    r = lax.broadcasted_iota(U32, main.shape, 0)

    def vec(field, w):
        return jnp.broadcast_to(fields[field][w], main.shape)

    return spec.decode(main, r, vec)


def decode_matrix(p: Planes, expert: int = 0) -> jnp.ndarray:
    """f32 [cols, rows]: W^T of one expert in `input_order(p)` (row k holds input input_order(p)[k]), decoded
    chunk by chunk by `decode_chunk` (plain jnp; the tests' numerical check of the tensor-core decoders)."""
    out = []
    for c in range(p.cols // chunk_inputs(p)):
        words = {}
        for f in p.fmt.fields:
            n = _field_rows(p, f)
            words[f.name] = jnp.asarray(p.fields[f.name][expert, c * n : (c + 1) * n])
        out.append(jnp.concatenate(decode_chunk(p.fmt.name, words), axis=0))
    return jnp.concatenate(out, axis=0)


def _swizzled(cols: int, itemsize: int):
    sw = min(128, cols * itemsize)
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def _field_rows(p: Planes, field) -> int:
    """Words of `field` per chunk (a paired 2-byte field: one word per two blocks)."""
    spec = SPECS[p.fmt.name]
    return spec.blocks // 2 if field.nbytes == 2 else spec.blocks * field.nbytes // 4


def _kernel(te_ref, nt_ref, x_gmem, *refs, mats, limit, interpret):
    it = iter(refs)
    mat_refs = [[next(it) for _ in p.fmt.fields] for p in mats]
    o_gmem = next(it)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    halves = _steps_per_chunk(mats[0])  # gate and up share a format
    step_k = chunk_inputs(mats[0]) // halves
    col = plgpu.Layout.WGMMA.reduce(0)

    def decode_into(b_smem, p: Planes, smems, half: int):
        spec = SPECS[p.fmt.name]
        fields = {f.name: s for f, s in zip(p.fmt.fields, smems)}
        if interpret:  # the interpreter has no layouts (and no plgpu.load)
            pieces = decode_chunk(p.fmt.name, fields)
        else:
            r = plgpu.broadcasted_iota(U32, (WORDS, TN), 0, layout=plgpu.Layout.WGMMA)

            def vec(field, w):
                v = plgpu.load(fields[field].at[w], (), layout=col)
                return lax.broadcast_in_dim(v, (WORDS, TN), (1,))

            pieces = spec.decode(fields[spec.main][...], r, vec)
        n = len(pieces) // halves
        for s, piece in enumerate(pieces[half * n : (half + 1) * n]):
            b_smem[s * WORDS : (s + 1) * WORDS, :] = piece.astype(BF16)
        plgpu.commit_smem()

    def tile(accs, b_smem):
        e = te_ref[i]

        def body(idx, x_smem, *smems):
            for p, acc, n in zip(mats, accs, (len(p.fmt.fields) for p in mats)):
                for half in range(halves):  # the chunk's pieces half * 8 .. + 7 at its step half

                    @pl.when(idx[0] % halves == half)
                    def _(p=p, acc=acc, n=n, half=half, smems=smems):
                        decode_into(b_smem, p, smems[:n], half)
                        plgpu.wgmma(acc, x_smem, b_smem)
                        plgpu.wgmma_wait(0)  # b_smem is rewritten by the next matrix / step

                smems = smems[n:]

        specs = [plgpu.BlockSpec((ROWS, step_k), lambda c: (0, c), transforms=_swizzled(TN, 2))]
        gm = []
        for p, rs in zip(mats, mat_refs):
            for f, ref in zip(p.fmt.fields, rs):
                rows = _field_rows(p, f)
                tr = _swizzled(TN, 4) if f.name == SPECS[p.fmt.name].main else ()
                specs.append(plgpu.BlockSpec((rows, TN), lambda c: (c // halves, j), transforms=tr))
                gm.append(ref.at[e])
        plgpu.emit_pipeline(body, grid=(mats[0].cols // step_k,), in_specs=specs, max_concurrent_steps=2)(
            x_gmem.at[pl.ds(i * ROWS, ROWS)], *gm
        )

    def run(*accs):
        b_type = plgpu.SMEM((step_k, TN), BF16, transforms=_swizzled(TN, 2))
        pl.run_scoped(functools.partial(tile, accs), b_type)
        vals = [a[...] for a in accs]
        if len(vals) == 2:
            g = jnp.minimum(vals[0], F32(limit))
            out = g / (F32(1.0) + jnp.exp(-g)) * jnp.minimum(jnp.maximum(vals[1], F32(-limit)), F32(limit))
        else:
            out = vals[0]
        o_gmem[pl.ds(i * ROWS, ROWS), pl.ds(j * TN, TN)] = out

    @pl.when(i < nt_ref[0])
    def _():
        pl.run_scoped(run, *[plgpu.ACC((ROWS, TN)) for _ in mats])


def grouped_matmul(x, te, n_tiles, mats: list[Planes], *, limit=None, interpret=False):
    """out [NT * 64, N] f32: row tile i = x[tile i] @ W[te[i]]^T (two matrices: the clamped SwiGLU of the two,
    `limit` its clamp), for tiles i < n_tiles[0] (the rest unwritten). x [NT * 64, K] bf16 in
    `input_order(mats[0])`."""
    m, _ = x.shape
    n = mats[0].rows
    kernel = functools.partial(_kernel, mats=list(mats), limit=limit, interpret=bool(interpret))
    leaves = [p.fields[f.name] for p in mats for f in p.fmt.fields]
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), F32),
        grid=(m // ROWS, n // TN),
        grid_names=("i", "j"),
        interpret=InterpretGPUParams() if interpret else None,
    )(te.astype(jnp.int32), n_tiles.astype(jnp.int32), x.astype(BF16), *leaves)
