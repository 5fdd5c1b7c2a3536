"""Tensors on disk read by slice (`glm53.checkpoint.slices`, `glm53.io.sources.read_box`): what each process
reads when a parameter spans several processes (tests/test_multihost.py loads whole models that way).

Every view / box is checked against numpy on the tensor read whole (the HF loader's transforms, GGUF decoding,
GGUF experts packed as planes: the sharded layout's own slice), and the bytes read are counted exactly: a box
reads its own bytes and nothing else.
"""

from __future__ import annotations

import itertools
import json
import struct

import ml_dtypes
import numpy as np
import pytest
from gguf import GGUFWriter

from glm53.checkpoint import gguf_export, slices
from glm53.checkpoint.gguf import ExpertTensor, decode_tensor
from glm53.checkpoint.hf_rules import t_fused_gate_up, t_linear
from glm53.io.gguf import GGUFFile, GGUFModel
from glm53.io.safetensors import DTYPES, SafetensorsFile
from glm53.quant.formats import get_format
from glm53.quant.qweight import QuantizedExperts

E, ROWS, COLS = 4, 8, 1024  # Q4_K experts: 4 blocks of 256 per row
RNG = np.random.default_rng(7)
A = RNG.standard_normal((6, 5, 8)).astype(np.float32)
B = RNG.standard_normal((4, 6, 3)).astype(ml_dtypes.bfloat16)  # a fused gate_up [E, 2F, D] in bf16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("slices")
    st = d / "m.safetensors"
    header = {"a": {"dtype": "F32", "shape": list(A.shape), "data_offsets": [0, A.nbytes]},
              "b": {"dtype": "BF16", "shape": list(B.shape), "data_offsets": [A.nbytes, A.nbytes + B.nbytes]}}  # fmt: skip
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    st.write_bytes(struct.pack("<Q", len(h)) + h + A.tobytes() + B.tobytes())
    experts = RNG.standard_normal((E, ROWS, COLS)).astype(np.float32)
    w = GGUFWriter(str(d / "m.gguf"), "glm5-next")
    for name, a, fmt in (("blk.3.ffn_down_exps.weight", experts, "Q4_K"), ("lin_f32", A[0], "F32"),
                         ("lin_q8", RNG.standard_normal((6, 64)).astype(np.float32), "Q8_0")):  # fmt: skip
        data, raw_type = gguf_export.encode(a, fmt)
        w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return SafetensorsFile(st), str(d / "m.gguf")


@pytest.fixture
def reads(monkeypatch):
    """(reader, first byte, bytes) of every tensor read from now on (safetensors: offsets in the data section)."""
    log = []
    st_read, gguf_read = SafetensorsFile._read_into, GGUFFile._read_into

    def st(self, f, offset, buf, name):
        log.append(("st", offset, len(buf)))
        return st_read(self, f, offset, buf, name)

    def gg(self, offset, view, what):
        log.append(("gguf", offset, len(view)))
        return gguf_read(self, offset, view, what)

    monkeypatch.setattr(SafetensorsFile, "_read_into", st)
    monkeypatch.setattr(GGUFFile, "_read_into", gg)
    return log


def _view(sf: SafetensorsFile, key: str) -> slices.LazyArray:
    return slices.LazyArray(lambda box: sf.read_box(key, box), sf.shape(key), DTYPES[sf.dtype(key)], key)


