"""Planes: GGUF quantized blocks repacked as dense uint32 arrays with the matrix OUTPUT ROW on the last axis.

A quantized matrix [rows (out), cols (in)] is, in GGUF, `rows` rows of `n_blocks = cols / block_size` blocks, each
block a run of named byte fields (formats.py). `pack_planes` turns every field into one uint32 plane whose last
(lane) axis is the output row and whose second-to-last (sublane) axis runs over the field's words, block by block,
so a kernel reads whole words and never slices bytes at odd offsets. Leading axes (experts) are kept in front.

Field-to-plane rule (one rule for every format):

- a field of n bytes with n % 4 == 0 -> uint32 [..., n_blocks * n/4, rows]; word `b * n/4 + j` of a column holds
  bytes 4j .. 4j+3 of that field of block b, little-endian: exactly the GGUF bytes.
- a field of 2 bytes (the f16 `d` of every format, `dmin` of Q2_K/Q4_K/Q5_K, `scales_h` of IQ4_XS, the weights
  of F16/BF16) -> uint32 [..., ceil(n_blocks / 2), rows]; word j holds block 2j in its low half and block 2j+1 in
  its high half. When n_blocks is odd the high half of the last word is zero padding, two bytes per row per
  field: the planes are then larger than the GGUF bytes (budget.py counts this exactly).
- any other field size (the 1-byte FP8 weights) is rejected.

Splits (tensor parallelism): `split_rows(p, n, i)` takes output rows [i*rows/n, (i+1)*rows/n) (a lane slice of
every plane); `split_blocks(p, n, i)` takes input blocks [i*nb/n, (i+1)*nb/n) and requires whole blocks per
device. Paired 2-byte fields are re-paired inside the device's own blocks, so a device with an odd number of
blocks pays one padded half word per row and field (a single-block slice stores 2 bytes of `d` in 4).

`block_splits = s` (see `block_split_layout`) means the input blocks are cut into s equal contiguous groups and each
plane is the concatenation, along its word axis, of the s groups' planes, each paired on its own. Words of
4-byte fields do not change; paired fields get s * ceil(nb / (2 s)) words. Sharding the word axis s ways (e.g. a
NamedSharding over the TP mesh axis) then hands device i exactly `split_blocks(p, s, i)`.

`pack_planes` / `unpack_planes` run on the host (numpy) and round-trip the GGUF bytes exactly;
`dequantize_planes` is jnp, jit-able, and decodes through the single decoder `glm53.quant.dequant.decode_fields`.
Re-encoded (gather-free) layouts (reencode.py) reuse these planes with their own block formats; layout.py
unpacks and dequantizes planes of either layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct

from glm53.quant.dequant import decode_fields
from glm53.quant.formats import Field, QuantFormat, get_format

_PAIR = 2  # bytes of a field stored two blocks to a word


@struct.dataclass
class Planes:
    """Quantized matrices as dense uint32 planes (a pytree: the planes are leaves, the rest is static).

    fields: field name -> uint32 [..., n_words, rows] (leading axes, e.g. experts, first).
    fmt: the block layout the words hold (a GGUF format, or a re-encoded one from reencode.py).
    shape: (rows, cols) of one matrix: rows = outputs (lanes), cols = inputs (a multiple of the block size).
    block_splits: number of independently paired input-block groups along the word axis (module docstring).
    """

    fields: dict[str, Any]
    fmt: QuantFormat = struct.field(pytree_node=False)
    shape: tuple[int, int] = struct.field(pytree_node=False)
    block_splits: int = struct.field(pytree_node=False, default=1)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def n_blocks(self) -> int:
        return self.shape[1] // self.fmt.block_size

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """Leading (e.g. expert) axes shared by every plane."""
        return tuple(next(iter(self.fields.values())).shape[:-2])

    @property
    def nbytes(self) -> int:
        """Bytes held by the planes."""
        return sum(int(np.prod(a.shape)) * 4 for a in self.fields.values())


def _as_format(fmt: str | int | QuantFormat) -> QuantFormat:
    return fmt if isinstance(fmt, QuantFormat) else get_format(fmt)


def _is_paired(fmt: QuantFormat, field: Field) -> bool:
    if field.nbytes % 4 == 0:
        return False
    if field.nbytes == _PAIR:
        return True
    raise ValueError(
        f"{fmt.name}: field {field.name!r} has {field.nbytes} bytes per block; planes need a multiple of 4 bytes "
        f"or a 2-byte field (paired over two blocks)"
    )


def plane_words(
    fmt: str | int | QuantFormat, field: Field | str, n_blocks: int, block_splits: int = 1
) -> int:
    """Words along the sublane axis of `field`'s plane for `n_blocks` input blocks in `block_splits` groups."""
    f = _as_format(fmt)
    fd = f.field(field) if isinstance(field, str) else field
    if n_blocks % block_splits:
        raise ValueError(f"{f.name}: {n_blocks} blocks do not split into {block_splits} equal groups")
    if _is_paired(f, fd):
        return block_splits * math.ceil(n_blocks // block_splits / 2)
    return n_blocks * fd.nbytes // 4


def _check_split(what: str, total: int, n: int, i: int, label: str) -> int:
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"{label}: split index {i} out of range for {n} splits")
    if total % n:
        raise ValueError(
            f"{label}: {total} {what} do not split into {n} equal parts (whole {what} per device)"
        )
    return total // n


