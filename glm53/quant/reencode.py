"""Gather-free re-encodings of IQ2_S and IQ3_S: the same weights, decodable with shifts, masks and arithmetic only.

Every IQ2_S grid coordinate is one of {8, 25, 43} = 8 + 17 c + (c >> 1) for a level code c in 0..2, and every
signed IQ3_S weight is d * (1 + 2 scale) * (2 n - 15) for a 4-bit code n in 0..15 (the grid's odd magnitudes
1..15 with the sign bit folded in). Replacing the grid indices by these per-weight codes removes every table
lookup from the decoder, at the cost of bytes:

  IQ2_S_R, 106 bytes per 256 weights (3.3125 bpw, 106/82 = 1.293 x IQ2_S):
      d (2, f16), scales (8, the IQ2_S 4-bit scales), signs (32, the IQ2_S sign bytes),
      levels (64): weight 4 m + j at bits 2 j of byte m (word k: weights 16 k .. 16 k + 15, 2 bits each).
  IQ3_S_R, 134 bytes per 256 weights (4.1875 bpw, 134/110 = 1.218 x IQ3_S):
      d (2, f16), scales (4, the IQ3_S 4-bit scales),
      codes (128): weight 2 m + j at bits 4 j of byte m (word k: weights 8 k .. 8 k + 7, 4 bits each).

The decoded values are bit-identical to gguf-py's / llama.cpp's: IQ2_S w = (d (0.5 + s) 0.25) * g, negated when
the sign bit is set; IQ3_S w = (d (1 + 2 s)) * (2 n - 15). Re-encoding is lossless: both grids are injective
(no two entries hold the same coordinates, checked at import), so `restore` maps the codes back to the grid
indices and returns the original GGUF bytes. The re-encoded formats are `QuantFormat`s with `ggml_type=None`,
so the planes of planes.py hold them unchanged (same pairing of `d`, same splits).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm53.quant import registry, tables
from glm53.quant.formats import REENCODED_FORMATS, QuantFormat, UnknownFormatError, get_format
from glm53.quant.planes import Planes, gguf_fields, planes_from_fields, planes_to_fields, planes_to_words

REENCODED: dict[str, QuantFormat] = {  # GGUF source -> its gather-free layout (entries of glm53.quant.registry)
    src: REENCODED_FORMATS[name] for src, name in registry.reencoded_formats().items()
}
_SOURCE = {r.name: src for src, r in REENCODED.items()}


def reencoded_format(fmt: str | QuantFormat) -> QuantFormat:
    """The gather-free layout of a GGUF format ("IQ2_S" -> IQ2_S_R); UnknownFormatError where there is none."""
    name = fmt.name if isinstance(fmt, QuantFormat) else get_format(fmt).name
    if name not in REENCODED:
        raise UnknownFormatError(f"{name} has no gather-free re-encoding; available: {sorted(REENCODED)}")
    return REENCODED[name]


def source_format(fmt: QuantFormat | str) -> QuantFormat:
    """The GGUF format a re-encoded layout came from (IQ2_S_R -> IQ2_S)."""
    name = fmt.name if isinstance(fmt, QuantFormat) else str(fmt).upper()
    if name not in _SOURCE:
        raise UnknownFormatError(f"{name!r} is not a re-encoded layout; known: {sorted(_SOURCE)}")
    return get_format(_SOURCE[name])


# ----------------------------------------------------------------------------------------------------------------
# code tables (host side only: re-encoding and restoring; the decoder uses none of them)


def _iq2_level(c):
    """IQ2 level code c in 0..2 -> grid coordinate 8, 25, 43 (works on ints, numpy and jnp arrays)."""
    return 8 + 17 * c + (c >> 1)


def _inverse(keys: np.ndarray, n_keys: int, fmt: str) -> np.ndarray:
    if len(np.unique(keys)) != len(keys):  # pragma: no cover - would make the re-encoding lossy
        raise AssertionError(f"{fmt} grid has duplicate entries: re-encoding would not be invertible")
    inv = np.full(n_keys, -1, np.int32)
    inv[keys] = np.arange(len(keys), dtype=np.int32)
    return inv


_IQ2S_LEVEL_OF = {int(_iq2_level(c)): c for c in range(3)}
# grid index -> its 8 level codes as 16 bits (coordinate j at bits 2j)
_IQ2S_CODES = np.zeros(len(tables.GRIDS["IQ2_S"]), np.uint32)
for _j in range(8):
    _lv = np.vectorize(_IQ2S_LEVEL_OF.__getitem__)(tables.GRIDS["IQ2_S"][:, _j].astype(int)).astype(np.uint32)
    _IQ2S_CODES |= _lv << np.uint32(2 * _j)
_IQ2S_INDEX = _inverse(_IQ2S_CODES, 1 << 16, "IQ2_S")  # 16-bit codes -> grid index (-1: not on the grid)

# IQ3_S, per group of 4 weights: the 4-bit codes of the positive weights, n = (g + 15) / 2 (nibble j = weight j).
# A negative weight has code (15 - g) / 2 = n ^ 15, so a group's 16 code bits are _IQ3S_POS[idx] ^ _SPREAD4[signs].
_IQ3S_GRID = tables.GRIDS["IQ3_S"].astype(np.uint32)  # [512, 4] odd magnitudes 1..15
_IQ3S_POS = (((_IQ3S_GRID + 15) >> 1) << (4 * np.arange(4, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
_SPREAD4 = np.array([sum(0xF << (4 * j) for j in range(4) if s >> j & 1) for s in range(16)], np.uint32)
_IQ3S_KEYS = (_IQ3S_POS[:, None] ^ _SPREAD4[None, :]).ravel()  # [512 * 16]: (grid index, sign nibble)
_IQ3S_INDEX = _inverse(_IQ3S_KEYS, 1 << 16, "IQ3_S") >> 4  # 16 code bits -> grid index (-1: not on the grid)
_IQ3S_SIGNS = np.where(_IQ3S_INDEX >= 0, _inverse(_IQ3S_KEYS, 1 << 16, "IQ3_S") & 15, 0).astype(np.uint8)


def _bits(x: np.ndarray, width: int, count: int) -> np.ndarray:
    """uint [..., n] -> [..., n * count]: `count` fields of `width` bits per element, lowest first."""
    if width == 8 and x.dtype.itemsize == count:  # whole bytes: a little-endian view
        return np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<")).view(np.uint8)
    shifts = (width * np.arange(count)).astype(x.dtype)
    return ((x[..., None] >> shifts) & ((1 << width) - 1)).reshape(*x.shape[:-1], -1)


def _join(v: np.ndarray, width: int, count: int, dtype) -> np.ndarray:
    """Inverse of `_bits`: [..., n * count] -> [..., n] of `dtype`."""
    if width == 8 and count in (2, 4):  # whole bytes: a little-endian view
        return np.ascontiguousarray(v, np.uint8).view(f"<u{count}").astype(dtype)
    v = v.astype(np.uint32).reshape(*v.shape[:-1], -1, count)
    return (v << (width * np.arange(count, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32).astype(dtype)


def _block_error(mask: np.ndarray, fmt: str, what: str) -> ValueError:
    where = np.argwhere(mask)[0]
    return ValueError(
        f"{fmt}: {what} at block/group index {tuple(int(x) for x in where)} (not a valid encoding)"
    )


def reencode_fields(fmt: str | QuantFormat, fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF block fields (uint8 [..., nbytes] per field, formats.py names) -> re-encoded fields (host, numpy)."""
    name = reencoded_format(fmt).name
    if name == "IQ2_S_R":
        hi = _bits(fields["qh"], 2, 4).astype(np.uint16)  # [..., 32] grid index bits 8..9
        idx = fields["qs"].astype(np.uint16) | (hi << np.uint16(8))  # [..., 32] in 0..1023
        codes = _IQ2S_CODES[idx]  # [..., 32] 16-bit: 8 weights x 2 bits
        levels = _bits(codes, 8, 2).astype(np.uint8)  # [..., 64]
        return {"d": fields["d"], "scales": fields["scales"], "signs": fields["signs"], "levels": levels}
    hbit = _bits(fields["qh"], 1, 8).astype(np.uint16)  # [..., 64]
    idx = fields["qs"].astype(np.uint16) | (hbit << np.uint16(8))  # [..., 64] in 0..511
    sign4 = _bits(fields["signs"], 4, 2)  # [..., 64] sign bits of each group of 4 weights
    codes = _IQ3S_POS[idx] ^ _SPREAD4[sign4]  # [..., 64] 4 x 4-bit codes
    return {"d": fields["d"], "scales": fields["scales"], "codes": _bits(codes, 8, 2).astype(np.uint8)}


