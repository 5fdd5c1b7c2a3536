"""Training and per-layer statistics on a model with scanned layers (`ModelConfig.scan_layers`) equal the unrolled
model's: one train step (loss, MTP and balance losses, gradients per layer, router loads, bias updates, updated
parameters; also compiled for a 2 x 2 mesh of the virtual CPU devices), the per-layer names of a stacked router's statistics, llama.cpp's imatrix, and the ablation's
per-layer statistics (int8 round trip of the non-expert kernels, the per-layer parameters written to a GGUF and
their per-layer weight errors).

The tiny trunk: 0-1 (KDA, dense; scanned 2 x 1), 2 (DSA, MoE; plain, unit 1), 3-6 (KDA + DSA, MoE; scanned
2 x 2), and the MTP block."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from glm53.ablation import imatrix as imx
from glm53.ablation import pipeline
from glm53.checkpoint.gguf_export import model_params, write_gguf
from glm53.config import MeshConfig, model_config_from_dict
from glm53.layers.moe import Experts
from glm53.layers.stack import LayerGroup
from glm53.model import Glm53Model
from glm53.parallel import make_mesh
from glm53.train import per_layer, routing
from glm53.train import step as S
from glm53.train.loss import LossConfig

LAYERS = ["kda", "kda", "dsa", "kda", "dsa", "kda", "dsa"]
MLPS = ["dense", "dense", "moe", "moe", "moe", "moe", "moe"]
GROUPS = (LayerGroup(0, 1, 2), LayerGroup(2), LayerGroup(3, 2, 2))
BATCH, SEQ = 2, 16


def _cfg(scan: bool):
    c = tiny.get_config("default").model
    c.num_hidden_layers = len(LAYERS)
    c.layer_types, c.mlp_layer_types, c.indexer_types = LAYERS, MLPS, ["full"] * len(LAYERS)
    c.scan_layers = scan
    return model_config_from_dict(c)


def _model(scan: bool, **kw) -> Glm53Model:
    model = Glm53Model(_cfg(scan), rngs=nnx.Rngs(0), **kw)
    assert model.groups == (GROUPS if scan else tuple(LayerGroup(i) for i in range(len(LAYERS))))
    return model


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 128, (BATCH, SEQ)).astype(np.int32)
    mask = np.ones((BATCH, SEQ), np.int32)
    tokens[1, 11:], mask[1, 11:] = 0, 0  # padding
    return dict(tokens=tokens, mask=mask)


def _train_step(scan: bool, mesh_shape=None):
    """(groups, router names, gradients, new state, metrics) of one train step, with the MTP and balance losses
    (`mesh_shape`: compiled for a "data" x "model" mesh of the first devices, tp rules)."""
    model = _model(scan, kernels={"moe": "reference"})  # compiles faster than the blocked kernel
    names = routing.instrument_routers(model)
    graphdef, params, biases, rest = S.split_model(model)
    # eps 1e-3: Adam's first update ~ lr * g / (|g| + eps) is then ~ linear in g (see test_train_sharded.py)
    # no warmup: the first step's lr is 1e-3, so the update (weight decay included) really moves the parameters
    optim = S.OptimConfig(lr=1e-3, warmup_steps=0, total_steps=4, bias_gamma=0.01, eps=1e-3)
    tx = S.optimizer(optim)
    state, batch, sh = S.init_state(params, biases, tx), _batch(), None
    if mesh_shape is not None:
        mesh = make_mesh(MeshConfig(shape=mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
        sh = (S.state_shardings(state, mesh, "tp"), S.batch_sharding(mesh, "tp", BATCH))
        state, batch = jax.device_put(state, sh[0]), jax.device_put(batch, sh[1])
    step = S.make_train_step(graphdef, rest, tx, LossConfig(mtp_weight=0.3, balance_weight=1e-2), optim, names,
                             fast_compile=True, shardings=sh, with_grads=True)  # fmt: skip
    new, metrics = step(state, batch)
    return model.groups, names, metrics.pop("grads"), new, metrics


@pytest.fixture(scope="module")
def steps():  # two train-step compiles: about a minute on a loaded 2-core machine
    return {scan: _train_step(scan) for scan in (False, True)}


@pytest.mark.slow
def test_router_names_are_module_paths_once_per_stack(steps):
    assert steps[False][1] == [f"layers.{i}.mlp.router" for i in range(2, 7)] + ["mtp.mlp.router"]
    assert steps[True][1] == ["layers.1.mlp.router", "layers.2.period.0.mlp.router",
                              "layers.2.period.1.mlp.router", "mtp.mlp.router"]  # fmt: skip
    groups = steps[True][0]
    assert per_layer.layer_name("layers.2.period.1.mlp.router", groups) == [
        ("layers.4.mlp.router", 0), ("layers.6.mlp.router", 1)]  # fmt: skip
    assert per_layer.layer_name("layers.1.mlp.router", groups) == [("layers.2.mlp.router", None)]
    assert per_layer.layer_name("mtp.mlp.router", groups) == [("mtp.mlp.router", None)]


@pytest.mark.slow
def test_scanned_train_step_equals_unrolled(steps):
    (g0, _, grads0, new0, m0), (g1, _, grads1, new1, m1) = steps[False], steps[True]
    for k in ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "load_max", "load_min", "tokens"):
        assert _rel(m1[k], m0[k]) <= 1e-6, (k, float(m1[k]), float(m0[k]))
    assert float(m0["mtp_loss"]) > 0 and float(m0["balance_loss"]) > 0
    # router loads: stacked routers [R, E] under their module path, named per layer they equal the unrolled ones
    assert m1["loads"]["layers.2.period.0.mlp.router"].shape == (2, 8)
    loads0, loads1 = per_layer.expand_names(m0["loads"], g0), per_layer.expand_names(m1["loads"], g1)
    assert list(loads1) == list(loads0) == [f"layers.{i}.mlp.router" for i in range(2, 7)] + ["mtp.mlp.router"]
    for k in loads0:
        np.testing.assert_array_equal(np.asarray(loads1[k]), np.asarray(loads0[k]), err_msg=k)
    # gradients, updated biases and parameters per layer (stacked leaves sliced per repeat)
    for what, a, b in (("grads", grads1, grads0), ("biases", new1.biases, new0.biases),
                       ("params", new1.params, new0.params)):  # fmt: skip
        flat1, flat0 = per_layer.expand_state(a, g1), per_layer.expand_state(b, g0)
        assert sorted(flat1, key=str) == sorted(flat0, key=str), what
        for p in flat0:
            assert _rel(flat1[p], flat0[p]) <= 1e-6, (what, p, _rel(flat1[p], flat0[p]))
    b0 = per_layer.expand_state(new0.biases, g0)
    assert any(np.any(np.asarray(v) != 0) for v in b0.values())  # the biases moved
    p0 = per_layer.expand_state(new0.params, g0)
    norm = ("layers", 4, "post_attention_layernorm", "weight")  # stacked [2, D] when scanned: not decayed
    assert float(m0["lr"]) == pytest.approx(1e-3) and np.any(np.asarray(p0[norm]) != 1.0)


@pytest.mark.slow
def test_sharded_scanned_step_equals_unrolled(steps):
    """The scanned model's step compiled for a 2 x 2 "data" x "model" mesh (stacked parameters placed by the
    rules, their repeat axis unsplit) against the unrolled model's on one device."""
    g0, _, grads0, new0, m0 = steps[False]
    g1, _, grads1, new1, m1 = _train_step(True, mesh_shape=(2, 2))
    for k in ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "load_max", "load_min"):
        assert _rel(m1[k], m0[k]) <= 1e-5, k
    split = 0
    flat0 = per_layer.expand_state(new0.params, g0)
    for path, var in nnx.to_flat_state(new1.params):
        x = var.get_value()
        split += "period" in path and not x.sharding.is_fully_replicated and x.sharding.spec[0] is None
    assert split > 10  # stacked parameters really are split (over "model", never over their repeat axis)
    # of a tensor's largest entry: the sharded sums' float noise is ~1e-5 of the smallest gradients (mHC's `base`,
    # ~1e-4 against a gradient norm of 8); a parameter that starts at 0 (`base`) is its first update, Adam's
    # normalized step of that gradient (as in test_train_sharded.py)
    d0 = per_layer.expand_state(grads0, g0)
    for p, x in per_layer.expand_state(grads1, g1).items():
        assert _rel(x, d0[p]) <= 1e-4, ("grads", p)
    for p, x in per_layer.expand_state(new1.params, g1).items():
        assert _rel(x, flat0[p]) <= 5e-5, ("params", p)
    b0 = per_layer.expand_state(new0.biases, g0)
    for p, x in per_layer.expand_state(new1.biases, g1).items():
        np.testing.assert_allclose(np.asarray(x), np.asarray(b0[p]), rtol=0, atol=1e-7)


