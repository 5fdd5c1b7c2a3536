"""Scanned layers (glm53/layers/stack.py): the grouping of the release and of brute force, scanned == unrolled
(forward, prefill in pieces + decode), stacking and unstacking move values unchanged, sharded scanned ==
unsharded, the stacked parameters' shardings and the number of scans a step traces."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import glm53_flash, tiny
from glm53 import dims
from glm53 import parallel as S
from glm53.config import QuantConfig, model_config_from_dict
from glm53.layers.block import DecoderLayer
from glm53.layers.stack import LayerGroup, LayerStack, describe_groups, layer_groups
from glm53.model import Glm53Model, layer_cache
from glm53.testing.params import randomize_params

N = 12  # dense 0-2, DSA at 3, 7, 11: groups 0-2 (3 x 1), 3, 4-11 (2 x 4)


def scan_cfg(variant: str = "parity", scan: bool = True, **kw):
    d = dict(tiny.get_config(variant).model)
    d.update(num_hidden_layers=N, layer_types=["dsa" if i % 4 == 3 else "kda" for i in range(N)],
             mlp_layer_types=["dense"] * 3 + ["moe"] * (N - 3), indexer_types=["full"] * N, scan_layers=scan)  # fmt: skip
    d.update(kw)
    return model_config_from_dict(d)


def rel(a, b) -> float:
    """Relative Frobenius error of a against the reference b."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def reorder_floor(model, tokens) -> float:
    """How far XLA's own reordering moves the unrolled model's logits: eager (op by op) vs one jitted program.
    Scanned vs unrolled may differ by this much (bit-exact when XLA keeps the order), never more; the bound of
    the tests is max(1e-6, this)."""
    return max(1e-6, rel(model(tokens)[0], jit_call(model, tokens)[0]))


@pytest.fixture(scope="module")
def floor(models):
    """`reorder_floor` of the unrolled model, measured once (an eager forward of 12 layers takes a while)."""
    ref, _ = models
    return reorder_floor(ref, jnp.asarray(np.random.default_rng(0).integers(0, ref.cfg.vocab_size, (2, 20))))


@functools.partial(jax.jit, static_argnums=0)
def _call(gd, st, tokens, cache):
    return nnx.merge(gd, st)(tokens, cache=cache)


def jit_call(model, tokens, cache=None):
    """The model's forward as one jitted program. One jit for the module, the graph definition static: a model
    structure and input shapes seen before (the decode steps, the floor's and the forward test's unrolled call,
    the unsharded reference of each mesh) reuse their compiled program instead of tracing and compiling again."""
    gd, st = nnx.split(model)
    return _call(gd, st, tokens, cache)


@pytest.fixture(scope="module")
def models():
    """(unrolled, scanned) with the same values: one model built unrolled, a copy regrouped."""
    cfg = scan_cfg(scan=False)
    ref = Glm53Model(cfg, rngs=nnx.Rngs(0))
    randomize_params(ref)
    scanned = nnx.clone(ref)
    scanned.set_scan_layers(True)
    return ref, scanned


# ----------------------------------------------------------------------------------------------- grouping
def test_release_grouping():
    cfg = model_config_from_dict(glm53_flash.model_config())
    assert cfg.scan_layers  # the release config scans
    plain = layer_groups(cfg)
    assert [(g.first, g.period, g.repeats) for g in plain] == [(0, 1, 3), (3, 1, 1), (4, 1, 1), (5, 4, 10)]
    ud = layer_groups(cfg, QuantConfig(experts="ud_iq3_xxs"))  # layers 11, 12 and 44 have formats of their own
    assert [(g.first, g.period, g.repeats) for g in ud] == [
        (0, 1, 3), (3, 4, 2), (11, 1, 1), (12, 1, 1), (13, 1, 2), (15, 1, 1), (16, 4, 7), (44, 1, 1)
    ]  # fmt: skip
    assert describe_groups(ud).startswith("layers: 14 traced for 45 (0-2 (scan: 3 x 1), 3-10 (scan: 2 x 4), 11")
    off = layer_groups(cfg.replace(scan_layers=False), QuantConfig(experts="ud_iq3_xxs"))
    assert off == tuple(LayerGroup(i) for i in range(45))
    assert describe_groups(off) == "layers: 45 unrolled (scan_layers off)"


