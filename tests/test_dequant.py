"""glm53.quant.dequant against gguf-py's `gguf.quants.dequantize`, bit for bit in f32.

Blocks come from two sources: random bytes with sane f16 scale fields (every bit pattern of the payload
fields, including codes a quantizer rarely emits) and llama.cpp's own quantizer (`ggml_quantize_chunk` via
ctypes) on Gaussian rows of varied magnitude.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.quant import dequant, ggml
from glm53.quant.formats import GGUF_FORMATS, I_QUANTS, K_QUANTS, UnknownFormatError, get_format

ROWS, COLS = 4, 512  # 8 super-blocks or 64 small blocks per format
QUANTIZED = I_QUANTS + K_QUANTS + ("Q8_0", "Q4_0")
SCALE_FIELDS = ("d", "dmin")


def _random_blocks(name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes [n_blocks, type_size]; f16 scale fields set to finite values (incl. subnormal, 0, < 0)."""
    f = get_format(name)
    if name in ("F32", "F16", "BF16"):
        x = (rng.standard_normal(n_blocks) * np.exp(rng.uniform(-8, 8, n_blocks))).astype(np.float32)
        x[:3] = (0.0, -0.0, 1e-40)  # zeros and an f32 subnormal
        if name == "F16":
            x[3] = 3e-6  # an f16 subnormal
            return x.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        if name == "BF16":
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
        return x.view(np.uint8).reshape(n_blocks, 4)
    blocks = rng.integers(0, 256, (n_blocks, f.type_size), dtype=np.uint8)
    for fld in f.fields:
        if fld.name in SCALE_FIELDS:
            d = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-5, 1, n_blocks)).astype(np.float16)
            d[0], d[1] = 0.0, np.float16(2.0**-20)  # zero and an f16 subnormal
            blocks[:, fld.offset : fld.offset + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def _gguf(blocks: np.ndarray, name: str, shape) -> np.ndarray:
    return gq.dequantize(blocks.reshape(shape[0], -1), GGMLQuantizationType[name]).reshape(shape)


def _assert_bits_equal(got, want, what: str):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} weights differ, e.g. {got[bad][:4]} vs {want[bad][:4]}"
    )


@pytest.fixture(scope="module")
def ggml_blocks():
    """llama.cpp-quantized rows [ROWS, COLS] for every quantized format, as uint8 blocks."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32) * np.array(
        [[1e-3], [0.02], [1.0], [30.0]], np.float32
    )
    x[0, :40] = 0.0  # a partly empty row
    out = {}
    for name in QUANTIZED:
        f = get_format(name)
        out[name] = np.frombuffer(ggml.quantize(x, name), np.uint8).reshape(-1, f.type_size)
    return out


@pytest.fixture(scope="module")
def decode_jit():
    """One jitted decode_fields per format, traced on [n_blocks] leading dims (the planes-style entry point)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = jax.jit(lambda fields: dequant.decode_fields(name, fields))
        return cache[name]

    return get


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_random_blocks_bit_exact(name, decode_jit):
    f = get_format(name)
    n_blocks = ROWS * COLS // f.block_size
    blocks = _random_blocks(name, n_blocks, np.random.default_rng(zlib.crc32(name.encode())))
    want = _gguf(blocks, name, (ROWS, COLS))
    _assert_bits_equal(dequant.dequantize(blocks, name, (ROWS, COLS)), want, f"{name} dequantize")
    fields = {k: jnp.asarray(v) for k, v in dequant.split_fields(name, blocks).items()}
    _assert_bits_equal(decode_jit(name)(fields).reshape(ROWS, COLS), want, f"{name} decode_fields")


@pytest.mark.parametrize("name", QUANTIZED)
def test_llama_cpp_blocks_bit_exact(name, ggml_blocks, decode_jit):
    blocks = ggml_blocks[name]
    want = _gguf(blocks, name, (ROWS, COLS))
    _assert_bits_equal(dequant.dequantize(blocks.tobytes(), name, (ROWS, COLS)), want, f"{name} dequantize")
    fields = {k: jnp.asarray(v) for k, v in dequant.split_fields(name, blocks).items()}
    _assert_bits_equal(decode_jit(name)(fields).reshape(ROWS, COLS), want, f"{name} decode_fields")


def test_dequantize_inside_jit_and_leading_dims(ggml_blocks):
    """The traced path (inside a user's jit) and a 3-D shape give the same bits as the host path."""
    blocks = ggml_blocks["IQ2_S"]
    want = _gguf(blocks, "IQ2_S", (ROWS, COLS)).reshape(2, 2, COLS)
    got = jax.jit(lambda r: dequant.dequantize(r, "IQ2_S", (2, 2, COLS)))(jnp.asarray(blocks.reshape(-1)))
    _assert_bits_equal(got, want, "IQ2_S in jit")
    got16 = dequant.dequantize(blocks, "iq2_s", (ROWS, COLS), dtype=jnp.bfloat16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got16), want.reshape(ROWS, COLS).astype(jnp.bfloat16))


