"""glm53.io.gguf against gguf-py: files written by gguf.GGUFWriter read identically by gguf.GGUFReader and by us;
split models; HTTP range reads; exact byte accounting; every malformed-input check raises GGUFError."""

from __future__ import annotations

import http.server
import math
import os
import struct
import threading
import urllib.parse

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from glm53.io.gguf import GGUFError, GGUFFile, GGUFModel, GGUFValue, open_gguf, split_shard_names
from glm53.io.sources import LocalFileSource, MemorySource
from glm53.quant.formats import FORMATS, get_format

Q, V = GGMLQuantizationType, GGUFValueType

# ---------------------------------------------------------------------------------------------------------------
# Writing test files with gguf-py's GGUFWriter
# ---------------------------------------------------------------------------------------------------------------

SCALARS = [  # (type, value written, value expected back)
    (V.UINT8, 255, 255),
    (V.INT8, -128, -128),
    (V.UINT16, 65535, 65535),
    (V.INT16, -32768, -32768),
    (V.UINT32, 2**32 - 1, 2**32 - 1),
    (V.INT32, -(2**31), -(2**31)),
    (V.FLOAT32, 0.1, float(np.float32(0.1))),
    (V.UINT64, 2**64 - 1, 2**64 - 1),
    (V.INT64, -(2**63), -(2**63)),
    (V.FLOAT64, math.pi, math.pi),
    (V.BOOL, True, True),
    (V.STRING, "ünïcode ☃ text", "ünïcode ☃ text"),
]
ARRAYS = [  # (key, value, sub_type or None, expected to_python)
    ("arr.u8", [0, 7, 255], V.UINT8, [0, 7, 255]),
    ("arr.i8", [-128, 0, 127], V.INT8, [-128, 0, 127]),
    ("arr.u16", [1, 65535], V.UINT16, [1, 65535]),
    ("arr.i16", [-5, 5], V.INT16, [-5, 5]),
    ("arr.u32", [3, 2**32 - 1], V.UINT32, [3, 2**32 - 1]),
    ("arr.i32", [-(2**31), 2**31 - 1], V.INT32, [-(2**31), 2**31 - 1]),
    ("arr.f32", [0.5, -1.25, 0.1], V.FLOAT32, [0.5, -1.25, float(np.float32(0.1))]),
    ("arr.u64", [2**64 - 1, 0], V.UINT64, [2**64 - 1, 0]),
    ("arr.i64", [-(2**63), 2**63 - 1], V.INT64, [-(2**63), 2**63 - 1]),
    ("arr.f64", [math.e, -0.0], V.FLOAT64, [math.e, -0.0]),
    ("arr.bool", [True, False, True], V.BOOL, [True, False, True]),
    ("arr.str", ["a", "", "ββ", "tok<0x0A>"], V.STRING, ["a", "", "ββ", "tok<0x0A>"]),
    ("arr.nested", [[1, 2], [3, 4, 5]], None, [[1, 2], [3, 4, 5]]),
    ("arr.nested_mixed", [[1, 2], [0.5], ["x", "yz"]], None, [[1, 2], [0.5], ["x", "yz"]]),
    ("arr.nested3", [[[1.5]], [[2.5, 3.5], [4.5]]], None, [[[1.5]], [[2.5, 3.5], [4.5]]]),
    ("arr.nested_str", [["a"], ["b", "c"]], None, [["a"], ["b", "c"]]),
]