def _brute_force(sig: list) -> tuple[int, int]:
    """(traced bodies, groups) of the best partition, trying every composition of the layers into parts: a
    part is one plain layer (cost 1) or r >= 2 repeats of a period of p layers (cost p, the smallest such p)."""
    n, best = len(sig), None
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        parts = [sig[a:b] for a, b in zip(bounds, bounds[1:])]
        cost = 0
        for part in parts:
            periods = [p for p in range(1, len(part) // 2 + 1)
                       if len(part) % p == 0 and part == part[:p] * (len(part) // p)]  # fmt: skip
            if len(part) == 1:
                cost += 1
            elif periods:
                cost += periods[0]
            else:
                break
        else:
            best = min(best or (cost, len(parts)), (cost, len(parts)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_grouping_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 9
    attn = rng.choice(["kda", "dsa"], n, p=[0.7, 0.3]).tolist()
    mlp = ["dense"] * 2 + ["moe"] * (n - 2)
    cfg = scan_cfg(num_hidden_layers=n, layer_types=attn, mlp_layer_types=mlp, indexer_types=["full"] * n)
    groups = layer_groups(cfg)
    assert [i for g in groups for i in g.layers] == list(range(n))
    for g in groups:  # every repeat of a scanned group has the same signature, position by position
        for r, j in itertools.product(range(g.repeats), range(g.period)):
            assert (attn[g.layer(r, j)], mlp[g.layer(r, j)]) == (attn[g.first + j], mlp[g.first + j])
    traced = sum(g.period if g.scanned else 1 for g in groups)
    assert (traced, len(groups)) == _brute_force(list(zip(attn, mlp)))


def test_shared_indexer_periods_are_not_scanned():
    n = 8
    cfg = scan_cfg(num_hidden_layers=n, layer_types=["kda", "dsa"] * 4, mlp_layer_types=["moe"] * n,
                   indexer_types=["full", "full", "full", "shared"] * 2)  # fmt: skip
    for g in layer_groups(cfg):
        if g.scanned:
            first_dsa = next(i for i in range(g.first, g.first + g.period) if cfg.layer_types[i] == "dsa")
            assert cfg.indexer_types[first_dsa] == "full"


# ------------------------------------------------------------------------------------------- exactness
def test_scanned_model_structure(models):
    ref, scanned = models
    assert [type(u) for u in scanned.layers] == [LayerStack, DecoderLayer, LayerStack]
    assert [(g.first, g.period, g.repeats) for g in scanned.groups] == [(0, 1, 3), (3, 1, 1), (4, 4, 2)]
    w = scanned.layers[2].period[1].self_attn.q_proj.kernel  # layer 5 and layer 9, stacked
    assert w.get_metadata()["logical_axes"][0] == dims.LAYERS
    np.testing.assert_array_equal(w[...][0], ref.layers[5].self_attn.q_proj.kernel[...])
    np.testing.assert_array_equal(w[...][1], ref.layers[9].self_attn.q_proj.kernel[...])
    assert scanned.layer(9).layer_idx == 9
    assert scanned.unit_of(9) == (2, scanned.groups[2])


def test_stack_unstack_round_trip_is_exact(models):
    ref, scanned = models
    back = nnx.clone(scanned)
    back.set_scan_layers(False)
    a, b = nnx.to_flat_state(nnx.state(ref)), nnx.to_flat_state(nnx.state(back))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (p, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(p))


def test_forward_scanned_equals_unrolled(models, floor):
    ref, scanned = models
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, ref.cfg.vocab_size, (2, 20)))
    want, _ = jit_call(ref, tokens)
    got, _ = jit_call(scanned, tokens)
    assert rel(got, want) <= floor


def test_prefill_in_pieces_and_decode_scanned_equals_unrolled(models, floor):
    ref, scanned = models
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, ref.cfg.vocab_size, (2, 24)))
    outs = []
    for m in (ref, scanned):
        cache, pieces = m.init_cache(2, 40), []
        for lo, hi in ((0, 13), (13, 21), (21, 22), (22, 23), (23, 24)):  # prefill 13 + 8, then 3 decode steps
            lg, cache = jit_call(m, tokens[:, lo:hi], cache)
            pieces.append(lg)
        outs.append((np.concatenate(pieces, 1), cache))
    (want, c_ref), (got, c_scan) = outs
    assert rel(got, want) <= floor
    for i in range(N):  # every layer's cache, sliced out of its stack
        for x, y in zip(jax.tree.leaves(layer_cache(scanned, c_scan, i)), jax.tree.leaves(c_ref.layers[i])):
            assert x.shape == y.shape and x.dtype == y.dtype
            if y.size and np.abs(np.asarray(y)).max() > 0:
                assert rel(x, y) <= 1e-5


def test_a_cache_of_the_other_layout_is_a_clear_error(models):
    ref, scanned = models
    with pytest.raises(ValueError, match="scan_layers"):
        scanned(jnp.zeros((1, 2), jnp.int32), cache=ref.init_cache(1, 8))


def test_one_scan_per_scanned_group(models):
    """The jaxpr of a step holds one scan per scanned group, and each layer body of the period once."""
    _, scanned = models
    gd, st = nnx.split(scanned)
    jaxpr = jax.make_jaxpr(lambda st, t: nnx.merge(gd, st)(t)[0])(st, jnp.zeros((1, 4), jnp.int32))
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan" and "scan_layers_" in str(e.source_info.name_stack)]
    assert [e.params["length"] for e in scans] == [g.repeats for g in scanned.groups if g.scanned] == [3, 2]
    assert [str(e.source_info.name_stack) for e in scans] == ["scan_layers_0", "scan_layers_4"]


# ------------------------------------------------------------------------------------------------ sharded
@pytest.mark.parametrize("shape,rules", [((1, 8), "tp"), ((2, 4), "ep")])
def test_sharded_scanned_equals_unsharded(shape, rules):
    cfg = scan_cfg("sharded", scan=False)
    ref = Glm53Model(cfg, rngs=nnx.Rngs(0))
    randomize_params(ref, 2)
    scanned = nnx.clone(ref)
    scanned.set_scan_layers(True)
    mesh = S.make_mesh(ml_collections.ConfigDict(dict(axes=("data", "model"), shape=shape, rules=rules)))
    sharded = S.shard_model(scanned, mesh, rules)
    w = sharded.layers[2].period[0].self_attn.q_proj.kernel[...]
    assert w.sharding.spec[0] is None and w.sharding.spec[2] == "model"  # the repeat axis is never split
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 24)))
    outs = []
    for m, place in ((ref, None), (sharded, mesh)):
        cache = m.init_cache(2, 40)
        if place is not None:
            cache = S.shard_cache(cache, mesh, rules)
        a, cache = jit_call(m, tokens[:, :20], cache)
        b, cache = jit_call(m, tokens[:, 20:], cache)
        outs.append(np.concatenate([a, b], 1))
    assert rel(outs[1], outs[0]) <= 1e-5  # the same bound as tests/test_sharding.py's unrolled comparisons


