"""Dense routed experts as separate arrays for CPU decode: kernels/moe/expert_list.py, the xla_cpu decode form on
them, Experts' fallback to the stacked kernels, and `glm53.runtime.weights.decode_state` (views, no copy).

References: the stacked kernels through the same decode form (equal values), the reference implementation, and
f64 numpy (tests/test_moe.py runs the decode form on an ExpertList against its f64 loop too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_moe import _np_moe  # the f64 loop over (token, slot) the shared MoE tests use

from configs import tiny
from glm53.config import model_config_from_dict
from glm53.layers.moe import Experts
from glm53.model import Glm53Model
from glm53.runtime import weights
from glm53.train.step import FAST_COMPILE
from kernels.matmul import cpu_ffi as matmul_ffi
from kernels.moe import api, expert_list
from kernels.moe.expert_list import ExpertList

LIMIT = 3.0
E, D, F = 8, 32, 16


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, D))
    ids = np.array([[1, 5], [5, 5], [E, 2]], np.int32)  # a repeated expert, an empty slot
    w = rng.uniform(0.1, 1.0, size=ids.shape)
    wg, wu = rng.normal(size=(E, D, F)) * 0.4, rng.normal(size=(E, D, F)) * 0.4
    wd = rng.normal(size=(E, F, D)) * 0.3
    return x, ids, w, wg, wu, wd


def test_decode_form_on_expert_list(case):
    x, ids, w, wg, wu, wd = case
    f = lambda a: jnp.asarray(a, jnp.float32)
    stacked = (f(wg), f(wu), f(wd))
    split = tuple(expert_list.split_experts(a) for a in stacked)
    assert split[0].shape == (E, D, F) and split[2].shape == (E, F, D) and split[0].dtype == jnp.float32
    fn = jax.jit(lambda *a: api.moe_experts(*a, LIMIT, implementation="xla_cpu_decode"))
    got = fn(f(x), jnp.asarray(ids), f(w), *split)
    same = fn(f(x), jnp.asarray(ids), f(w), *stacked)
    want = _np_moe(x, ids, w, wg, wu, wd, LIMIT)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))
    print(f"ExpertList decode vs f64 rel {err:.2e}; vs stacked max|d| {float(jnp.max(jnp.abs(got - same))):.1e}")
    assert err <= 1e-5
    np.testing.assert_allclose(np.asarray(got), np.asarray(same), rtol=1e-6, atol=1e-6)
    # bf16 activations: the parts are cast like the stacked kernels
    b = lambda a: jnp.asarray(a, jnp.bfloat16)
    yb = fn(b(x), jnp.asarray(ids), f(w), *split)
    yr = api.moe_experts(b(x), jnp.asarray(ids), f(w), *stacked, LIMIT, implementation="xla_cpu_decode")
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb, np.float32), np.asarray(yr, np.float32))  # the same ops


def test_split_shares_memory_and_validates():
    w = jax.random.normal(jax.random.key(0), (4, 64, 32))
    s = expert_list.split_experts(w)
    base = w.unsafe_buffer_pointer()
    offsets = [p.unsafe_buffer_pointer() - base for p in s.parts]
    assert offsets == [i * 64 * 32 * 4 for i in range(4)]  # views of w's buffer, no copy
    np.testing.assert_array_equal(np.asarray(s.stacked()), np.asarray(w))
    leaves, tdef = jax.tree.flatten(s)
    assert len(leaves) == 4 and isinstance(jax.tree.unflatten(tdef, leaves), ExpertList)
    with pytest.raises(ValueError, match="stacked kernel"):
        expert_list.split_experts(w[0])
    with pytest.raises(ValueError, match="part 1"):
        ExpertList([w[0], w[1, :8]])
    with pytest.raises(ValueError, match="at least one"):
        ExpertList([])


@pytest.mark.parametrize("implementation", ["xla_cpu"])
def test_experts_module_falls_back_to_stacked(case, implementation):
    """An Experts layer holding ExpertLists gives the stacked kernels' output under any implementation and slot
    count (only the xla_cpu decode form reads the parts; others get `stacked()`)."""
    x, ids, w, wg, wu, wd = case
    cfg = model_config_from_dict({**tiny.model_config("default"), "hidden_size": D, "moe_intermediate_size": F,
                                  "n_routed_experts": E, "swiglu_limit": LIMIT})  # fmt: skip
    m = Experts(cfg, rngs=nnx.Rngs(0), implementation=implementation, decode_max_slots=4)
    for name, a in (("gate_proj", wg), ("up_proj", wu), ("down_proj", wd)):
        getattr(m, name).set_value(jnp.asarray(a, jnp.float32))
    f = lambda a: jnp.asarray(a, jnp.float32)
    for rows in (slice(0, 1), slice(0, 3)):  # 2 slots (decode form) and 6 (> decode_max_slots: prefill form)
        want = m(f(x[rows]), jnp.asarray(ids[rows]), f(w[rows]))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m, name).set_value(expert_list.split_experts(getattr(m, name).get_value()))
        got = m(f(x[rows]), jnp.asarray(ids[rows]), f(w[rows]))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m, name).set_value(getattr(m, name).get_value().stacked())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_decode_state_splits_experts(monkeypatch):
    """Without the row-matmul kernel (GLM53_MATMUL_FFI=0; tests/test_matmul_ffi_cpu.py covers it on) the decode
    programs' state (`decode_state`, glm53.runtime.weights) holds ExpertLists for the xla_cpu layers, views of the
    same buffers; one-token steps on it give the greedy tokens and logits of the stacked state; a reference-MoE
    model keeps its state."""
    monkeypatch.setenv(matmul_ffi.ENV, "0")
    cfg = model_config_from_dict(tiny.model_config("default"))
    model = Glm53Model(cfg, rngs=nnx.Rngs(3), with_mtp=False, kernels={"moe": "auto"})
    gd, state = nnx.split(model)
    split_state = weights.decode_state(model, state)
    lists = [x for x in jax.tree.leaves(split_state, is_leaf=lambda x: isinstance(x, ExpertList))
             if isinstance(x, ExpertList)]  # fmt: skip
    n_moe = sum(k == "moe" for k in cfg.mlp_layer_types)
    assert n_moe > 0 and len(lists) == 3 * n_moe
    stacked = {a.unsafe_buffer_pointer() for a in jax.tree.leaves(state) if a.ndim == 3}
    assert all(x.parts[0].unsafe_buffer_pointer() in stacked for x in lists)  # views, not copies

    # cheapest compile (tests' train step option)
    step = jax.jit(lambda st, c, tok: nnx.merge(gd, st)(tok, cache=c), compiler_options=FAST_COMPILE)

    def run(dstate):
        logits, cache = step(state, model.init_cache(1, 16), jnp.asarray([[5, 9, 2, 7]], jnp.int32))  # prefill
        tok, out = np.array([int(jnp.argmax(logits[0, -1]))], np.int32), []
        for _ in range(3):
            logits, cache = step(dstate, cache, jnp.asarray(tok[:, None]))
            out.append(np.asarray(logits[:, -1]))
            tok = out[-1].argmax(-1).astype(np.int32)
        return np.stack(out)

    a, b = run(split_state), run(state)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert (a.argmax(-1) == b.argmax(-1)).all()
    ref = Glm53Model(cfg, rngs=nnx.Rngs(3), with_mtp=False, kernels={"moe": "reference"})
    ref_state = nnx.split(ref)[1]
    assert weights.decode_state(ref, ref_state) is ref_state  # the reference MoE reads stacked kernels
