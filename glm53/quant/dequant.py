"""Dequantization of GGUF blocks in pure jnp: bit-exact in f32 with gguf-py's `gguf.quants.dequantize`.

Three layers, each built on the one before:

- `decode_fields(fmt, fields)`: the decode math of a format, the single source of it. `fields` maps each of the
  format's named byte fields (`glm53.quant.formats`, llama.cpp memory order) to a uint8 array
  [..., field_nbytes]; returns f32 [..., block_size]. Other layouts (e.g. `glm53.quant.planes`) call this.
- `split_fields(fmt, blocks)`: uint8 [..., type_size] blocks -> that dict (`decode_blocks` composes the two).
- `dequantize(raw, fmt, shape)`: GGUF tensor bytes in the natural layout (rows of blocks) -> f32 `shape`;
  `dequantize_into` does the same into a caller's (donated) buffer.

All functions are jit-able; formats and shapes are static. Every product below is exact in f32 (an f16 scale
has 11 significant bits and the integer factors at most 12 together), so the result does not depend on the
order of the multiplications; the K-quants' one subtraction rounds once, as in gguf-py.
Codebook (IQ2/IQ3 grid) lookups are one small-table `jnp.take` per 8 (IQ2) or 4 (IQ3) weights; signs and all
K-quant decoding are bit arithmetic without gathers; the IQ4 16-level table is a gather on CPU only (faster
there) and word selects on every other platform.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from glm53.quant import registry, tables
from glm53.quant.formats import QuantFormat, get_format

Fields = Mapping[str, jax.Array]
_U32 = jnp.uint32


# ----------------------------------------------------------------------------------------------- byte helpers


def _u(x: jax.Array) -> jax.Array:
    return x.astype(_U32)


def _le(b: jax.Array, width: int) -> jax.Array:
    """uint8 [..., width * k] -> uint32 [..., k]: little-endian words of `width` (2 or 4) bytes."""
    b = _u(b).reshape(b.shape[:-1] + (-1, width))
    out = b[..., 0]
    for i in range(1, width):
        out = out | (b[..., i] << (8 * i))
    return out


def _f16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] (one little-endian f16) -> f32 [..., 1], exact."""
    return lax.bitcast_convert_type(_le(b, 2).astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _i8(x: jax.Array) -> jax.Array:
    """Low byte of each element as a signed int32."""
    return ((_u(x) & 0xFF) ^ 0x80).astype(jnp.int32) - 0x80


def _bits(x: jax.Array, step: int, count: int, mask: int) -> jax.Array:
    """x [..., n] -> uint32 [..., count, n]: (x >> (step * i)) & mask for i < count."""
    # Measured on XLA:CPU: along a non-minor axis a stack of static shifts is fast and an iota shift slow;
    # along the minor axis (`_spread`) it is the other way round.
    x = _u(x)
    return jnp.stack([(x >> (step * i)) & mask for i in range(count)], axis=-2)


def _spread(x: jax.Array, bits: int, count: int, mask: int) -> jax.Array:
    """x [..., n] -> uint32 [..., n, count]: the `count` fields of `bits` bits packed in each element."""
    sh = lax.broadcasted_iota(_U32, (x.shape[-1], count), 1) * bits
    return (_u(x)[..., :, None] >> sh) & mask


def _with_sign(v: jax.Array, s: jax.Array) -> jax.Array:
    """Flips the sign of f32 `v` where the 0/1 uint32 `s` is 1 (exact, as multiplying by -1)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(v, _U32) ^ (s << 31), jnp.float32)


def _ksigns(idx7: jax.Array) -> jax.Array:
    """7-bit sign index -> the 8 sign bits of llama.cpp's ksigns table (bit 7: parity of the seven)."""
    idx7 = _u(idx7)
    return idx7 | ((lax.population_count(idx7) & 1) << 7)


def _iq4_levels_select(q: jax.Array) -> jax.Array:
    """4-bit codes (uint32) -> IQ4_NL levels as int32 without a gather: pick one of the table's 4 packed words."""
    w = [int(v) for v in tables.KVALUES_IQ4NL_WORDS]
    hi, lo = (q & 8) != 0, (q & 4) != 0
    word = jnp.where(hi, jnp.where(lo, _U32(w[3]), _U32(w[2])), jnp.where(lo, _U32(w[1]), _U32(w[0])))
    return _i8(word >> ((q & 3) << 3))


def _iq4_levels_take(q: jax.Array) -> jax.Array:
    """4-bit codes (uint32) -> IQ4_NL levels as int32 by a gather from the 16-entry table."""
    return jnp.take(jnp.asarray(tables.KVALUES_IQ4NL.astype(np.int32)), q.astype(jnp.int32), mode="clip")


def _iq4_levels(q: jax.Array) -> jax.Array:
    """4-bit codes -> IQ4_NL levels: a 16-entry gather on CPU (measured 1.7-2x faster there), selects elsewhere.

    TPUs gather slowly and Pallas cannot lower an element gather, so every other platform gets the select form.
    """
    return lax.platform_dependent(q, cpu=_iq4_levels_take, default=_iq4_levels_select)


def _nibbles(qs: jax.Array) -> jax.Array:
    """uint8 [..., 16 k] -> uint32 [..., k, 32]: per 16-byte run, its 16 low nibbles then its 16 high nibbles."""
    # Split in uint8: when XLA:CPU materializes this (IQ4's lookup reads it three times) it costs 1 byte/weight.
    q = qs.reshape(qs.shape[:-1] + (-1, 16))
    return _u(jnp.concatenate([q & jnp.uint8(15), q >> jnp.uint8(4)], axis=-1))


def _kquant_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K 12-byte packed 6-bit (scale, min) pairs -> two uint32 [..., 8]."""
    s = _u(scales)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def _flat(x: jax.Array, nd: int) -> jax.Array:
    """Merges the last `nd` axes."""
    return x.reshape(x.shape[: x.ndim - nd] + (-1,))


# --------------------------------------------------------------------------------------------------- decoders
# Each takes the fields dict and returns f32 [..., block_size]. Comments give the weight index decomposition.


def _dec_f32(f: Fields) -> jax.Array:
    return lax.bitcast_convert_type(_le(f["w"], 4), jnp.float32)


def _dec_f16(f: Fields) -> jax.Array:
    return _f16(f["w"])


def _dec_bf16(f: Fields) -> jax.Array:
    return lax.bitcast_convert_type(_le(f["w"], 2) << 16, jnp.float32)


def _dec_q8_0(f: Fields) -> jax.Array:
    return _f32(_i8(f["qs"])) * _f16(f["d"])


def _dec_q4_0(f: Fields) -> jax.Array:
    q = _flat(_nibbles(f["qs"]), 2).astype(jnp.int32) - 8  # [..., 32]
    return _f16(f["d"]) * _f32(q)


def _dec_iq4_nl(f: Fields) -> jax.Array:
    return _f16(f["d"]) * _f32(_iq4_levels(_flat(_nibbles(f["qs"]), 2)))


def _dec_iq4_xs(f: Fields) -> jax.Array:
    # w = 32 ib + l, ib in 0..7; 6-bit scale ib = nibble ib of scales_l | 2 bits ib of scales_h << 4.
    sl = _flat(_spread(f["scales_l"], 4, 2, 15), 2)  # [..., 8]: nibble ib % 2 of byte ib // 2
    sh = _spread(_le(f["scales_h"], 2), 2, 8, 3)[..., 0, :]  # [..., 8]
    dl = _f16(f["d"]) * _f32((sl | (sh << 4)).astype(jnp.int32) - 32)  # [..., 8]
    v = _f32(_iq4_levels(_nibbles(f["qs"])))  # [..., 8, 32]
    return _flat(dl[..., None] * v, 2)


def _dec_q2_k(f: Fields) -> jax.Array:
    # w = 128 h + 32 s + l: 2 bits at 2 s of qs[32 h + l]; 16-weight sub-block w // 16 has scale/min nibbles.
    sc = _u(f["scales"])
    d, dmin = _f16(f["d"]), _f16(f["dmin"])
    dl = (d * _f32(sc & 15)).reshape(sc.shape[:-1] + (8, 2, 1))
    ml = (dmin * _f32(sc >> 4)).reshape(sc.shape[:-1] + (8, 2, 1))
    q = _bits(f["qs"].reshape(f["qs"].shape[:-1] + (2, 32)), 2, 4, 3)  # [..., 2, 4, 32]
    q = _f32(q).reshape(q.shape[:-3] + (8, 2, 16))
    return _flat(dl * q - ml, 3)


def _dec_q3_k(f: Fields) -> jax.Array:
    # scale k (16 of them, one per 16 weights): low 4 bits = nibble k // 8 of byte k % 8, high 2 bits = bits
    # 2 (k // 4) of byte 8 + k % 4. w = 128 h + 32 s + l: 2 bits at 2 s of qs[32 h + l], high bit: bit w // 32
    # of hmask[l], set meaning "no -4 offset".
    sc = _u(f["scales"])
    lo = _flat(_bits(sc[..., 0:8], 4, 2, 15), 2)  # [..., 16]
    hi = _flat(_bits(sc[..., 8:12], 2, 4, 3), 2)  # [..., 16]
    dl = _f16(f["d"]) * _f32((lo | (hi << 4)).astype(jnp.int32) - 32)  # [..., 16]
    ql = _bits(f["qs"].reshape(f["qs"].shape[:-1] + (2, 32)), 2, 4, 3)  # [..., 2, 4, 32]
    hb = _bits(f["hmask"], 1, 8, 1).reshape(ql.shape)  # [..., 2, 4, 32]
    q = ql.astype(jnp.int32) - (((hb ^ 1) << 2).astype(jnp.int32))
    q = _f32(q).reshape(q.shape[:-3] + (16, 16))
    return _flat(dl[..., None] * q, 2)


def _dec_q4_k(f: Fields) -> jax.Array:
    # w = 64 c + 32 k + l: nibble k of qs[32 c + l]; sub-block w // 32.
    sc, mn = _kquant_scale_min(f["scales"])
    dl = _f16(f["d"]) * _f32(sc)  # [..., 8]
    ml = _f16(f["dmin"]) * _f32(mn)
    q = _bits(f["qs"].reshape(f["qs"].shape[:-1] + (4, 32)), 4, 2, 15)  # [..., 4, 2, 32]
    q = _f32(q).reshape(q.shape[:-3] + (8, 32))
    return _flat(dl[..., None] * q - ml[..., None], 2)


def _dec_q5_k(f: Fields) -> jax.Array:
    # as Q4_K, plus a fifth bit: bit w // 32 of qh[l].
    sc, mn = _kquant_scale_min(f["scales"])
    dl = _f16(f["d"]) * _f32(sc)
    ml = _f16(f["dmin"]) * _f32(mn)
    ql = _bits(f["qs"].reshape(f["qs"].shape[:-1] + (4, 32)), 4, 2, 15)  # [..., 4, 2, 32]
    ql = ql.reshape(ql.shape[:-3] + (8, 32))
    qh = _bits(f["qh"], 1, 8, 1)  # [..., 8, 32]
    q = _f32(ql | (qh << 4))
    return _flat(dl[..., None] * q - ml[..., None], 2)


def _dec_q6_k(f: Fields) -> jax.Array:
    # w = 128 h + 32 s + l (s in 0..3): low nibble s // 2 of ql[64 h + 32 (s % 2) + l], high 2 bits at 2 s of
    # qh[32 h + l]; int8 scale per 16 weights.
    ql = _bits(f["ql"].reshape(f["ql"].shape[:-1] + (2, 64)), 4, 2, 15)  # [..., 2, 2, 64] = [.., h, s//2, ..]
    ql = ql.reshape(ql.shape[:-3] + (2, 4, 32))
    qh = _bits(f["qh"].reshape(f["qh"].shape[:-1] + (2, 32)), 2, 4, 3)  # [..., 2, 4, 32]
    q = (ql | (qh << 4)).astype(jnp.int32) - 32
    q = _f32(q).reshape(q.shape[:-3] + (16, 16))
    dl = _f16(f["d"]) * _f32(_i8(f["scales"]))  # [..., 16]
    return _flat(dl[..., None] * q, 2)


def _iq2_values(grid_idx: jax.Array, name: str) -> jax.Array:
    """Grid indices [..., g] -> f32 coordinate magnitudes [..., g, 8] in {8, 25, 43}."""
    codes = jnp.take(jnp.asarray(tables.GRID_CODES[name]), grid_idx.astype(jnp.int32), mode="clip")
    c = _spread(codes, 2, 8, 3)  # [..., g, 8] level codes 0..2
    return _f32(8 + 17 * c + (c >> 1))


def _iq3_values(grid_idx: jax.Array, name: str) -> jax.Array:
    """Grid indices [..., g] -> f32 coordinate magnitudes [..., g, 4] (one packed uint32 word per entry)."""
    words = jnp.take(jnp.asarray(tables.GRID_WORDS[name][:, 0]), grid_idx.astype(jnp.int32), mode="clip")
    return _f32(_spread(words, 8, 4, 255))


def _iq_scale(d: jax.Array, s4: jax.Array, mult: float) -> jax.Array:
    """d * (0.5 + s) * mult, as gguf-py computes IQ2/IQ3_XXS sub-block scales."""
    return d * (jnp.float32(0.5) + _f32(s4)) * jnp.float32(mult)


def _dec_iq2_xxs(f: Fields) -> jax.Array:
    # 8 sub-blocks of 32: two words (a0, a1); a0's bytes index 4 grid entries of 8; a1 = 4 x 7-bit sign
    # indices | 4-bit scale << 28.
    a = _le(f["qs"], 4).reshape(f["qs"].shape[:-1] + (8, 2))
    a0, a1 = a[..., 0], a[..., 1]  # [..., 8]
    db = _iq_scale(_f16(f["d"]), a1 >> 28, 0.25)  # [..., 8]
    v = _iq2_values(_spread(a0, 8, 4, 255), "IQ2_XXS")  # [..., 8, 4, 8]
    sg = _spread(_ksigns(_spread(a1, 7, 4, 127)), 1, 8, 1)  # [..., 8, 4, 8]
    return _flat(_with_sign(db[..., None, None] * v, sg), 3)


def _dec_iq2_xs(f: Fields) -> jax.Array:
    # 32 little-endian uint16 entries of 8 weights: 9-bit grid index | 7-bit sign index << 9; a 4-bit scale per
    # 16 weights. (Read byte-wise: combining the bytes into words first is 7x slower on XLA:CPU.)
    q = _u(f["qs"]).reshape(f["qs"].shape[:-1] + (32, 2))
    lo, hi = q[..., 0], q[..., 1]  # [..., 32]
    s = _flat(_spread(f["scales"], 4, 2, 15), 2)  # [..., 16]
    db = _iq_scale(_f16(f["d"]), s, 0.25).reshape(s.shape[:-1] + (16, 1, 1))
    v = _iq2_values(lo | ((hi & 1) << 8), "IQ2_XS").reshape(lo.shape[:-1] + (16, 2, 8))
    sg = _spread(_ksigns(hi >> 1), 1, 8, 1).reshape(v.shape)
    return _flat(_with_sign(db * v, sg), 3)


def _dec_iq2_s(f: Fields) -> jax.Array:
    # 32 entries of 8 weights: 10-bit grid index = qs[g] | 2 bits (2 (g % 4)) of qh[g // 4] << 8; explicit
    # sign bits; a 4-bit scale per 16 weights.
    qh = _flat(_spread(f["qh"], 2, 4, 3), 2)  # [..., 32]
    idx = _u(f["qs"]) | (qh << 8)
    s = _flat(_spread(f["scales"], 4, 2, 15), 2)  # [..., 16]
    db = _iq_scale(_f16(f["d"]), s, 0.25).reshape(s.shape[:-1] + (16, 1, 1))
    v = _iq2_values(idx, "IQ2_S").reshape(idx.shape[:-1] + (16, 2, 8))
    sg = _spread(f["signs"], 1, 8, 1).reshape(v.shape)
    return _flat(_with_sign(db * v, sg), 3)


def _dec_iq3_xxs(f: Fields) -> jax.Array:
    # 64 grid entries of 4 weights (qs bytes); per 32 weights one word = 4 x 7-bit sign indices | scale << 28.
    a = _le(f["scales_signs"], 4)  # [..., 8]
    db = _iq_scale(_f16(f["d"]), a >> 28, 0.5)  # [..., 8]
    v = _iq3_values(f["qs"], "IQ3_XXS").reshape(a.shape + (4, 8))  # [..., 8, 4, 8]
    sg = _spread(_ksigns(_spread(a, 7, 4, 127)), 1, 8, 1)  # [..., 8, 4, 8]
    return _flat(_with_sign(db[..., None, None] * v, sg), 3)


def _dec_iq3_s(f: Fields) -> jax.Array:
    # 64 grid entries of 4 weights: 9-bit index = qs[i] | bit i % 8 of qh[i // 8] << 8; explicit sign bits;
    # scale 1 + 2 s (4-bit s) per 32 weights.
    qh = _flat(_spread(f["qh"], 1, 8, 1), 2)  # [..., 64]
    idx = _u(f["qs"]) | (qh << 8)
    s = _flat(_spread(f["scales"], 4, 2, 15), 2)  # [..., 8]
    db = _f16(f["d"]) * _f32(1 + 2 * s)  # [..., 8]
    v = _iq3_values(idx, "IQ3_S").reshape(idx.shape[:-1] + (8, 8, 4))
    sg = _spread(f["signs"], 1, 8, 1).reshape(v.shape)
    return _flat(_with_sign(db[..., None, None] * v, sg), 3)


_DECODERS: dict[str, Callable[[Fields], jax.Array]] = {
    "F32": _dec_f32,
    "F16": _dec_f16,
    "BF16": _dec_bf16,
    "Q8_0": _dec_q8_0,
    "Q4_0": _dec_q4_0,
    "IQ4_NL": _dec_iq4_nl,
    "IQ4_XS": _dec_iq4_xs,
    "Q2_K": _dec_q2_k,
    "Q3_K": _dec_q3_k,
    "Q4_K": _dec_q4_k,
    "Q5_K": _dec_q5_k,
    "Q6_K": _dec_q6_k,
    "IQ2_XXS": _dec_iq2_xxs,
    "IQ2_XS": _dec_iq2_xs,
    "IQ2_S": _dec_iq2_s,
    "IQ3_XXS": _dec_iq3_xxs,
    "IQ3_S": _dec_iq3_s,
}

# The GGUF formats of the registry's "jnp" backend (the re-encoded ones decode in reencode.py); `_DECODERS` names
# exactly these (tests/test_expert_formats.py).
SUPPORTED_FORMATS: tuple[str, ...] = tuple(f for f in registry.formats_for("jnp") if registry.entry(f).gguf)


# ------------------------------------------------------------------------------------------------- public API


def _format(fmt: str | int | QuantFormat) -> QuantFormat:
    f = fmt if isinstance(fmt, QuantFormat) else get_format(fmt)
    if f.name not in _DECODERS:
        raise NotImplementedError(f"no GGUF block decoder for {f.name} (FP8 lives in glm53.quant.fp8)")
    return f


def decode_fields(fmt: str | int | QuantFormat, fields: Fields) -> jax.Array:
    """Decodes blocks given as named uint8 byte fields [..., field_nbytes] -> f32 [..., block_size].

    The field names and sizes are the format's (`glm53.quant.formats`); all fields share the leading dims.
    """
    f = _format(fmt)
    names = [x.name for x in f.fields]
    if set(fields) != set(names):
        raise ValueError(f"{f.name}: expected fields {names}, got {sorted(fields)}")
    lead = None
    for fld in f.fields:
        a = fields[fld.name]
        if a.dtype != jnp.uint8 or a.ndim < 1 or a.shape[-1] != fld.nbytes:
            raise ValueError(
                f"{f.name}: field {fld.name!r} must be uint8 [..., {fld.nbytes}], got {a.dtype} {tuple(a.shape)}"
            )
        if lead is None:
            lead = a.shape[:-1]
        elif a.shape[:-1] != lead:
            raise ValueError(f"{f.name}: field {fld.name!r} has leading dims {a.shape[:-1]}, expected {lead}")
    return _DECODERS[f.name]({k: jnp.asarray(v) for k, v in fields.items()})


def split_fields(fmt: str | int | QuantFormat, blocks: jax.Array) -> dict[str, jax.Array]:
    """uint8 blocks [..., type_size] -> {field name: uint8 [..., field_nbytes]}."""
    f = _format(fmt)
    if blocks.dtype != jnp.uint8 or blocks.ndim < 1 or blocks.shape[-1] != f.type_size:
        raise ValueError(
            f"{f.name}: blocks must be uint8 [..., {f.type_size}], got {blocks.dtype} {blocks.shape}"
        )
    return {fld.name: blocks[..., fld.offset : fld.offset + fld.nbytes] for fld in f.fields}


def decode_blocks(fmt: str | int | QuantFormat, blocks: jax.Array) -> jax.Array:
    """uint8 blocks [..., type_size] -> f32 [..., block_size]."""
    return decode_fields(fmt, split_fields(fmt, blocks))


# XLA:CPU emits a fusion as loops over its root shape. With a root of [rows, cols] the inner loop runs over a
# whole row and per-block values are recomputed for every weight (5-20x slower, measured); with a root of
# [n / 32, 32] each inner loop covers one 32-weight sub-block. So host calls decode into that flat shape and
# then reshape with a donated (zero-copy) bitcast.
_ROW = 32


def _decode_raw(raw: jax.Array, f: QuantFormat, n: int) -> jax.Array:
    """uint8 bytes of n weights -> f32 [n // _ROW, _ROW] (block formats) or [n] (F32/F16/BF16)."""
    out = decode_blocks(f, raw.reshape(n // f.block_size, f.type_size))
    return out.reshape(-1) if f.block_size == 1 else out.reshape(-1, _ROW)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _dequantize_flat(raw: jax.Array, name: str, n: int, dtype: np.dtype) -> jax.Array:
    return _decode_raw(raw.reshape(-1), get_format(name), n).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(0,))
def _reshape_donated(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return x.reshape(shape)


def _check_raw(raw, f: QuantFormat, shape) -> tuple[jax.Array | np.ndarray, tuple[int, ...]]:
    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] % f.block_size:
        raise ValueError(f"{f.name}: shape {shape} needs a last dim that is a multiple of {f.block_size}")
    if isinstance(raw, bytes | bytearray | memoryview):
        raw = np.frombuffer(raw, np.uint8)
    if raw.dtype != np.uint8:
        raise ValueError(f"{f.name}: raw data must be uint8 bytes, got {raw.dtype}")
    need = f.nbytes(math.prod(shape))
    if raw.size != need:
        raise ValueError(f"{f.name}: shape {shape} needs {need} bytes, got {raw.size}")
    return raw, shape


def dequantize(
    raw: jax.Array | np.ndarray | bytes,
    fmt: str | int | QuantFormat,
    shape: tuple[int, ...] | list[int],
    dtype=jnp.float32,
) -> jax.Array:
    """GGUF tensor bytes (natural layout: rows of blocks, row-major) -> `shape` array of `dtype` (default f32).

    `shape` is the logical numpy-order shape (GGUF `ne` reversed); its last dim must be a multiple of the
    format's block size. `raw` holds exactly the tensor's bytes in any shape. Works on host data and on traced
    uint8 arrays inside jit.
    """
    f = _format(fmt)
    raw, shape = _check_raw(raw, f, shape)
    n = math.prod(shape)
    if isinstance(raw, jax.core.Tracer):
        return _decode_raw(raw.reshape(-1), f, n).astype(dtype).reshape(shape)
    flat = _dequantize_flat(jnp.asarray(raw), f.name, n, np.dtype(dtype))
    return _reshape_donated(flat, shape)


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def _dequantize_into_flat(raw: jax.Array, name: str, out: jax.Array) -> jax.Array:
    f = get_format(name)
    dec = _decode_raw(raw.reshape(-1), f, out.size).astype(out.dtype).reshape(out.shape)
    return lax.dynamic_update_slice(out, dec, (0,) * out.ndim)


def dequantize_into(
    raw: jax.Array | np.ndarray | bytes, fmt: str | int | QuantFormat, out: jax.Array
) -> jax.Array:
    """Like `dequantize`, but writes into `out` (its shape and dtype), which is donated; returns the result.

    For host callers that reuse one buffer (no fresh allocation per call); inside jit it is `dequantize`.
    """
    f = _format(fmt)
    raw, shape = _check_raw(raw, f, out.shape)
    if isinstance(raw, jax.core.Tracer) or isinstance(out, jax.core.Tracer):
        return dequantize(raw, f, shape, out.dtype)
    n = math.prod(shape)
    flat_shape = (n,) if f.block_size == 1 else (n // _ROW, _ROW)
    flat = _dequantize_into_flat(jnp.asarray(raw), f.name, _reshape_donated(out, flat_shape))
    return _reshape_donated(flat, shape)