def test_init_sharded_scanned_model_equals_unsharded_init():
    n = 4  # dense 0-1 (2 x 1), KDA + MoE 2-3 (2 x 1): two stacks, each of two repeats
    cfg = scan_cfg("sharded", num_hidden_layers=n, layer_types=["kda"] * n,
                   mlp_layer_types=["dense"] * 2 + ["moe"] * (n - 2), indexer_types=["full"] * n)  # fmt: skip
    mesh = S.make_mesh(ml_collections.ConfigDict(dict(axes=("data", "model"), shape=(1, 8), rules="tp")))
    sharded = S.init_sharded_model(lambda: Glm53Model(cfg, rngs=nnx.Rngs(3)), mesh, "tp")
    # the reference: the unrolled model initialized the same way (one jitted init: eager init differs by ulps)
    plain = S.init_sharded_model(lambda: Glm53Model(cfg.replace(scan_layers=False), rngs=nnx.Rngs(3)), mesh, "tp")
    assert [(g.first, g.period, g.repeats) for g in sharded.groups] == [(0, 1, 2), (2, 1, 2)]
    for i in range(n):  # every layer, each repeat of both stacks
        a = nnx.state(sharded.layer(i), nnx.Param)
        b = nnx.state(plain.layers[i], nnx.Param)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------- in-place experts
@pytest.mark.parametrize("tokens", [1, 12])  # decode (distinct-expert grid) and prefill (grouped tiles) kernels
def test_pallas_experts_read_the_stack_in_place(tokens):
    """Quantized experts under the Pallas TPU kernels (interpreted on CPU): a scanned layer's decode step hands
    them the whole stack and offset expert ids (`StackedSlice.merged`), never a sliced copy (the step's jaxpr
    slices no expert plane); prefill takes the slice. Logits equal the unrolled model's either way."""
    n = 6  # dense 0-1, then 4 identical KDA + MoE layers: one scan of 4
    quant = QuantConfig(experts="IQ4_XS", decode_max_slots=8)
    cfg = scan_cfg("gguf", scan=False, num_hidden_layers=n, layer_types=["kda"] * n,
                   mlp_layer_types=["dense"] * 2 + ["moe"] * (n - 2), indexer_types=["full"] * n)  # fmt: skip
    ref = Glm53Model(cfg, rngs=nnx.Rngs(0), quant=quant, kernels={"moe": "pallas_tpu"}, with_mtp=False)
    scanned = nnx.clone(ref)
    scanned.set_scan_layers(True)
    assert [(g.first, g.period, g.repeats) for g in scanned.groups] == [(0, 1, 2), (2, 1, 4)]
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, tokens)))
    want, _ = jit_call(ref, ids)
    got, _ = jit_call(scanned, ids)
    assert rel(got, want) <= 1e-5
    gd, st = nnx.split(scanned)
    jaxpr = jax.make_jaxpr(lambda st, t: nnx.merge(gd, st)(t)[0])(st, ids)
    body = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] == 4)
    planes = {tuple(v.shape) for v in jax.tree.leaves(scanned.layers[1].period[0].mlp.experts.gate_proj.get_value())}
    ops = [e for e in _eqns(body.params["jaxpr"].jaxpr) if e.invars and hasattr(e.invars[0], "aval")]
    assert any(tuple(e.invars[0].aval.shape) in planes for e in ops)  # the stack reaches the body ...
    sliced = [e.primitive.name for e in ops if e.primitive.name in ("dynamic_slice", "gather", "slice")
              and tuple(e.invars[0].aval.shape) in planes]  # fmt: skip
    if tokens == 1:
        assert not sliced  # ... and a decode step never slices it
    else:
        assert sliced  # a prefill step takes the layer's slice (its kernel pads rows per expert of the stack)


def _eqns(jaxpr):
    """Every equation of a jaxpr, nested jaxprs (jit, custom calls, loops) included."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)
