"""Every implementation of every expert format against gguf-py: one shared test body, one subclass per backend.

The registry (`glm53.quant.registry`) says which backend implements which format; `pytest_generate_tests` below
runs each backend's subclass of `FormatBackendTest` over exactly those formats, so a format added to the registry
is tested on every backend it names, and a backend that drops one fails `test_decoder_tables_match_registry`.

The body, per (backend, format): blocks drawn as real files hold them (tests/expert_blocks.py: negative and
subnormal f16 scales, random codes), packed into the backend's planes layout (1 and 2 block groups), then
- `test_decode_equals_gguf_py`: the backend's own decoder, run on the planes, gives W equal to gguf-py's
  `gguf.quants.dequantize` of the source bytes (f32 values equal; for the C++ kernel: its matvec of the identity);
- `test_matvec_vs_f64`: the backend's kernel (interpreted where it is a Pallas kernel) on 3 tokens against
  x @ W^T in f64 numpy, within f32 accumulation error (bf16 rounding for the tensor-core path).
The GPU tensor-core decoders (pallas_gpu_wgmma) are checked through `decode_chunk`, the code the kernel runs in
interpret mode.
"""

from __future__ import annotations

import functools
import re
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from expert_blocks import F16_SUBNORMAL, SCALE_FIELDS, draw_gguf, oracle, scales_of
from jax.experimental.pallas import tpu as pltpu

from glm53.quant import dequant, layout, registry
from glm53.quant import reencode as R
from glm53.quant.formats import FORMATS, GGUF_FORMATS, REENCODED_FORMATS, get_format
from kernels.moe import cpu_ffi
from kernels.moe import pallas_common as C
from kernels.moe import pallas_gpu as G
from kernels.moe import pallas_gpu_wgmma as W
from kernels.moe import pallas_tpu_decode as KD

ROOT = Path(__file__).resolve().parents[1]


def pytest_generate_tests(metafunc):
    """Parametrizes `fmt` of a backend class by the formats the registry gives that backend (and `splits` by
    the class's block-group counts)."""
    cls = metafunc.cls
    if cls is not None and getattr(cls, "backend", None):
        if "fmt" in metafunc.fixturenames:
            metafunc.parametrize("fmt", registry.formats_for(cls.backend))
        if "splits" in metafunc.fixturenames:
            metafunc.parametrize("splits", cls.splits)


@functools.cache
def case(fmt: str, rows: int, cols: int, splits: int):
    """(planes [1] x (rows, cols) of block format `fmt`, f32 oracle W [rows, cols], source GGUF bytes)."""
    e = registry.entry(fmt)
    src = e.source or e.name
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{rows}/{cols}/{splits}".encode()))
    raw = draw_gguf(src, rows * cols, rng).reshape(1, rows, -1)
    lay = "planes" if e.gguf else "reencoded"
    planes = layout.pack(raw, src, (1, rows, cols), lay, block_splits=splits)
    assert planes.fmt.name == fmt and planes.block_splits == splits
    return planes, oracle(raw, src, (rows, cols)), raw


