"""Serving and generation on a scanned model (ModelConfig.scan_layers; docs/scan.md, "Caches and serving").

One tiny model (configs/tiny.py:parity with 12 layers: 0-2 scanned 3 x 1 (KDA, dense FFN), 3 plain (DSA), 4-11
scanned 2 x 4 (KDA, KDA, KDA, DSA; MoE)) is built once; `set_scan_layers` switches its layout in place, values
unchanged. The reference is the unrolled model in the speculative serving engine without a prefix cache: greedy,
its tokens are plain greedy decoding's (tests/test_serving_spec.py checks that against a cache-free forward) and
its events count each request's drafts and accepts. The lm head keeps 5 of the 128 columns so that the random MTP
block's drafts are right often enough to take both verdicts. A scanned cache holds a LayerStack's caches stacked
over its repeats: every slot, row and snapshot operation has to read them per layer.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec
from serving_helpers import run_staggered

from configs import tiny
from glm53 import build
from glm53 import parallel as S
from glm53.config import model_config_from_dict
from glm53.layers.dsa import DSACache
from glm53.layers.kda import KDACache
from glm53.layers.moe import Experts
from glm53.layers.stack import LayerStack
from glm53.memory import caches as memory_caches
from glm53.model import layer_cache
from glm53.runtime.cache import map_rows
from glm53.runtime.weights import decode_state
from glm53.serving import engine as E

FAST = {"xla_backend_optimization_level": 0}
K = 8  # prefix block
_rng = np.random.default_rng(0)
BASE = [int(t) for t in _rng.integers(1, 128, 30)]
PROMPTS = [BASE[:13], [7, 8, 9], BASE, BASE[:9] + [1, 2, 3, 4]]
MAX_NEW = [9, 6, 8, 10]
ENGINE = dict(slots=2, max_len=48, buckets=(1, 8), compiler_options=FAST)


def _layers_cfg(name: str, n: int, mlp: list[str], dsa_every: int = 4):
    d = tiny.get_config(name).model
    d.num_hidden_layers = n
    d.layer_types = ["dsa" if i % dsa_every == dsa_every - 1 else "kda" for i in range(n)]
    d.mlp_layer_types = mlp
    d.indexer_types = ["full"] * n
    return model_config_from_dict(d)


@pytest.fixture(scope="module")
def model():
    cfg = _layers_cfg("parity", 12, ["dense"] * 3 + ["moe"] * 9)
    m = build.random_model(cfg, seed=0, with_mtp=True)
    w = np.asarray(m.lm_head.kernel[...])
    keep = np.zeros_like(w)
    cols = [3, 17, 42, 99, 120]
    keep[:, cols] = 4 * w[:, cols]
    m.lm_head.kernel[...] = jnp.asarray(keep)
    return m


def _run(eng, prompts=PROMPTS, max_new=MAX_NEW, late=1, after=3):
    """(tokens, last event) per request: all but the last `late` submitted, `after` steps, then the rest."""
    return run_staggered(eng, [E.Request(p, max_tokens=n) for p, n in zip(prompts, max_new)], late, after)


@pytest.fixture(scope="module")
def ref(model):
    """The unrolled speculative engine (one decode width, prefilled one request at a time, no prefix cache):
    (engine, tokens, (drafted, accepted) per request)."""
    model.set_scan_layers(False)
    eng = E.Engine(model, speculative=True, decode_widths=(2,), prefill_batch=1, **ENGINE)
    out, last = _run(eng)
    acc = [(e.drafted, e.accepted) for e in last]
    assert sum(a for _, a in acc) > 0
    return eng, out, acc


def _scanned(model):
    model.set_scan_layers(True)
    assert [g.describe() for g in model.groups] == ["0-2 (scan: 3 x 1)", "3", "4-11 (scan: 2 x 4)"]
    return model


def _block_bytes(cfg, with_mtp: bool) -> int:
    """One prefix block's rows (f32): latent rows and pooled keys of every DSA layer, the MTP block's too."""
    n_dsa = cfg.layer_types.count("dsa") + with_mtp
    return 4 * n_dsa * (K * cfg.kv_lora_rank + K // cfg.index_kpool * cfg.index_head_dim)


def test_engine_greedy_and_prefix_hits_equal_unrolled(model, ref):
    """The plain engine on the scanned model (decode widths 1 and 2: narrow steps, `put` and slot moves; the
    prefix cache): the unrolled engine's greedy tokens, cold and resumed from snapshots whose rows cover every
    repeat of a stacked DSA layer."""
    _, want, _ = ref
    m = _scanned(model)
    eng = E.Engine(m, prefix_cache_bytes=1 << 30, prefix_block=K, prefill_batch=1, **ENGINE)
    eng.warmup()
    n0 = eng.compiled_programs()
    kda_stack, dsa_stack = eng.cache.layers[0], eng.cache.layers[2]
    assert isinstance(kda_stack, tuple) and kda_stack[0].state.shape[:2] == (3, 2)  # [repeats, slots, ...]
    assert isinstance(dsa_stack[3], DSACache) and dsa_stack[3].latent.shape[:2] == (2, 2)
    out, last = _run(eng)
    assert out == want
    assert [e.prefix_tokens for e in last] == [0, 0, 8, 8]  # BASE and the 4th share BASE[:13]'s first block
    assert eng.stats["slot_moves"] > 0 and eng.stats["decode_width_1"] > 0
    # Every block's rows: each DSA layer's (both repeats of the stacked one) and nothing else.
    blocks = list(eng.prefix._blocks.values())
    assert all(sum(a.nbytes for a in jax.tree.leaves(b.rows)) == _block_bytes(m.cfg, False) for b in blocks)
    latent = blocks[0].rows[0][2][3][0]  # unit 2 (the 2 x 4 scan), position 3 (DSA): [repeats, 1, K, R]
    assert latent.shape == (2, 1, K, m.cfg.kv_lora_rank)
    # Again: every prompt resumes from its deepest stored state; the same tokens.
    again, last = _run(eng)
    assert again == want and [e.prefix_tokens for e in last] == [8, 0, 24, 8]
    assert eng.compiled_programs() == n0


def test_speculative_engine_equals_unrolled(model, ref):
    """MTP speculative decoding on the scanned model (accepted drafts: two positions; rejected ones: the stacked
    KDA states rolled back per slot): the unrolled engine's tokens and the same drafts accepted, cold and
    resumed from the prefix cache; then its caches hold the unrolled engine's rows, layer by layer."""
    ref_eng, want, acc = ref
    m = _scanned(model)
    eng = E.Engine(m, speculative=True, decode_widths=(2,), prefill_batch=1,
                   prefix_cache_bytes=1 << 30, prefix_block=K, **ENGINE)  # fmt: skip
    out, last = _run(eng)
    assert out == want and [(e.drafted, e.accepted) for e in last] == acc
    drafted, accepted = sum(d for d, _ in acc), sum(a for _, a in acc)
    assert 0 < accepted < drafted  # both verdicts
    again, last = _run(eng)
    assert again == want and [(e.drafted, e.accepted) for e in last] == acc
    assert [e.prefix_tokens for e in last] == [8, 0, 24, 8]
    # One request alone in both engines (slot 0): every layer's cache rows agree.
    p, n = PROMPTS[2], MAX_NEW[2]
    for e in (eng, ref_eng):
        assert _run(e, [p], [n], late=0, after=0)[0] == [want[2]]
    rows = int(eng.cache.length[0])
    assert rows == int(ref_eng.cache.length[0])
    for i in range(m.cfg.num_hidden_layers):
        got, exp = layer_cache(m, eng.cache, i), ref_eng.cache.layers[i]
        if isinstance(exp, KDACache):
            np.testing.assert_allclose(np.asarray(got.state[0]), np.asarray(exp.state[0]), rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_allclose(np.asarray(got.latent[0, :rows]), np.asarray(exp.latent[0, :rows]),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip
    np.testing.assert_allclose(np.asarray(eng.cache.mtp.latent[0, :rows - 1]),
                               np.asarray(ref_eng.cache.mtp.latent[0, :rows - 1]), rtol=1e-4, atol=1e-5)  # fmt: skip


def test_decode_state_leaves_stacked_experts(model):
    """`decode_state` (glm53.runtime.weights) on the scanned model wraps a plain layer's experts and leaves a
    LayerStack's stacked (the engine's decode programs read it: the tests above)."""
    m = _scanned(model)
    # xla_cpu decode experts: a plain layer's are wrapped (views per expert), a LayerStack's stay stacked.
    experts = [(path, e) for path, e in nnx.iter_graph(m) if isinstance(e, Experts)]
    saved = [e.implementation for _, e in experts]
    try:
        for _, e in experts:
            e.implementation = "xla_cpu"
        flat = dict(nnx.to_flat_state(decode_state(m, nnx.state(m), 1)))
    finally:
        for (_, e), impl in zip(experts, saved):
            e.implementation = impl
    for path, _ in experts:
        wrapped = not isinstance(flat[(*path, "gate_proj")].get_value(), jax.Array)
        assert wrapped == ("period" not in path), path


def _slice_stream(cache, b):
    return map_rows(lambda a, axis: jax.lax.slice_in_dim(a, b, b + 1, axis=axis), cache)


def _put_stream(cache, b, sub):
    return map_rows(lambda a, s, axis: a.at[(slice(None),) * axis + (slice(b, b + 1),)].set(s), cache, sub)


def test_stream_rows_of_a_stacked_cache(model):
    """`_slice_stream` / `_put_stream` (glm53.runtime.cache.map_rows) take and write one stream's rows of every layer,
    stacked or not: each layer's cache (`layer_cache`) sliced as its own."""
    m = _scanned(model)
    cache = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(1).standard_normal(a.shape), a.dtype),
                         m.init_cache(3, 8))  # fmt: skip
    sub = _slice_stream(cache, 1)
    for i in range(m.cfg.num_hidden_layers):
        for a, b in zip(jax.tree.leaves(layer_cache(m, sub, i)), jax.tree.leaves(layer_cache(m, cache, i))):
            np.testing.assert_array_equal(a, b[1:2])
    back = _put_stream(jax.tree.map(jnp.zeros_like, cache), 2, sub)
    for a, b in zip(jax.tree.leaves(_slice_stream(back, 2)), jax.tree.leaves(sub)):
        np.testing.assert_array_equal(a, b)