def _index_grid(shape):
    """Every box of halves / whole / single entries over `shape` (the splits devices get)."""
    per_axis = [[slice(None), slice(0, max(1, n // 2)), slice(n // 2, n), 1 % n] for n in shape]
    return list(itertools.product(*per_axis))


def test_views_read_exactly_their_box(files, reads):
    sf, _ = files
    a = _view(sf, "a")
    views = {
        "a": (a, A),
        "a.T": (a.T, A.T),
        "a.transpose(0,2,1)[1:4]": (a.transpose(0, 2, 1)[1:4], A.transpose(0, 2, 1)[1:4]),
        "a[:, 2, :].T": (a[:, 2, :].T, A[:, 2, :].T),
        "a[2:5, ..., 1:7].astype(f16)": (
            a[2:5, ..., 1:7].astype(np.float16),
            A[2:5, ..., 1:7].astype(np.float16),
        ),
    }
    for what, (view, want) in views.items():
        assert view.shape == want.shape and view.dtype == want.dtype, what
        for index in _index_grid(view.shape):
            reads.clear()
            got = np.asarray(view[index])
            np.testing.assert_array_equal(got, want[index], err_msg=f"{what}[{index}]")
            assert got.dtype == want.dtype
            assert sum(n for _, _, n in reads) == want[index].size * 4, f"{what}[{index}]"  # f32 on disk


def test_hf_transforms_on_views_equal_numpy(files, reads):
    """The HF loader's transforms run on views unchanged: a fused bf16 gate_up [E, 2F, D] split into gate and
    up [E, D, F], and a Linear's transpose, read by device box."""
    sf, _ = files
    b = B.astype(np.float32)
    got = t_fused_gate_up(_view(sf, "b"), "{x}", {})
    want = t_fused_gate_up(b, "{x}", {})
    for (tg, v, _), (tw, w, _) in zip(got, want):
        assert tg == tw and v.shape == w.shape
        for index in _index_grid(v.shape):
            reads.clear()
            np.testing.assert_array_equal(
                np.asarray(v[index], np.float32), w[index], err_msg=f"{tg}[{index}]"
            )
            assert sum(n for _, _, n in reads) == w[index].size * 2  # bf16 on disk
    (_, v, _), = t_linear(_view(sf, "a")[0], "k", {})  # fmt: skip
    np.testing.assert_array_equal(np.asarray(v[2:, 1:3]), A[0].T[2:, 1:3])
    stacked = slices.Stacked([_view(sf, "a")[i].T for i in range(6)], np.float32)
    np.testing.assert_array_equal(stacked[1:3, 2:, :2], A[1:3].transpose(0, 2, 1)[:, 2:, :2])
    np.testing.assert_array_equal(np.asarray(stacked), A.transpose(0, 2, 1))


def _experts(path: str) -> tuple[GGUFModel, ExpertTensor]:
    g = GGUFModel(path)
    name = "blk.3.ffn_down_exps.weight"
    info = g.tensors[name]
    return g, ExpertTensor(
        ("layers", 3, "mlp", "experts", "down_proj"), name, info.format, tuple(info.shape), g
    )


@pytest.mark.parametrize("split", ["experts", "rows", "words"])
def test_quantized_expert_boxes_equal_the_sharded_layout(files, reads, split):
    """Each device's box of every plane, packed from only its experts / rows / input blocks, equals that box
    of the planes packed whole in the sharded layout (a word split of n: `block_splits = n`)."""
    g, et = _experts(files[1])
    n = 2
    whole = et.quantized()
    like = QuantizedExperts.from_gguf_bytes(
        whole.to_gguf_bytes(), "Q4_K", (E, ROWS, COLS), block_splits=n if split == "words" else 1
    )
    q = slices.expert_planes(et, like, lambda source, sharding: source)
    row_bytes = COLS // 256 * get_format("Q4_K").type_size
    for i in range(n):
        reads.clear()  # the fields of one box share one read; input-block shards of the same rows, too
        for name, field in like.planes.fields.items():
            box = [slice(None)] * 3
            axis = {"experts": 0, "words": 1, "rows": 2}[split]
            k = field.shape[axis] // n
            box[axis] = slice(i * k, (i + 1) * k)
            np.testing.assert_array_equal(
                q.planes.fields[name][tuple(box)], np.asarray(field)[tuple(box)], name
            )
        want = {"experts": E // n * ROWS, "rows": E * ROWS // n, "words": E * ROWS * (i == 0)}[
            split
        ] * row_bytes
        assert sum(nb for _, _, nb in reads) == want
    assert np.asarray(q.planes.fields["qs"]).shape == like.planes.fields["qs"].shape
    g.close()


def test_dense_boxes_equal_whole_decode(files, reads):
    """GGUF tensors decoded by box (experts x output rows of whole input rows) equal the whole decode."""
    g, et = _experts(files[1])
    whole = et.dequantize(np.float32)
    row_bytes = COLS // 256 * get_format("Q4_K").type_size
    for index in _index_grid(whole.shape):
        view = slices.expert_dense(et, np.float32)  # a fresh view: one view reads each row box once
        reads.clear()
        np.testing.assert_array_equal(np.asarray(view[index]), whole[index], err_msg=str(index))
        n_e, _, n_out = (len(range(*s.indices(d))) if isinstance(s, slice) else 1
                         for s, d in zip(index, view.shape))  # fmt: skip
        assert sum(nb for _, _, nb in reads) == n_e * n_out * row_bytes, index
    for name in ("lin_f32", "lin_q8"):
        info = g.tensors[name]
        want = decode_tensor(g, info).T
        v = slices.gguf_decoded(g, name, info.format, info.shape).T
        for index in _index_grid(v.shape):
            np.testing.assert_array_equal(np.asarray(v[index]), want[index], err_msg=f"{name}[{index}]")
    g.close()