def test_weight_decay_by_the_rank_of_one_layer():
    model = _model(True)
    _, params, _, _ = S.split_model(model)
    mask = {tuple(p): v for p, v in nnx.to_flat_state(S.decay_mask(params))}
    stacked_norm = ("layers", 2, "period", 0, "post_attention_layernorm", "weight")
    assert params["layers"][2]["period"][0]["post_attention_layernorm"]["weight"].get_value().ndim == 2
    assert mask[stacked_norm] is False and mask[("layers", 2, "period", 0, "mlp", "router", "kernel")] is True


def test_instrumented_routers_follow_a_regrouping():
    model = _model(False)
    routing.instrument_routers(model)
    model.set_scan_layers(True)
    names = routing.instrument_routers(model)
    assert set(routing.router_params(model)) == set(names)
    model.set_scan_layers(False)
    assert routing.instrument_routers(model) == [f"layers.{i}.mlp.router" for i in range(2, 7)] + ["mtp.mlp.router"]
    assert set(routing.router_params(model)) == set(routing.instrument_routers(model))


@pytest.fixture(scope="module")
def models():
    return {scan: _model(scan, with_mtp=False) for scan in (False, True)}


def test_imatrix_scanned_equals_unrolled(models):
    chunks = np.random.default_rng(1).integers(0, 128, (2, 24))
    im0, seen0 = imx.collect(models[False], chunks, record=True)
    im1, seen1 = imx.collect(models[True], chunks, record=True)
    assert sorted(im1.entries) == sorted(im0.entries) and len(im0.entries) == 5 * 3 and im1.chunks == 2
    for name, (s0, c0) in im0.entries.items():
        s1, c1 = im1.entries[name]
        np.testing.assert_array_equal(c1, c0, err_msg=name)
        assert _rel(s1, s0) <= 1e-5, name
    assert [i for i, _, _ in seen1] == [i for i, _, _ in seen0] == [2, 3, 4, 5, 6] * 2
    for (_, x1, ids1), (_, x0, ids0) in zip(seen1, seen0):
        np.testing.assert_array_equal(ids1, ids0)
        assert _rel(x1, x0) <= 1e-5
    m = models[True]
    assert all(isinstance(m.layer(i).mlp.experts, Experts) for i in range(2, 7))  # the capture is undone


