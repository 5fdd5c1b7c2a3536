"""The CPU few-row matmul kernel (kernels/matmul/cpu_ffi.py, csrc/rowmm.cc), `StreamedKernel`, the xla_cpu MoE
decode form on it, and `glm53.runtime.weights.decode_state`'s wrapping.

References: f64 numpy products (the kernel's f32 fma chains within f32 accumulation error), the f64 MoE loop of
tests/test_moe.py, and exact identities: a row's result is bit-identical alone and inside any batch, run or
column block. The kernel must build here (CI has a C++ compiler): `available()` is asserted, never skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_moe import _np_moe

from configs import tiny
from glm53.config import model_config_from_dict
from glm53.model import Glm53Model
from glm53.runtime import weights
from kernels.matmul import cpu_ffi
from kernels.matmul.streamed import MAX_ROWS, StreamedKernel
from kernels.moe import api

LIMIT = 3.0


def _check(y, x, w, ids):
    """y [n, T, N] against f64 x @ w[ids] within f32 accumulation error; ids outside [0, E): exact zeros."""
    for i, e in enumerate(ids):
        xi = x[i if x.shape[0] > 1 else 0].astype(np.float64)
        if not 0 <= e < w.shape[0]:
            assert not np.any(y[i]), f"id {e} should give zeros"
            continue
        want = xi @ w[e].astype(np.float64)
        bound = 1e-5 * (np.abs(xi) @ np.abs(w[e]).astype(np.float64)) + 1e-30
        assert np.all(np.abs(y[i] - want) <= bound), (i, float(np.max(np.abs(y[i] - want) / bound)))


def test_kernel_builds():
    assert cpu_ffi.enabled() and cpu_ffi.available()
    from kernels import ffi_build

    assert ffi_build.library_path(ffi_build.compiler(), cpu_ffi.SOURCE).exists()


@pytest.mark.parametrize("t,k,n", [(1, 256, 512), (3, 37, 50), (8, 64, 16), (11, 130, 300), (17, 8, 7)])
def test_row_matmul_vs_f64(t, k, n):
    """Shapes with a column tail (N % 16), a k tail (K % 4), more than 8 tokens (several passes), more than one
    column block (N > 256); a shared x and x per id; repeated and out-of-range ids; one thread and two."""
    rng = np.random.default_rng(t * 1000 + k + n)
    w = rng.standard_normal((4, k, n)).astype(np.float32)
    ids = np.array([2, 0, 4, 2, -1, 3], np.int32)
    for lead, threads in ((1, 1), (len(ids), 2)):
        x = rng.standard_normal((lead, t, k)).astype(np.float32)
        y = np.asarray(cpu_ffi.row_matmul(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), threads=threads))
        assert y.shape == (len(ids), t, n) and y.dtype == np.float32
        _check(y, x, w, ids)


def test_rows_do_not_depend_on_the_batch():
    """Every row of a 13-row product equals that row alone, bit for bit; sorted ids with one row each (runs read
    the matrix once) equal the same rows one id at a time; two threads equal one."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 96, 1000)).astype(np.float32)  # 4 column blocks, one partial
    x = rng.standard_normal((1, 13, 96)).astype(np.float32)
    mm = jax.jit(cpu_ffi.row_matmul, static_argnames="threads")
    one = jnp.zeros((1,), jnp.int32) + 3
    y = np.asarray(mm(jnp.asarray(x), one, jnp.asarray(w)))
    for r in range(13):
        assert np.array_equal(y[0, r], np.asarray(mm(jnp.asarray(x[:, r : r + 1]), one, jnp.asarray(w)))[0, 0])
    ids = np.array([0, 0, 0, 2, 4, 4, 5, 5], np.int32)  # runs of equal ids, then out-of-range ones (zeros)
    xs = rng.standard_normal((8, 1, 96)).astype(np.float32)
    runs = np.asarray(mm(jnp.asarray(xs), jnp.asarray(ids), jnp.asarray(w)))
    alone = np.concatenate([np.asarray(mm(jnp.asarray(xs[i : i + 1]), jnp.asarray(ids[i : i + 1]), jnp.asarray(w)))
                            for i in range(8)])  # fmt: skip
    assert np.array_equal(runs, alone)
    _check(runs, xs, w, ids)
    two = np.asarray(mm(jnp.asarray(xs), jnp.asarray(ids), jnp.asarray(w), threads=2))
    assert np.array_equal(runs, two)


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="row_matmul"):
        cpu_ffi.row_matmul(jnp.zeros((1, 2, 8)), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 9, 4)))
    with pytest.raises(TypeError, match="f32"):
        cpu_ffi.row_matmul(jnp.zeros((1, 2, 8), jnp.bfloat16), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 8, 4)))


def _custom_calls(fn, *args) -> int:  # a fresh jit: the switch is read when a program is traced
    return jax.jit(lambda *a: fn(*a)).lower(*args).compile().as_text().count('custom_call_target="glm53_rowmm"')


