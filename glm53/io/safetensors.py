"""Reading one safetensors file into host numpy arrays, including bf16 and float8 tensors.

The safetensors format is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and the raw little-endian
tensor bytes. A file is accepted exactly when the `safetensors` library accepts it (``safe_open`` validates
the header: known dtypes, offsets that match each shape and tile the data section in order, no byte left over
or missing). safetensors' numpy loader cannot return bf16 or float8 arrays (numpy lacks those dtypes), so
tensors are then read by offset into ml_dtypes arrays, one at a time.

Every failure raises `CheckpointError` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import os
import re
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from glm53.errors import CheckpointError
from glm53.io.sources import read_box

# safetensors dtype names -> numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "C64": np.dtype(np.complex64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """One safetensors file, validated on open by the `safetensors` library; tensors read on demand with
    `read(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with safe_open(self.path, framework="numpy") as f:
                self.metadata: dict[str, str] = f.metadata() or {}
            n, header = self._header()
        except SafetensorError as e:
            raise self._rejected(str(e)) from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e.strerror or e}") from e
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {
            name: (t["dtype"], tuple(t["shape"]), *t["data_offsets"]) for name, t in header.items()
        }

    def _err(self, msg: str, tensor: str | None = None) -> CheckpointError:
        where = self.path if tensor is None else f"{self.path}, tensor '{tensor}'"
        return CheckpointError(f"{where}: {msg}")

    def _rejected(self, why: str) -> CheckpointError:
        """The library's verdict as a CheckpointError; a truncated file names the first tensor it lost."""
        why = why.removeprefix("Error while deserializing header: ")
        lost = self._lost_tensor() if "not fully covered" in why else None
        if lost is not None:
            tensor, (begin, end), have = lost
            msg = f"data [{begin}, {end}) runs past the file's {have} data bytes: the file is truncated"
            return self._err(f"{msg} (safetensors: {why})", tensor)
        named = re.search(r"tensor `(.*)`", why)
        return self._err(f"not a valid safetensors file (safetensors: {why})", named and named.group(1))

    def _header(self) -> tuple[int, dict]:
        """(header length, the JSON header) as the file holds them."""
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return n, json.loads(f.read(n))

    def _lost_tensor(self) -> tuple[str, tuple[int, int], int] | None:
        """(tensor, its data offsets, data bytes present) of the first tensor that runs past the end of the
        file, or None; called once the library has parsed the header and found the data section wrong."""
        try:
            size = os.path.getsize(self.path)
            n, header = self._header()
        except OSError:
            return None
        header.pop("__metadata__", None)
        have = size - 8 - n
        spans = sorted((t["data_offsets"], name) for name, t in header.items())
        return next(((name, tuple(span), have) for span, name in spans if span[1] > have), None)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str) -> str:
        """The safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self.tensors[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def _typed(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        if name not in self.tensors:
            raise self._err("no such tensor", name)
        dtype, shape, begin, end = self.tensors[name]
        if dtype not in DTYPES:
            raise self._err(f"dtype {dtype} has no numpy equivalent (sub-byte packed)", name)
        return DTYPES[dtype], shape, begin, end

    def _read_into(self, f, offset: int, buf: memoryview, name: str) -> None:
        """Every tensor byte read goes through here: `len(buf)` bytes at `offset` of the data section."""
        try:
            f.seek(self._data_start + offset)
            got = 0
            while got < len(buf):
                k = f.readinto(buf[got:])
                if not k:
                    break
                got += k
        except OSError as e:
            raise self._err(f"cannot read: {e.strerror or e}", name) from e
        if got != len(buf):
            raise self._err(f"short read ({got} of {len(buf)} bytes): the file is truncated", name)

    def read(self, name: str) -> np.ndarray:
        """The tensor as a host numpy array of its stored dtype (ml_dtypes for BF16 / F8)."""
        dtype, shape, begin, end = self._typed(name)
        out = np.empty(shape, dtype)
        try:
            with open(self.path, "rb") as f:
                self._read_into(f, begin, memoryview(out.reshape(-1).view(np.uint8)), name)
        except OSError as e:
            raise self._err(f"cannot read: {e.strerror or e}", name) from e
        return out

    def read_box(self, name: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The box [lo, hi) per axis of a tensor (stored dtype), reading exactly its bytes: one read per
        contiguous run (`glm53.io.sources.read_box`; a range of the leading axis is one read)."""
        dtype, shape, begin, _ = self._typed(name)
        try:
            with open(self.path, "rb") as f:
                raw = read_box(lambda off, view: self._read_into(f, begin + off, view, name), shape, dtype.itemsize,
                               box)  # fmt: skip
        except OSError as e:
            raise self._err(f"cannot read: {e.strerror or e}", name) from e
        except ValueError as e:
            raise self._err(str(e), name) from None
        return raw.view(dtype).reshape(raw.shape[:-1])
