"""Fuzzing glm53.io.gguf with hypothesis: random bytes, mutated valid files, and hand-built headers with absurd
fields. Only GGUFError may escape (naming the file), and no read allocates much more than the input's size."""

from __future__ import annotations

import functools
import struct
import tracemalloc

import numpy as np
from fuzzing import fuzz
from gguf.constants import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st
from test_gguf_reader import TENSORS, enc_str, enc_tensor, raw_gguf, write_gguf

from glm53.io.gguf import GGUFError, GGUFFile
from glm53.io.sources import MemorySource

NAME = "fuzz.gguf"


def exercise(data: bytes) -> str:
    """Opens `data` and reads everything it claims to hold; returns 'ok' or 'error'. Only GGUFError may escape
    from the reader, and the peak memory traced while reading stays within 64x the input (+1 MiB)."""
    tracemalloc.start()
    try:
        try:
            f = GGUFFile(MemorySource(data, name=NAME))
        except GGUFError as e:
            assert str(e).startswith(f"{NAME}: "), str(e)
            return "error"
        for v in f.metadata.values():
            v.to_python()
        for t in f:
            assert f.read_tensor_bytes(t.name).nbytes == t.nbytes
            assert f.read_tensor_data(t.name).nbytes == t.nbytes
            if len(t.shape) >= 2 or (len(t.shape) == 1 and t.block_size == 1):
                assert f.read_tensor_rows(t.name, 0, t.shape[0]).nbytes == t.nbytes
            assert t.offset >= f.data_offset and t.offset + t.nbytes <= len(data)
        return "ok"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= 64 * len(data) + (1 << 20), f"peak {peak} bytes for a {len(data)}-byte input"


# ---- 1. random bytes, mostly behind a valid magic and version ---------------------------------------------------

PREFIXES = [
    b"",
    b"GGUF",
    b"GGUF\x03\x00\x00\x00",
    b"GGUF\x02\x00\x00\x00",
    b"GGUF\x03\x00\x00\x00\x01" + b"\0" * 7,
]


@fuzz(1500)
@given(prefix=st.sampled_from(PREFIXES), body=st.binary(max_size=400))
def test_fuzz_random_bytes(prefix, body):
    exercise(prefix + body)


# ---- 2. valid files written by GGUFWriter, then mutated ---------------------------------------------------------


@functools.cache
def valid_files() -> tuple[tuple[bytes, int, int], ...]:
    """(file bytes, start of the tensor infos, end of the index) of a few GGUFWriter files."""
    import tempfile

    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, (align, tensors) in enumerate(
            [(None, TENSORS[:4]), (64, TENSORS[10:14]), (1, TENSORS[17:20])]
        ):
            path = write_gguf(f"{d}/{i}.gguf", alignment=align, tensors=tensors, seed=i)
            with GGUFFile(path) as f:
                infos = sum(8 + len(t.name) + 4 + 8 * len(t.dims) + 4 + 8 for t in f)
                out.append((open(path, "rb").read(), f.index_nbytes - infos, f.index_nbytes))
    return tuple(out)


@st.composite
def mutated(draw):
    data, infos_start, index_end = draw(st.sampled_from(valid_files()))
    data = bytearray(data)
    # edits land in the fixed header, the metadata, the tensor infos, or anywhere
    lo, hi = draw(
        st.sampled_from(
            [(4, 24), (24, infos_start), (infos_start, index_end), (infos_start, index_end), (4, len(data))]
        )
    )
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        pos = draw(st.integers(lo, min(hi, len(data)) - 1)) if lo < min(hi, len(data)) else 0
        kind = draw(st.sampled_from(["byte", "bit", "u64", "u64", "cut", "dup"]))
        if kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "bit":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "u64":  # a plausible-looking absurd length, count or offset
            v = draw(
                st.sampled_from([0, 1, 5, 32, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1, len(data)])
            )
            data[pos : pos + 8] = struct.pack("<Q", v)
        elif kind == "cut":
            del data[pos:]
        else:
            n = draw(st.integers(1, 64))
            data[pos:pos] = data[pos : pos + n]
    return bytes(data)


@fuzz(1500)
@given(data=mutated())
def test_fuzz_mutated_valid_files(data):
    exercise(data)