def test_streamed_kernel_runs_the_kernel_only_for_few_f32_rows(monkeypatch):
    """Up to MAX_ROWS f32 rows: one custom call, the f64 product; more rows, bf16 activations or the switch off:
    jnp.matmul (no custom call) with jnp.matmul's values. The wrapper reads as its array elsewhere."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((40, 24)).astype(np.float32))
    sk = StreamedKernel(w)
    assert sk.shape == (40, 24) and sk.dtype == jnp.float32 and sk.ndim == 2
    assert np.array_equal(np.asarray(sk[...]), np.asarray(w)) and sk.astype(jnp.bfloat16).dtype == jnp.bfloat16
    mm = lambda x, w: StreamedKernel(w).matmul(x)
    few = jnp.asarray(rng.standard_normal((2, 3, 40)).astype(np.float32))  # 6 rows, leading axes kept
    assert _custom_calls(mm, few, w) == 1
    y = np.asarray(jax.jit(mm)(few, w))
    assert y.shape == (2, 3, 24)
    _check(y.reshape(1, 6, 24), np.asarray(few).reshape(1, 6, 40), np.asarray(w)[None], [0])
    many = jnp.asarray(rng.standard_normal((MAX_ROWS + 1, 40)).astype(np.float32))
    assert _custom_calls(mm, many, w) == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(mm)(many, w)), np.asarray(jax.jit(jnp.matmul)(many, w)))
    assert _custom_calls(mm, few.astype(jnp.bfloat16), w) == 0
    monkeypatch.setenv(cpu_ffi.ENV, "0")
    assert not cpu_ffi.available() and _custom_calls(mm, few, w) == 0
    with pytest.raises(NotImplementedError, match="unavailable"):
        cpu_ffi.row_matmul(few.reshape(1, 6, 40), jnp.zeros((1,), jnp.int32), w[None])


def test_moe_decode_form_on_streamed_experts(monkeypatch):
    """The xla_cpu decode form on StreamedKernel experts: three custom calls (routed rows only, sorted by
    expert), the f64 MoE loop's values; the same as the stacked arrays' XLA path within f32 error; a token's
    output is the same alone and in the batch (bit for bit)."""
    rng = np.random.default_rng(40)
    t, k, e, d, f = 9, 3, 16, 32, 16
    x = rng.normal(size=(t, d))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    ids[2, 1] = e  # an empty slot
    ids[5, 0] = ids[5, 2] = 3  # the same expert twice for one token (summed)
    w = rng.uniform(0.1, 1.0, size=(t, k))
    wg, wu, wd = rng.normal(size=(e, d, f)) * 0.3, rng.normal(size=(e, d, f)) * 0.3, rng.normal(size=(e, f, d)) * 0.2
    c = lambda a: jnp.asarray(a, jnp.float32)
    streamed = tuple(StreamedKernel(c(a)) for a in (wg, wu, wd))
    fn = lambda x, i, w, *ws: api.moe_experts(x, i, w, *ws, LIMIT, implementation="xla_cpu_decode")
    args = (c(x), jnp.asarray(ids), c(w))
    assert _custom_calls(fn, *args, *streamed) == 3
    got = np.asarray(jax.jit(fn)(*args, *streamed), np.float64)
    want = _np_moe(x, ids, w, wg, wu, wd, LIMIT)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-5
    xla = np.asarray(jax.jit(fn)(*args, c(wg), c(wu), c(wd)))
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)
    for r in (0, 5, 8):
        alone = jax.jit(fn)(c(x[r : r + 1]), jnp.asarray(ids[r : r + 1]), c(w[r : r + 1]), *streamed)
        assert np.array_equal(np.asarray(alone)[0], got[r].astype(np.float32))
    monkeypatch.setenv(cpu_ffi.ENV, "0")  # the switch off: the XLA path on the wrapped arrays
    assert _custom_calls(fn, *args, *streamed) == 0
    off = jax.jit(lambda *a: fn(*a))(*args, *streamed)
    np.testing.assert_allclose(np.asarray(off), xla, rtol=1e-6, atol=1e-6)


def test_decode_state_wraps_linear_and_expert_kernels():
    """decode_state wraps every f32 Linear kernel, mHC projection and the xla_cpu MoE layers' experts in
    StreamedKernels over the same buffers (no copy); one-token steps on it give the plain state's greedy tokens,
    logits within f32 error."""
    cfg = model_config_from_dict(tiny.model_config("default"))
    model = Glm53Model(cfg, rngs=nnx.Rngs(3), with_mtp=False, kernels={"moe": "auto"})
    gd, state = nnx.split(model)
    dstate = weights.decode_state(model, state)
    wrapped = [x for x in jax.tree.leaves(dstate, is_leaf=lambda x: isinstance(x, StreamedKernel))
               if isinstance(x, StreamedKernel)]  # fmt: skip
    kinds = [type(m).__name__ for _, m in nnx.iter_graph(model)]
    n_moe = sum(k == "moe" for k in cfg.mlp_layer_types)
    assert n_moe > 0 and len(wrapped) == kinds.count("Linear") + kinds.count("HyperConnection") + 3 * n_moe
    plain = {a.unsafe_buffer_pointer() for a in jax.tree.leaves(state)}
    assert all(x.w.unsafe_buffer_pointer() in plain for x in wrapped)  # the same arrays

    def run(st):
        m = nnx.merge(gd, st)
        cache = m.init_cache(2, 16)
        step = jax.jit(lambda st, c, tok: nnx.merge(gd, st)(tok, cache=c))
        toks, out = jnp.asarray([[5], [9]], jnp.int32), []
        for _ in range(4):
            logits, cache = step(st, cache, toks)
            out.append(np.asarray(logits[:, -1]))
            toks = jnp.asarray(out[-1].argmax(-1)[:, None], jnp.int32)
        return np.stack(out)

    a, b = run(dstate), run(state)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert (a.argmax(-1) == b.argmax(-1)).all()