def test_sharded_scanned_cache(monkeypatch):
    """On the 8 virtual devices ("data" 2 x "model" 4, rules tp): a stacked cache's shardings are its layers'
    behind an unsharded repeat axis; the sharded scanned model's prefill + decode equals the unsharded unrolled
    one; and the per-device context-set bytes of a stacked cache equal the unrolled cache's."""
    cfg = _layers_cfg("sharded", 4, ["moe"] * 4, dsa_every=2)  # one group: 0-3 scanned 2 x 2 (KDA, DSA; MoE)
    model = build.random_model(cfg, seed=0, with_mtp=False)
    mesh = S.make_mesh(ml_collections.ConfigDict(dict(axes=("data", "model"), shape=(2, 4), rules="tp")))
    b, t = 2, 12
    unrolled = S.cache_shardings(model.init_cache(b, 16), mesh, "tp")
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (b, t + 1)).astype(np.int32)

    def run(gd, state, cache, out_shardings=None):
        def f(state, cache, prompt, nxt):
            m = nnx.merge(gd, state)
            lp, cache = m(prompt, cache=cache)
            ld, cache = m(nxt, cache=cache)
            return lp, ld, cache

        return jax.jit(f, compiler_options=FAST, out_shardings=out_shardings)(state, cache, ids[:, :t], ids[:, t:])

    lp0, ld0, _ = run(*nnx.split(model), model.init_cache(b, 16))
    model.set_scan_layers(True)
    assert [g.describe() for g in model.groups] == ["0-3 (scan: 2 x 2)"]
    cache = model.init_cache(b, 16)
    sh = S.cache_shardings(cache, mesh, "tp")
    for j, stacked in enumerate(sh.layers[0]):
        for s, u in zip(jax.tree.leaves(stacked), jax.tree.leaves(unrolled.layers[j])):
            assert s.spec == PartitionSpec(None, *u.spec), (j, s.spec, u.spec)
    assert sh.layers[0][1].latent.spec == PartitionSpec(None, "data", "model", None)  # the sequence split
    sharded = S.shard_model(model, mesh, "tp")
    lp, ld, out = run(*nnx.split(sharded), S.shard_cache(cache, mesh, "tp"), (None, None, sh))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ld), np.asarray(ld0), rtol=1e-4, atol=1e-5)
    assert out.layers[0][0].state.sharding.is_equivalent_to(sh.layers[0][0].state, 5)
    # memory.caches reads a stacked cache per layer (its abstract cache is unrolled: patched here to a stacked one)
    want = memory_caches.context_set_bytes(cfg, 1024, 8)
    def stacked(cfg, context, *, with_mtp=False):
        return jax.eval_shape(lambda: model.init_cache(1, context, jnp.bfloat16))

    monkeypatch.setattr(memory_caches, "abstract_cache", stacked)
    assert isinstance(stacked(cfg, 1024).layers[0], tuple)
    assert memory_caches.context_set_bytes(cfg, 1024, 8) == want
    assert isinstance(model.layers[0], LayerStack)
