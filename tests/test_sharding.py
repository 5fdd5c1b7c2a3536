"""Sharding on 8 virtual CPU devices: mesh and rules, sharded == unsharded forward (prefill + decode) for the
tensor- and expert-parallel rule sets with the reference and Pallas expert paths, parameter placement equal to
the rules, one all-reduce per MoE layer, and per-device plane bytes equal to the budget's prediction.

The model under test is the `sharded` tiny variant (8 KDA / MLA / indexer heads, so every split axis divides 8),
randomized by transformers' side (constant-init parameters included), saved as an HF folder and loaded through
the real checkpoint loader into abstract, sharded parameters."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import flags
from flax import nnx
from hf_reference import hf_logits, tiny_hf_model
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from configs import tiny
from glm53 import dims
from glm53 import parallel as S
from glm53.checkpoint import hf as hf_ckpt
from glm53.config import ConfigError, QuantConfig, model_config_from_dict
from glm53.layers.moe import MoE
from glm53.memory import budget as memory
from glm53.model import Glm53Model
from glm53.parallel.moe import ShardedMoE
from glm53.quant import budget
from glm53.quant import planes as P
from glm53.quant.formats import get_format
from glm53.quant.int8 import Int8Weight, quantize_int8
from glm53.quant.qweight import QuantizedExperts
from kernels import dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_config_from_dict(tiny.get_config("sharded").model)  # KDA 0-2, DSA 3, KDA 4; MoE at 3 and 4
B, T = 2, 24  # 24 tokens: KDA chunked prefill, DSA sparse (6 pools, 2 selected)


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def mesh_of(shape, rules="tp"):
    return S.make_mesh(ml_collections.ConfigDict(dict(axes=("data", "model"), shape=shape, rules=rules)))


def all_reduces(hlo: str) -> list[str]:
    """Result types of the all-reduce ops of a compiled HLO module (a combined all-reduce is one op)."""
    return re.findall(r"= (.+?) all-reduce(?:-start)?\(", hlo)


# ----------------------------------------------------------------------------------------------- fixtures
def _run(graphdef):
    """Prefill T tokens, then decode one: (prefill logits [B, T, V], decode logits [B, 1, V], cache)."""

    def run(state, cache, prompt_bt, next_b1):
        m = nnx.merge(graphdef, state)
        lp, cache = m(prompt_bt, cache=cache)
        ld, cache = m(next_b1, cache=cache)
        return lp, ld, cache

    return run


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    hf = tiny_hf_model(CFG, 0)
    folder = tmp_path_factory.mktemp("hf_sharded")
    hf.save_pretrained(folder)
    cfg, model = hf_ckpt.load_hf_model(folder, dtype=np.float32, with_mtp=False)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, CFG.vocab_size, size=(B, T + 1)).astype(np.int32)
    gd, state = nnx.split(model)
    lp, ld, _ = jax.jit(_run(gd))(state, model.init_cache(B, T + 1), ids[:, :T], ids[:, T:])
    return dict(
        hf=hf, folder=folder, cfg=cfg, model=model, ids=ids, prefill=np.asarray(lp), decode=np.asarray(ld)
    )


def _pallas_experts(model, decode_max_slots: int = 8):
    """The model with every routed expert stored as exact F32 planes and run by the Pallas kernels."""
    for layer in model.layers:
        if not isinstance(layer.mlp, MoE):
            continue
        ex = layer.mlp.experts
        for m in ("gate_proj", "up_proj", "down_proj"):
            w = np.asarray(getattr(ex, m).get_value(), np.float32)  # [E, in, out]
            rows = np.ascontiguousarray(np.swapaxes(w, 1, 2))  # [E, out, in]: GGUF orientation
            q = QuantizedExperts.from_gguf_bytes(rows.view(np.uint8), "F32", rows.shape)
            getattr(ex, m).set_value(q)
        ex.implementation, ex.decode_max_slots = "pallas_tpu", decode_max_slots
    return model


@pytest.fixture
def no_fallback(monkeypatch):
    """Fails the test when kernels.moe falls back from the Pallas kernels to the reference path."""

    def fail(op, name, reason):
        raise AssertionError(f"{op} fell back from {name} to reference: {reason}")

    monkeypatch.setattr(dispatch, "warn_fallback", fail)


# ------------------------------------------------------------------------------------------ mesh / rules
def test_mesh_from_config():
    m = S.make_mesh(tiny.get_config("sharded").mesh)
    assert dict(m.shape) == {"data": 1, "model": 8}
    m = mesh_of((2, -1))
    assert dict(m.shape) == {"data": 2, "model": 4}
    argv = [
        "prog",
        f"--config={ROOT}/configs/tiny.py:sharded",
        "--config.mesh.shape=(4, 2)",
        "--config.mesh.rules=ep",
    ]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    mesh, rules = S.mesh_from_experiment_config(fv.config)
    assert dict(mesh.shape) == {"data": 4, "model": 2} and rules is S.EP_RULES
    for bad, match in [
        (dict(shape=(3, -1)), "does not divide 8"),
        (dict(shape=(2, 2)), "holds 4 devices"),
        (dict(shape=(-1, -1)), "at most one -1"),
        (dict(rules="dp"), "unknown rule set 'dp'"),
        (dict(axes=("model", "model")), "distinct axis names"),
        (dict(shape=(8,)), "1 entries"),
        (dict(devices=8), "unknown keys"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(match)):
            S.make_mesh(bad)


def test_rules_cover_every_logical_axis_and_reject_collisions():
    names = {v for k, v in vars(dims).items() if k.isupper() and isinstance(v, str)}
    for rules in (S.TP_RULES, S.EP_RULES):
        assert names <= set(rules.as_dict())
    assert S.TP_RULES.mesh_axes(dims.EXPERT_MLP) == ("model",) and S.TP_RULES.mesh_axes(dims.EXPERT) == ()
    assert S.EP_RULES.mesh_axes(dims.EXPERT) == ("model",) and S.EP_RULES.mesh_axes(dims.EXPERT_MLP) == ()
    model = nnx.eval_shape(lambda: Glm53Model(CFG, rngs=nnx.Rngs(0)))
    specs = S.check_rules(model, S.TP_RULES, mesh_of((1, 8)))
    assert specs["layers.3.mlp.experts.down_proj"] == PartitionSpec(None, "model", None)
    assert specs["embed.embedding"] == PartitionSpec("model", None)

    both = S.TP_RULES.replace(expert="model")
    with pytest.raises(S.ShardingError) as e:
        S.check_rules(model, both)
    msg = str(e.value)
    for path in (
        "layers.3.mlp.experts.gate_proj",
        "layers.4.mlp.experts.down_proj",
        "mtp.mlp.experts.up_proj",
    ):
        assert f"parameter {path}: logical axes" in msg
    assert "'expert' and 'expert_mlp' both map to mesh axis 'model'" in msg
    assert "layers.3.mlp.router.kernel" not in msg  # no collision there, only on the expert kernels

    with pytest.raises(S.ShardingError, match="'embed' and 'vocab' both map to mesh axis 'model'"):
        S.logical_to_spec((dims.EMBED, dims.VOCAB), S.TP_RULES.replace(embed="model"), "lm_head")
    with pytest.raises(S.ShardingError, match="logical axis 'nope' has no rule"):
        S.logical_to_spec(("nope",), S.TP_RULES, "x")
    with pytest.raises(S.ShardingError, match=r"dimension 0 \('vocab', size 100\) does not split"):
        S.logical_to_sharding((dims.VOCAB, dims.EMBED), mesh_of((1, 8)), "tp", (100, 64), "embedding")
    with pytest.raises(S.ShardingError, match="linear_num_heads"):  # 2 KDA heads cannot split 8 ways
        S.check_config(model_config_from_dict(tiny.get_config("default").model), mesh_of((1, 8)), "tp")
    S.check_config(CFG, mesh_of((1, 8)), "tp")
    S.check_config(CFG, mesh_of((1, 8)), "ep")


@pytest.fixture(scope="module")
def random_model():
    return Glm53Model(CFG, rngs=nnx.Rngs(3))  # with the MTP block


@pytest.mark.parametrize("rules", ["tp", "ep"])
def test_every_param_sharding_equals_its_rule(random_model, rules):
    mesh = mesh_of((2, 4), rules)
    model = S.shard_model(random_model, mesh, rules)
    abstract = nnx.state(S.abstract_sharded_model(lambda: Glm53Model(CFG, rngs=nnx.Rngs(3)), mesh, rules))
    plain = nnx.state(random_model)
    n = 0
    for (path, var), (_, pv), (_, av) in zip(
        nnx.to_flat_state(nnx.state(model)),
        nnx.to_flat_state(plain),
        nnx.to_flat_state(abstract),
        strict=True,
    ):
        axes = var.get_metadata()["logical_axes"]
        value = var.get_value()
        want = S.logical_to_sharding(axes, mesh, rules, value.shape)
        assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding, want)
        assert av.get_value().sharding.is_equivalent_to(want, value.ndim), path
        assert np.array_equal(np.asarray(value), np.asarray(pv.get_value())), path
        shard = value.addressable_shards[0].data.shape
        splits = [S.axis_size(mesh, S.get_rules(rules).mesh_axes(a)) for a in axes]
        assert shard == tuple(s // k for s, k in zip(value.shape, splits, strict=True)), path
        n += 1
    assert n == len(jax.tree.leaves(plain))
    moes = [type(layer.mlp) for layer in model.layers] + [type(model.mtp.mlp)]
    assert moes.count(ShardedMoE) == 3 and MoE not in moes  # layers 3, 4 and the MTP block
    assert type(random_model.layers[3].mlp) is MoE  # the input model is left as it was
    e_split = (8 // 4, 64, 64) if rules == "ep" else (8, 64, 64 // 4)  # gate [E, D, F]: experts or width / 4
    assert model.layers[3].mlp.experts.gate_proj.get_value().addressable_shards[0].data.shape == e_split
    assert model.layers[0].self_attn.q_proj.kernel.get_value().addressable_shards[0].data.shape == (
        64,
        64 // 4,
    )


def test_init_sharded_model_equals_jitted_init():
    """Initialized straight into the shardings (quantized down planes re-laid out inside the same jit)."""
    quant = QuantConfig(experts="gate=F32,up=F32,down=BF16")

    def build():
        return MoE(CFG, rngs=nnx.Rngs(6), quant=quant, layer_idx=3)

    mesh = mesh_of((1, 8))
    sharded = S.init_sharded_model(build, mesh, "tp")
    shard_of_plain = S.shard_model(nnx.merge(*jax.jit(lambda: nnx.split(build()))()), mesh, "tp")
    a, b = nnx.state(sharded), nnx.state(shard_of_plain)
    assert sharded.experts.down_proj.get_value().planes.block_splits == 8
    for (path, x), (_, y) in zip(nnx.to_flat_state(a), nnx.to_flat_state(b), strict=True):
        for u, v in zip(jax.tree.leaves(x.get_value()), jax.tree.leaves(y.get_value()), strict=True):
            assert u.sharding == v.sharding and np.array_equal(np.asarray(u), np.asarray(v)), path


# ------------------------------------------------------------------------------------------ forward parity
def test_unsharded_model_matches_transformers(ref):
    full = hf_logits(ref["hf"], ref["ids"]).numpy()
    print(f"unsharded vs transformers: prefill rel {rel(ref['prefill'], full[:, :T]):.1e}, "
          f"decode rel {rel(ref['decode'], full[:, T:]):.1e}")  # fmt: skip
    assert rel(ref["prefill"], full[:, :T]) <= 1e-4
    assert rel(ref["decode"], full[:, T:]) <= 1e-4


VARIANTS = [  # (rules, mesh shape, expert path)
    ("tp", (1, 8), "reference"),
    ("tp", (2, 4), "pallas"),
    ("ep", (1, 8), "pallas"),
    ("ep", (2, 4), "reference"),
]


@pytest.mark.parametrize("rules,shape,path", VARIANTS, ids=["-".join(map(str, v)) for v in VARIANTS])
def test_sharded_prefill_and_decode_equal_unsharded(ref, rules, shape, path, no_fallback):
    mesh = mesh_of(shape, rules)
    cfg = ref["cfg"]
    if path == "reference":  # the loader fills abstract sharded parameters directly
        abstract = S.abstract_sharded_model(
            lambda: Glm53Model(cfg, rngs=nnx.Rngs(0), with_mtp=False), mesh, rules
        )
        model, _ = hf_ckpt.load_hf_weights(ref["folder"], abstract, cfg)
    else:
        _, plain = hf_ckpt.load_hf_model(ref["folder"], dtype=np.float32, with_mtp=False)
        model = S.shard_model(_pallas_experts(plain), mesh, rules)
    assert isinstance(model.layers[3].mlp, ShardedMoE)
    gd, state = nnx.split(model)
    cache = model.init_cache(B, T + 1)
    cache_sh = S.cache_shardings(cache, mesh, rules)
    step = jax.jit(_run(gd), out_shardings=(None, None, cache_sh))
    lp, ld, cache = step(state, S.shard_cache(cache, mesh, rules), ref["ids"][:, :T], ref["ids"][:, T:])
    rp, rd = rel(lp, ref["prefill"]), rel(ld, ref["decode"])
    print(f"{rules} {shape} {path}: prefill rel {rp:.1e}, decode rel {rd:.1e}")
    assert rp <= 1e-5 and rd <= 1e-5
    kda_state = cache.layers[0].state  # [B, H, dk, dv]: by head on "model", streams on "data"
    want = PartitionSpec("data" if shape[0] > 1 else None, "model", None, None)
    assert kda_state.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, want), 4)


# --------------------------------------------------------------------------------------------- all-reduce
@pytest.mark.parametrize("rules,path", [("tp", "reference"), ("tp", "pallas"), ("ep", "reference")])
def test_one_all_reduce_per_moe_layer(rules, path, no_fallback):
    """The routed experts' and the shared expert's partial sums share ONE all-reduce of [T, D]."""
    quant = (
        None if path == "reference" else QuantConfig(experts="F32", decode_max_slots=8)
    )
    impl = "reference" if quant is None else "pallas_tpu"
    moe = MoE(CFG, rngs=nnx.Rngs(1), quant=quant, implementation=impl, layer_idx=3)
    mesh = mesh_of((1, 8), rules)
    sharded = S.shard_model(moe, mesh, rules)
    assert isinstance(sharded, ShardedMoE)
    gd, state = nnx.split(sharded)
    f = jax.jit(lambda s, x: nnx.merge(gd, s)(x))
    for t in (T, 1):  # prefill and decode
        x = jax.random.normal(jax.random.key(t), (t, CFG.hidden_size), jnp.float32)
        compiled = f.lower(state, x).compile()
        ops = all_reduces(compiled.as_text())
        full = [o for o in ops if o.startswith(f"f32[{t},{CFG.hidden_size}]")]
        print(f"{rules} {path} T={t}: all-reduce ops {ops}")
        assert len(full) == 1
        if rules == "tp":
            assert len(ops) == 1  # and nothing else: the router is replicated
        assert rel(compiled(state, x), moe(x)) <= 1e-5


# ------------------------------------------------------------------------------------------------ planes
MIXES = {"ud": ("IQ2_S", "IQ3_S"), "iq4_down": ("IQ2_S", "IQ4_XS")}


@pytest.mark.parametrize("rules", ["tp", "ep"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_plane_bytes_per_device_equal_budget(mix, rules):
    """gate/up [E, 2048 out, 512 in] and down [E, 512 out, 2048 in]. Under TP, gate/up keep both input blocks of
    a row (paired 2-byte fields whole) and down has ONE of its 8 blocks per row on each device (every 2-byte field
    padded to a word), as the release's 2048 x 4096 / 4096 x 2048 experts over 8 chips."""
    gate_up, down = MIXES[mix]
    e, d, f = 8, 512, 2048
    cfg = CFG.replace(hidden_size=d, moe_intermediate_size=f, n_routed_experts=e)
    quant = QuantConfig(experts=f"gate={gate_up},up={gate_up},down={down}")
    moe = MoE(cfg, rngs=nnx.Rngs(2), quant=quant, layer_idx=3)
    mesh = mesh_of((1, 8), rules)
    sharded = S.shard_model(moe, mesh, rules)
    fmts = {"gate": gate_up, "up": gate_up, "down": down}
    total = 0
    for m, fmt in fmts.items():
        q0 = getattr(moe.experts, f"{m}_proj").get_value()
        q = getattr(sharded.experts, f"{m}_proj").get_value()
        shape = budget.expert_shape(m, e, d, f)  # [E, rows, cols]
        if rules == "tp":
            split = budget.tp_split(m, 8)
            want = budget.plane_nbytes(shape, fmt, split)
        else:
            split, want = None, budget.plane_nbytes((e // 8, *shape[1:]), fmt)
        var = getattr(sharded.experts, f"{m}_proj")
        want_sh = S.logical_to_sharding(var.get_metadata()["logical_axes"], mesh, rules)
        assert all(leaf.sharding.is_equivalent_to(want_sh, 3) for leaf in jax.tree.leaves(q))
        got = S.device_nbytes(q)
        print(f"{mix} {rules} {m} {fmt}: {got[0]} B per device (budget {want}), GGUF {q.gguf_nbytes // 8}")
        assert got == [want] * 8
        total += got[0]
        # Device i holds exactly the planes that split_rows / split_blocks give device i.
        for i in range(8):
            if rules == "tp":
                mine = P.split_planes(q0.planes, split, i).fields
            else:
                mine = {k: v[i * e // 8 : (i + 1) * e // 8] for k, v in q0.planes.fields.items()}
            for name, arr in q.planes.fields.items():
                shard = next(s for s in arr.addressable_shards if s.device == mesh.devices[0, i])
                assert np.array_equal(np.asarray(shard.data), np.asarray(mine[name])), (m, name, i)
    if rules == "tp":
        layer_mix = {(3, m): fmt for m, fmt in fmts.items()}
        assert total == memory.expert_bytes(cfg, layer_mix, 8).per_device
        # Each 2-byte field of down (IQ3_S: d; IQ4_XS: d, scales_h) pads 2 bytes per row per expert per device.
        gguf = sum(budget.gguf_nbytes(budget.expert_shape(m, e, d, f), x) for m, x in fmts.items()) // 8
        assert total - gguf == e * d * 2 * sum(fd.nbytes == 2 for fd in get_format(down).fields)


@pytest.mark.parametrize("rules", ["tp", "ep"])
def test_block_quantized_experts_sharded_equal_unsharded(rules, no_fallback):
    """Q4_K gate/up and IQ4_XS down (two 2-byte fields, one block per device per row) through the Pallas kernels
    on the block-split planes of each device, against the unsharded reference path."""
    e, d, f = 8, 256, 2048
    cfg = CFG.replace(hidden_size=d, moe_intermediate_size=f, n_routed_experts=e)
    quant = QuantConfig(experts="gate=Q4_K,up=Q4_K,down=IQ4_XS", decode_max_slots=8)
    moe = MoE(cfg, rngs=nnx.Rngs(4), quant=quant, implementation="pallas_tpu", layer_idx=3)
    oracle = nnx.merge(*nnx.split(moe))
    oracle.experts.implementation = "reference"
    sharded = S.shard_model(moe, mesh_of((1, 8), rules), rules)
    gd, state = nnx.split(sharded)
    f_ = jax.jit(lambda s, x: nnx.merge(gd, s)(x))
    for t in (2, 8):  # decode kernel (2 x 2 slots <= 8) and prefill kernel (16 slots)
        x = jax.random.normal(jax.random.key(10 + t), (t, d), jnp.float32)
        r = rel(f_(state, x), oracle(x))
        print(f"{rules} T={t}: rel {r:.1e}")
        assert r <= 1e-5


# ------------------------------------------------------------------------------------------ activations
def test_constrain_by_logical_names():
    mesh = mesh_of((2, 4))
    f = jax.jit(lambda x: S.constrain(x * 2.0, (S.BATCH, None, dims.VOCAB), mesh, "tp"))
    y = f(jnp.ones((2, 3, 128)))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("data", None, "model")), 3)
    y = f(jnp.ones((1, 3, 128)))  # one stream does not split over "data": left unconstrained there
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, None, "model")), 3)


def test_int8_shared_expert_sharded():
    """Int8Weight kernels (the HF loader's int8 option): values by the kernel's rule, scales by its output axis."""
    moe = MoE(CFG, rngs=nnx.Rngs(7), layer_idx=3)
    for m in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(moe.shared_experts, m)
        lin.kernel.set_value(quantize_int8(np.asarray(lin.kernel.get_value())))
    mesh = mesh_of((1, 8))
    sharded = S.shard_model(moe, mesh, "tp")
    gate = sharded.shared_experts.gate_proj.kernel.get_value()
    down = sharded.shared_experts.down_proj.kernel.get_value()
    assert isinstance(gate, Int8Weight) and isinstance(down, Int8Weight)
    assert gate.values.sharding.spec == PartitionSpec(
        None, "model"
    ) and gate.scale.sharding.spec == PartitionSpec("model")
    assert down.values.sharding.spec == PartitionSpec(
        "model", None
    ) and down.scale.sharding.spec == PartitionSpec(None)
    x = jax.random.normal(jax.random.key(3), (4, CFG.hidden_size), jnp.float32)
    assert rel(jax.jit(lambda x: sharded(x))(x), moe(x)) <= 1e-5
