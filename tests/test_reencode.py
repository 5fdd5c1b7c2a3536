"""Gather-free re-encodings (glm53.quant.reencode): lossless round trips to the GGUF bytes, decoding bit-exact
against gguf-py and ggml (llama.cpp), no gather in the lowered program, and the byte ratios 1.29 / 1.22."""

import jax
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.quant import budget, ggml
from glm53.quant import layout as L
from glm53.quant import planes as P
from glm53.quant import reencode as R
from glm53.quant.formats import UnknownFormatError, get_format

NAMES = ("IQ2_S", "IQ3_S")
_deq = jax.jit(R.dequantize_reencoded)


def random_gguf(name: str, lead_rows: tuple[int, ...], n_blocks: int, rng, d=None) -> np.ndarray:
    """Random IQ2_S / IQ3_S bytes (every byte pattern is a valid block once `d`, at offset 0, is finite)."""
    f = get_format(name)
    raw = rng.integers(0, 256, size=(*lead_rows, n_blocks, f.type_size), dtype=np.uint8)
    dv = rng.uniform(-0.05, 0.05, size=raw.shape[:-1]) if d is None else np.broadcast_to(d, raw.shape[:-1])
    raw[..., 0:2] = np.ascontiguousarray(dv, np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*lead_rows, -1)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _gguf(raw, name):
    return gq.dequantize(raw, GGMLQuantizationType[name])


def test_grid_structure_makes_the_codes_exact():
    """gguf-py's grids: IQ2_S coordinates are 8 + 17c + (c >> 1), IQ3_S magnitudes are odd 1..15, and no grid
    repeats an entry, so level codes map back to exactly one grid index."""
    for cls, entry, levels in ((gq.IQ2_S, 8, {8, 25, 43}), (gq.IQ3_S, 4, set(range(1, 16, 2)))):
        cls.init_grid()
        grid = np.asarray(cls.grid).reshape(-1, entry)
        assert set(np.unique(grid).tolist()) == levels
        assert len({tuple(row) for row in grid.tolist()}) == len(grid)
    assert [8 + 17 * c + (c >> 1) for c in range(3)] == [8, 25, 43]


