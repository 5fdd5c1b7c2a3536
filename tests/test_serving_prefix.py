"""The serving engine's prefix cache (glm53.serving.prefix) on the tiny random model.

Reference: the same prompt run cold (the cache cleared) on the same engine. A prompt resumed from snapshots must
give exactly its greedy tokens, for 0, 1, several shared blocks and the whole prompt, with eviction under a tiny
budget too; the held bytes are checked against a count from the config's shapes, and no request compiles.
"""

import jax
import numpy as np
import pytest

from configs import tiny
from glm53 import build
from glm53.config import model_config_from_dict
from glm53.serving import engine as E
from glm53.serving.prefix import chunk_plan

FAST = {"xla_backend_optimization_level": 0}
K = 8  # the block
_rng = np.random.default_rng(1)
R, R2, X, Y, Z, W, V = ([int(t) for t in _rng.integers(1, 128, n)] for n in (40, 10, 8, 10, 8, 6, 6))
# (prompt, prompt tokens resumed when the prompts run in this order). Buckets (1, 8, 16): A's chunks are 16, 16,
# 8, so its snapshots of the KDA state are at 16, 32 and 40 (rows for all five blocks).
CASES = [
    (R, 0),  # A, cold
    (R[:12] + X, 0),  # shares block 0, which has no state snapshot (inside A's first chunk): prefilled from 0
    (R[:20] + Y, 16),  # two blocks
    (R[:36] + Z, 32),  # four blocks
    (R, 32),  # the whole prompt: one block is left to prefill (the last token's logits are needed)
    (R[:28] + W, 16),  # three blocks shared, the third without a state: resumes after the second
    (V + R2, 0),  # nothing shared
    (R2, 0),  # its chunk 8 leaves a state at 8
    (R2[:8] + V, 8),  # one block
]
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = build.random_model(cfg, seed=0, with_mtp=False)
    eng = E.Engine(model, slots=2, max_len=64, buckets=(1, 8, 16), compiler_options=FAST,
                   prefix_cache_bytes=1 << 30, prefix_block=K, prefill_batch=1)  # fmt: skip (batched: test_serving_spec)
    eng.warmup()
    cold = []
    for p, _ in CASES:
        eng.prefix.clear()
        cold.append(E.generate(eng, [E.Request(p, max_tokens=MAX_NEW)])[0])
    return eng, cfg, cold, model


def _sizes(cfg):
    """Bytes of one block's rows and of one state snapshot, from the config (f32 everywhere): rows = the block's
    latent rows and pooled keys; state = KDA conv + recurrent states and every DSA cache's indexer ring
    (2 * kpool keys and gates)."""
    n_dsa = cfg.layer_types.count("dsa")
    rows = n_dsa * (K * cfg.kv_lora_rank + K // cfg.index_kpool * cfg.index_head_dim)
    hd = cfg.linear_num_heads * cfg.linear_head_dim
    state = (len(cfg.layer_types) - n_dsa) * (
        (cfg.linear_conv_kernel_dim - 1) * 3 * hd + hd * cfg.linear_head_dim
    ) + n_dsa * 2 * (2 * cfg.index_kpool) * cfg.index_head_dim
    return 4 * rows, 4 * state


def _held(eng):
    """Recounts the held bytes from the arrays, and checks the chains: every parent held, every leaf resumable."""
    blocks = eng.prefix._blocks
    kids = {n: 0 for n in blocks}
    for b in blocks.values():
        if b.parent is not None:
            assert b.parent in blocks
            kids[b.parent] += 1
    assert all(b.children == kids[n] and (b.children or b.state is not None) for n, b in blocks.items())
    return sum(a.nbytes for b in blocks.values() for a in jax.tree.leaves((b.rows, b.state)))


def _run(eng, prompts):
    reqs = [E.Request(p, max_tokens=MAX_NEW) for p in prompts]
    ev = {}
    for r in reqs:
        eng.submit(r, lambda e: ev.setdefault(e.request_id, []).append(e))
    eng.run_until_idle()
    return [[t for e in ev[r.id] for t in e.token_ids] for r in reqs], [
        ev[r.id][-1].prefix_tokens for r in reqs
    ]


def test_hits_give_the_cold_tokens_and_count_the_saved_prefill(setup):
    eng, cfg, cold, _ = setup
    n0 = eng.compiled_programs()
    # decode x 2 widths (1, 2 slots), put (1), move, prefill x 3 buckets, insert, cache init x 2, fresh h, rows /
    # state / put rows / put state
    assert n0 == 15
    eng.prefix.clear()
    # A alone: five blocks of rows, states at 16, 32, 40: the bytes held are exactly those.
    rows, state = _sizes(cfg)
    assert _run(eng, [CASES[0][0]])[0] == cold[:1]
    assert eng.prefix.blocks == 5 and eng.prefix.nbytes == _held(eng) == 5 * rows + 3 * state
    eng.stats.clear()
    # The rest together (two slots; each is looked up when admitted, after the previous one's prefill).
    out, resumed = _run(eng, [p for p, _ in CASES[1:]])
    assert out == cold[1:]
    assert resumed == [n for _, n in CASES[1:]]
    hits = [n for _, n in CASES[1:] if n]
    assert eng.stats["prefix_lookups"] == len(CASES) - 1 and eng.stats["prefix_hits"] == len(hits)
    assert eng.stats["prefix_hit_tokens"] == sum(hits)
    assert eng.stats["prefill_tokens"] == sum(len(p) - n for p, n in CASES[1:])
    assert eng.prefix.nbytes == _held(eng)
    assert eng.compiled_programs() == n0


def test_eviction_under_a_tiny_budget_keeps_the_tokens(setup):
    eng, cfg, cold, _ = setup
    rows, state = _sizes(cfg)
    budget = eng.prefix.budget
    try:
        for blocks in (1, 3):  # a budget of 1 block + 1 state: every chain is cut short; 3: some survive
            eng.prefix.budget = blocks * (rows + state)
            eng.prefix.clear()
            eng.stats.clear()
            out, resumed = _run(eng, [p for p, _ in CASES])
            assert out == cold
            assert eng.prefix.nbytes == _held(eng) <= eng.prefix.budget
            assert eng.stats["prefix_evicted_blocks"] > 0
            assert eng.stats["prefix_hit_tokens"] == sum(resumed) < sum(n for _, n in CASES)
    finally:
        eng.prefix.budget = budget


def test_chunk_plan_ends_on_block_boundaries_and_bad_options(setup):
    eng, _, _, model = setup
    assert chunk_plan(40, (1, 8, 16), 8) == [16, 16, 8]
    assert chunk_plan(45, (1, 4, 16), 8) == [16, 16, 4, 4, 4, 1]  # the last block in 4s, then the tail
    assert chunk_plan(7, (1, 8), 8) == [1] * 7
    ends = np.cumsum(chunk_plan(300, (1, 4, 16, 64, 256), 16))
    assert all(e % 16 == 0 for e in ends if e <= 288) and ends[-1] == 300
    with pytest.raises(ValueError, match="prefix_block"):
        E.Engine(model, prefix_cache_bytes=1, prefix_block=6)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        E.Engine(model, prefix_cache_bytes=-1)
    with pytest.raises(ValueError, match="speculative"):
        E.Engine(model, speculative=True)  # built without the MTP block