# ggml type -> numpy shape (elements) of a test tensor; data is random bytes of the right size
PLAIN = {
    Q.F32: np.float32,
    Q.F16: np.float16,
    Q.F64: np.float64,
    Q.I8: np.int8,
    Q.I16: np.int16,
    Q.I32: np.int32,
    Q.I64: np.int64,
}
TENSORS = [  # (name, type, numpy shape)
    ("plain.f32", Q.F32, (3, 5)),
    ("plain.f16", Q.F16, (2, 3, 4)),
    ("plain.f64", Q.F64, (7,)),
    ("plain.i8", Q.I8, (2, 1, 3, 5)),
    ("plain.i16", Q.I16, (4, 2)),
    ("plain.i32", Q.I32, (3, 3)),
    ("plain.i64", Q.I64, (2, 2)),
    ("raw.bf16", Q.BF16, (3, 8)),
    ("q.q8_0", Q.Q8_0, (2, 64)),
    ("q.q4_0", Q.Q4_0, (3, 32)),
    ("q.q4_k", Q.Q4_K, (2, 256)),
    ("q.q6_k", Q.Q6_K, (1, 512)),
    ("q.iq2_s", Q.IQ2_S, (4, 2, 256)),  # expert-like: [E, F, D]
    ("q.iq3_s", Q.IQ3_S, (3, 256)),
    ("q.iq4_xs", Q.IQ4_XS, (2, 2, 256)),
    ("q.iq2_xxs", Q.IQ2_XXS, (256,)),
    ("q.iq4_nl", Q.IQ4_NL, (2, 32)),
    # types glm53 cannot dequantize: sizes from gguf-py's table
    ("other.q5_1", Q.Q5_1, (2, 32)),
    ("other.tq2_0", Q.TQ2_0, (1, 256)),
    ("other.mxfp4", Q.MXFP4, (2, 64)),
    ("other.iq1_m", Q.IQ1_M, (2, 256)),
    ("other.q1_0", Q.Q1_0, (3, 128)),
]


def write_gguf(path, *, alignment=None, version=3, tensors=TENSORS, extra_kv=(), seed=0, arch="test"):
    """Writes a GGUF with every metadata type and the given tensors (random bytes); returns the path."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vt, val, _ in SCALARS:
        w.add_key_value(f"scalar.{vt.name.lower()}", val, vt)
    w.add_key_value("scalar.bool_false", False, V.BOOL)
    w.add_key_value("scalar.raw_bytes", b"\xff\xfe not utf-8", V.STRING)
    for key, val, sub, _ in ARRAYS:
        w.add_key_value(key, val, V.ARRAY, sub_type=sub)
    for key, val, vt in extra_kv:
        w.add_key_value(key, val, vt)
    for name, qt, shape in tensors:
        if qt in PLAIN:
            data = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(PLAIN[qt]).itemsize, dtype=np.uint8)
            w.add_tensor(name, data.view(PLAIN[qt]).reshape(shape))
        else:
            bs, ts = GGML_QUANT_SIZES[qt]
            byte_shape = (*shape[:-1], shape[-1] // bs * ts)
            w.add_tensor(name, rng.integers(0, 256, byte_shape, dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version != 3:
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(struct.pack("<I", version))
    return str(path)


def leaves(v: GGUFValue) -> list[tuple[str, list]]:
    """Our value as gguf-py's leaf parts: (dtype name, values) per scalar, (uint8, bytes) per string."""
    if v.type == V.STRING:
        return [("uint8", list(v.value.encode("utf-8", "surrogateescape")))]
    if v.type != V.ARRAY:
        return [(DTYPE_NAME[v.type], [v.value])]
    if v.item_type == V.STRING:
        return [("uint8", list(s.encode("utf-8", "surrogateescape"))) for s in v.value]
    if v.item_type == V.ARRAY:
        return [leaf for child in v.value for leaf in leaves(child)]
    return [(DTYPE_NAME[v.item_type], [x]) for x in v.value.tolist()]


DTYPE_NAME = {
    V.UINT8: "uint8",
    V.INT8: "int8",
    V.UINT16: "uint16",
    V.INT16: "int16",
    V.UINT32: "uint32",
    V.INT32: "int32",
    V.FLOAT32: "float32",
    V.UINT64: "uint64",
    V.INT64: "int64",
    V.FLOAT64: "float64",
    V.BOOL: "bool",
}


def types_of(v: GGUFValue) -> list:
    """gguf-py's ReaderField.types: the type chain through the first item of each array."""
    if v.type != V.ARRAY:
        return [v.type]
    if v.item_type == V.ARRAY:
        return [V.ARRAY, *types_of(v.value[0])]
    return [V.ARRAY, v.item_type]


