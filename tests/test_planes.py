"""Planes (glm53.quant.planes): exact GGUF round trips, the documented word layout, TP splits, and dequantization
bit-exact against gguf-py's `gguf.quants.dequantize` and ggml's own `dequantize_row_*` (llama.cpp via ctypes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from glm53.quant import ggml
from glm53.quant import planes as P
from glm53.quant.formats import GGUF_FORMATS, get_format

REQUIRED = ("IQ2_S", "IQ3_S", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
EXTRA = tuple(f for f in GGUF_FORMATS if f not in REQUIRED)
_deq = jax.jit(P.dequantize_planes)


def random_gguf(name: str, lead_rows: tuple[int, ...], n_blocks: int, rng) -> np.ndarray:
    """Random valid GGUF bytes [*lead_rows, n_blocks * type_size]: random bytes, float fields set to finite values."""
    f = get_format(name)
    raw = rng.integers(0, 256, size=(*lead_rows, n_blocks, f.type_size), dtype=np.uint8)
    if name == "F32":
        v = rng.uniform(-2, 2, size=raw.shape[:-1]).astype(np.float32)
        raw = v.view(np.uint8).reshape(raw.shape)
    for fd in f.fields:
        if fd.name in ("d", "dmin") or name in ("F16", "BF16"):
            v = rng.uniform(-0.05, 0.05, size=raw.shape[:-1]).astype(np.float32)
            b = v.view(np.uint32) >> 16 if name == "BF16" else v.astype(np.float16).view(np.uint16)
            raw[..., fd.offset : fd.offset + 2] = b.astype("<u2").view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*lead_rows, -1)


def ggml_gguf(name: str, lead_rows: tuple[int, ...], n_blocks: int, rng) -> np.ndarray:
    """GGUF bytes quantized by llama.cpp (ggml_quantize_chunk) from random normal weights."""
    f = get_format(name)
    x = rng.standard_normal((int(np.prod(lead_rows)), n_blocks * f.block_size)).astype(np.float32)
    return np.frombuffer(ggml.quantize(x, name, threads=1), np.uint8).reshape(*lead_rows, -1)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", REQUIRED + EXTRA)
def test_round_trip_exact(name):
    rng = np.random.default_rng(1)
    f = get_format(name)
    for nb in (1, 3, 4):
        raw = random_gguf(name, (2, 8), nb, rng)
        p = P.pack_planes(raw, name, (2, 8, nb * f.block_size))
        assert all(a.dtype == np.uint32 and a.shape[-1] == 8 for a in p.fields.values())
        np.testing.assert_array_equal(P.unpack_planes(p), raw)


@pytest.mark.parametrize("name", ("IQ2_S", "IQ3_S", "IQ4_XS", "Q4_K"))
def test_words_are_the_gguf_bytes(name):
    """Every word of every plane, read off the GGUF bytes by the documented rule with plain Python ints."""
    rng = np.random.default_rng(2)
    f, nb, rows = get_format(name), 5, 3
    raw = random_gguf(name, (2, rows), nb, rng)
    p = P.pack_planes(raw, name, (2, rows, nb * f.block_size))
    for fd in f.fields:
        plane = p.fields[fd.name]
        for e in range(2):
            for r in range(rows):
                field = [bytes(raw[e, r, b * f.type_size + fd.offset :][: fd.nbytes]) for b in range(nb)]
                if fd.nbytes == 2:  # block 2j low half, 2j+1 high half, zero padding after the last odd block
                    halves = [int.from_bytes(x, "little") for x in field] + [0]
                    want = [halves[2 * j] | halves[2 * j + 1] << 16 for j in range((nb + 1) // 2)]
                else:
                    want = [
                        int.from_bytes(x[4 * j : 4 * j + 4], "little")
                        for x in field
                        for j in range(fd.nbytes // 4)
                    ]
                assert plane[e, :, r].tolist() == want, (fd.name, e, r)


def test_iq2_s_plane_shapes():
    """One gate/up device slice of one expert: 256 rows x 4096 inputs (16 blocks) of IQ2_S."""
    raw = random_gguf("IQ2_S", (256,), 16, np.random.default_rng(3))
    p = P.pack_planes(raw, "IQ2_S", (256, 4096))
    assert {k: v.shape for k, v in p.fields.items()} == {
        "d": (8, 256),
        "qs": (128, 256),
        "signs": (128, 256),
        "qh": (32, 256),
        "scales": (32, 256),
    }
    assert p.nbytes == raw.size  # no growth with an even block count


@pytest.fixture(scope="module")
def quantized():
    rng = np.random.default_rng(4)
    return {name: ggml_gguf(name, (2, 4), 2, rng) for name in REQUIRED}


@pytest.mark.parametrize("name", REQUIRED)
def test_dequantize_matches_gguf_py_and_ggml(name, quantized):
    f = get_format(name)
    for raw in (quantized[name], random_gguf(name, (2, 4), 2, np.random.default_rng(5))):
        p = P.pack_planes(raw, name, (2, 4, 2 * f.block_size))
        got = _deq(p)
        assert got.shape == (2, 4, 512) and got.dtype == jnp.float32
        np.testing.assert_array_equal(_bits(got), _bits(gq.dequantize(raw, GGMLQuantizationType[name])))
        np.testing.assert_array_equal(
            _bits(got).ravel(), _bits(ggml.dequantize_row(name, raw, raw.size // f.type_size * f.block_size))
        )


@pytest.mark.parametrize("name", EXTRA)
def test_dequantize_extra_formats_match_gguf_py(name):
    f = get_format(name)
    raw = random_gguf(name, (2, 4), 3, np.random.default_rng(6))
    got = _deq(P.pack_planes(raw, name, (2, 4, 3 * f.block_size)))
    np.testing.assert_array_equal(_bits(got), _bits(gq.dequantize(raw, GGMLQuantizationType[name])))


@pytest.mark.parametrize("name", ("IQ2_S", "IQ4_XS", "Q4_K"))
def test_splits_are_slices(name):
    """split_rows / split_blocks == the same slices of the GGUF bytes and of the dequantized matrix."""
    f = get_format(name)
    nb, rows = 6, 8
    raw = random_gguf(name, (2, rows), nb, np.random.default_rng(7))
    p = P.pack_planes(raw, name, (2, rows, nb * f.block_size))
    full = np.asarray(_deq(p))
    for n in (2, 4):
        for i in range(n):
            q = P.split_rows(p, n, i)
            r = rows // n
            assert q.shape == (r, p.cols)
            np.testing.assert_array_equal(P.unpack_planes(q), raw[:, i * r : (i + 1) * r])
    for n in (1, 2, 3, 6):  # 6, 2, 3 (odd: padded), 1 (odd: padded) blocks per device
        k = nb // n
        for i in range(n):
            q = P.split_blocks(p, n, i)
            assert q.shape == (rows, k * f.block_size)
            np.testing.assert_array_equal(
                P.unpack_planes(q), raw[..., i * k * f.type_size : (i + 1) * k * f.type_size]
            )
            if n in (3, 6):
                cols = slice(i * k * f.block_size, (i + 1) * k * f.block_size)
                np.testing.assert_array_equal(_bits(_deq(q)), _bits(full[..., cols]))
    # splits compose: rows then blocks == blocks then rows
    a = P.split_blocks(P.split_rows(p, 2, 1), 3, 2)
    b = P.split_rows(P.split_blocks(p, 3, 2), 2, 1)
    np.testing.assert_array_equal(P.unpack_planes(a), P.unpack_planes(b))


def test_odd_block_slice_pads_half_a_word():
    """A one-block device slice stores each 2-byte field in a whole word whose high half is zero."""
    raw = random_gguf("IQ4_XS", (4,), 8, np.random.default_rng(8))
    p = P.pack_planes(raw, "IQ4_XS", (4, 2048))
    q = P.split_blocks(p, 8, 5)
    assert q.fields["d"].shape == (1, 4) and q.fields["scales_h"].shape == (1, 4)
    assert (q.fields["d"] >> 16).tolist() == [[0, 0, 0, 0]]
    assert q.nbytes == raw.size // 8 + 2 * 2 * 4  # + 2 fields x 2 bytes x 4 rows


def test_block_split_layout_shards_over_devices():
    """block_split_layout(p, 8): sharding the word axis 8 ways gives device i split_blocks(p, 8, i), and a
    shard_map of the per-device dequantization reassembles the unsharded matrix."""
    name, f = "IQ3_S", get_format("IQ3_S")
    raw = random_gguf(name, (2, 4), 8, np.random.default_rng(9))
    p = P.pack_planes(raw, name, (2, 4, 8 * f.block_size))
    lay = P.block_split_layout(p, 8)
    assert lay.fields["d"].shape == (2, 8, 4) and p.fields["d"].shape == (2, 4, 4)
    np.testing.assert_array_equal(P.unpack_planes(lay), raw)
    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",))
    spec = PS(None, "tp", None)
    sharded = {k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in lay.fields.items()}
    for k, arr in sharded.items():
        for shard in arr.addressable_shards:
            i = shard.index[1].start // (arr.shape[1] // 8)
            np.testing.assert_array_equal(np.asarray(shard.data), P.split_blocks(p, 8, i).fields[k])

    def local(fields):
        return P.dequantize_planes(P.Planes(fields, lay.fmt, (4, f.block_size), 1))

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=PS(None, None, "tp")))
    np.testing.assert_array_equal(_bits(fn(sharded)), _bits(gq.dequantize(raw, GGMLQuantizationType[name])))
    # re-splitting a split layout takes the group directly
    np.testing.assert_array_equal(
        P.unpack_planes(P.split_blocks(lay, 4, 3)), P.unpack_planes(P.split_blocks(p, 4, 3))
    )
    assert P.split_blocks(lay, 4, 3).block_splits == 2


def test_pytree_and_jit_static_metadata():
    raw = random_gguf("Q6_K", (3,), 2, np.random.default_rng(10))
    p = P.pack_planes(raw, "Q6_K", (3, 512))
    leaves, tree = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 4 and all(x.dtype == np.uint32 for x in leaves)
    q = jax.tree_util.tree_unflatten(tree, [jnp.asarray(x) for x in leaves])
    assert q.fmt.name == "Q6_K" and q.shape == (3, 512)
    np.testing.assert_array_equal(_bits(_deq(q)), _bits(gq.dequantize(raw, GGMLQuantizationType.Q6_K)))


def test_bad_input_errors():
    f = get_format("IQ2_S")
    raw = random_gguf("IQ2_S", (4,), 2, np.random.default_rng(11))
    with pytest.raises(ValueError, match=r"blk.3.ffn_gate_exps.*got 655 bytes, expected 656"):
        P.pack_planes(raw.ravel()[:-1], "IQ2_S", (4, 512), name="blk.3.ffn_gate_exps")
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        P.pack_planes(raw, "IQ2_S", (4, 500))
    with pytest.raises(ValueError, match="must be uint8"):
        P.pack_planes(raw.view(np.int8), "IQ2_S", (4, 512))
    with pytest.raises(ValueError, match="not a GGUF block format"):
        P.pack_planes(raw, "FP8_E4M3", (4, 512))
    p = P.pack_planes(raw, f, (4, 512))
    with pytest.raises(ValueError, match="4 rows do not split into 3"):
        P.split_rows(p, 3, 0)
    with pytest.raises(ValueError, match="2 blocks do not split into 4"):
        P.split_blocks(p, 4, 0)
    with pytest.raises(ValueError, match="split index 2 out of range"):
        P.split_rows(p, 2, 2)
    broken = P.Planes({**p.fields, "qh": p.fields["qh"][:-1]}, p.fmt, p.shape)
    with pytest.raises(ValueError, match="field 'qh'"):
        P.unpack_planes(broken)
