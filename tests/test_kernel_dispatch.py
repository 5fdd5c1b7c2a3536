"""The implementation rule every kernels/<op>/api.py follows (kernels.dispatch), one case per api entry: a named
implementation that cannot take the inputs raises NotImplementedError naming itself; only "auto" falls back to
"reference", logging the reason once. (kernels.moe: tests/test_moe_quant.py::test_auto_and_fallback.)"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import dispatch
from kernels.kda import api as kda
from kernels.mhc import api as mhc
from kernels.sparse_mla import api as sparse_mla

_R = np.random.default_rng(0)


def _a(*shape, dtype=jnp.float32):
    return jnp.asarray(_R.standard_normal(shape), dtype)


def _kda_inputs():
    b, t, h, d = 1, 3, 2, 4
    beta = jax.nn.sigmoid(_a(b, t, h))
    return _a(b, t, h, d), _a(b, t, h, d), _a(b, t, h, d), -jnp.abs(_a(b, t, h, d)), beta


_N, _D = 4, 8  # mHC streams, hidden
_MHC_PRE = (_a(1, 2, _N, _D), _a(_N * _D, (2 + _N) * _N), _a((2 + _N) * _N), _a(3))
_MHC_POST = (_a(1, 2, _N, _D), _a(1, 2, _D), _a(1, 2, _N), _a(1, 2, _N, _N))
_SEL = (jnp.asarray([[[0], [1]]], jnp.int32), jnp.asarray([[3, 5]], jnp.int32))  # pool ids, query positions
_MLA = (_a(1, 2, 2, 8), _a(1, 6, 8), *_SEL)  # absorbed queries, latent cache
_MHA = (_a(1, 2, 2, 4), _a(1, 6, 2, 4), _a(1, 6, 2, 5), *_SEL)  # q, k, v
_KDA = _kda_inputs()

# op -> (api module, its table for the op, run(implementation))
CASES = {
    "chunk_kda": (kda, "_CHUNK", lambda impl: kda.chunk_kda(*_KDA, scale=0.5, implementation=impl)),
    "recurrent_kda": (
        kda,
        "_RECURRENT",
        lambda impl: kda.recurrent_kda(*_KDA, scale=0.5, implementation=impl),
    ),
    "mhc_pre": (
        mhc,
        "_PRE",
        lambda impl: mhc.mhc_pre(*_MHC_PRE, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3, implementation=impl),
    ),
    "mhc_post": (mhc, "_POST", lambda impl: mhc.mhc_post(*_MHC_POST, implementation=impl)),
    "sparse_mla": (
        sparse_mla,
        "_MLA",
        lambda impl: sparse_mla.sparse_mla(*_MLA, kpool=2, scale=0.3, implementation=impl),
    ),
    "sparse_mha": (
        sparse_mla,
        "_MHA",
        lambda impl: sparse_mla.sparse_mha(*_MHA, kpool=2, scale=0.3, implementation=impl),
    ),
}


@pytest.mark.parametrize("op", CASES)
def test_named_implementation_raises_and_auto_falls_back_once(op, monkeypatch, caplog):
    mod, table, run = CASES[op]

    def unsupported(*args, **kwargs):
        raise NotImplementedError("not these shapes")

    monkeypatch.setitem(getattr(mod, table), "fast", unsupported)
    monkeypatch.setitem(mod._AUTO, jax.default_backend(), "fast")
    with pytest.raises(NotImplementedError, match=f"{op}: implementation 'fast' cannot run these inputs"):
        run("fast")
    want = run("reference")
    dispatch.warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="kernels.dispatch"):
        got = [run("auto") for _ in range(2)]
    for y in got:
        jax.tree.map(np.testing.assert_array_equal, y, want)
    warned = [r.getMessage() for r in caplog.records if r.name == "kernels.dispatch"]
    assert warned == [f"{op}: fast cannot run these inputs (not these shapes); using reference"]


@pytest.mark.parametrize("op", CASES)
def test_auto_is_the_reference_without_a_backend(op, monkeypatch):
    """A backend the op's `_AUTO` table does not name runs the reference (kda names "cpu": removed here)."""
    mod, _, run = CASES[op]
    monkeypatch.delitem(mod._AUTO, jax.default_backend(), raising=False)
    jax.tree.map(np.testing.assert_array_equal, run("auto"), run("reference"))


def test_auto_on_cpu():
    """What "auto" runs on a CPU backend, per op (the reference where no CPU implementation is registered)."""
    assert dispatch.resolve("chunk_kda", "auto", kda.IMPLEMENTATIONS, kda._AUTO, "cpu") == "xla_cpu"
    assert dispatch.resolve("mhc_pre", "auto", ("auto", "reference", "xla_cpu"), mhc._AUTO, "cpu") == "xla_cpu"
    assert dispatch.resolve("sparse_mla", "auto", ("auto", "reference", "gather"), sparse_mla._AUTO, "cpu") == "gather"


def test_unknown_implementation_raises():
    with pytest.raises(
        ValueError, match="chunk_kda: unknown implementation 'fastest'; valid: \\['auto', 'reference', 'xla_cpu'\\]"
    ):
        CASES["chunk_kda"][2]("fastest")


def test_auto_picks_the_differentiable_experts_where_a_gradient_is_taken():
    """One "auto" default for inference and training: inside `dispatch.differentiable()` (the training loss) the
    experts resolve to the grouped matmul, whose reverse mode exists; outside, to the backend's best. Explicit
    names are never changed."""
    from kernels.moe import api as moe_api

    assert moe_api.select_implementation("auto", 4, backend="cpu") == "xla_cpu_decode"
    with dispatch.differentiable():
        assert moe_api.select_implementation("auto", 4, backend="cpu") == "blocked"
        assert moe_api.select_implementation("auto", 4, backend="tpu") == "blocked"
        assert moe_api.select_implementation("reference", 4, backend="cpu") == "reference"
    assert moe_api.select_implementation("auto", 400, backend="cpu") == "xla_cpu_prefill"