def assert_matches_gguf_py(ours: GGUFFile, path: str) -> None:
    ref = gguf.GGUFReader(path)
    assert ours.version == int(ref.fields["GGUF.version"].parts[0][0])
    assert ours.n_tensors == int(ref.fields["GGUF.tensor_count"].parts[0][0]) == len(ours.tensors)
    assert ours.n_kv == int(ref.fields["GGUF.kv_count"].parts[0][0]) == len(ours.metadata)
    assert ours.alignment == ref.alignment
    assert ours.data_offset == ref.data_offset
    ref_fields = [f for k, f in ref.fields.items() if not k.startswith("GGUF.")]
    assert list(ours.metadata) == [f.name for f in ref_fields]
    for f in ref_fields:
        v = ours.metadata[f.name]
        assert types_of(v) == f.types, f.name
        ref_leaves = [(f.parts[i].dtype.name, f.parts[i].tolist()) for i in f.data]
        assert leaves(v) == ref_leaves, f.name
    assert [t.name for t in ours] == [t.name for t in ref.tensors]
    for rt in ref.tensors:
        t = ours.tensor(rt.name)
        assert t.ggml_type == int(rt.tensor_type)
        assert t.dims == tuple(int(d) for d in rt.shape)
        assert t.shape == tuple(reversed(t.dims))
        assert (t.n_elements, t.nbytes, t.offset) == (rt.n_elements, rt.n_bytes, rt.data_offset)
        data = ours.read_tensor_data(rt.name)
        assert data.dtype == rt.data.dtype and data.shape == rt.data.shape
        assert data.tobytes() == rt.data.tobytes()
        assert ours.read_tensor_bytes(rt.name).tobytes() == rt.data.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Agreement with gguf-py
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {
        "default": write_gguf(d / "default.gguf"),
        "align1": write_gguf(d / "align1.gguf", alignment=1, seed=1),
        "align256": write_gguf(d / "align256.gguf", alignment=256, seed=2),
        "v2_align64": write_gguf(d / "v2.gguf", alignment=64, version=2, seed=3),
    }


@pytest.mark.parametrize("which", ["default", "align1", "align256", "v2_align64"])
def test_matches_gguf_reader(files, which):
    with open_gguf(files[which]) as f:
        assert_matches_gguf_py(f, files[which])
        assert f.version == (2 if which.startswith("v2") else 3)
        assert f.alignment == {"default": 32, "align1": 1, "align256": 256, "v2_align64": 64}[which]
        assert all(t.offset % f.alignment == 0 for t in f)


def test_metadata_values_are_what_was_written(files):
    with open_gguf(files["default"]) as f:
        for vt, _, expected in SCALARS:
            v = f.metadata[f"scalar.{vt.name.lower()}"]
            assert v.type == vt and v.value == expected and type(v.value) is type(expected)
        assert f.get("scalar.bool_false") is False
        assert f.get("general.architecture") == "test"
        assert (
            f.metadata["scalar.raw_bytes"].value.encode("utf-8", "surrogateescape") == b"\xff\xfe not utf-8"
        )
        for key, _, sub, expected in ARRAYS:
            v = f.metadata[key]
            assert v.type == V.ARRAY and v.item_type == (V.ARRAY if sub is None else sub)
            assert f.get(key) == expected, key
            if sub is not None and sub in DTYPE_NAME:
                assert v.value.dtype.name == DTYPE_NAME[sub]
        inner = f.metadata["arr.nested_mixed"].value
        assert [c.item_type for c in inner] == [V.INT32, V.FLOAT32, V.STRING]
        assert f.get("missing.key", 17) == 17


def test_tensor_types_and_sizes(files):
    with open_gguf(files["default"]) as f:
        for name, qt, shape in TENSORS:
            t = f.tensor(name)
            bs, ts = GGML_QUANT_SIZES[qt]
            assert (t.ggml_type, t.type_name, t.shape) == (int(qt), qt.name, shape)
            assert (t.block_size, t.type_size) == (bs, ts)
            assert t.nbytes == int(np.prod(shape)) // bs * ts
            if qt.name in FORMATS:  # glm53 can dequantize it
                assert t.format is get_format(qt.name)
            else:  # F64, I8..I64, Q5_1, TQ2_0, MXFP4, IQ1_M, Q1_0: indexed and readable all the same
                assert t.format is None
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            f.read_tensor_bytes("nope")


