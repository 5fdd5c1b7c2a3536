"""GGUF reader: metadata, tensor index and tensor bytes of a GGUF file (v2 / v3) or of a split model.

A file is read through a byte source (local path or HTTP URL, see `glm53.io.sources`): the index (header,
metadata, tensor infos) is parsed from a few read-ahead chunks, and tensor bytes are read by offset on demand.
Nothing is mapped and no file is read whole. Every length and count field is checked against the bytes left in
the file (and a cap) before anything is allocated or looped over; any malformed input raises `GGUFError`,
whose message names the file and the problem. Metadata values and the index cursor: `glm53.io.gguf_values`.

Shapes: `TensorInfo.dims` is ggml order (dims[0] is the contiguous row length); `TensorInfo.shape` is numpy
order, i.e. reversed dims.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
import struct
import urllib.parse
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from glm53.errors import GGUFError
from glm53.io.gguf_values import DEFAULT_READAHEAD, Cursor, GGUFValue, read_value, value_type
from glm53.io.sources import ByteSource, SourceError, is_url, open_source, read_box
from glm53.quant.formats import QuantFormat, UnknownFormatError, get_format

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFModel",
    "GGUFValue",
    "TensorInfo",
    "open_gguf",
    "split_shard_names",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 65535  # keys and tensor names
MAX_COUNT = 1 << 24  # tensors or key/value pairs in one file
_INT64_MAX = (1 << 63) - 1

_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset

# numpy dtypes gguf-py gives plain-typed tensors; every other type is returned as bytes
_PLAIN_TENSOR_DTYPE = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index."""

    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is contiguous
    ggml_type: int  # GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in its file
    nbytes: int
    block_size: int  # weights per block
    type_size: int  # bytes per block
    shard: int = 0  # index of the file holding it (split models)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (reversed ggml dims)."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def format(self) -> QuantFormat | None:
        """glm53's format for this type, or None where glm53 cannot dequantize it."""
        try:
            return get_format(self.ggml_type)
        except UnknownFormatError:
            return None

    @property
    def row_nbytes(self) -> int:
        """Bytes of one slice along the leading numpy axis (shape[0]); elements of 1-D block_size-1 tensors."""
        if len(self.dims) >= 2:
            return self.nbytes // self.dims[-1]
        if len(self.dims) == 1 and self.block_size == 1:
            return self.type_size
        raise ValueError(f"tensor {self.name!r} ({self.type_name}, shape {self.shape}) has no row structure")


def _type_sizes(cur: Cursor, raw: int, what: str) -> tuple[int, int]:
    """(block_size, type_size) of a ggml type id: from glm53's formats, else from gguf-py's table."""
    try:
        f = get_format(raw)
        return f.block_size, f.type_size
    except UnknownFormatError:
        pass
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(raw)]
    except (ValueError, KeyError):
        raise cur.fail(f"{what} has unknown ggml type id {raw}") from None