def test_unmutated_files_read():
    assert [exercise(d) for d, _, _ in valid_files()] == ["ok"] * 3


# ---- 3. hand-built headers with absurd fields -------------------------------------------------------------------

HUGE = st.sampled_from([2**16, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1])
EIGHTH = st.integers(0, 7)
SCALAR_BYTES = {
    t: st.binary(min_size=n, max_size=n)
    for t, n in {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}.items()
}
SMALL_BYTES, KEY_TEXT = st.binary(max_size=12), st.text(max_size=12)
ODD_KEY = st.sampled_from([b"general.alignment", b"\xff"])
VALUE_TYPE, BAD_TYPE, SMALL_COUNT = st.integers(0, 12), st.integers(13, 2**32 - 1), st.integers(0, 4)
TYPE_IDS = st.sampled_from([int(t) for t in GGMLQuantizationType])
DIM, BAD_DIM = st.one_of(st.integers(1, 600), st.sampled_from([32, 256])), st.sampled_from([0, 2**32, 2**63])
OFFSET, BAD_OFFSET = st.integers(0, 64).map(lambda k: 32 * k), st.one_of(st.integers(0, 4096), HUGE)
TENSOR_NAME = st.sampled_from(["w", "v", "blk.0.ffn_down_exps.weight"])


def rarely(draw, usual, absurd=HUGE):
    """Draws from `absurd` one time in eight, else from `usual`, so most cases get past the first field."""
    return draw(absurd if draw(EIGHTH) == 5 else usual)  # 5, not 0: hypothesis favours 0


def value_payload(draw, vtype: int, depth: int = 0) -> bytes:
    if vtype in SCALAR_BYTES:
        return draw(SCALAR_BYTES[vtype])
    if vtype == 8:
        s = draw(SMALL_BYTES)
        return struct.pack("<Q", rarely(draw, st.just(len(s)))) + s
    if vtype == 9:
        item = rarely(draw, VALUE_TYPE, BAD_TYPE)
        n = rarely(draw, SMALL_COUNT)
        items = b""
        if item <= 12 and n <= 4 and depth < 3:
            items = b"".join(value_payload(draw, item, depth + 1) for _ in range(n))
        return struct.pack("<IQ", item, n) + items
    return draw(SMALL_BYTES)  # unknown type: whatever follows


@st.composite
def kv(draw) -> bytes:
    key = rarely(draw, KEY_TEXT.map(str.encode), ODD_KEY)
    key_field = struct.pack("<Q", rarely(draw, st.just(len(key)))) + key
    vtype = rarely(draw, VALUE_TYPE, BAD_TYPE)
    return key_field + struct.pack("<I", vtype) + value_payload(draw, vtype)


@st.composite
def tensor_info(draw) -> bytes:
    name = draw(TENSOR_NAME)
    dims = tuple(rarely(draw, DIM, BAD_DIM) for _ in range(draw(SMALL_COUNT)))
    info = enc_tensor(name, dims, rarely(draw, TYPE_IDS, BAD_TYPE), rarely(draw, OFFSET, BAD_OFFSET))
    k = draw(EIGHTH)
    if k == 5:  # an absurd name length
        info = struct.pack("<Q", draw(HUGE)) + info[8:]
    elif k == 6:  # an absurd n_dims
        n = len(enc_str(name))
        info = info[:n] + struct.pack("<I", draw(st.integers(5, 2**32 - 1))) + info[n + 4 :]
    return info


@st.composite
def header_count(draw):
    return rarely(draw, st.none())


@st.composite
def version(draw):
    return rarely(draw, st.sampled_from([2, 3]), st.sampled_from([1, 4, 0x03000000]))


@fuzz(1500)
@given(
    kvs=st.lists(kv(), max_size=4),
    infos=st.lists(tensor_info(), max_size=3),
    n_kv=header_count(),
    n_tensors=header_count(),
    version=version(),
    data_len=st.sampled_from([0, 1, 32, 100, 4096]),
)
def test_fuzz_structured_headers(kvs, infos, n_kv, n_tensors, version, data_len):
    data = raw_gguf(
        kvs,
        infos,
        np.arange(data_len, dtype=np.uint8).tobytes(),
        n_kv=n_kv,
        n_tensors=n_tensors,
        version=version,
    )
    exercise(data)