# ----------------------------------------------------------------------------------------------------------------
# word <-> byte conversions, generic over numpy (host packing) and jax.numpy (jit-able decoding)


def _xp(a) -> Any:
    return np if isinstance(a, np.ndarray) else jnp


def _unpair(a, s: int, nb: int, xp) -> Any:
    """Paired plane uint32 [..., s * kp, R] -> uint32 [..., R, nb] of 16-bit values (padding dropped)."""
    *lead, _, r = a.shape
    k = nb // s
    kp = math.ceil(k / 2)
    a = xp.moveaxis(a, -1, -2).reshape(*lead, r, s, kp)
    h = (a[..., None] >> xp.asarray([0, 16], dtype=xp.uint32)) & xp.uint32(0xFFFF)  # [..., R, s, kp, 2]
    return h.reshape(*lead, r, s, 2 * kp)[..., :k].reshape(*lead, r, nb)


def _pair(h, s: int, xp) -> Any:
    """uint32 [..., R, nb] of 16-bit values -> paired plane uint32 [..., s * ceil(nb / (2 s)), R]."""
    *lead, r, nb = h.shape
    k = nb // s
    kp = math.ceil(k / 2)
    h = h.reshape(*lead, r, s, k)
    if k % 2:
        h = xp.concatenate([h, xp.zeros((*lead, r, s, 1), xp.uint32)], axis=-1)
    h = h.reshape(*lead, r, s, kp, 2)
    w = h[..., 0] | (h[..., 1] << xp.uint32(16))  # [..., R, s, kp]
    return xp.moveaxis(w.reshape(*lead, r, s * kp), -1, -2)