def restore_fields(fmt: str | QuantFormat, fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Re-encoded fields -> the GGUF block fields they came from (host, numpy; exact inverse of reencode_fields).

    ValueError when a group of codes is not a grid entry (the input was not produced by `reencode_fields`).
    """
    name = fmt.name if isinstance(fmt, QuantFormat) and fmt.ggml_type is None else reencoded_format(fmt).name
    if name == "IQ2_S_R":
        codes = _join(fields["levels"], 8, 2, np.uint32)  # [..., 32]
        idx = _IQ2S_INDEX[codes]
        if (idx < 0).any():
            raise _block_error(idx < 0, name, "8 level codes that are not an IQ2_S grid entry")
        idx = idx.astype(np.uint32)
        qh = _join(idx >> np.uint32(8), 2, 4, np.uint8)  # [..., 8]
        return {
            "d": fields["d"],
            "qs": (idx & np.uint32(0xFF)).astype(np.uint8),
            "signs": fields["signs"],
            "qh": qh,
            "scales": fields["scales"],
        }
    codes = _join(fields["codes"], 8, 2, np.uint32)  # [..., 64] 16 code bits per group of 4 weights
    idx = _IQ3S_INDEX[codes]
    if (idx < 0).any():
        raise _block_error(idx < 0, name, "4 codes whose magnitudes are not an IQ3_S grid entry")
    idx = idx.astype(np.uint32)
    return {
        "d": fields["d"],
        "qs": (idx & np.uint32(0xFF)).astype(np.uint8),
        "qh": _join(idx >> np.uint32(8), 1, 8, np.uint8),
        "signs": _join(_IQ3S_SIGNS[codes], 4, 2, np.uint8),
        "scales": fields["scales"],
    }


def _split_blocks(raw, f: QuantFormat, label: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    a = np.frombuffer(raw, np.uint8) if isinstance(raw, bytes | bytearray | memoryview) else np.asarray(raw)
    if a.dtype != np.uint8 or a.shape[-1] % f.type_size:
        raise ValueError(
            f"{label}: expected uint8 rows of {f.type_size}-byte {f.name} blocks, got {a.dtype} {a.shape}"
        )
    blocks = a.reshape(*a.shape[:-1], -1, f.type_size)
    return blocks, {fd.name: blocks[..., fd.offset : fd.offset + fd.nbytes] for fd in f.fields}


def _join_blocks(fields: dict[str, np.ndarray], f: QuantFormat) -> np.ndarray:
    blocks = np.concatenate([fields[fd.name] for fd in f.fields], axis=-1)  # [..., nb, type_size]
    return blocks.reshape(*blocks.shape[:-2], -1)


def reencode(raw, fmt: str | QuantFormat) -> np.ndarray:
    """GGUF byte rows uint8 [..., nb * type_size] of IQ2_S / IQ3_S -> re-encoded rows [..., nb * new_size]."""
    src = get_format(fmt) if not isinstance(fmt, QuantFormat) else fmt
    _, fields = _split_blocks(raw, src, f"reencode({src.name})")
    return _join_blocks(_map_blocks(reencode_fields, src, fields), reencoded_format(src))


def restore(raw, fmt: str | QuantFormat) -> np.ndarray:
    """Re-encoded rows of the layout of GGUF format `fmt` -> the original GGUF byte rows (exact)."""
    r = reencoded_format(fmt)
    _, fields = _split_blocks(raw, r, f"restore({r.name})")
    return _join_blocks(_map_blocks(restore_fields, r, fields), source_format(r))


def _map_blocks(fn, fmt, fields: dict[str, np.ndarray], chunk: int = 1 << 14) -> dict[str, np.ndarray]:
    """Applies a per-block field transform over [..., n] fields in chunks of blocks (bounds host memory)."""
    lead = next(iter(fields.values())).shape[:-1]
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in fields.items()}
    n = next(iter(flat.values())).shape[0]
    parts = []
    for i in range(0, max(n, 1), chunk):
        try:
            parts.append(fn(fmt, {k: v[i : i + chunk] for k, v in flat.items()}))
        except ValueError as e:
            raise ValueError(f"{e} (in flattened blocks {i}..{min(n, i + chunk) - 1})") from None
    return {k: np.concatenate([p[k] for p in parts]).reshape(*lead, -1) for k in parts[0]}


def pack_reencoded(
    raw, fmt: str | QuantFormat, shape: Sequence[int], *, block_splits: int = 1, name: str | None = None
) -> Planes:
    """GGUF bytes of an IQ2_S / IQ3_S tensor of logical shape [..., rows, cols] -> re-encoded Planes."""
    src = fmt if isinstance(fmt, QuantFormat) else get_format(fmt)
    r = reencoded_format(src)
    fields = _map_blocks(reencode_fields, src, gguf_fields(raw, src, shape, name=name))
    return planes_from_fields(fields, r, tuple(shape)[-2:], block_splits)


def unpack_reencoded(planes: Planes) -> np.ndarray:
    """Re-encoded Planes -> the source GGUF bytes, uint8 [..., rows, n_blocks * type_size] (exact)."""
    host = Planes(
        {k: np.asarray(v) for k, v in planes.fields.items()}, planes.fmt, planes.shape, planes.block_splits
    )
    fields = _map_blocks(restore_fields, planes.fmt, planes_to_fields(host, np))
    return _join_blocks(fields, source_format(planes.fmt))


# ----------------------------------------------------------------------------------------------------------------
# gather-free decoding (jnp: shifts, masks, converts, multiplies; no table, no gather)


def _unpack(w: jnp.ndarray, width: int) -> jnp.ndarray:
    """uint32 [..., n] -> uint32 [..., n * 32 / width]: consecutive `width`-bit fields, lowest first."""
    shifts = jnp.arange(0, 32, width, dtype=jnp.uint32)
    return ((w[..., None] >> shifts) & jnp.uint32((1 << width) - 1)).reshape(*w.shape[:-1], -1)


def _f16_to_f32(w: jnp.ndarray) -> jnp.ndarray:
    """uint32 holding f16 bits in its low half -> f32."""
    return jax.lax.bitcast_convert_type(w.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def decode_reencoded_words(fmt: QuantFormat | str, words: dict[str, jnp.ndarray]) -> jnp.ndarray:
    """Re-encoded per-block words (field -> uint32 [..., words_per_block], `d` in a word's low half) -> f32 [..., 256].

    The gather-free decoder: both layouts are decoded with shifts, masks, converts and multiplies only.
    """
    name = fmt.name if isinstance(fmt, QuantFormat) else str(fmt).upper()
    d = _f16_to_f32(words["d"][..., 0])[..., None]  # [..., 1]
    sc = _unpack(words["scales"], 4).astype(jnp.float32)  # [..., 16] IQ2_S / [..., 8] IQ3_S
    if name == "IQ2_S_R":
        db = d * (0.5 + sc) * 0.25  # [..., 16]: one scale per 16 weights
        c = _unpack(words["levels"], 2)  # [..., 256]
        g = _iq2_level(c).astype(jnp.float32)
        w = db[..., :, None] * g.reshape(*g.shape[:-1], 16, 16)
        neg = _unpack(words["signs"], 1).reshape(w.shape) != 0
        return jnp.where(neg, -w, w).reshape(*w.shape[:-2], 256)
    if name == "IQ3_S_R":
        db = d * (1.0 + 2.0 * sc)  # [..., 8]: one scale per 32 weights
        n = _unpack(words["codes"], 4).astype(jnp.int32)  # [..., 256]
        v = (2 * n - 15).astype(jnp.float32)
        w = db[..., :, None] * v.reshape(*v.shape[:-1], 8, 32)
        return w.reshape(*w.shape[:-2], 256)
    raise UnknownFormatError(f"no gather-free decoder for {name!r}; known: {sorted(_SOURCE)}")


def dequantize_reencoded(planes: Planes) -> jnp.ndarray:
    """Re-encoded Planes -> f32 [..., rows, cols], gather-free and jit-able (bit-exact vs gguf-py)."""
    source_format(planes.fmt)  # clear error for a GGUF layout
    p = Planes(
        {k: jnp.asarray(v) for k, v in planes.fields.items()}, planes.fmt, planes.shape, planes.block_splits
    )
    w = decode_reencoded_words(planes.fmt, planes_to_words(p, jnp))  # [..., R, nb, 256]
    return w.reshape(*w.shape[:-2], planes.cols)


def dequantize_reencoded_rows(raw, fmt: str | QuantFormat) -> jnp.ndarray:
    """Re-encoded byte rows (from `reencode`) of GGUF format `fmt` -> f32 [..., n_weights] (jit-able)."""
    r = reencoded_format(fmt)
    a = jnp.asarray(raw, dtype=jnp.uint8)
    blocks = a.reshape(*a.shape[:-1], -1, r.type_size)  # [..., nb, type_size]
    words = {}
    for fd in r.fields:
        b = blocks[..., fd.offset : fd.offset + fd.nbytes].astype(jnp.uint32)
        if fd.nbytes % 4:
            b = jnp.concatenate([b, jnp.zeros((*b.shape[:-1], 4 - fd.nbytes % 4), jnp.uint32)], axis=-1)
        b = b.reshape(*b.shape[:-1], -1, 4) << jnp.arange(0, 32, 8, dtype=jnp.uint32)
        words[fd.name] = b[..., 0] | b[..., 1] | b[..., 2] | b[..., 3]
    w = decode_reencoded_words(r, words)  # [..., nb, 256]
    return w.reshape(*w.shape[:-2], -1)