def test_dequantize_into_reuses_buffer(ggml_blocks):
    blocks = ggml_blocks["Q6_K"]
    want = _gguf(blocks, "Q6_K", (ROWS, COLS))
    out = jnp.full((ROWS, COLS), jnp.nan, jnp.float32)
    for _ in range(2):  # the returned array is the next call's buffer
        out = dequant.dequantize_into(blocks, "Q6_K", out)
        _assert_bits_equal(out, want, "Q6_K dequantize_into")
    with pytest.raises(ValueError, match="needs 840 bytes"):
        dequant.dequantize_into(blocks, "Q6_K", jnp.zeros((ROWS // 2, COLS), jnp.float32))


def test_decode_fields_per_block_dims():
    """decode_fields accepts any leading dims; block b of a [2, 3] grid decodes like block b alone."""
    rng = np.random.default_rng(7)
    blocks = _random_blocks("IQ3_S", 6, rng)
    fields = {k: jnp.asarray(v.reshape(2, 3, -1)) for k, v in dequant.split_fields("IQ3_S", blocks).items()}
    got = jax.jit(lambda fl: dequant.decode_fields("IQ3_S", fl))(fields)
    assert got.shape == (2, 3, 256)
    _assert_bits_equal(got.reshape(6, 256), _gguf(blocks, "IQ3_S", (6, 256)), "IQ3_S [2, 3] blocks")


def _lowered_gathers(name: str, n_blocks: int, platform: str) -> list[int]:
    """Element counts of the gathers in the decode of n_blocks blocks as lowered for `platform`."""
    f = get_format(name)
    exported = jax.export.export(jax.jit(lambda b: dequant.decode_blocks(name, b)), platforms=[platform])
    text = exported(jax.ShapeDtypeStruct((n_blocks, f.type_size), jnp.uint8)).mlir_module()
    sizes = []
    for line in text.splitlines():
        if '"stablehlo.gather"' in line or '"stablehlo.dynamic_gather"' in line:
            dims = line.rsplit("-> tensor<", 1)[1].split(">", 1)[0].split("x")[:-1]
            sizes.append(int(np.prod([int(d) for d in dims])))
    return sizes


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_gather_counts(name):
    """Exact table reads per block as lowered for TPU: none for K-quants, IQ4 and the simple formats; one per
    8 (IQ2) or 4 (IQ3) weights. On CPU, IQ4's 16-level table is one gather per weight instead (faster there)."""
    per_block = {"IQ2_XXS": 32, "IQ2_XS": 32, "IQ2_S": 32, "IQ3_XXS": 64, "IQ3_S": 64}.get(name, 0)
    assert _lowered_gathers(name, 4, "tpu") == ([4 * per_block] if per_block else [])
    if name in ("IQ4_NL", "IQ4_XS"):
        assert _lowered_gathers(name, 4, "cpu") == [4 * get_format(name).block_size]


def test_iq4_select_form_matches_table():
    """The gather-free IQ4 level lookup (used off CPU) against gguf-py's table, for all 16 codes."""
    codes = jnp.arange(16, dtype=jnp.uint32)
    np.testing.assert_array_equal(np.asarray(dequant._iq4_levels_select(codes)), np.array(gq.IQ4_NL.kvalues))
    np.testing.assert_array_equal(np.asarray(dequant._iq4_levels_take(codes)), np.array(gq.IQ4_NL.kvalues))


def test_bad_inputs():
    blocks = _random_blocks("Q4_K", 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="needs 288 bytes"):
        dequant.dequantize(blocks[:, :-1], "Q4_K", (1, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        dequant.dequantize(blocks, "Q4_K", (2, 288))
    with pytest.raises(ValueError, match="uint8"):
        dequant.dequantize(blocks.view(np.int8), "Q4_K", (1, 512))
    fields = dequant.split_fields("Q4_K", blocks)
    with pytest.raises(ValueError, match="expected fields"):
        dequant.decode_fields("Q4_K", {k: v for k, v in fields.items() if k != "dmin"})
    with pytest.raises(ValueError, match="'scales' must be uint8"):
        dequant.decode_fields("Q4_K", {**fields, "scales": fields["scales"][:, :11]})
    with pytest.raises(ValueError, match="leading dims"):
        dequant.decode_fields("Q4_K", {**fields, "qs": fields["qs"][:1]})
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[..., 144\]"):
        dequant.split_fields("Q4_K", blocks[:, :100])
    with pytest.raises(UnknownFormatError):
        dequant.dequantize(blocks, "Q4_9", (1, 512))
    with pytest.raises(NotImplementedError, match="fp8"):
        dequant.decode_fields("FP8_E4M3", {"w": blocks[:, :1]})


def test_bench_dequant_smoke():
    """The benchmark entry point runs end to end on a tiny matrix and its jax impls are exact."""
    from glm53.benchmarks import dequant as bench_dequant

    records = bench_dequant.run(["IQ4_XS", "Q8_0"], 8, 256, 1, 4, ["jax", "jax_into"], 0)
    assert records[-1]["type"] == "machine" and records[-1]["cpu_count"] >= 1
    rows = records[:-1]
    assert {(r["type"], r["impl"]) for r in rows} == {
        (t, i) for t in ("IQ4_XS", "Q8_0") for i in ("jax", "jax_into", "gguf_py", "ggml")
    }
    keys = {"type", "impl", "median_s", "weights_per_s", "ratio_vs_gguf_py", "ratio_vs_ggml"}
    assert all(keys <= set(r) and r["exact"] and r["median_s"] > 0 for r in rows)
    assert "IQ4_XS" in bench_dequant.format_table(records)
