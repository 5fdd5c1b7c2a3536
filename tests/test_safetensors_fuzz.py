"""Fuzzing glm53.io.safetensors with hypothesis against the `safetensors` library's own verdict: well-formed
files (every dtype the library knows) then mutated (flipped header bytes, cut, extended, a new header length), and
hand-built headers (any dtype, shape, offsets, metadata, data length).

Property: we accept a file exactly when ``safetensors.deserialize`` accepts its bytes, and then list the same
tensors with the same dtypes and shapes and read the same bytes (bf16 and float8 included; packed sub-byte
dtypes raise CheckpointError on read); a rejected file raises CheckpointError naming it, never anything else.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import safetensors
from fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st

from glm53.errors import CheckpointError
from glm53.io.safetensors import DTYPES, SafetensorsFile

# Every dtype the library knows, with its size in bits.
BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
        "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
        "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # fmt: skip


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fuzz") / "fuzz.safetensors")


def exercise(path: str, data: bytes) -> str:
    """Writes `data` to `path`, opens it with both readers, compares; returns 'ok' or 'error'."""
    with open(path, "wb") as f:
        f.write(data)
    try:
        lib = dict(safetensors.deserialize(data))
    except safetensors.SafetensorError:
        lib = None
    try:
        ours = SafetensorsFile(path)
    except CheckpointError as e:
        assert lib is None, f"the library accepts what we reject: {e}"
        assert str(e).startswith(path), str(e)
        return "error"
    assert lib is not None, "we accept what the library rejects"
    assert sorted(ours.keys()) == sorted(lib)
    for k, t in lib.items():
        assert (ours.dtype(k), list(ours.shape(k))) == (t["dtype"], t["shape"])
        if t["dtype"] in DTYPES:
            a = ours.read(k)
            assert a.dtype == DTYPES[t["dtype"]] and a.shape == tuple(t["shape"])
            assert a.tobytes() == bytes(t["data"])
        else:
            with pytest.raises(CheckpointError, match=f"tensor '{k}'"):
                ours.read(k)
    return "ok"


def nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * BITS[dtype] // 8


# ---- 1. well-formed files, then mutated --------------------------------------------------------------

SHAPES = st.lists(st.integers(0, 5), max_size=3)
NAMES = st.sampled_from(["w", "b", "model.norm.weight", "x.weight_scale_inv", "é"])


def pack(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict | None = None) -> bytes:
    """A well-formed file, laid out as the library writes one (contiguous data, header padded to 8 bytes)."""
    h, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        h["__metadata__"] = metadata
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


DTYPE_NAMES = st.sampled_from(sorted(BITS))
META = st.none() | st.dictionaries(st.sampled_from(["format", "x"]), st.sampled_from(["pt", ""]))


@st.composite
def valid_file(draw) -> bytes:
    tensors, rng = {}, np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for name in draw(st.lists(NAMES, max_size=4, unique=True)):
        dtype, shape = draw(DTYPE_NAMES), draw(SHAPES)
        if BITS[dtype] < 8:  # packed: whole bytes only
            shape = [*shape, 8]
        tensors[name] = (dtype, shape, rng.bytes(nbytes(dtype, shape)))
    return pack(tensors, draw(META))


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(valid_file()))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "flip", "byte", "cut", "extend", "length"]))
        end = min(8 + struct.unpack("<Q", data[:8])[0], len(data)) if len(data) >= 8 else len(data)
        if kind in ("flip", "byte") and end > 8:
            pos = draw(st.integers(8, end - 1))  # inside the JSON header
            data[pos] = (
                data[pos] ^ (1 << draw(st.integers(0, 7))) if kind == "flip" else draw(st.integers(0, 255))
            )
        elif kind == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif kind == "extend":
            data += bytes(draw(st.integers(1, 16)))
        elif kind == "length" and len(data) >= 8:
            n = struct.unpack("<Q", data[:8])[0]
            data[:8] = struct.pack(
                "<Q", draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, 2**40, 2**64 - 1])) % 2**64
            )
    return bytes(data)


@fuzz(800)
@given(data=mutated())
def test_fuzz_valid_files_mutated(path, data):
    exercise(path, data)


def test_unmutated_files_read(path):
    rng = np.random.default_rng(0)
    for _ in range(20):
        t = {
            f"t{i}": (d, [2, 8], rng.bytes(nbytes(d, [2, 8])))
            for i, d in enumerate(rng.permutation(sorted(BITS))[:5])
        }
        assert exercise(path, pack(t, {"format": "pt"})) == "ok"


# ---- 2. hand-built headers -----------------------------------------------------------------------------

ODD = st.sampled_from([None, -1, 1.5, "1", True, [], {}, 2**64, 2**63])
DTYPE = st.sampled_from([*sorted(BITS), "F99", "bf16", "", 5])
ANY_SHAPE = SHAPES | st.lists(st.integers(0, 5) | ODD, max_size=3) | ODD
ANY_META = (
    st.none() | ODD | st.dictionaries(st.sampled_from(["a", "b"]), st.text(max_size=3) | ODD, max_size=2)
)
EIGHTH = st.integers(0, 7)


@st.composite
def header(draw) -> tuple[bytes, int]:
    """(JSON header, the data length its tensors tile)."""
    h, offset = {}, 0
    for name in draw(st.lists(NAMES, max_size=4, unique=True)):
        dtype, shape = draw(DTYPE), draw(ANY_SHAPE if draw(EIGHTH) == 5 else SHAPES)
        valid_shape = isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
        size = nbytes(dtype, shape) if dtype in BITS and valid_shape else 4
        start = ([offset] * 5 + [0, offset + 1, max(offset - 1, 0)])[draw(EIGHTH)]
        # mostly the right offsets; else reversed, one too long, or nonsense
        offsets = [[start, start + size]] * 5 + [[start + size, start], [start, start + size + 1]]
        k = draw(EIGHTH)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets[k] if k < 7 else draw(ODD)}
        if draw(EIGHTH) == 5:
            del entry[["dtype", "shape", "data_offsets"][draw(st.integers(0, 2))]]
        h[name] = draw(ODD) if draw(EIGHTH) == 5 else entry
        offset = max(offset, start + size)
    if draw(st.booleans()):
        h["__metadata__"] = draw(ANY_META)
    text = json.dumps(h, allow_nan=False) + " " * draw(EIGHTH)
    return text.encode(), offset


@fuzz(800)
@given(h=header(), extra=st.sampled_from([0, 0, 0, -1, 1, -4]))
def test_fuzz_hand_built_headers(path, h, extra):
    text, length = h
    n = length + extra if 0 <= length + extra <= 1 << 16 else 16  # absurd offsets: a little data
    data = (np.arange(n) % 251).astype(np.uint8).tobytes()
    exercise(path, struct.pack("<Q", len(text)) + text + data)