def _rel_check(y, x, w, rtol):
    """|y - x W^T| <= rtol |x| |W|^T elementwise (f64 reference)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = x64 @ w64.T
    bound = rtol * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - want)
    assert np.all(err <= bound), float(np.max(err / bound))


class FormatBackendTest:
    """The shared body. A subclass names its registry `backend` and implements `weights` (its decoder's W) and
    `matvec` (its kernel)."""

    backend = ""
    rows = 128
    splits = (1, 2)  # block groups (planes.py `block_splits`): 2 re-pairs the 2-byte fields per group
    matvec_rtol = 1e-5

    def cols(self, fmt: str, splits: int) -> int:
        return 512 * splits  # two 256-weight blocks per group (one paired d word), 16 of Q8_0's

    def weights(self, planes) -> np.ndarray:  # f32 [rows, cols]
        raise NotImplementedError

    def matvec(self, planes, x: np.ndarray) -> np.ndarray:  # x f32 [T, cols] -> f32 [T, rows]
        raise NotImplementedError

    def test_decode_equals_gguf_py(self, fmt, splits):
        planes, w, _ = case(fmt, self.rows, self.cols(fmt, splits), splits)
        got = np.asarray(self.weights(planes), np.float32)
        assert got.shape == w.shape
        np.testing.assert_array_equal(got, w, err_msg=f"{self.backend} {fmt} splits={splits}")

    def test_matvec_vs_f64(self, fmt):
        planes, w, _ = case(fmt, self.rows, self.cols(fmt, 1), 1)
        x = np.random.default_rng(1).standard_normal((3, planes.cols)).astype(np.float32)
        y = np.asarray(self.matvec(planes, x))
        assert y.shape == (3, planes.rows)
        _rel_check(y, x, w, self.matvec_rtol)


class TestJnp(FormatBackendTest):
    """glm53.quant.dequant (GGUF formats) and reencode (re-encoded) through `layout.dequantize` of the planes:
    what the XLA paths (reference, xla_quant, xla_cpu) run. (`dequant.dequantize` of the natural GGUF layout:
    tests/test_dequant.py, on blocks with signed, zero and subnormal scales too.)"""

    backend = "jnp"
    splits = (1,)  # the pairing is format-independent here (planes_to_fields); tests/test_planes.py splits

    def weights(self, planes):
        return _jnp_weights(planes.fmt.name, planes.rows, planes.cols, planes.block_splits)

    def matvec(self, planes, x):
        return np.asarray(x, np.float32) @ self.weights(planes).T


@functools.cache
def _jnp_weights(fmt, rows, cols, splits):
    return np.asarray(layout.dequantize(case(fmt, rows, cols, splits)[0]))[0]


class TestCpuFfi(FormatBackendTest):
    """kernels/moe/cpu_ffi.py + csrc/qmatvec.cc (40 rows: two 16-row tiles and 8 rows one at a time)."""

    backend = "cpu_ffi"
    rows = 40

    def _qmatvec(self, planes, x, threads):
        assert cpu_ffi.available()
        return cpu_ffi.qmatvec(jnp.asarray(x)[None], jnp.zeros((1,), jnp.int32), planes, threads=threads)[0]

    def weights(self, planes):  # the kernel's matvec of the identity: W^T one column per token
        return np.asarray(self._qmatvec(planes, np.eye(planes.cols, dtype=np.float32), 1)).T

    def matvec(self, planes, x):
        return self._qmatvec(planes, x, 2)


class TestPallasTpu(FormatBackendTest):
    """kernels/moe/pallas_common.py's decoders (plain jnp) and the TPU decode kernel (`down_decode`) in TPU
    interpret mode."""

    backend = "pallas_tpu"

    def weights(self, planes):
        one = {k: jnp.asarray(v[0]) for k, v in planes.fields.items()}
        dec = np.asarray(C.decode_matrix(planes.fmt, planes.cols, planes.block_splits, one))
        got = np.empty_like(dec)
        got[C.input_order(planes.fmt, planes.cols)] = dec
        return got.T

    def matvec(self, planes, x):
        xs = np.zeros((8, planes.cols), np.float32)
        xs[: len(x)] = x
        hs = C.permute_inputs(jnp.asarray(xs), planes.fmt, planes.cols)[None]
        one = jnp.zeros((1,), jnp.int32)
        interpret = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
        return KD.down_decode(hs, one, one + 1, planes, lane_tile=128, interpret=interpret)[: len(x)]


class TestPallasGpu(FormatBackendTest):
    """kernels/moe/pallas_gpu.py: its 1-D decoders (vmapped plain jnp) and `grouped_matvec` interpreted."""

    backend = "pallas_gpu"

    def weights(self, planes):
        return np.asarray(G.decode_matrix(planes)).T

    def matvec(self, planes, x):
        z = jnp.zeros((1,), jnp.int32)
        y = G.grouped_matvec(jnp.asarray(x)[None], z, z, z + 1, [planes], tile=128, interpret=True)
        return y[0]


class TestPallasGpuWgmma(FormatBackendTest):
    """kernels/moe/pallas_gpu_wgmma.py: the tensor-core decoders through `decode_chunk` (what the kernel runs in
    interpret mode), and the bf16 x bf16 -> f32 product of the decoded tile."""

    backend = "pallas_gpu_wgmma"
    matvec_rtol = 1.6e-2  # activations and weights rounded to bf16

    def cols(self, fmt, splits):
        return 2 * W.ROWS * W.SPECS[fmt].pieces * splits  # two chunks per group

    def weights(self, planes):
        assert W.supports(planes, planes, planes) is None
        dec = np.asarray(W.decode_matrix(planes))
        got = np.empty_like(dec)
        got[W.input_order(planes)] = dec
        return got.T

    def matvec(self, planes, x):
        xp = jnp.asarray(x[:, W.input_order(planes)], jnp.bfloat16)
        return jnp.dot(xp, W.decode_matrix(planes).astype(jnp.bfloat16), preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------- the registry


def test_decoder_tables_match_registry():
    """Each backend's decoder table names exactly the formats the registry gives it."""
    jnp_formats = set(registry.formats_for("jnp"))
    assert set(dequant._DECODERS) == set(dequant.SUPPORTED_FORMATS) == jnp_formats & set(FORMATS)
    assert {e.name for e in R.REENCODED.values()} == jnp_formats - set(FORMATS) == set(REENCODED_FORMATS)
    tpu = set(C._DECODERS) | set(C._LOOKUP_DECODERS) | set(C.DENSE_FORMATS)
    assert tpu == set(C.SUPPORTED) == set(registry.formats_for("pallas_tpu"))
    assert set(C._LOOKUP_DECODERS) == set(C.LOOKUP_FORMATS)
    assert set(G._DECODERS) == set(G.SUPPORTED) == set(registry.formats_for("pallas_gpu"))
    assert set(W.SPECS) == set(W.SUPPORTED) == set(registry.formats_for("pallas_gpu_wgmma"))
    assert cpu_ffi.FORMAT_CODES == registry.cpu_codes()


def test_cpp_kernel_names_the_registry_codes():
    """csrc/qmatvec.cc's `enum Format`, its field counts and its decode switch agree with the registry."""
    src = cpu_ffi.SOURCE.read_text()
    enum = re.search(r"enum Format : int64_t \{([^}]*)\}", src).group(1)
    codes = {k: int(v) for k, v in re.findall(r"(\w+) = (\d+)", enum)}
    assert codes == registry.cpu_codes()
    body = re.search(r"int n_fields\(int64_t fmt\) \{(.*?)\n\}", src, re.S).group(1)
    for cases, n in re.findall(r"((?:case \w+: )+)return (\d+);", body):
        for name in re.findall(r"case (\w+):", cases):
            assert len(registry.entry(name).fields) == int(n), name
    decode = re.search(r"void decode\(int64_t fmt.*?\{(.*?)\n\}", src, re.S).group(1)
    assert set(re.findall(r"case (\w+):", decode)) == set(codes)
    for name in codes:
        assert (registry.entry(name).block_size == 32) == (name == "Q8_0")  # block_size(): Q8_0 ? 32 : 256


def test_formats_are_built_from_the_registry():
    assert set(GGUF_FORMATS) == set(registry.gguf_formats())
    for e in registry.ENTRIES:
        f = get_format(e.name) if e.gguf else REENCODED_FORMATS[e.name]
        assert (f.block_size, f.type_size, f.ggml_type) == (e.block_size, e.type_size, e.ggml_type)
        assert tuple((fd.name, fd.nbytes) for fd in f.fields) == e.fields
        assert all(kind != "not packable" for _, kind in e.plane_layout)
    assert R.REENCODED == {e.source: REENCODED_FORMATS[e.name] for e in registry.ENTRIES if not e.gguf}


def test_gpu_backend_imports_no_tpu_module():
    for path in sorted((ROOT / "kernels" / "moe").glob("pallas_gpu*.py")):
        assert not re.search(r"^\s*(from|import) \S*pallas_tpu", path.read_text(), re.M), path.name


def test_support_matrix_in_docs_is_generated():
    """docs/quantization.md's matrix between the markers is `registry.support_matrix_markdown()`
    (regenerate: python -m glm53.quant.registry)."""
    text = (ROOT / "docs/quantization.md").read_text()
    m = re.search(r"<!-- support-matrix:begin -->\n(.*?)<!-- support-matrix:end -->", text, re.S)
    assert m, "docs/quantization.md lacks the support-matrix markers"
    assert m.group(1).strip() == registry.support_matrix_markdown().strip()


@pytest.mark.parametrize("fmt", [e.name for e in registry.ENTRIES])
def test_drawn_blocks_hold_negative_and_subnormal_scales(fmt):
    """The shared body's blocks hold every kind of f16 scale a real file may (so a decoder that drops the
    scale's sign, or flushes a subnormal one, fails it)."""
    e = registry.entry(fmt)
    src = e.source or e.name
    _, _, raw = case(fmt, 128, 512, 1)
    for field in (f for f, _ in registry.entry(src).fields if f in SCALE_FIELDS):
        s = scales_of(raw, src, field).astype(np.float32)
        assert np.isfinite(s).all()
        sub = np.abs(s) < F16_SUBNORMAL
        assert (s < 0).sum() > len(s) // 4 and (sub & (s < 0)).any() and (sub & (s > 0)).any(), field