@pytest.mark.parametrize("name", NAMES)
def test_every_grid_index_round_trips(name):
    """Blocks whose groups walk through every grid index (1024 for IQ2_S, 512 for IQ3_S) restore exactly."""
    f = get_format(name)
    groups = 32 if name == "IQ2_S" else 64  # grid indices per block
    n_idx = 1024 if name == "IQ2_S" else 512
    raw = random_gguf(name, (1,), n_idx // groups, np.random.default_rng(0)).reshape(-1, f.type_size)
    idx = np.arange(n_idx).reshape(-1, groups)
    qs = f.field("qs")
    raw[:, qs.offset : qs.offset + groups] = idx & 0xFF
    qh = f.field("qh")
    if name == "IQ2_S":  # 2 high bits per group, 4 groups per byte
        raw[:, qh.offset : qh.offset + 8] = ((idx >> 8).reshape(-1, 8, 4) << np.array([0, 2, 4, 6])).sum(-1)
    else:  # 1 high bit per group, 8 groups per byte
        raw[:, qh.offset : qh.offset + 8] = ((idx >> 8).reshape(-1, 8, 8) << np.arange(8)).sum(-1)
    raw = raw.reshape(1, -1)
    shape = (1, raw.size // f.type_size * 256)
    p = R.pack_reencoded(raw, name, shape)
    np.testing.assert_array_equal(L.unpack(p), raw)
    np.testing.assert_array_equal(R.restore(R.reencode(raw, name), name), raw)
    np.testing.assert_array_equal(_bits(_deq(p)), _bits(_gguf(raw, name)))


@pytest.fixture(scope="module")
def quantized():
    """llama.cpp-quantized blocks (ggml_quantize_chunk) of random normal weights, [2 experts, 4 rows, 512]."""
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    return {n: np.frombuffer(ggml.quantize(x, n, threads=1), np.uint8).reshape(2, 4, -1) for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_and_bit_exact_decode(name, quantized):
    rng = np.random.default_rng(2)
    d_edge = np.array(
        [0.0, -0.0, 6e-8, -1e-6, 3e-5, 6.1e-5, -65504.0, 1e-3], np.float16
    )  # zero, subnormal, max
    cases = [
        quantized[name],
        random_gguf(name, (2, 4), 2, rng),
        random_gguf(name, (2, 4), 2, rng, d_edge.reshape(2, 4, 1)),
    ]
    for raw in cases:
        p = R.pack_reencoded(raw, name, (2, 4, 512))
        assert p.fmt is R.reencoded_format(name)
        np.testing.assert_array_equal(R.unpack_reencoded(p), raw)
        np.testing.assert_array_equal(L.unpack(p), raw)
        assert L.pack(raw, name, (2, 4, 512), "reencoded").fmt is p.fmt
        got = _deq(p)
        assert got.shape == (2, 4, 512)
        np.testing.assert_array_equal(_bits(got), _bits(_gguf(raw, name)))
        np.testing.assert_array_equal(_bits(got).ravel(), _bits(ggml.dequantize_row(name, raw, 8 * 512)))
        np.testing.assert_array_equal(_bits(L.dequantize(p)), _bits(got))  # layout dispatch
        rows = R.reencode(raw, name)
        assert rows.shape == (2, 4, 2 * R.reencoded_format(name).type_size)
        np.testing.assert_array_equal(R.restore(rows, name), raw)
        np.testing.assert_array_equal(_bits(R.dequantize_reencoded_rows(rows, name)), _bits(_gguf(raw, name)))


def _ops(lowered_text: str) -> set[str]:
    return {w for w in ("gather", "dynamic_slice", "dynamic-slice") if w in lowered_text}


@pytest.mark.parametrize("name", NAMES)
def test_decoder_lowers_without_gathers(name):
    raw = random_gguf(name, (2, 4), 2, np.random.default_rng(3))
    text = jax.jit(R.dequantize_reencoded).lower(R.pack_reencoded(raw, name, (2, 4, 512))).as_text()
    assert _ops(text) == set()
    # the check can fail: the codebook decoder of the GGUF layout looks its grid up
    gguf_text = jax.jit(P.dequantize_planes).lower(P.pack_planes(raw, name, (2, 4, 512))).as_text()
    assert "gather" in gguf_text


@pytest.mark.parametrize("name, ratio", [("IQ2_S", 1.29), ("IQ3_S", 1.22)])
def test_byte_ratios(name, ratio):
    f, r = get_format(name), R.reencoded_format(name)
    assert (r.type_size, r.bits_per_weight) == ((106, 3.3125) if name == "IQ2_S" else (134, 4.1875))
    raw = random_gguf(name, (3, 8), 4, np.random.default_rng(4))
    p = R.pack_reencoded(raw, name, (3, 8, 1024))
    measured = p.nbytes / raw.size
    assert measured == r.type_size / f.type_size and round(measured, 2) == ratio
    assert p.nbytes == budget.plane_nbytes((3, 8, 1024), name, layout="reencoded")
    assert P.pack_planes(raw, name, (3, 8, 1024)).nbytes == raw.size  # GGUF-layout planes: no growth


@pytest.mark.parametrize("name", NAMES)
def test_splits_of_reencoded_planes(name):
    raw = random_gguf(name, (2, 4), 4, np.random.default_rng(5))
    f = get_format(name)
    p = R.pack_reencoded(raw, name, (2, 4, 1024))
    for n, i in ((4, 1), (2, 1), (1, 0)):
        k = 4 // n
        q = P.split_blocks(p, n, i)
        assert q.nbytes == budget.plane_nbytes((2, 4, 1024), name, ("blocks", n), "reencoded")
        np.testing.assert_array_equal(L.unpack(q), raw[..., i * k * f.type_size : (i + 1) * k * f.type_size])
    q = P.split_rows(P.block_split_layout(p, 2), 2, 1)
    np.testing.assert_array_equal(L.unpack(q), raw[:, 2:])
    np.testing.assert_array_equal(_bits(_deq(q)), _bits(_gguf(raw[:, 2:], name)))


def test_restore_rejects_codes_off_the_grid():
    raw = random_gguf("IQ2_S", (1,), 1, np.random.default_rng(6))
    rows = R.reencode(raw, "IQ2_S")
    lv = R.reencoded_format("IQ2_S").field("levels")
    rows[0, lv.offset] |= 0x03  # level code 3 does not exist
    with pytest.raises(ValueError, match="IQ2_S_R: 8 level codes that are not an IQ2_S grid entry"):
        R.restore(rows, "IQ2_S")
    gq.IQ3_S.init_grid()
    on_grid = {tuple(v) for v in np.asarray(gq.IQ3_S.grid).reshape(-1, 4).astype(int).tolist()}
    off = next(t for t in ((a, 1, 1, 1) for a in range(1, 16, 2)) if t not in on_grid)
    rows = R.reencode(random_gguf("IQ3_S", (1,), 1, np.random.default_rng(7)), "IQ3_S")
    c = R.reencoded_format("IQ3_S").field("codes")
    n = [(m + 15) // 2 for m in off]  # positive weights with magnitudes `off`
    rows[0, c.offset : c.offset + 2] = [n[0] | n[1] << 4, n[2] | n[3] << 4]
    with pytest.raises(ValueError, match="IQ3_S_R: 4 codes whose magnitudes are not an IQ3_S grid entry"):
        R.restore(rows, "IQ3_S")


def test_formats_without_reencoding():
    with pytest.raises(UnknownFormatError, match="IQ4_XS has no gather-free re-encoding"):
        R.reencoded_format("IQ4_XS")
    raw = random_gguf("IQ2_S", (1,), 1, np.random.default_rng(8))
    with pytest.raises(UnknownFormatError, match="not a re-encoded layout"):
        R.dequantize_reencoded(P.pack_planes(raw, "IQ2_S", (1, 256)))
    # the "reencoded" layout keeps a format without a re-encoding as itself, in GGUF planes
    iq4 = get_format("IQ4_XS")
    assert L.layout_format(iq4, "reencoded") is iq4 and L.layout_format("IQ2_S", "planes").name == "IQ2_S"
    raw4 = random_gguf("IQ4_XS", (1,), 1, np.random.default_rng(8))
    assert L.pack(raw4, iq4, (1, 256), "reencoded").fmt is iq4
    with pytest.raises(ValueError, match="unknown layout 'packed'"):
        L.layout_format(iq4, "packed")
    # planes.py reads the GGUF layout only; layout.py dispatches
    p = R.pack_reencoded(raw, "IQ2_S", (1, 256))
    for fn in (P.unpack_planes, P.dequantize_planes):
        with pytest.raises(ValueError, match="IQ2_S_R planes hold a re-encoded layout"):
            fn(p)


def test_chunked_host_conversion_matches_one_shot():
    raw = random_gguf("IQ3_S", (3, 5), 2, np.random.default_rng(9))
    fields = P.gguf_fields(raw, "IQ3_S", (3, 5, 512))
    one = R.reencode_fields("IQ3_S", fields)
    chunked = R._map_blocks(R.reencode_fields, get_format("IQ3_S"), fields, chunk=4)  # 30 blocks, 8 chunks
    assert one.keys() == chunked.keys() and all(np.array_equal(one[k], chunked[k]) for k in one)
    back = R._map_blocks(R.restore_fields, R.reencoded_format("IQ3_S"), chunked, chunk=7)
    assert all(np.array_equal(back[k], fields[k]) for k in fields)