def test_read_tensor_rows_matches_gguf_py(files):
    ref = {t.name: t for t in gguf.GGUFReader(files["default"]).tensors}
    rng = np.random.default_rng(0)
    with open_gguf(files["default"]) as f:
        for t in f:
            if len(t.shape) < 2 and t.block_size != 1:
                with pytest.raises(ValueError, match="no row structure"):
                    f.read_tensor_rows(t.name, 0, 1)
                continue
            rows = ref[t.name].data.reshape(t.shape[0], -1).view(np.uint8).reshape(t.shape[0], -1)
            for _ in range(3):
                a = int(rng.integers(0, t.shape[0] + 1))
                b = int(rng.integers(a, t.shape[0] + 1))
                got = f.read_tensor_rows(t.name, a, b)
                assert got.shape == (b - a, t.row_nbytes) and np.array_equal(got, rows[a:b]), (t.name, a, b)
        with pytest.raises(ValueError, match="not a range"):
            f.read_tensor_rows("q.iq2_s", 2, 5)
        with pytest.raises(ValueError, match="not a range"):
            f.read_tensor_rows("q.iq2_s", 3, 2)


class CountingSource:
    """Wraps a source and records every read (offset, nbytes)."""

    def __init__(self, inner):
        self.inner, self.name, self.size = inner, inner.name, inner.size
        self.reads: list[tuple[int, int]] = []

    def read(self, offset, n):
        self.reads.append((offset, n))
        return self.inner.read(offset, n)

    def read_into(self, offset, out):
        self.reads.append((offset, memoryview(out).nbytes))
        self.inner.read_into(offset, out)

    def close(self):
        self.inner.close()


def test_reads_only_the_index_and_the_requested_bytes(tmp_path):
    big = [("big.f32", Q.F32, (64, 1024)), ("experts", Q.IQ2_S, (8, 4, 256))]  # 256 KiB + 21 KiB of data
    path = write_gguf(tmp_path / "big.gguf", tensors=big)
    src = CountingSource(LocalFileSource(path))
    with open_gguf(src, readahead=4096) as f:
        assert f.index_nbytes < 4096 < f.size
        assert src.reads == [(0, 4096)]  # the whole index in one read, nothing else
        src.reads.clear()
        t = f.tensor("big.f32")
        f.read_tensor_bytes("big.f32")
        assert src.reads == [(t.offset, t.nbytes)]
        src.reads.clear()
        e = f.tensor("experts")
        got = f.read_tensor_rows("experts", 3, 5)  # experts 3 and 4 only
        assert src.reads == [(e.offset + 3 * e.row_nbytes, 2 * e.row_nbytes)]
        assert e.row_nbytes == 4 * 82 and got.shape == (2, 328)
        assert np.array_equal(got, f.read_tensor_bytes("experts").reshape(8, -1)[3:5])


def test_large_index_comes_in_few_reads(tmp_path):
    vocab = [f"token_{i:05d}_" + "x" * (i % 17) for i in range(10000)]  # ~ 250 KB of metadata
    path = write_gguf(tmp_path / "vocab.gguf", tensors=TENSORS[:2], extra_kv=[("tok.vocab", vocab, V.ARRAY)])
    src = CountingSource(LocalFileSource(path))
    with open_gguf(src, readahead=16384) as f:
        n = f.index_nbytes
        sizes = [r[1] for r in src.reads]
        assert f.get("tok.vocab") == vocab
        # read-ahead doubles: 16K, 32K, 64K, ... so an index of n bytes needs about log2(n / 16K) + 1 reads
        assert len(sizes) <= math.ceil(math.log2(n / 16384 + 1)) + 1
        assert sizes[0] == 16384 and all(b >= 2 * a for a, b in zip(sizes, sizes[1:-1]))
        assert sum(sizes) < 2 * n + 16384
        print(f"index {n} bytes read in {len(sizes)} reads: {sizes}")
        assert_matches_gguf_py(f, path)


def test_truncation_at_every_length(files):
    """Every cut inside the index fails; in the data section, a cut fails exactly when it loses tensor bytes."""
    data = open(files["default"], "rb").read()
    with open_gguf(files["default"]) as f:
        ends = sorted({t.offset + t.nbytes for t in f})
        index_end, data_start = f.index_nbytes, f.data_offset
    assert index_end < data_start < ends[-1] < len(data)
    cuts = set(range(data_start + 2)) | {e + d for e in ends for d in (-1, 0, 1)} | {len(data)}
    for n in sorted(cuts):
        src = MemorySource(data[:n], name="cut.gguf")
        if n < ends[-1]:
            with pytest.raises(GGUFError, match=r"^cut\.gguf: .*(truncated|past the end|left)"):
                GGUFFile(src)
        else:  # only padding after the last tensor is missing: still a complete file
            assert len(GGUFFile(src).tensors) == len(TENSORS)


