"""Router statistics: expert loads, the auxiliary-loss-free bias update and the sequence-wise balance loss against
numpy implementations, and the instrumented routers (same parameters, same routing, every router recorded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import tiny
from glm53.config import model_config_from_dict
from glm53.layers.moe import Router
from glm53.model import Glm53Model
from glm53.train import routing
from glm53.train import step as S

CFG = model_config_from_dict(tiny.get_config("default").model)


def np_loads(ids, valid, e):
    out = np.zeros(e)
    for n in range(ids.shape[0]):
        if valid[n]:
            for k in range(ids.shape[1]):
                out[ids[n, k]] += 1
    return out


def np_bias_update(bias, load, gamma):
    mean = load.mean()
    return np.array(
        [b + gamma * (1.0 if ld < mean else -1.0 if ld > mean else 0.0) for b, ld in zip(bias, load)]
    )


def np_balance(ids, probs, valid, e):
    b, t, k = ids.shape
    total = 0.0
    for i in range(b):
        n = max(valid[i].sum(), 1)
        f = np.zeros(e)
        p = np.zeros(e)
        for s in range(t):
            if valid[i, s]:
                for j in range(k):
                    f[ids[i, s, j]] += e / (k * n)
                p += probs[i, s] / n
        total += (f * p).sum()
    return total / b


def test_loads_bias_update_and_balance_loss_match_numpy():
    rng = np.random.default_rng(0)
    e, k, b, t = 8, 2, 3, 10
    ids = np.stack([rng.permutation(e)[:k] for _ in range(b * t)]).astype(np.int32)
    valid = (rng.random(b * t) > 0.2).astype(np.float32)
    load = np.asarray(routing.expert_load(jnp.asarray(ids), jnp.asarray(valid), e))
    np.testing.assert_array_equal(load, np_loads(ids, valid, e))
    bias = rng.standard_normal(e).astype(np.float32)
    for ld in (load, np.full(e, 3.0), np.array([0, 0, 0, 0, 0, 0, 0, 8.0])):
        got = np.asarray(routing.bias_update(jnp.asarray(bias), jnp.asarray(ld, jnp.float32), 0.01))
        np.testing.assert_allclose(got, np_bias_update(bias, ld, 0.01), rtol=0, atol=1e-7)
    probs = rng.random((b * t, e))
    probs /= probs.sum(-1, keepdims=True)
    got = routing.sequence_balance_loss(jnp.asarray(ids.reshape(b, t, k)), jnp.asarray(probs.reshape(b, t, e)),
                                        jnp.asarray(valid.reshape(b, t)))  # fmt: skip
    ref = np_balance(ids.reshape(b, t, k), probs.reshape(b, t, e), valid.reshape(b, t), e)
    assert abs(float(got) - ref) <= 1e-6 * ref
    # Perfect balance with uniform affinities gives exactly 1.
    uni = np.full((1, e, e), 1.0 / e)
    ids_u = np.stack([np.roll(np.arange(e), -i)[:k] for i in range(e)])[None].astype(np.int32)
    one = routing.sequence_balance_loss(jnp.asarray(ids_u), jnp.asarray(uni), jnp.ones((1, e)))
    assert abs(float(one) - 1.0) < 1e-6


def test_instrumented_routers_share_parameters_and_route_identically():
    model = Glm53Model(CFG, rngs=nnx.Rngs(0), kernels={"moe": "reference"})
    x = jax.random.normal(jax.random.key(1), (7, CFG.hidden_size))
    before = model.layers[3].mlp.router(x)
    kernel = model.layers[3].mlp.router.kernel
    names = routing.instrument_routers(model)
    assert names == ["layers.3.mlp.router", "layers.4.mlp.router", "layers.5.mlp.router", "mtp.mlp.router"]
    assert routing.instrument_routers(model) == names  # idempotent
    r = model.layers[3].mlp.router
    assert isinstance(r, routing.RecordingRouter) and isinstance(r, Router) and r.kernel is kernel
    with routing.record_routing() as rec:
        after = r(x)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids, probs = rec["layers.3.mlp.router"]
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(before[0]))
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
    # Parameter paths are unchanged (checkpoints keep working); the biases are split off from the trainables.
    _, params, biases, rest = S.split_model(model)
    bias_paths = [tuple(p) for p, _ in nnx.to_flat_state(biases)]
    assert bias_paths == [(*n.split("."), "e_score_correction_bias") if not n.startswith("layers") else
                          ("layers", int(n.split(".")[1]), "mlp", "router", "e_score_correction_bias") for n in names]  # fmt: skip
    assert not any("e_score_correction_bias" in p for p, _ in nnx.to_flat_state(params))
    assert not jax.tree.leaves(rest)


def test_compute_dtype_cast_keeps_routers_f32_and_masters_f32():
    model = Glm53Model(CFG, rngs=nnx.Rngs(0), kernels={"moe": "reference"})
    routing.instrument_routers(model)
    _, params, biases, _ = S.split_model(model)
    cast = {tuple(p): v.get_value().dtype for p, v in nnx.to_flat_state(S.cast_params(params, jnp.bfloat16))}
    assert cast[("layers", 3, "mlp", "router", "kernel")] == jnp.float32
    assert cast[("layers", 0, "mlp", "gate_proj", "kernel")] == jnp.bfloat16
    assert cast[("mtp", "mlp", "experts", "down_proj")] == jnp.bfloat16
    tx = S.optimizer(S.OptimConfig(compute_dtype="bfloat16"))
    state = S.init_state(S.cast_params(params, jnp.bfloat16), biases, tx)  # masters are f32 whatever comes in
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
