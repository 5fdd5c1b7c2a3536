"""Reading one safetensors file into host numpy arrays, including bf16 and float8 tensors.

The safetensors format is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and the raw little-endian
tensor bytes. safetensors' own numpy loader cannot return bf16 or float8 arrays (numpy lacks those dtypes), so the
header is parsed and validated here and tensors are read by offset into ml_dtypes arrays, one at a time.

Every failure (truncated file, bad header, unknown dtype, inconsistent offsets) raises `CheckpointError` naming
the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from glm53.errors import CheckpointError

# safetensors dtype names -> numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
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

_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


class SafetensorsFile:
    """One safetensors file: header validated on open, tensors read on demand with `read(name)` (a tensor whose
    bytes lie past the end of a truncated file fails on read, naming it; the others stay readable)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self.size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise self._err(f"file is {len(raw)} bytes, too short for a safetensors header")
                (n,) = struct.unpack("<Q", raw)
                if n > _MAX_HEADER or 8 + n > self.size:
                    raise self._err(
                        f"header length {n} does not fit the file ({self.size} bytes): truncated or "
                        "not a safetensors file"
                    )
                header_bytes = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e.strerror or e}") from e
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._err(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._err("header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self.tensors[name] = self._check_entry(name, info)

    def _err(self, msg: str, tensor: str | None = None) -> CheckpointError:
        where = self.path if tensor is None else f"{self.path}, tensor '{tensor}'"
        return CheckpointError(f"{where}: {msg}")

    def _check_entry(self, name: str, info) -> tuple[str, tuple[int, ...], int, int]:
        try:
            dtype, shape, (begin, end) = (
                info["dtype"],
                tuple(int(s) for s in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise self._err(f"malformed header entry {info!r}", name) from None
        if dtype not in DTYPES:
            raise self._err(f"unknown dtype {dtype!r}", name)
        if any(s < 0 for s in shape):
            raise self._err(f"negative dimension in shape {shape}", name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != nbytes or begin < 0:
            raise self._err(
                f"data offsets [{begin}, {end}) do not match {dtype} {list(shape)} ({nbytes} bytes)", name
            )
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str) -> str:
        """The safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self.tensors[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def read(self, name: str) -> np.ndarray:
        """The tensor as a host numpy array of its stored dtype (ml_dtypes for BF16 / F8)."""
        if name not in self.tensors:
            raise self._err("no such tensor", name)
        dtype, shape, begin, end = self.tensors[name]
        if self._data_start + end > self.size:
            raise self._err(
                f"data [{self._data_start + begin}, {self._data_start + end}) runs past the end of the file "
                f"({self.size} bytes): the file is truncated",
                name,
            )
        out = np.empty(shape, DTYPES[dtype])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with open(self.path, "rb") as f:
                f.seek(self._data_start + begin)
                got = 0
                while got < end - begin:
                    k = f.readinto(buf[got:])
                    if not k:
                        break
                    got += k
        except OSError as e:
            raise self._err(f"cannot read: {e.strerror or e}", name) from e
        if got != end - begin:
            raise self._err(f"short read ({got} of {end - begin} bytes): the file is truncated", name)
        return out