def planes_to_words(planes: Planes, xp=None) -> dict[str, Any]:
    """Per-block words: field -> uint32 [..., rows, n_blocks, words_per_block].

    A paired 2-byte field comes back as one word per block holding the 16-bit value in its low half.
    """
    xp = xp or _xp(next(iter(planes.fields.values())))
    check_planes(planes)
    nb, s = planes.n_blocks, planes.block_splits
    out = {}
    for fd in planes.fmt.fields:
        a = planes.fields[fd.name]
        *lead, _, r = a.shape
        if _is_paired(planes.fmt, fd):
            out[fd.name] = _unpair(a, s, nb, xp)[..., None]
        else:
            out[fd.name] = xp.moveaxis(a, -1, -2).reshape(*lead, r, nb, fd.nbytes // 4)
    return out


def words_to_bytes(w, nbytes: int, xp=None) -> Any:
    """uint32 words [..., n] -> uint8 [..., nbytes] (little-endian; nbytes <= 4 n)."""
    xp = xp or _xp(w)
    b = (w[..., None] >> xp.asarray([0, 8, 16, 24], dtype=xp.uint32)) & xp.uint32(0xFF)
    return b.reshape(*w.shape[:-1], 4 * w.shape[-1])[..., :nbytes].astype(xp.uint8)


def planes_to_fields(planes: Planes, xp=None) -> dict[str, Any]:
    """Per-block GGUF byte fields: field -> uint8 [..., rows, n_blocks, field_nbytes]."""
    xp = xp or _xp(next(iter(planes.fields.values())))
    words = planes_to_words(planes, xp)
    return {fd.name: words_to_bytes(words[fd.name], fd.nbytes, xp) for fd in planes.fmt.fields}


def _bytes_to_words(b) -> np.ndarray:
    """uint8 [..., 4 n] -> uint32 [..., n] little-endian (host)."""
    return np.ascontiguousarray(b, dtype=np.uint8).view("<u4").astype(np.uint32, copy=False)


def planes_from_fields(
    fields: dict[str, np.ndarray],
    fmt: str | int | QuantFormat,
    shape: Sequence[int],
    block_splits: int = 1,
) -> Planes:
    """Planes from per-block byte fields: field -> uint8 [..., rows, n_blocks, field_nbytes] (host, numpy)."""
    f = _as_format(fmt)
    rows, cols = (int(x) for x in tuple(shape)[-2:])
    nb = cols // f.block_size
    if block_splits < 1 or nb % block_splits:
        raise ValueError(f"{f.name}: {nb} blocks do not split into {block_splits} equal groups")
    out = {}
    for fd in f.fields:
        if fd.name not in fields:
            raise KeyError(f"{f.name}: missing field {fd.name!r}; got {sorted(fields)}")
        b = np.asarray(fields[fd.name])
        if b.dtype != np.uint8 or b.shape[-3:] != (rows, nb, fd.nbytes):
            raise ValueError(
                f"{f.name}: field {fd.name!r} must be uint8 [..., {rows}, {nb}, {fd.nbytes}], got {b.dtype} {b.shape}"
            )
        lead = b.shape[:-3]
        if _is_paired(f, fd):
            h = np.ascontiguousarray(b).view("<u2")[..., 0].astype(np.uint32)  # [..., R, nb]
            out[fd.name] = np.ascontiguousarray(_pair(h, block_splits, np))
        else:
            w = _bytes_to_words(b).reshape(*lead, rows, nb * fd.nbytes // 4)
            out[fd.name] = np.ascontiguousarray(np.moveaxis(w, -1, -2))
    return Planes(out, f, (rows, cols), block_splits)


# ----------------------------------------------------------------------------------------------------------------
# public API


def gguf_fields(
    raw, fmt: str | int | QuantFormat, shape: Sequence[int], *, name: str | None = None
) -> dict[str, np.ndarray]:
    """GGUF bytes of a tensor of logical `shape` [..., rows, cols] -> field -> uint8 [..., rows, n_blocks, nbytes].

    Checks the size and dtype; `name` (the tensor's name) goes into the error messages. Views, no copies.
    """
    f = _as_format(fmt)
    label = f"{name or 'tensor'} ({f.name}, shape {tuple(shape)})"
    if f.ggml_type is None:
        raise ValueError(f"{label}: {f.name} is not a GGUF block format")
    if len(shape) < 2:
        raise ValueError(f"{label}: planes need a [..., rows, cols] shape")
    *lead, rows, cols = (int(x) for x in shape)
    if cols % f.block_size:
        raise ValueError(f"{label}: {cols} inputs is not a multiple of the block size {f.block_size}")
    for fd in f.fields:
        _is_paired(f, fd)  # rejects unsupported field sizes early, naming the field
    nb = cols // f.block_size
    a = np.frombuffer(raw, np.uint8) if isinstance(raw, bytes | bytearray | memoryview) else np.asarray(raw)
    if a.dtype != np.uint8:
        raise ValueError(f"{label}: raw bytes must be uint8, got {a.dtype}")
    want = int(np.prod(lead, dtype=np.int64)) * rows * nb * f.type_size
    if a.size != want:
        raise ValueError(f"{label}: got {a.size} bytes, expected {want}")
    blocks = a.reshape(*lead, rows, nb, f.type_size)
    return {fd.name: blocks[..., fd.offset : fd.offset + fd.nbytes] for fd in f.fields}


def pack_planes(
    raw, fmt: str | int | QuantFormat, shape: Sequence[int], *, block_splits: int = 1, name: str | None = None
) -> Planes:
    """GGUF bytes of a tensor of logical `shape` [..., rows, cols] (numpy order, cols = inputs) -> Planes.

    raw: the tensor's GGUF bytes (any array or buffer of uint8 of the exact size). name: tensor name for errors.
    """
    f = _as_format(fmt)
    return planes_from_fields(gguf_fields(raw, f, shape, name=name), f, tuple(shape)[-2:], block_splits)


def check_planes(planes: Planes) -> None:
    """Raises ValueError naming the field when a plane has the wrong shape or dtype for its format."""
    f = planes.fmt
    rows, cols = planes.shape
    if cols % f.block_size:
        raise ValueError(f"{f.name} planes: {cols} inputs is not a multiple of the block size {f.block_size}")
    if set(planes.fields) != {fd.name for fd in f.fields}:
        raise ValueError(f"{f.name} planes: fields {sorted(planes.fields)} != {[fd.name for fd in f.fields]}")
    lead = planes.lead_shape
    for fd in f.fields:
        a = planes.fields[fd.name]
        want = (*lead, plane_words(f, fd, planes.n_blocks, planes.block_splits), rows)
        if tuple(a.shape) != want or a.dtype != np.uint32:
            raise ValueError(
                f"{f.name} planes: field {fd.name!r} is {a.dtype} {tuple(a.shape)}, expected uint32 {want}"
            )


def _check_gguf_layout(planes: Planes) -> None:
    if planes.fmt.ggml_type is None:
        raise ValueError(
            f"{planes.fmt.name} planes hold a re-encoded layout; glm53.quant.layout unpacks and dequantizes those"
        )


def unpack_planes(planes: Planes) -> np.ndarray:
    """Planes of a GGUF format -> its bytes, uint8 [..., rows, n_blocks * type_size] (exact inverse of
    `pack_planes`)."""
    _check_gguf_layout(planes)
    host = Planes(
        {k: np.asarray(v) for k, v in planes.fields.items()}, planes.fmt, planes.shape, planes.block_splits
    )
    fields = planes_to_fields(host, np)
    blocks = np.concatenate([fields[fd.name] for fd in planes.fmt.fields], axis=-1)  # [..., R, nb, type_size]
    return blocks.reshape(*blocks.shape[:-2], -1)


def dequantize_planes(planes: Planes) -> jnp.ndarray:
    """Planes of a GGUF format -> f32 [..., rows, cols] (jit-able; decoded by glm53.quant.dequant.decode_fields)."""
    _check_gguf_layout(planes)
    fields = planes_to_fields(
        Planes(
            {k: jnp.asarray(v) for k, v in planes.fields.items()},
            planes.fmt,
            planes.shape,
            planes.block_splits,
        ),
        jnp,
    )
    w = decode_fields(planes.fmt, fields)  # [..., R, nb, block_size]
    return w.reshape(*w.shape[:-2], planes.cols).astype(jnp.float32)


def split_rows(planes: Planes, n: int, i: int) -> Planes:
    """Device i of n's slice by output rows: rows [i*rows/n, (i+1)*rows/n) of every plane (a lane slice)."""
    r = _check_split("rows", planes.rows, n, i, f"{planes.fmt.name} split_rows")
    fields = {k: v[..., i * r : (i + 1) * r] for k, v in planes.fields.items()}
    return Planes(fields, planes.fmt, (r, planes.cols), planes.block_splits)


def _regroup(planes: Planes, lo: int, hi: int, s_new: int) -> dict[str, Any]:
    """Fields for input blocks [lo, hi), paired fields re-paired in `s_new` groups."""
    f, nb, s = planes.fmt, planes.n_blocks, planes.block_splits
    out = {}
    for fd in f.fields:
        a = planes.fields[fd.name]
        xp = _xp(a)
        if _is_paired(f, fd):
            out[fd.name] = _pair(_unpair(a, s, nb, xp)[..., lo:hi], s_new, xp)
        else:
            wpb = fd.nbytes // 4
            out[fd.name] = a[..., lo * wpb : hi * wpb, :]
    return out


def split_blocks(planes: Planes, n: int, i: int) -> Planes:
    """Device i of n's slice by input blocks: blocks [i*nb/n, (i+1)*nb/n) (whole blocks per device).

    Paired 2-byte fields are re-paired within the slice; an odd block count per device pads half a word per row.
    """
    k = _check_split("blocks", planes.n_blocks, n, i, f"{planes.fmt.name} split_blocks")
    s = planes.block_splits
    s_new = s // n if s % n == 0 else 1
    fields = _regroup(planes, i * k, (i + 1) * k, s_new)
    return Planes(fields, planes.fmt, (planes.rows, k * planes.fmt.block_size), s_new)


def block_split_layout(planes: Planes, n: int) -> Planes:
    """The same matrix with `block_splits = n`: the word axis shards n ways into `split_blocks(planes, n, i)`."""
    _check_split("blocks", planes.n_blocks, n, 0, f"{planes.fmt.name} block_split_layout")
    return Planes(_regroup(planes, 0, planes.n_blocks, n), planes.fmt, planes.shape, n)


def split_planes(planes: Planes, split: tuple[str, int] | None, i: int) -> Planes:
    """`split` = None | ("rows", n) | ("blocks", n): device i's planes (the splits of budget.plane_nbytes)."""
    if split is None:
        return planes
    kind, n = split
    if kind == "rows":
        return split_rows(planes, n, i)
    if kind == "blocks":
        return split_blocks(planes, n, i)
    raise ValueError(f"unknown split {split!r}; expected None, ('rows', n) or ('blocks', n)")
