"""The CPU quantized-expert kernel (kernels/moe/cpu_ffi.py, csrc/qmatvec.cc) and the xla_cpu decode form on it.

References: gguf-py's `gguf.quants.dequantize` of the same GGUF bytes, in f64 numpy (matvecs), and
`kernels.moe.reference` / the f64 MoE loop of tests/test_moe_quant.py (whole decode). The kernel must build here
(CI has a C++ compiler): `available()` is asserted, never skipped.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType
from test_moe_quant import moe_f64, random_gguf, rel_err

from glm53.quant import registry
from glm53.quant.qweight import QuantizedExperts
from kernels import ffi_build
from kernels.moe import api, cpu_ffi, xla_cpu

LIMIT = 2.0
CASES = [  # (GGUF format, layout): every format x layout the kernel decodes (from the registry)
    (registry.entry(f).source or f, "planes" if registry.entry(f).gguf else "reencoded")
    for f in registry.formats_for("cpu_ffi")
]


def test_kernel_builds():
    assert cpu_ffi.enabled() and cpu_ffi.available()
    path = cpu_ffi.library_path(cpu_ffi._compiler())
    assert path.exists() and path.parent == cpu_ffi._cache_dir()


def _matvec_case(fmt, layout, rng, rows=40, cols=512, e=5, splits=1):
    raw = random_gguf(fmt, (e, rows, cols), rng)
    q = QuantizedExperts.from_gguf_bytes(raw, fmt, (e, rows, cols), layout, block_splits=splits)
    w = gq.dequantize(raw, GGMLQuantizationType[fmt]).reshape(e, rows, cols).astype(np.float64)
    return q, w


def _check_matvec(y, w, x, ids):
    """y [n, T, rows] against f64 W x within f32 accumulation error; ids outside [0, E) give exact zeros."""
    e = w.shape[0]
    for i, ex in enumerate(ids):
        xi = x[i if x.shape[0] > 1 else 0].astype(np.float64)  # [T, cols]
        if not 0 <= ex < e:
            assert not np.any(y[i]), f"slot {i} (id {ex}) should be zeros"
            continue
        want = xi @ w[ex].T  # [T, rows]
        bound = 1e-5 * (np.abs(xi) @ np.abs(w[ex]).T) + 1e-30
        assert np.all(np.abs(y[i] - want) <= bound), (ex, float(np.max(np.abs(y[i] - want) / bound)))


@pytest.mark.parametrize("fmt,layout", CASES)
def test_matvec_vs_gguf_f64(fmt, layout):
    """Per format (tests/test_expert_formats.py runs the shared body on this kernel too): 40 rows (two 16-row tiles and 8 rows one at a time), T = 3 tokens, shared and per-expert x,
    repeated and out-of-range ids, one thread and two."""
    rng = np.random.default_rng(CASES.index((fmt, layout)))
    q, w = _matvec_case(fmt, layout, rng)
    assert q.planes.fmt.name in cpu_ffi.FORMAT_CODES
    ids = np.array([3, 0, 5, 3, -1, 4], np.int32)
    fn = jax.jit(lambda x, i, p, th: cpu_ffi.qmatvec(x, i, p, threads=th), static_argnums=3)
    for x_lead, threads in ((1, 1), (len(ids), 2)):
        x = rng.standard_normal((x_lead, 3, q.planes.cols)).astype(np.float32)
        y = np.asarray(fn(jnp.asarray(x), jnp.asarray(ids), q.planes, threads))
        assert y.shape == (len(ids), 3, q.planes.rows)
        _check_matvec(y, w, x, ids)


def test_matvec_block_splits_and_many_tokens():
    """Planes with block_splits = 2 (paired fields per group, as for a 2-way split of the inputs) and T = 11
    tokens (a pass of 8 and one of 3)."""
    rng = np.random.default_rng(3)
    for fmt in ("Q4_K", "IQ4_XS"):
        q, w = _matvec_case(fmt, "planes", rng, rows=32, cols=768 * 2, e=3, splits=2)
        assert q.planes.block_splits == 2
        ids = np.array([2, 1], np.int32)
        x = rng.standard_normal((1, 11, q.planes.cols)).astype(np.float32)
        _check_matvec(np.asarray(cpu_ffi.qmatvec(jnp.asarray(x), jnp.asarray(ids), q.planes)), w, x, ids)


def test_unsupported_formats_are_named():
    rng = np.random.default_rng(4)
    q, _ = _matvec_case("Q6_K", "planes", rng, rows=16, cols=256, e=2)
    assert "Q6_K" in cpu_ffi.unsupported_reason(q.planes)
    with pytest.raises(NotImplementedError, match="Q6_K"):
        cpu_ffi.qmatvec(jnp.zeros((1, 1, 256)), jnp.zeros((1,), jnp.int32), q.planes)


E, D, F, K = 10, 512, 256, 4
MIX = {"gate": "IQ2_S", "up": "IQ2_S", "down": "IQ3_S"}  # the UD-IQ3_XXS common layer
SHAPES = {"gate": (E, F, D), "up": (E, F, D), "down": (E, D, F)}


@pytest.fixture(scope="module")
def experts():
    """{layout: {matrix: QuantizedExperts}} of MIX, plus their f64 kernels [E, in, out]."""
    rng = np.random.default_rng(0)
    raws = {m: random_gguf(MIX[m], SHAPES[m], rng) for m in MIX}
    kernels = {
        m: np.swapaxes(
            gq.dequantize(raws[m], GGMLQuantizationType[MIX[m]]).reshape(SHAPES[m]).astype(np.float64), 1, 2
        )
        for m in MIX
    }
    qs = {
        lay: {m: QuantizedExperts.from_gguf_bytes(raws[m], MIX[m], SHAPES[m], lay) for m in MIX}
        for lay in ("planes", "reencoded")
    }
    return qs, kernels


def _routing(t, rng):
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(t)]).astype(np.int32)
    ids[0, -1] = E  # an empty slot
    w = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
    x = rng.standard_normal((t, D)).astype(np.float32)
    return x, ids, w


def _moe(impl):
    return jax.jit(lambda x, i, w, g, u, d: api.moe_experts(x, i, w, g, u, d, LIMIT, implementation=impl))


@pytest.mark.parametrize("layout", ("planes", "reencoded"))
def test_decode_vs_reference_and_f64(experts, layout):
    """xla_cpu's decode form on the kernel equals the reference implementation on the same QuantizedExperts
    (and the f64 loop), at T = 1, 3 and 9 (9 * 4 slots > E: padded distinct-expert ids)."""
    qs, kernels = experts
    ws = qs[layout]
    rng = np.random.default_rng(1)
    for t in (1, 3, 9):
        x, ids, w = _routing(t, rng)
        args = (x, ids, w, ws["gate"], ws["up"], ws["down"])
        got = np.asarray(_moe("xla_cpu_ffi_decode")(*args))
        assert rel_err(got, _moe("reference")(*args)) < 2e-5
        assert rel_err(got, moe_f64(x, ids, w, kernels, LIMIT)) < 2e-5


def test_decode_bf16_activations(experts):
    """bf16 x: the kernel takes x and the SwiGLU output rounded to bf16 (as the reference does) but keeps the
    weights f32 (the reference rounds them to bf16 too): bf16-level agreement, bf16 out."""
    qs, kernels = experts
    ws = qs["reencoded"]
    x, ids, w = _routing(3, np.random.default_rng(6))
    xb = jnp.asarray(x, jnp.bfloat16)
    args = (xb, ids, w, ws["gate"], ws["up"], ws["down"])
    got = _moe("xla_cpu_ffi_decode")(*args)
    assert got.dtype == jnp.bfloat16
    want = moe_f64(np.asarray(xb.astype(jnp.float32)), ids, w, kernels, LIMIT)
    assert rel_err(np.asarray(got.astype(jnp.float32)), want) < 2e-2


def _custom_calls(impl, args) -> int:
    text = _moe(impl).lower(*args).compile().as_text()
    return len(re.findall(r'custom_call_target="glm53_qmatvec"', text))


def test_auto_uses_the_kernel_once_per_matrix_and_the_switch_turns_it_off(experts, monkeypatch):
    """On CPU "auto" (xla_cpu's decode form) runs the kernel: the compiled program holds exactly three custom
    calls (gate, up, down). GLM53_MOE_FFI=0 gives the XLA path (no custom call) with the same result."""
    qs, _ = experts
    ws = qs["reencoded"]
    x, ids, w = _routing(2, np.random.default_rng(2))
    args = (x, ids, w, ws["gate"], ws["up"], ws["down"])
    assert api.select_implementation("auto", 2 * K, backend="cpu") == "xla_cpu_decode"
    assert _custom_calls("auto", args) == 3
    on = np.asarray(_moe("auto")(*args))
    monkeypatch.setenv(cpu_ffi.ENV, "0")
    assert not cpu_ffi.available()
    assert _custom_calls("auto", args) == 0
    off = np.asarray(_moe("auto")(*args))
    assert rel_err(on, off) < 2e-5
    with pytest.raises(NotImplementedError, match="disabled"):
        _moe("xla_cpu_ffi_decode")(*args)


def test_build_failure_warns_once_and_falls_back(experts, monkeypatch, tmp_path):
    """A compiler that fails: the build raises (no library left behind); a kernel that is not available warns
    once and the decode form runs the XLA path."""
    with pytest.raises(RuntimeError, match="failed"):
        cpu_ffi._build("false", tmp_path / "k.so")
    assert list(tmp_path.iterdir()) == []
    kernel = ffi_build.Kernel(cpu_ffi.SOURCE, "Glm53QMatvec", cpu_ffi.TARGET, cpu_ffi.ENV, cpu_ffi.KERNEL.what)
    monkeypatch.setattr(kernel, "load", lambda: "no C++ compiler (test)")
    monkeypatch.setattr(cpu_ffi, "KERNEL", kernel)
    qs, kernels = experts
    ws = qs["planes"]
    x, ids, w = _routing(1, np.random.default_rng(5))
    args = (x, ids, w, ws["gate"], ws["up"], ws["down"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not cpu_ffi.available() and not cpu_ffi.available()
        assert _custom_calls("xla_cpu_decode", args) == 0
        y = np.asarray(xla_cpu.moe_experts_decode(*(jnp.asarray(a) for a in args[:3]), *args[3:], LIMIT))
    msgs = [str(s.message) for s in seen if "CPU quantized-expert kernel" in str(s.message)]
    assert len(msgs) == 1 and "no C++ compiler (test)" in msgs[0]
    assert rel_err(y, moe_f64(x, ids, w, kernels, LIMIT)) < 2e-5
