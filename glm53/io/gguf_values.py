"""GGUF metadata values: the read-ahead cursor over a file's index and the parsing of typed values.

Every length and count is checked against the bytes left in the file (and a cap) before anything is allocated
or looped over; malformed input raises `GGUFError` naming the file, the field and the byte offset.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from glm53.errors import GGUFError
from glm53.io.sources import ByteSource, SourceError

DEFAULT_READAHEAD = 1 << 20  # first index read; each further read doubles, up to MAX_READAHEAD
MAX_READAHEAD = 64 << 20
MAX_STRING_BYTES = 256 << 20
MAX_ARRAY_ITEMS = 1 << 28
MAX_ARRAY_DEPTH = 8  # arrays of arrays of ...

SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPE = {t: np.dtype(f) for t, f in SCALAR_FORMATS.items() if t != GGUFValueType.BOOL}
_SCALAR_DTYPE[GGUFValueType.BOOL] = np.dtype("u1")
# Smallest encoding of one array item of each type: scalars their size, a string its u64 length,
# an array its u32 type + u64 count.
_MIN_ITEM_BYTES = {t: struct.calcsize(f) for t, f in SCALAR_FORMATS.items()}
_MIN_ITEM_BYTES[GGUFValueType.STRING] = 8
_MIN_ITEM_BYTES[GGUFValueType.ARRAY] = 12


@dataclasses.dataclass(frozen=True)
class GGUFValue:
    """One metadata value.

    `value`: int / float / bool / str for scalars; for arrays a 1-D numpy array (numeric and bool items),
    a list of str (string items) or a list of GGUFValue (array items). Strings are decoded as UTF-8 with
    `surrogateescape`, so invalid bytes survive: `s.encode("utf-8", "surrogateescape")`.
    """

    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None  # arrays only

    def to_python(self) -> Any:
        """The value as plain Python: arrays become (nested) lists."""
        if self.type != GGUFValueType.ARRAY:
            return self.value
        if self.item_type == GGUFValueType.ARRAY:
            return [v.to_python() for v in self.value]
        if self.item_type == GGUFValueType.STRING:
            return list(self.value)
        return self.value.tolist()


class Cursor:
    """Sequential reads of the index with read-ahead: each source read is at least `chunk` bytes, doubling."""

    def __init__(self, source: ByteSource, name: str, chunk: int):
        self.src, self.name, self.size = source, name, source.size
        self.pos = 0
        self._buf = memoryview(b"")
        self._buf_start = 0
        self._chunk = max(1, chunk)

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.name}: {problem}")

    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > self.size:
            raise self.fail(f"truncated {what}: needs bytes [{self.pos}, {end}) but the file has {self.size}")
        buf_end = self._buf_start + len(self._buf)
        if end > buf_end:
            keep = self._buf[self.pos - self._buf_start :]
            fetch = min(max(end - buf_end, self._chunk), self.size - buf_end)
            try:
                new = self.src.read(buf_end, fetch)
            except SourceError as e:
                raise self.fail(f"cannot read {what}: {e}") from e
            self._chunk = min(2 * self._chunk, MAX_READAHEAD)
            self._buf = memoryview(bytes(keep) + new)
            self._buf_start = self.pos
        out = self._buf[self.pos - self._buf_start : end - self._buf_start]
        self.pos = end
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, cap: int, strict: bool) -> str:
        n = self.unpack("<Q", f"length of {what}")
        if n > min(cap, self.remaining()):
            raise self.fail(
                f"{what} has length {n} at byte {self.pos - 8}, more than the {self.remaining()} bytes left"
                + (f" or the cap of {cap}" if n > cap else "")
            )
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8", "strict" if strict else "surrogateescape")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {self.pos - n} is not valid UTF-8: {e}") from None


def value_type(cur: Cursor, raw: int, what: str) -> GGUFValueType:
    """The value type of id `raw`, just read by `cur`."""
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{what} has unknown value type id {raw} at byte {cur.pos - 4}") from None


def read_value(cur: Cursor, vtype: GGUFValueType, what: str, depth: int = 0) -> GGUFValue:
    """The value of type `vtype` at the cursor; `what` names it in errors."""
    if vtype == GGUFValueType.STRING:
        return GGUFValue(vtype, cur.string(what, MAX_STRING_BYTES, strict=False))
    if vtype != GGUFValueType.ARRAY:
        v = cur.unpack(SCALAR_FORMATS[vtype], what)
        return GGUFValue(vtype, bool(v) if vtype == GGUFValueType.BOOL else v)
    if depth >= MAX_ARRAY_DEPTH:
        raise cur.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    itype = value_type(cur, cur.unpack("<I", f"item type of {what}"), f"array {what}")
    count = cur.unpack("<Q", f"item count of {what}")
    if count > MAX_ARRAY_ITEMS or count * _MIN_ITEM_BYTES[itype] > cur.remaining():
        raise cur.fail(
            f"array {what} claims {count} items of type {itype.name}, which cannot fit in the "
            f"{cur.remaining()} bytes left (cap {MAX_ARRAY_ITEMS} items)"
        )
    if itype in _SCALAR_DTYPE:
        dt = _SCALAR_DTYPE[itype]
        arr = np.frombuffer(cur.take(count * dt.itemsize, what), dtype=dt).astype(dt.newbyteorder("="))
        return GGUFValue(vtype, arr.astype(bool) if itype == GGUFValueType.BOOL else arr, itype)
    if itype == GGUFValueType.STRING:
        items = [cur.string(f"{what}[{i}]", MAX_STRING_BYTES, strict=False) for i in range(count)]
        return GGUFValue(vtype, items, itype)
    items = [read_value(cur, GGUFValueType.ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]
    return GGUFValue(vtype, items, itype)