class GGUFFile:
    """The index of one GGUF file and on-demand reads of its tensor bytes.

    Attributes: `name` (path or URL), `version`, `alignment`, `metadata` (key -> GGUFValue, file order),
    `tensors` (name -> TensorInfo, file order), `data_offset` (start of the data section), `index_nbytes`
    (bytes of header + metadata + tensor infos), `size`, `source`.
    """

    def __init__(self, source: str | os.PathLike | ByteSource, *, readahead: int = DEFAULT_READAHEAD):
        self._owns_source = not isinstance(source, ByteSource)
        name = os.fspath(source) if self._owns_source else source.name
        try:
            self.source: ByteSource = (
                open_source(source, probe_bytes=readahead) if self._owns_source else source
            )
        except SourceError as e:
            raise GGUFError(str(e)) from e
        self.name = name
        self.size = self.source.size
        try:
            self._parse(Cursor(self.source, name, readahead))
        except BaseException:
            self.close()
            raise

    # ---- index ----------------------------------------------------------------------------------------------
    def _parse(self, cur: Cursor) -> None:
        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise cur.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
        version = cur.unpack("<I", "version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = (
                " (GGUF v1 is not supported)"
                if version == 1
                else " (a big-endian GGUF file; only little-endian is supported)"
                if swapped in (1, 2, 3)
                else ""
            )
            raise cur.fail(f"unsupported GGUF version {version}{hint}; supported: {SUPPORTED_VERSIONS}")
        self.version = version
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        need = n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT or need > cur.remaining():
            raise cur.fail(
                f"header claims {n_tensors} tensors and {n_kv} metadata pairs, which need at least {need} bytes "
                f"but {cur.remaining()} are left (cap {MAX_COUNT} each)"
            )
        self.n_tensors, self.n_kv = n_tensors, n_kv

        self.metadata: dict[str, GGUFValue] = {}
        for i in range(n_kv):
            key = cur.string(f"key of metadata pair #{i}", MAX_NAME_BYTES, strict=True)
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {key!r} (pair #{i})")
            vtype = value_type(cur, cur.unpack("<I", f"value type of {key!r}"), f"metadata {key!r}")
            self.metadata[key] = read_value(cur, vtype, f"metadata {key!r}")

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a = self.metadata["general.alignment"]
            if a.type != GGUFValueType.UINT32:
                raise cur.fail(f"general.alignment has type {a.type.name}, expected UINT32")
            if a.value == 0 or a.value & (a.value - 1):
                raise cur.fail(f"general.alignment = {a.value} is not a power of two")
            self.alignment = a.value

        # name, dims, ggml type, offset in the data section, block size, type size
        raw: list[tuple[str, tuple[int, ...], int, int, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            tname = cur.string(f"name of tensor #{i}", MAX_NAME_BYTES, strict=True)
            what = f"tensor {tname!r} (#{i})"
            if tname in seen:
                raise cur.fail(f"duplicate tensor name {tname!r} (#{i})")
            seen.add(tname)
            n_dims = cur.unpack("<I", f"n_dims of {what}")
            if n_dims > MAX_DIMS:
                raise cur.fail(f"{what} has {n_dims} dimensions; at most {MAX_DIMS} are allowed")
            dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"dims of {what}"))
            if any(d == 0 for d in dims):
                raise cur.fail(f"{what} has a zero dimension: dims {dims}")
            n_el = 1
            for d in dims:
                n_el *= d
            if n_el > _INT64_MAX:
                raise cur.fail(f"{what}: dims {dims} have {n_el} elements, more than 2**63 - 1")
            gtype = cur.unpack("<I", f"type of {what}")
            bs, ts = _type_sizes(cur, gtype, what)
            if (dims[0] if dims else 1) % bs:
                raise cur.fail(
                    f"{what} of type {GGMLQuantizationType(gtype).name} has rows of {dims[0] if dims else 1} "
                    f"elements, not a multiple of its block size {bs}"
                )
            rel = cur.unpack("<Q", f"data offset of {what}")
            raw.append((tname, dims, gtype, rel, bs, ts))
        self.index_nbytes = cur.pos
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        if n_tensors and self.data_offset > self.size:
            raise cur.fail(
                f"truncated: the data section starts at byte {self.data_offset} past the end ({self.size})"
            )

        self.tensors: dict[str, TensorInfo] = {}
        for tname, dims, gtype, rel, bs, ts in raw:
            nbytes = self._nbytes(dims, bs, ts)
            what = f"tensor {tname!r}"
            if rel % self.alignment:
                raise cur.fail(
                    f"{what} has data offset {rel}, not a multiple of the alignment {self.alignment}"
                )
            start = self.data_offset + rel
            if start + nbytes > self.size:
                raise cur.fail(
                    f"{what} data [{start}, {start + nbytes}) runs past the end of the file ({self.size} bytes)"
                )
            self.tensors[tname] = TensorInfo(tname, dims, gtype, start, nbytes, bs, ts)
        by_start = sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes))
        for a, b in zip(by_start, by_start[1:]):
            if b.offset < a.offset + a.nbytes:
                raise cur.fail(
                    f"tensors {a.name!r} [{a.offset}, {a.offset + a.nbytes}) and {b.name!r} "
                    f"[{b.offset}, {b.offset + b.nbytes}) overlap"
                )

    @staticmethod
    def _nbytes(dims: tuple[int, ...], block_size: int, type_size: int) -> int:
        n_el = 1
        for d in dims:
            n_el *= d
        return n_el // block_size * type_size

    # ---- access ---------------------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as plain Python (see GGUFValue.to_python), or `default`."""
        v = self.metadata.get(key)
        return default if v is None else v.to_python()

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.name}: no tensor {name!r} ({len(self.tensors)} tensors)") from None

    def _read(self, offset: int, nbytes: int, what: str) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        self._read_into(offset, memoryview(out), what)
        return out

    def _read_into(self, offset: int, view: memoryview, what: str) -> None:
        """Every tensor byte read goes through here (one contiguous run)."""
        try:
            self.source.read_into(offset, view)
        except SourceError as e:
            raise GGUFError(f"{self.name}: cannot read {what}: {e}") from e

    def read_tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor, [nbytes] uint8; reads exactly those bytes."""
        t = self.tensor(name)
        return self._read(t.offset, t.nbytes, f"tensor {name!r}")

    def read_tensor_rows(self, name: str, row_start: int, row_stop: int) -> np.ndarray:
        """Raw bytes of the slices [row_start, row_stop) along the leading numpy axis: [rows, row_nbytes] uint8.

        For an expert tensor of shape [E, F, D] the rows are experts; only their bytes are read.
        """
        t = self.tensor(name)
        try:
            row = t.row_nbytes
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        n_rows = t.shape[0]
        row_start, row_stop = operator.index(row_start), operator.index(row_stop)
        if not 0 <= row_start <= row_stop <= n_rows:
            raise ValueError(
                f"{self.name}: rows [{row_start}, {row_stop}) are not a range within the {n_rows} rows of {name!r}"
            )
        out = self._read(t.offset + row_start * row, (row_stop - row_start) * row, f"rows of tensor {name!r}")
        return out.reshape(row_stop - row_start, row)

    def read_tensor_region(self, name: str, lead: tuple[slice, ...]) -> np.ndarray:
        """Raw bytes of a box of the tensor's leading numpy axes (all but the last, whose row bytes come whole):
        uint8 [*box shape, row bytes]. `lead` holds one slice (step 1) per leading axis, None bounds allowed.

        Reads exactly the box's bytes: one read per contiguous run (every box row of the second-to-last axis is
        contiguous; a box spanning that whole axis is one run per index of the axes before it, and so on). For
        an expert tensor [E, rows, row bytes], ``(slice(a, b), slice(None))`` is experts [a, b) in one read.
        """
        t = self.tensor(name)
        shape = t.shape
        if not shape or len(lead) != len(shape) - 1:
            raise ValueError(
                f"{self.name}: {len(lead)} slices for the leading axes of {name!r}, shape {shape}"
            )
        box = []
        for k, (s, n) in enumerate(zip(lead, shape[:-1])):
            lo, hi, step = s.indices(n)
            if step != 1 or hi < lo:
                raise ValueError(
                    f"{self.name}: {s} of axis {k} of {name!r} is not a range within its {n} entries"
                )
            box.append((lo, hi))
        row = t.nbytes // math.prod(shape[:-1])
        what = f"a region of tensor {name!r}"
        return read_box(
            lambda off, view: self._read_into(t.offset + off, view, what), shape[:-1], row, tuple(box)
        )

    def read_tensor_data(self, name: str) -> np.ndarray:
        """The tensor as gguf-py presents it: typed with numpy shape for F32/F16/F64/I8..I64, else uint8 bytes
        shaped [*shape[:-1], row bytes]."""
        t = self.tensor(name)
        raw = self.read_tensor_bytes(name)
        dt = _PLAIN_TENSOR_DTYPE.get(GGMLQuantizationType(t.ggml_type))
        if dt is not None:
            return raw.view(dt).reshape(t.shape)
        shape = t.shape or (1,)
        return raw.reshape(*shape[:-1], shape[-1] // t.block_size * t.type_size)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def close(self) -> None:
        if self._owns_source and getattr(self, "source", None) is not None:
            self.source.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({self.name!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors, "
            f"alignment {self.alignment}, data at {self.data_offset})"
        )


def open_gguf(path_or_url: str | os.PathLike | ByteSource, *, readahead: int = DEFAULT_READAHEAD) -> GGUFFile:
    """Opens one GGUF file (a path, an http(s) URL, or a ByteSource) and parses its index."""
    return GGUFFile(path_or_url, readahead=readahead)


def split_shard_names(path_or_url: str | os.PathLike) -> list[str] | None:
    """All shard paths/URLs of a split model named like `NAME-0000N-of-0000M.gguf`, else None."""
    s = os.fspath(path_or_url)
    if is_url(s):
        parts = urllib.parse.urlsplit(s)
        head, _, base = parts.path.rpartition("/")
        m = _SPLIT_NAME.match(base)
        if m is None:
            return None
        count = m["count"]
        return [
            urllib.parse.urlunsplit(parts._replace(path=f"{head}/{m['prefix']}-{i:05d}-of-{count}.gguf"))
            for i in range(1, int(count) + 1)
        ]
    head, base = os.path.split(s)
    m = _SPLIT_NAME.match(base)
    if m is None:
        return None
    count = m["count"]
    return [os.path.join(head, f"{m['prefix']}-{i:05d}-of-{count}.gguf") for i in range(1, int(count) + 1)]


_SPLIT_NO, _SPLIT_COUNT, _SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def _int_key(f: GGUFFile, key: str) -> int | None:
    v = f.metadata.get(key)
    if v is None:
        return None
    if v.type in (GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.BOOL) or isinstance(
        v.value, float
    ):
        raise GGUFError(f"{f.name}: {key} has type {v.type.name}, expected an integer")
    return int(v.value)


class GGUFModel:
    """A model stored as one GGUF file or as split shards `NAME-0000N-of-0000M.gguf`, seen as one.

    Open it with any shard. `metadata` is the first shard's (llama.cpp's gguf-split keeps all metadata there);
    `tensors` maps every tensor name to its TensorInfo, whose `shard` says which of `shards` holds it.
    """

    def __init__(self, path_or_url: str | os.PathLike, *, readahead: int = DEFAULT_READAHEAD):
        names = split_shard_names(path_or_url)
        self.shards: list[GGUFFile] = []
        try:
            if names is None:
                f = GGUFFile(path_or_url, readahead=readahead)
                self.shards.append(f)
                count = _int_key(f, _SPLIT_COUNT)
                if count is not None and count > 1:
                    raise GGUFError(
                        f"{f.name}: split.count = {count} but the name does not follow NAME-0000N-of-0000M.gguf, "
                        "so the other shards cannot be found"
                    )
            else:
                for n in names:
                    self.shards.append(GGUFFile(n, readahead=readahead))
            self._check_split()
        except BaseException:
            self.close()
            raise
        self.name = self.shards[0].name
        self.metadata = self.shards[0].metadata

    def _check_split(self) -> None:
        n = len(self.shards)
        self.tensors: dict[str, TensorInfo] = {}
        for i, f in enumerate(self.shards):
            no, count = _int_key(f, _SPLIT_NO), _int_key(f, _SPLIT_COUNT)
            if n > 1 and (no is None or count is None):
                raise GGUFError(
                    f"{f.name}: shard {i + 1} of {n} has no {_SPLIT_NO} / {_SPLIT_COUNT} metadata"
                )
            if no is not None and no != i:
                raise GGUFError(f"{f.name}: {_SPLIT_NO} = {no}, but the file name says shard index {i}")
            if count is not None and count != n:
                raise GGUFError(f"{f.name}: {_SPLIT_COUNT} = {count}, but the file name says {n} shards")
            for t in f.tensors.values():
                if t.name in self.tensors:
                    other = self.shards[self.tensors[t.name].shard].name
                    raise GGUFError(f"{f.name}: tensor {t.name!r} is also in {other}")
                self.tensors[t.name] = dataclasses.replace(t, shard=i)
        total = _int_key(self.shards[0], _SPLIT_TENSORS)
        if total is not None and total != len(self.tensors):
            raise GGUFError(
                f"{self.shards[0].name}: {_SPLIT_TENSORS} = {total}, but the {n} shards hold {len(self.tensors)}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value of the first shard as plain Python, or `default`."""
        return self.shards[0].get(key, default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.name}: no tensor {name!r} ({len(self.tensors)} tensors)") from None

    def shard_of(self, name: str) -> GGUFFile:
        return self.shards[self.tensor(name).shard]

    def read_tensor_bytes(self, name: str) -> np.ndarray:
        return self.shard_of(name).read_tensor_bytes(name)

    def read_tensor_rows(self, name: str, row_start: int, row_stop: int) -> np.ndarray:
        return self.shard_of(name).read_tensor_rows(name, row_start, row_stop)

    def read_tensor_region(self, name: str, lead: tuple[slice, ...]) -> np.ndarray:
        return self.shard_of(name).read_tensor_region(name, lead)

    def read_tensor_data(self, name: str) -> np.ndarray:
        return self.shard_of(name).read_tensor_data(name)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def close(self) -> None:
        for f in self.shards:
            f.close()

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFModel({self.name!r}, {len(self.shards)} shards, {len(self.tensors)} tensors)"
