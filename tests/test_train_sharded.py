"""A sharded train step equals the unsharded one: a (2, 4) "data" x "model" mesh of the 8 virtual CPU devices
with the tp rules (the batch on "data", parameters and their AdamW moments by the rules on "model"), two steps
of the tiny training model: losses, gradient norms, router biases and updated parameters equal the one-device
run to rel 1e-5."""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import train as train_configs
from glm53.config import MeshConfig, model_config_from_dict
from glm53.errors import ShardingError
from glm53.model import Glm53Model
from glm53.parallel import make_mesh
from glm53.testing.params import randomize_params
from glm53.train import routing
from glm53.train import step as S
from glm53.train.loop import train_mesh
from glm53.train.loss import LossConfig

pytestmark = pytest.mark.slow  # two train-step compiles: about a minute on a loaded 2-core machine

BATCH, SEQ = 4, 16


def _setup(mesh_section):
    c = train_configs.get_config("tiny")
    c.model.vocab_size = 256
    c.model.linear_num_heads = c.model.num_attention_heads = 4  # heads that split over "model" = 4
    c.model.num_hidden_layers = 2  # KDA + dense MLP, DSA + MoE (and the MTP layer): a shorter compile
    c.model.layer_types, c.model.mlp_layer_types, c.model.indexer_types = (
        ["kda", "dsa"],
        ["dense", "moe"],
        ["full"] * 2,
    )
    c.mesh = ml_collections.ConfigDict(mesh_section)
    cfg = model_config_from_dict(c.model)
    model = randomize_params(Glm53Model(cfg, rngs=nnx.Rngs(0), kernels={"moe": "reference"}))  # no constant inits
    names = routing.instrument_routers(model)
    graphdef, params, biases, rest = S.split_model(model)
    # eps 1e-3: Adam's first updates are ~ lr * g / (|g| + eps), so with a small eps an entry whose gradient is
    # tiny moves by ~lr whatever its value, and the summation order's float noise in g (~1e-7 relative to the
    # gradient's norm) becomes a relative error of the update; with eps above most |g| the update is ~ linear in g
    optim = S.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=4, bias_gamma=0.01, eps=1e-3)
    tx = S.optimizer(optim)
    mesh, rules = train_mesh(c, cfg)
    state = S.init_state(params, biases, tx)
    sh = (S.state_shardings(state, mesh, rules), S.batch_sharding(mesh, rules, BATCH))
    step = S.make_train_step(graphdef, rest, tx, LossConfig(mtp_weight=0.3, balance_weight=1e-3), optim, names,
                             fast_compile=True, shardings=sh)  # fmt: skip
    return mesh, jax.device_put(state, sh[0]), sh, step


def _batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        tokens = rng.integers(1, 256, (BATCH, SEQ)).astype(np.int32)
        mask = np.ones((BATCH, SEQ), np.int32)
        mask[1, 11:] = 0  # padding
        tokens[1, 11:] = 0
        out.append(dict(tokens=tokens, mask=mask))
    return out


def _run(mesh_section):
    mesh, state, sh, step = _setup(mesh_section)
    metrics = []
    for b in _batches():
        state, m = step(state, jax.device_put(b, sh[1]))
        metrics.append({k: float(v) for k, v in m.items() if k != "loads"})
    return mesh, state, metrics


@pytest.fixture(scope="module")
def runs():
    one = _run(dict(axes=("data", "model"), shape=(1, 1), rules="tp"))
    eight = _run(dict(axes=("data", "model"), shape=(2, 4), rules="tp"))
    return one, eight


def test_sharded_step_equals_unsharded(runs):
    (mesh1, s1, m1), (mesh8, s8, m8) = runs
    assert mesh1.size == 1 and dict(mesh8.shape) == {"data": 2, "model": 4}
    for a, b in zip(m1, m8):
        for k in ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "load_max", "load_min"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert m1[1]["loss"] != m1[0]["loss"]
    flat1, flat8 = nnx.to_flat_state(s1.params), nnx.to_flat_state(s8.params)
    split = 0
    for (p, v1), (q, v8) in zip(flat1, flat8):
        assert p == q
        x1, x8 = np.asarray(v1.get_value()), np.asarray(v8.get_value())
        # rel 1e-5 of the tensor's largest entry: an entry with a near-zero gradient still moves by Adam's
        # normalized step, where the summation order's float noise is amplified
        np.testing.assert_allclose(x8, x1, rtol=1e-5, atol=1e-5 * np.abs(x1).max(), err_msg=str(p))
        split += (
            len(v8.get_value().sharding.device_set) == 8 and not v8.get_value().sharding.is_fully_replicated
        )
    assert split > 10  # the parameters really are sharded over the "model" axis
    for b1, b8 in zip(jax.tree.leaves(s1.biases), jax.tree.leaves(s8.biases)):
        np.testing.assert_allclose(np.asarray(b8), np.asarray(b1), rtol=1e-5, atol=1e-7)
    mu1 = jax.tree.leaves(s1.opt_state)
    mu8 = jax.tree.leaves(s8.opt_state)
    assert len(mu1) == len(mu8)
    for x1, x8 in zip(mu1, mu8):
        x1, x8 = np.asarray(x1), np.asarray(x8)
        np.testing.assert_allclose(x8, x1, rtol=1e-5, atol=1e-5 * np.abs(x1).max())


def test_mesh_section_and_bad_input():
    c = train_configs.get_config("tiny")  # 2 heads: they do not split over 4 "model" devices
    cfg = model_config_from_dict(c.model)
    c.mesh.shape = (1, 2)
    mesh, rules = train_mesh(c, cfg)
    assert dict(mesh.shape) == {"data": 1, "model": 2} and list(mesh.devices.flat) == jax.devices()[:2]
    c.mesh.shape = (2, 4)
    with pytest.raises(ShardingError, match=r"'linear_num_heads' = 2 does not split over 4 devices"):
        train_mesh(c, cfg)
    with pytest.raises(ValueError, match=r"batch_size=3 does not split over the mesh's \('data',\) axes"):
        S.batch_sharding(make_mesh(MeshConfig(shape=(2, 4))), "tp", 3)