# ---------------------------------------------------------------------------------------------------------------
# Split models
# ---------------------------------------------------------------------------------------------------------------

SPLIT_TENSORS = TENSORS[:7]


@pytest.fixture(scope="module")
def split_files(tmp_path_factory):
    """A model split by GGUFWriter itself (3 shards, as llama.cpp's gguf-split lays them out) and unsplit."""
    d = tmp_path_factory.mktemp("split")
    rng = np.random.default_rng(5)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, _, shape in SPLIT_TENSORS}
    for path, max_tensors in ((d / "model.gguf", 3), (d / "whole.gguf", 0)):
        w = gguf.GGUFWriter(str(path), "test", split_max_tensors=max_tensors)
        w.add_key_value("model.note", "hello", V.STRING)
        for name, a in arrays.items():
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    shards = [str(d / f"model-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    assert all(os.path.exists(s) for s in shards)
    return shards, str(d / "whole.gguf")


@pytest.mark.parametrize("open_with", [0, 1, 2])
def test_split_model_is_one_model(split_files, open_with):
    shards, whole = split_files
    with GGUFModel(shards[open_with]) as m, open_gguf(whole) as w:
        assert [s.name for s in m.shards] == shards
        assert list(m.tensors) == list(w.tensors)
        assert m.get("model.note") == "hello" and m.get("split.count") == 3
        assert m.get("split.tensors.count") == len(SPLIT_TENSORS)
        for i, path in enumerate(shards):
            ref = gguf.GGUFReader(path)
            assert int(ref.fields["split.no"].parts[-1][0]) == i
            for rt in ref.tensors:
                t = m.tensor(rt.name)
                assert t.shard == i and m.shard_of(rt.name).name == path
                assert (t.offset, t.nbytes) == (rt.data_offset, rt.n_bytes)
                assert m.read_tensor_bytes(rt.name).tobytes() == rt.data.tobytes()
        for name in w.tensors:
            assert np.array_equal(m.read_tensor_data(name), w.read_tensor_data(name))
            assert np.array_equal(m.read_tensor_rows(name, 0, 1), w.read_tensor_rows(name, 0, 1))


def test_split_shard_names():
    assert split_shard_names("/a/m-00002-of-00003.gguf") == [f"/a/m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_shard_names("https://h/x/My%20M-00001-of-00002.gguf?download=1") == [
        "https://h/x/My%20M-00001-of-00002.gguf?download=1",
        "https://h/x/My%20M-00002-of-00002.gguf?download=1",
    ]
    assert split_shard_names("/a/model.gguf") is None


def _write_shard(path, no, count, total, tensors, seed, extra=()):
    w = gguf.GGUFWriter(str(path), "test")
    for key, val, vt in (
        ("split.no", no, V.UINT16),
        ("split.count", count, V.UINT16),
        ("split.tensors.count", total, V.INT32),
    ) + tuple(extra):
        if val is not None:
            w.add_key_value(key, val, vt)
    rng = np.random.default_rng(seed)
    for name in tensors:
        w.add_tensor(name, rng.standard_normal((2, 4)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "case, problem",
    [
        ("duplicate", "'b' is also in"),
        ("missing", "cannot open"),
        ("wrong_no", "split.no = 0, but the file name says shard index 1"),
        ("wrong_count", "split.count = 3, but the file name says 2 shards"),
        ("wrong_total", "split.tensors.count = 9, but the 2 shards hold 3"),
        ("no_keys", "has no split.no"),
    ],
)
def test_split_model_errors(tmp_path, case, problem):
    p1, p2 = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    total = 9 if case == "wrong_total" else 3
    _write_shard(p1, 0, 3 if case == "wrong_count" else 2, total, ["a", "b"], 0)
    if case != "missing":
        no = None if case == "no_keys" else 0 if case == "wrong_no" else 1
        _write_shard(p2, no, 2, total, ["b" if case == "duplicate" else "c"], 1)
    with pytest.raises(GGUFError, match=problem) as e:
        GGUFModel(p1)
    assert "m-0000" in str(e.value)


def test_split_keys_in_an_unsplit_name(tmp_path):
    p = tmp_path / "renamed.gguf"
    _write_shard(p, 0, 2, 1, ["a"], 0)
    with pytest.raises(GGUFError, match=r"renamed\.gguf: split.count = 2 but the name does not follow"):
        GGUFModel(p)
    with GGUFModel(files_one := write_gguf(tmp_path / "one.gguf", tensors=TENSORS[:2])) as m:
        assert len(m.shards) == 1 and m.name == files_one and set(m.tensors) == {"plain.f32", "plain.f16"}


# ---------------------------------------------------------------------------------------------------------------
# HTTP range requests
# ---------------------------------------------------------------------------------------------------------------


class RangeServer:
    """A local http.server serving a folder, honouring `Range: bytes=a-b` (or ignoring it), counting requests."""

    def __init__(self, root):
        self.root, self.requests, self.honour_range = str(root), [], True
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                path = os.path.join(
                    server.root, urllib.parse.unquote(urllib.parse.urlsplit(self.path).path[1:])
                )
                rng = self.headers.get("Range")
                server.requests.append((os.path.basename(path), rng))
                if not os.path.isfile(path):
                    self.send_error(404)
                    return
                data = open(path, "rb").read()
                if rng is None or not server.honour_range:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                a, b = rng.removeprefix("bytes=").split("-")
                a, b = int(a), min(int(b), len(data) - 1)
                if a >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
                self.send_header("Content-Length", str(b - a + 1))
                self.end_headers()
                self.wfile.write(data[a : b + 1])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def count(self, name):
        return sum(1 for n, _ in self.requests if n == name)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(files, split_files):
    root = os.path.dirname(split_files[0][0])
    for src in (files["default"],):  # serve a copy of the single-file model next to the shards
        with open(src, "rb") as i, open(os.path.join(root, "single.gguf"), "wb") as o:
            o.write(i.read())
    s = RangeServer(root)
    yield s
    s.close()


def test_http_file_matches_local(server, files):
    server.requests.clear()
    with open_gguf(f"{server.url}/single.gguf") as f:  # read-ahead 1 MiB > file: one request serves it all
        n_index = server.count("single.gguf")
        print(f"single.gguf: index ({f.index_nbytes} bytes) in {n_index} range request(s)")
        assert n_index == 1 and f.source.n_requests == 1
        assert_matches_gguf_py(f, files["default"])
        assert server.count("single.gguf") == 1
        head = f.index_nbytes + 16
    server.requests.clear()
    with open_gguf(f"{server.url}/single.gguf", readahead=head) as f:  # now tensors need their own requests
        assert server.requests == [("single.gguf", f"bytes=0-{head - 1}")]
        assert_matches_gguf_py(f, files["default"])  # reads every tensor twice
        assert server.count("single.gguf") == 1 + 2 * sum(t.offset + t.nbytes > head for t in f)
        server.requests.clear()
        got = f.read_tensor_rows("q.iq2_s", 1, 3)
        t = f.tensor("q.iq2_s")  # [4 experts, 2, 256]: 2 * 82 = 164 bytes per expert
        assert t.row_nbytes == 164 and server.requests == [
            ("single.gguf", f"bytes={t.offset + 164}-{t.offset + 3 * 164 - 1}")
        ]
        with open_gguf(files["default"]) as local:
            assert np.array_equal(got, local.read_tensor_rows("q.iq2_s", 1, 3))


def test_http_split_model(server, split_files):
    shards, whole = split_files
    server.requests.clear()
    with GGUFModel(f"{server.url}/model-00003-of-00003.gguf") as m, open_gguf(whole) as w:
        counts = [server.count(os.path.basename(s)) for s in shards]
        print(f"index requests per shard: {counts}")
        assert counts == [1, 1, 1]
        assert [s.name for s in m.shards] == [f"{server.url}/{os.path.basename(s)}" for s in shards]
        for name in w.tensors:
            assert np.array_equal(m.read_tensor_data(name), w.read_tensor_data(name))
        assert len(server.requests) == 3  # tiny shards: each first (1 MiB) request held the whole shard


def test_http_large_index_in_few_requests(server, tmp_path):
    vocab = [f"piece{i}" * 3 for i in range(30000)]
    write_gguf(os.path.join(server.root, "vocab.gguf"), tensors=TENSORS[:1], extra_kv=[("v", vocab, V.ARRAY)])
    server.requests.clear()
    with open_gguf(f"{server.url}/vocab.gguf", readahead=65536) as f:
        n = server.count("vocab.gguf")
        print(
            f"vocab.gguf: index of {f.index_nbytes} bytes in {n} range requests (read-ahead 64 KiB, doubling)"
        )
        # each request is twice the previous one: 64K, 128K, 256K, ... until the index is in
        assert f.index_nbytes > 1_000_000 and n == next(
            k for k in range(1, 64) if 65536 * (2**k - 1) >= f.index_nbytes
        )
        assert n == 5
        assert f.get("v") == vocab


def test_http_errors(server):
    with pytest.raises(GGUFError, match=r"/nothing\.gguf: HTTP 404"):
        open_gguf(f"{server.url}/nothing.gguf")
    server.honour_range = False
    try:
        with pytest.raises(GGUFError, match=r"single\.gguf: server ignored the Range header"):
            open_gguf(f"{server.url}/single.gguf")
    finally:
        server.honour_range = True
    with pytest.raises(GGUFError, match="127.0.0.1:1/x.gguf: request failed"):
        open_gguf("http://127.0.0.1:1/x.gguf")


# ---------------------------------------------------------------------------------------------------------------
# Malformed input: hand-built files, one check each
# ---------------------------------------------------------------------------------------------------------------


def enc_str(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_value(vt: int, val, item_type: int | None = None) -> bytes:
    """Encodes a value (no leading type id); arrays take (item_type, items)."""
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    if vt == 8:
        return enc_str(val)
    if vt == 9:
        return struct.pack("<IQ", item_type, len(val)) + b"".join(enc_value(item_type, x) for x in val)
    return struct.pack("<" + fmt[vt], val)


def enc_kv(key, vt, val, item_type=None) -> bytes:
    return enc_str(key) + struct.pack("<I", vt) + enc_value(vt, val, item_type)


def enc_tensor(name, dims, gtype, offset) -> bytes:
    return enc_str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, gtype, offset)


def raw_gguf(kvs=(), infos=(), data=b"", *, n_kv=None, n_tensors=None, version=3, magic=b"GGUF", align=32):
    head = magic + struct.pack(
        "<IQQ", version, len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    head += b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % align) + data


F32_2x8 = enc_tensor("w", (8, 2), 0, 0)  # 64 bytes of F32
OK_KV = enc_kv("general.architecture", 8, "test")


def _nested(depth):
    v = enc_value(9, [1], 5)
    for _ in range(depth - 1):
        v = struct.pack("<IQ", 9, 1) + v
    return enc_str("deep") + struct.pack("<I", 9) + v


MALFORMED = {
    "empty": (b"", "truncated magic"),
    "bad_magic": (raw_gguf(magic=b"GGML"), "bad magic b'GGML'"),
    "version1": (raw_gguf(version=1), "version 1 .*v1 is not supported"),
    "version4": (raw_gguf(version=4), "unsupported GGUF version 4"),
    "big_endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "truncated_counts": (raw_gguf()[:12], "truncated metadata count|truncated tensor count"),
    "absurd_n_tensors": (raw_gguf(n_tensors=2**63), r"claims 9223372036854775808 tensors"),
    "absurd_n_kv": (raw_gguf(n_kv=2**40), r"1099511627776 metadata pairs"),
    "absurd_key_length": (
        raw_gguf([struct.pack("<Q", 2**62) + b"k"], n_kv=1),
        "key of metadata pair #0 has length",
    ),
    "string_past_end": (
        raw_gguf([enc_str("k") + struct.pack("<IQ", 8, 1000) + b"abc"]),
        "'k' has length 1000",
    ),
    "unknown_value_type": (
        raw_gguf([enc_str("k") + struct.pack("<I", 13) + b"\0" * 8]),
        "unknown value type id 13",
    ),
    "unknown_item_type": (
        raw_gguf([enc_str("k") + struct.pack("<IIQ", 9, 99, 0)]),
        "unknown value type id 99",
    ),
    "absurd_array_count": (
        raw_gguf([enc_str("k") + struct.pack("<IIQ", 9, 4, 2**60)]),
        "claims 1152921504606846976 items",
    ),
    "absurd_string_array": (
        raw_gguf([enc_str("k") + struct.pack("<IIQ", 9, 8, 2**40)]),
        "items of type STRING",
    ),
    "nested_too_deep": (raw_gguf([_nested(9)]), "nests arrays more than 8 deep"),
    "duplicate_key": (raw_gguf([OK_KV, OK_KV]), "duplicate metadata key 'general.architecture'"),
    "bad_utf8_key": (raw_gguf([enc_kv(b"k\xff", 4, 1)]), "not valid UTF-8"),
    "alignment_not_pow2": (
        raw_gguf([enc_kv("general.alignment", 4, 48)]),
        "general.alignment = 48 is not a power of two",
    ),
    "alignment_zero": (
        raw_gguf([enc_kv("general.alignment", 4, 0)]),
        "general.alignment = 0 is not a power of two",
    ),
    "alignment_type": (raw_gguf([enc_kv("general.alignment", 10, 64)]), "general.alignment has type UINT64"),
    "n_dims_5": (
        raw_gguf([], [enc_tensor("w", (1, 1, 1, 1, 1), 0, 0)], b"\0" * 32),
        "'w' .* has 5 dimensions",
    ),
    "zero_dim": (raw_gguf([], [enc_tensor("w", (8, 0), 0, 0)]), r"zero dimension: dims \(8, 0\)"),
    "dims_overflow": (raw_gguf([], [enc_tensor("w", (2**32, 2**32), 0, 0)]), "more than 2..63 - 1"),
    "removed_type_id": (raw_gguf([], [enc_tensor("w", (32,), 4, 0)], b"\0" * 32), "unknown ggml type id 4"),
    "unknown_type_id": (
        raw_gguf([], [enc_tensor("w", (32,), 9999, 0)], b"\0" * 32),
        "unknown ggml type id 9999",
    ),
    "row_not_blocks": (
        raw_gguf([], [enc_tensor("w", (100, 2), 12, 0)], b"\0" * 288),
        "not a multiple of its block size 256",
    ),
    "offset_unaligned": (
        raw_gguf([], [enc_tensor("w", (8, 2), 0, 4)], b"\0" * 96),
        "data offset 4, not a multiple of the alignment 32",
    ),
    "data_past_end": (raw_gguf([], [F32_2x8], b"\0" * 60), "data .* runs past the end"),
    "offset_past_end": (raw_gguf([], [enc_tensor("w", (8, 2), 0, 2**62)], b"\0" * 64), "runs past the end"),
    "overlap": (
        raw_gguf([], [F32_2x8, enc_tensor("v", (4,), 0, 32)], b"\0" * 64),
        "'w' .* and 'v' .* overlap",
    ),
    "duplicate_tensor": (
        raw_gguf([], [F32_2x8, enc_tensor("w", (8,), 0, 64)], b"\0" * 96),
        "duplicate tensor name 'w'",
    ),
    "truncated_tensor_info": (raw_gguf([], [F32_2x8])[:50], "truncated .*tensor 'w'"),
    "data_section_missing": (
        raw_gguf([], [enc_tensor("w", (8,), 0, 0)], align=1),
        "data section starts at byte",
    ),
    "tensor_name_past_end": (
        raw_gguf([], [struct.pack("<Q", 2**33) + b"abc"], n_tensors=1),
        "name of tensor #0 has length",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_raises_gguf_error(tmp_path, case):
    data, problem = MALFORMED[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=problem) as e:
        open_gguf(path)
    assert str(e.value).startswith(f"{path}: ")


def test_hand_built_files_are_valid_when_not_broken():
    """The encoder above writes files gguf-py and we both read, so the malformed cases differ only in the flaw."""
    data = raw_gguf(
        [OK_KV, enc_kv("a", 9, [1, 2], 5), enc_kv("e", 9, [], 8)],
        [F32_2x8, enc_tensor("v", (4,), 0, 64)],
        np.arange(20, dtype="<f4").tobytes() + b"\0" * 16,
    )
    f = GGUFFile(MemorySource(data, name="ok.gguf"))
    assert f.get("a") == [1, 2] and f.get("e") == [] and f.get("general.architecture") == "test"
    assert np.array_equal(f.read_tensor_data("v"), np.arange(16, 20, dtype=np.float32))
    with pytest.raises(GGUFError, match="nope.gguf: cannot open"):
        open_gguf("/nonexistent/nope.gguf")