def test_ablation_per_layer_statistics_scanned_equal_unrolled(models, tmp_path):
    m0, m1 = models[False], models[True]
    p0, p1 = model_params(m0), pipeline.layer_params(m1)
    assert sorted(p1, key=str) == sorted(p0, key=str)
    for k in p0:
        np.testing.assert_array_equal(p1[k], p0[k], err_msg=str(k))
    cfg = m0.cfg
    path = str(tmp_path / "q8.gguf")
    write_gguf(path, cfg, p1, experts="Q8_0")
    err0, layers0 = pipeline.weight_errors(path, p0, cfg)
    err1, layers1 = pipeline.weight_errors(path, p1, cfg)
    assert err1 == err0 and layers1 == layers0 and sorted(layers0, key=int) == ["2", "3", "4", "5", "6"]
    assert all(0 < e < 0.05 for e in err0.values())
    # the int8 round trip of the non-expert kernels: per layer, the same matrices and values
    q0, q1 = nnx.clone(m0), nnx.clone(m1)
    n0, n1 = pipeline.int8_non_experts(q0), pipeline.int8_non_experts(q1)
    assert n1 == n0 > 0
    q0, q1 = model_params(q0), pipeline.layer_params(q1)
    assert any(np.any(q0[k] != p0[k]) for k in p0)
    for k in q0:
        np.testing.assert_array_equal(q1[k], q0[k], err_msg=str(k))
