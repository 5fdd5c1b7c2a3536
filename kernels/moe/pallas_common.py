"""Decode math shared by the quantized-expert kernels: uint32 plane words -> f32 weights, per format.

Integer / bit operations (shifts by scalars or by row-iota vectors, masks, selects, int->f32 converts,
bitcasts) on 2-D uint32 word arrays whose last (lane) axis is the matrix output row, as the planes of
`glm53.quant.planes` store them. Apart from the codebook lookup of the two GGUF codebook layouts (a callback),
nothing gathers, so the same code runs inside a Mosaic (TPU) kernel, a Pallas GPU kernel or plain XLA.

A matrix [N out, K in] is decoded in *units*: one 256-weight block for block formats, the whole K for the
dense formats (F32 / F16 / BF16). `decode_unit` returns the unit's weights as row pieces [rows, N] whose row
order is the format's natural decode order, not the input order: row r of a unit holds input
`input_order(...)[r]`. The kernels permute the activations instead of the weights (`permute_inputs`: a
reshape + transpose, no gather), so that `permute_inputs(x) @ decoded == x @ W^T`.

Supported formats (the set is the registry's, `glm53.quant.registry.formats_for("pallas_tpu")`; all bit-exact
with gguf-py's dequantize):
  IQ4_XS   16-level table by selecting one of four packed table words (no lookup)
  Q4_K     6-bit scale / min pairs, nibbles
  IQ2_S_R  gather-free IQ2_S (glm53.quant.reencode): 2-bit level codes + sign bits
  IQ3_S_R  gather-free IQ3_S: 4-bit affine codes
  IQ2_S    GGUF layout: 1024-entry grid, two 16-bit level-code entries per table word, looked up
  IQ3_S    GGUF layout: 512-entry grid, one word of 4 magnitudes per entry, looked up
  F32, F16, BF16
The GGUF codebook layouts take a `lookup` callback over `lookup_table(fmt)`, a uint32 [4, 128] table (four
128-lane chunks): a TPU kernel resolves an index with one in-vreg lane gather per chunk plus selects, XLA with
a take. Other formats: `check_supported` raises NotImplementedError.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from glm53.quant import registry, tables
from glm53.quant.formats import QuantFormat

_U32 = jnp.uint32

# Callbacks a kernel provides to read one unit's words (and, for IQ2_S / IQ3_S, to look the codebook up):
#   words(field, start, size) -> uint32 [size, N]: words start .. start + size - 1 of the unit's share of
#       `field` (a field with a whole number of words per block); contiguous, since Mosaic compiles a strided
#       load only from a block exactly 128 lanes wide;
#   half16(field) -> uint32 [1, N]: the unit's 16-bit value of a 2-byte field (the f16 `d`), low half.
Words = Callable[[str, int, int], jnp.ndarray]
Half16 = Callable[[str], jnp.ndarray]
#   lookup(index) -> uint32: word `index` (uint32 [rows, N], < 512) of `lookup_table(fmt)`.
Lookup = Callable[[jnp.ndarray], jnp.ndarray]

# The formats come from the registry (backend "pallas_tpu"); tests/test_expert_formats.py checks that the decoder
# tables below name exactly these.
SUPPORTED = registry.formats_for("pallas_tpu")
LOOKUP_FORMATS = tuple(f for f in SUPPORTED if registry.entry(f).codebook)  # GGUF codebook layouts
DENSE_FORMATS = tuple(f for f in SUPPORTED if registry.entry(f).dense)
BLOCK_FORMATS = tuple(f for f in SUPPORTED if not registry.entry(f).dense)  # the gather-free ones + LOOKUP

# Natural decode order of one 256-weight block: the block's input index i is reshaped to `dims` (row-major)
# and the decoded rows run over `axes` of it: row r holds input arange(256).reshape(dims).transpose(axes)[r].
_BLOCK_ORDER: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    # i = 32 ib + 16 h + 4 jj + bb: nibble h of byte bb of qs word 4 ib + jj; rows (bb, h | ib, jj)
    "IQ4_XS": ((8, 2, 4, 4), (3, 1, 0, 2)),
    # i = 64 c + 32 k + 4 jj + bb: nibble k of byte bb of qs word 8 c + jj; rows (bb, k | c, jj)
    "Q4_K": ((4, 2, 8, 4), (3, 1, 0, 2)),
    # i = 16 r + q: 2-bit code q of levels word r, sign bit 16 (r % 2) + q of signs word r // 2; rows (q | r)
    "IQ2_S_R": ((16, 16), (1, 0)),
    # i = 8 k + q: 4-bit code q of codes word k; rows (q | k)
    "IQ3_S_R": ((32, 8), (1, 0)),
    # i = 32 k + 8 bb + c: coordinate c of grid entry 4 k + bb, sign bit 8 bb + c of signs word k;
    # rows (bb, c | k)
    "IQ2_S": ((8, 32), (1, 0)),
    # i = 16 r + 4 bb + c: coordinate c of grid entry 4 r + bb (index low byte bb of qs word r); rows (bb, c | r)
    "IQ3_S": ((16, 16), (1, 0)),
}


def lookup_table(fmt: QuantFormat) -> np.ndarray | None:
    """uint32 [4, 128] codebook words of a GGUF codebook format (None for the others).

    IQ2_S: word t = level codes of grid entry 2 t | those of entry 2 t + 1 << 16 (8 x 2 bits each);
    IQ3_S: word t = the 4 magnitude bytes of grid entry t.
    """
    if fmt.name == "IQ2_S":
        codes = tables.GRID_CODES["IQ2_S"].astype(np.uint32).reshape(512, 2)
        return (codes[:, 0] | (codes[:, 1] << np.uint32(16))).reshape(4, 128)
    if fmt.name == "IQ3_S":
        return tables.GRID_WORDS["IQ3_S"][:, 0].astype(np.uint32).reshape(4, 128)
    return None


def check_supported(
    fmt: QuantFormat, shape: tuple[int, int], block_splits: int, what: str = "matrix"
) -> None:
    """NotImplementedError when the kernels cannot decode (format, layout, shape); `what` names the matrix."""
    rows, cols = shape
    if fmt.name not in SUPPORTED:
        raise NotImplementedError(
            f"{what}: no Pallas decoder for {fmt.name}; supported: {', '.join(SUPPORTED)}"
        )
    if fmt.name in ("F16", "BF16"):
        if cols % (16 * block_splits):
            raise NotImplementedError(
                f"{what}: {fmt.name} with {cols} inputs in {block_splits} block groups needs a multiple "
                f"of 16 inputs per group"
            )
    elif fmt.name == "F32" and cols % 8:
        raise NotImplementedError(f"{what}: F32 needs a multiple of 8 inputs, got {cols}")
    elif fmt.name in LOOKUP_FORMATS and rows % 128:
        raise NotImplementedError(
            f"{what}: the {fmt.name} codebook lookup needs a multiple of 128 rows, got {rows}"
        )


def _order_spec(fmt: QuantFormat, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims, axes) of the whole matrix's input order: reshape `cols` to dims, transpose by axes."""
    if fmt.name in ("F16", "BF16"):  # word j holds inputs 2 j (low half) and 2 j + 1 (high half)
        return (cols // 2, 2), (1, 0)
    if fmt.name == "F32":
        return (cols,), (0,)
    dims, axes = _BLOCK_ORDER[fmt.name]
    return (cols // fmt.block_size, *dims), (0, *(a + 1 for a in axes))


def input_order(fmt: QuantFormat, cols: int) -> np.ndarray:
    """int [cols]: decoded row r of the matrix (units concatenated) holds input `input_order[r]`."""
    dims, axes = _order_spec(fmt, cols)
    return np.arange(cols).reshape(dims).transpose(axes).reshape(cols)


def permute_inputs(x: jnp.ndarray, fmt: QuantFormat, cols: int) -> jnp.ndarray:
    """x [..., cols] -> x[..., input_order(fmt, cols)] (a reshape + transpose; no gather)."""
    dims, axes = _order_spec(fmt, cols)
    lead = x.shape[:-1]
    n = len(lead)
    y = x.reshape(*lead, *dims).transpose(*range(n), *(a + n for a in axes))
    return y.reshape(*lead, cols)


# ----------------------------------------------------------------------------------------------- bit helpers


def f16_bits_to_f32(h: jnp.ndarray) -> jnp.ndarray:
    """uint32 holding IEEE f16 bits in its low half -> f32 (exact for finite values, subnormals included)."""
    sign = (h & _U32(0x8000)) << 16
    em = h & _U32(0x7FFF)
    normal = lax.bitcast_convert_type((em << 13) + _U32(112 << 23), jnp.float32)  # rebias exponent 15 -> 127
    subnormal = _to_f32(em) * jnp.float32(2.0**-24)  # exponent field 0: mantissa * 2^-24
    v = jnp.where(em < _U32(0x400), subnormal, normal)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(v, _U32) | sign, jnp.float32)


def _to_f32(u: jnp.ndarray) -> jnp.ndarray:
    """Small uint32 (< 2^31) -> f32."""
    return lax.bitcast_convert_type(u, jnp.int32).astype(jnp.float32)


def _flip_sign(v: jnp.ndarray, bit: jnp.ndarray) -> jnp.ndarray:
    """-v where the 0/1 uint32 `bit` is 1 (exact)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(v, _U32) ^ (bit << 31), jnp.float32)


def _row_iota(rows: int, n: int) -> jnp.ndarray:
    return lax.broadcasted_iota(_U32, (rows, n), 0)


def _pick_rows(vals: list[jnp.ndarray], rows: int, group: int) -> jnp.ndarray:
    """[rows, N] whose row r is vals[r // group] (each [1, N]), by selects."""
    n = vals[0].shape[-1]
    g = _row_iota(rows, n) // _U32(group)
    out = jnp.broadcast_to(vals[0], (rows, n))
    for i, v in enumerate(vals[1:], start=1):
        out = jnp.where(g == _U32(i), v, out)
    return out


_IQ4_WORDS = [int(w) for w in tables.KVALUES_IQ4NL_WORDS]  # the 16 int8 levels, 4 per little-endian word


def _iq4_levels(q: jnp.ndarray) -> jnp.ndarray:
    """4-bit codes (uint32) -> f32 IQ4_NL levels: select the packed table word, shift out the byte, extend."""
    w = _IQ4_WORDS
    hi, lo = (q & _U32(8)) != 0, (q & _U32(4)) != 0
    word = jnp.where(hi, jnp.where(lo, _U32(w[3]), _U32(w[2])), jnp.where(lo, _U32(w[1]), _U32(w[0])))
    byte = (word >> ((q & _U32(3)) << 3)) & _U32(0xFF)
    return _to_f32(byte ^ _U32(0x80)) - jnp.float32(128.0)


# ------------------------------------------------------------------------------------------------ decoders
# Each returns [(row offset within the unit, f32 [rows, N])], rows in the unit's natural decode order.


def _dec_iq4_xs(words: Words, half16: Half16) -> list[tuple[int, jnp.ndarray]]:
    d = f16_bits_to_f32(half16("d"))  # [1, N]
    sh = half16("scales_h")  # [1, N]: 2 high scale bits per sub-block
    sl = words("scales_l", 0, 1)  # [1, N]: 4 low scale bits per sub-block
    qs = words("qs", 0, 32)  # [32, N]
    ib = _row_iota(32, qs.shape[-1]) >> 2  # qs word j belongs to sub-block j // 4
    ls = ((sl >> (ib << 2)) & _U32(15)) | (((sh >> (ib << 1)) & _U32(3)) << 4)
    scale = d * (_to_f32(ls) - jnp.float32(32.0))  # [32, N]
    return [(32 * s, scale * _iq4_levels((qs >> _U32(4 * s)) & _U32(15))) for s in range(8)]


def _q4k_scale_min(s: list[jnp.ndarray]) -> tuple[list[jnp.ndarray], list[jnp.ndarray]]:
    """The 12 scale bytes (3 words [1, N]) -> 8 sub-block 6-bit scales and 8 mins (uint32 [1, N] each)."""
    sc, mn = [], []
    for i in range(8):
        if i < 4:
            sc.append((s[0] >> _U32(8 * i)) & _U32(63))
            mn.append((s[1] >> _U32(8 * i)) & _U32(63))
        else:
            j = i - 4
            sc.append(((s[2] >> _U32(8 * j)) & _U32(15)) | (((s[0] >> _U32(8 * j + 6)) & _U32(3)) << 4))
            mn.append(((s[2] >> _U32(8 * j + 4)) & _U32(15)) | (((s[1] >> _U32(8 * j + 6)) & _U32(3)) << 4))
    return sc, mn


def blend(hi: jnp.ndarray, lo: jnp.ndarray, take_hi) -> jnp.ndarray:
    """hi where `take_hi` (bool, a scalar or broadcastable) holds, else lo, for uint32 (arithmetic, no select)."""
    m = jnp.asarray(take_hi).astype(_U32)
    return hi * m + lo * (_U32(1) - m)


def q4k_sub(s0, s1, s2, s):
    """Q4_K 6-bit (scale, min) of sub-block s (uint32, may be traced) from the three scale words (the GPU
    decoders' form of `_q4k_scale_min`)."""
    sh = (s & _U32(3)) << 3
    sc = blend(((s2 >> sh) & _U32(15)) | (((s0 >> (sh + 6)) & _U32(3)) << 4), (s0 >> sh) & _U32(63), s >= 4)
    mn_hi = ((s2 >> (sh + 4)) & _U32(15)) | (((s1 >> (sh + 6)) & _U32(3)) << 4)
    mn = blend(mn_hi, (s1 >> sh) & _U32(63), s >= 4)
    return sc, mn


def _dec_q4_k(words: Words, half16: Half16) -> list[tuple[int, jnp.ndarray]]:
    d, dmin = f16_bits_to_f32(half16("d")), f16_bits_to_f32(half16("dmin"))  # [1, N]
    sc, mn = _q4k_scale_min([words("scales", i, 1) for i in range(3)])
    qs = words("qs", 0, 32)  # [32, N]; word j = 8 c + jj covers sub-blocks 2 c (low nibbles), 2 c + 1 (high)
    dl = [d * _to_f32(v) for v in sc]
    ml = [dmin * _to_f32(v) for v in mn]
    scale = [_pick_rows([dl[2 * c + k] for c in range(4)], 32, 8) for k in range(2)]  # [32, N] per nibble k
    mins = [_pick_rows([ml[2 * c + k] for c in range(4)], 32, 8) for k in range(2)]
    out = []
    for s in range(8):  # s = 2 bb + k
        q = _to_f32((qs >> _U32(4 * s)) & _U32(15))
        out.append((32 * s, scale[s % 2] * q - mins[s % 2]))
    return out


def _level(c: jnp.ndarray) -> jnp.ndarray:
    """IQ2 level code 0..2 -> grid coordinate 8, 25, 43 as f32."""
    return _to_f32(_U32(8) + _U32(17) * c + (c >> 1))


def _signs16(words: Words, r: jnp.ndarray) -> jnp.ndarray:
    """[16, N]: row r holds the sign bits of weights 16 r .. 16 r + 15 (bit q), from 8 words of 32 signs."""
    return _pick_rows([words("signs", m, 1) for m in range(8)], 16, 2) >> ((r & _U32(1)) << 4)


def _dec_iq2_s_r(words: Words, half16: Half16) -> list[tuple[int, jnp.ndarray]]:
    d = f16_bits_to_f32(half16("d"))  # [1, N]
    lev = words("levels", 0, 16)  # [16, N]: word r = weights 16 r .. 16 r + 15 (2-bit level codes)
    r = _row_iota(16, lev.shape[-1])
    sc = _pick_rows([words("scales", 0, 1), words("scales", 1, 1)], 16, 8)  # 4-bit scale r: word r // 8
    db = d * (jnp.float32(0.5) + _to_f32((sc >> ((r & _U32(7)) << 2)) & _U32(15))) * jnp.float32(0.25)
    sg = _signs16(words, r)
    out = []
    for q in range(16):
        bit = (sg >> _U32(q)) & _U32(1)
        out.append((16 * q, _flip_sign(db * _level((lev >> _U32(2 * q)) & _U32(3)), bit)))
    return out


def _dec_iq3_s_r(words: Words, half16: Half16) -> list[tuple[int, jnp.ndarray]]:
    d = f16_bits_to_f32(half16("d"))  # [1, N]
    sc = words("scales", 0, 1)  # [1, N]: 8 x 4-bit scales, one per 32 weights
    codes = words("codes", 0, 32)  # [32, N]: word k = weights 8 k .. 8 k + 7 (4 bits each)
    ib = _row_iota(32, codes.shape[-1]) >> 2  # word k lies in sub-block k // 4
    db = d * (jnp.float32(1.0) + jnp.float32(2.0) * _to_f32((sc >> (ib << 2)) & _U32(15)))  # [32, N]
    out = []
    for q in range(8):
        n4 = lax.bitcast_convert_type((codes >> _U32(4 * q)) & _U32(15), jnp.int32)
        out.append((32 * q, db * (2 * n4 - 15).astype(jnp.float32)))
    return out


def _dec_iq2_s(words: Words, half16: Half16, lookup: Lookup) -> list[tuple[int, jnp.ndarray]]:
    d = f16_bits_to_f32(half16("d"))  # [1, N]
    qs = words("qs", 0, 8)  # [8, N]: word k = low index bytes of grid entries 4 k .. 4 k + 3
    sg = words("signs", 0, 8)  # [8, N]: word k = signs of weights 32 k .. 32 k + 31
    k8 = (_row_iota(8, qs.shape[-1]) & _U32(3)) << 3  # byte k % 4 of the qh / scales word k // 4
    qh = _pick_rows([words("qh", 0, 1), words("qh", 1, 1)], 8, 4)  # 2 index bits per entry
    sc = _pick_rows([words("scales", 0, 1), words("scales", 1, 1)], 8, 4)  # a 4-bit scale per 16 weights
    out = []
    for bb in range(4):  # entry 4 k + bb = weights 32 k + 8 bb .. + 7
        idx = ((qs >> _U32(8 * bb)) & _U32(255)) | (((qh >> (k8 + _U32(2 * bb))) & _U32(3)) << 8)
        code = (lookup(idx >> 1) >> ((idx & _U32(1)) << 4)) & _U32(0xFFFF)  # 8 level codes of 2 bits
        s4 = (sc >> (k8 + _U32(4 * (bb // 2)))) & _U32(15)
        db = d * (jnp.float32(0.5) + _to_f32(s4)) * jnp.float32(0.25)  # [8, N]
        for c in range(8):
            bit = (sg >> _U32(8 * bb + c)) & _U32(1)
            out.append((8 * (8 * bb + c), _flip_sign(db * _level((code >> _U32(2 * c)) & _U32(3)), bit)))
    return out


def _dec_iq3_s(words: Words, half16: Half16, lookup: Lookup) -> list[tuple[int, jnp.ndarray]]:
    d = f16_bits_to_f32(half16("d"))  # [1, N]
    qs = words("qs", 0, 16)  # [16, N]: word r = low index bytes of grid entries 4 r .. 4 r + 3
    r = _row_iota(16, qs.shape[-1])
    sc = words("scales", 0, 1)  # 8 x 4-bit scales, one per 32 weights (rows 2 m, 2 m + 1)
    db = d * (jnp.float32(1.0) + jnp.float32(2.0) * _to_f32((sc >> ((r >> 1) << 2)) & _U32(15)))  # [16, N]
    qh = _pick_rows([words("qh", 0, 1), words("qh", 1, 1)], 16, 8)  # high index bit of entry e: bit e % 32
    qh = qh >> ((r & _U32(7)) << 2)  # bit bb: entry 4 r + bb
    sg = _signs16(words, r)
    out = []
    for bb in range(4):
        hb = (qh >> _U32(bb)) & _U32(1)
        grid = lookup(((qs >> _U32(8 * bb)) & _U32(255)) | (hb << 8))  # [16, N]: 4 magnitude bytes
        for c in range(4):
            q = 4 * bb + c  # weight 16 r + q
            bit = (sg >> _U32(q)) & _U32(1)
            out.append((16 * q, _flip_sign(db * _to_f32((grid >> _U32(8 * c)) & _U32(255)), bit)))
    return out


def _dense(name: str, cols: int) -> Callable[[Words, Half16], list[tuple[int, jnp.ndarray]]]:
    def dec(words: Words, half16: Half16) -> list[tuple[int, jnp.ndarray]]:
        if name == "F32":
            return [(0, lax.bitcast_convert_type(words("w", 0, cols), jnp.float32))]
        w = words("w", 0, cols // 2)  # [cols / 2, N]: two 16-bit values per word
        if name == "BF16":
            lo = lax.bitcast_convert_type(w << 16, jnp.float32)
            hi = lax.bitcast_convert_type(w & _U32(0xFFFF0000), jnp.float32)
        else:
            lo, hi = f16_bits_to_f32(w & _U32(0xFFFF)), f16_bits_to_f32(w >> 16)
        return [(0, lo), (cols // 2, hi)]

    return dec


_DECODERS = {"IQ4_XS": _dec_iq4_xs, "Q4_K": _dec_q4_k, "IQ2_S_R": _dec_iq2_s_r, "IQ3_S_R": _dec_iq3_s_r}
_LOOKUP_DECODERS = {"IQ2_S": _dec_iq2_s, "IQ3_S": _dec_iq3_s}


def decode_unit(
    fmt: QuantFormat, cols: int, words: Words, half16: Half16, lookup: Lookup | None = None
) -> list[tuple[int, jnp.ndarray]]:
    """One unit's weights as [(row offset, f32 [rows, N])] in the natural decode order (see module docstring).

    cols: the matrix's inputs (read by the dense formats, whose unit is the whole matrix); lookup: the
    codebook callback, required by LOOKUP_FORMATS.
    """
    if fmt.name in DENSE_FORMATS:
        return _dense(fmt.name, cols)(words, half16)
    if fmt.name in _LOOKUP_DECODERS:
        return _LOOKUP_DECODERS[fmt.name](words, half16, lookup)
    return _DECODERS[fmt.name](words, half16)


# ------------------------------------------------------------------------------ a whole matrix, unit by unit

# read(field, start, size) -> uint32 [size, N]: plane words start .. start + size - 1 of `field`.
Read = Callable[[str, int, int], jnp.ndarray]


def paired_position(block: int, n_blocks: int, block_splits: int) -> tuple[int, int]:
    """(plane word, half) holding block `block`'s 16-bit value of a 2-byte field (planes.py block_splits)."""
    k = n_blocks // block_splits
    kp = math.ceil(k / 2)
    g, b = divmod(block, k)
    return g * kp + b // 2, b % 2


def decode_pieces(
    fmt: QuantFormat, cols: int, block_splits: int, read: Read, lookup: Lookup | None = None
) -> list[tuple[int, jnp.ndarray]]:
    """A matrix's planes -> [(row offset, f32 [rows, N])] covering rows 0..cols-1 in `input_order(fmt, cols)`.

    `read` reads raw plane words (a ref slice in a kernel, an array slice in XLA); every piece has a multiple
    of 8 rows at a multiple-of-8 offset. `lookup` resolves codebook indices (LOOKUP_FORMATS only).
    """
    if fmt.name in DENSE_FORMATS:
        return decode_unit(fmt, cols, read, None)
    nb = cols // fmt.block_size
    out = []
    for b in range(nb):

        def words(field, start, size, b=b):
            return read(field, b * (fmt.field(field).nbytes // 4) + start, size)

        def half16(field, b=b):
            word, half = paired_position(b, nb, block_splits)
            return (read(field, word, 1) >> _U32(16 * half)) & _U32(0xFFFF)

        pieces = decode_unit(fmt, cols, words, half16, lookup)
        out += [(b * fmt.block_size + off, piece) for off, piece in pieces]
    return out


def decode_matrix(
    fmt: QuantFormat, cols: int, block_splits: int, fields: dict[str, jnp.ndarray]
) -> jnp.ndarray:
    """One matrix's planes (field -> uint32 [words, N]) -> f32 [cols, N] in `input_order` (plain jnp).

    `decode_matrix(...)[argsort(input_order)]` is the transposed weight matrix W^T [cols (in), N (out)].
    """

    def read(field, start, size):
        return fields[field][start : start + size]

    table = lookup_table(fmt)

    def lookup(idx):
        return jnp.take(jnp.asarray(table.reshape(-1)), idx.astype(jnp.int32), mode="clip")

    pieces = decode_pieces(fmt, cols, block_splits, read, lookup if table is not None else None)
    return jnp.concatenate([p for _, p in sorted(pieces, key=lambda t: t[0])], axis=0)
