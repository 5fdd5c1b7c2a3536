"""MTP speculative decoding in the serving engine's batched step (glm53.runtime.speculative), tiny random model.

Reference: one cache-free forward of the final sequence (prompt + output, the trunk then the MTP block over every
pair (h_p, token p+1)), a different program from the engine's cached steps. From it: each greedy output token is
the argmax after its prefix, each sampled one the draw of `sampling.sample` with the engine's key (seed, token
index); the drafts a request must accept follow from the MTP block's argmax at each position; and the engine's
MTP cache rows must equal the reference's. The lm head keeps 5 of the 128 columns (the others 0), so the random
MTP block's drafts are right often enough to see both verdicts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving_helpers import run_staggered

from configs import tiny
from glm53 import build
from glm53.config import model_config_from_dict
from glm53.runtime import sampling
from glm53.serving import engine as E

FAST = {"xla_backend_optimization_level": 0}
N = 48  # the engine's max_len, and the reference's (padded) length
_rng = np.random.default_rng(2)
BASE = [int(t) for t in _rng.integers(1, 128, 30)]
PROMPTS = [BASE[:13], [7, 8, 9], BASE, BASE[:9] + [1, 2, 3, 4], [5] * 17]
MAX_NEW = [9, 12, 7, 10, 11]


@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = build.random_model(cfg, seed=0, with_mtp=True)
    w = np.asarray(model.lm_head.kernel[...])
    keep = np.zeros_like(w)
    cols = [3, 17, 42, 99, 120]
    keep[:, cols] = 4 * w[:, cols]
    model.lm_head.kernel[...] = jnp.asarray(keep)
    spec = E.Engine(model, slots=3, max_len=N, buckets=(1, 8), compiler_options=FAST, speculative=True,
                    prefix_cache_bytes=1 << 30, prefix_block=8)  # fmt: skip
    spec.warmup()
    return spec, _reference(model)


def _reference(model):
    """seq -> (logits [len, V], drafts [len - 1], MTP latent rows [len - 1, R]) from one cache-free forward."""
    gd, state = nnx.split(model)

    @functools.partial(jax.jit, compiler_options=FAST)
    def forward(state, tokens):
        m = nnx.merge(gd, state)
        h, _ = m.hidden(tokens)
        e = m.embed(tokens[:, 1:])
        x, c = m.mtp(h[:, :-1], e, cache=m.mtp.init_cache(1, N), start_b=jnp.zeros(1, jnp.int32))
        return m.logits(h)[0], jnp.argmax(m.logits(x)[0], axis=-1), c.latent[0]

    def ref(seq):
        out = forward(state, np.asarray([seq + [0] * (N - len(seq))], np.int32))  # causal: pad at the end
        return [np.asarray(a)[: len(seq) - (i > 0)] for i, a in enumerate(out)]

    return ref


def _accepts(prompt, out, drafts):
    """(drafted, accepted) of a greedy request: its first token, then per step the draft for the token after the
    pending one (drafts[i - 1] for token i + 1) is verified; accepted: two tokens, else one."""
    seq = prompt + out
    i, g, drafted, accepted = len(prompt), 1, 0, 0  # seq[i]: the pending token, g tokens generated
    while g < len(out):
        acc = int(drafts[i - 1] == seq[i + 1])
        drafted, accepted, i, g = drafted + 1, accepted + acc, i + 1 + acc, g + 1 + acc
    return drafted, accepted


_run = run_staggered


def test_speculative_greedy_tokens_and_acceptance(setup):
    spec, ref = setup
    n0 = spec.compiled_programs()
    # decode x 3 widths (1, 2, 3 slots), put x 2, move; prefill x 2 buckets, insert, cache init and fresh h per
    # prefill width (1, 2, 3 requests); the prefix cache's 4 and its rows / state programs for 2 and 3 rows
    assert n0 == 29
    spec.stats.clear()
    out, last = _run(spec, [E.Request(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_NEW)])
    expected = []
    for p, o, n in zip(PROMPTS, out, MAX_NEW):
        logits, drafts, _ = ref(p + o)
        assert len(o) == n and o == list(
            np.argmax(logits[len(p) - 1 : -1], axis=-1)
        )  # greedy, token by token
        expected.append(_accepts(p, o, drafts))
    assert [(e.drafted, e.accepted) for e in last] == expected
    drafted, accepted = sum(e.drafted for e in last), sum(e.accepted for e in last)
    assert spec.stats["mtp_drafted"] == drafted and spec.stats["mtp_accepted"] == accepted
    assert 0 < accepted < drafted  # both verdicts happen
    for e, n in zip(last, MAX_NEW):  # the first token, then 1 + accepted a step (the last may overshoot by 1)
        assert e.finish_reason == "length" and n <= 1 + e.drafted + e.accepted <= n + 1
    assert spec.stats["tokens"] == sum(MAX_NEW)
    # Again, resumed from the prefix cache (MTP rows and the last hidden state restored): the same tokens, and
    # the same drafts accepted (the tokens alone could not show a wrong MTP cache: drafts are only verified).
    again, last2 = _run(spec, [E.Request(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_NEW)])
    assert again == out and [(e.drafted, e.accepted) for e in last2] == expected
    assert [e.prefix_tokens for e in last2] == [8, 0, 24, 8, 16]
    assert spec.compiled_programs() == n0


def test_batched_prefill_keeps_the_mtp_cache_and_the_snapshots(setup):
    """Three 17-token prompts prefilled as one group (chunks 8, 8, 1 of a [3, C] program; the MTP pairs and the
    first drafts of each row): greedy tokens and the drafts accepted as the cache-free reference says; then each
    alone resumes from the snapshots the group stored row by row (16 tokens) with the same tokens and drafts."""
    spec, ref = setup
    n0 = spec.compiled_programs()
    spec.prefix.clear()
    spec.stats.clear()
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(1, 128, 17)] for _ in range(3)]
    out, last = _run(spec, [E.Request(p, max_tokens=6) for p in prompts], late=0, after=0)
    assert spec.stats["prefill_groups"] == 1
    accepts = []
    for p, o, e in zip(prompts, out, last):
        logits, drafts, _ = ref(p + o)
        assert o == list(np.argmax(logits[len(p) - 1 : -1], axis=-1))
        accepts.append(_accepts(p, o, drafts))
        assert (e.drafted, e.accepted) == accepts[-1]
    for p, o, acc in zip(prompts, out, accepts):
        again, last2 = _run(spec, [E.Request(p, max_tokens=6)], late=0, after=0)
        assert again[0] == o and last2[0].prefix_tokens == 16 and (last2[0].drafted, last2[0].accepted) == acc
    assert spec.compiled_programs() == n0


def test_mtp_cache_rows_match_a_cache_free_run(setup):
    """The MTP block's cache after a request (cold, then resumed from the prefix cache at 24 tokens) holds the rows
    of the pairs (h_p, token p+1) of the final sequence, also at the prefill's chunk and block boundaries."""
    spec, ref = setup
    p, n = PROMPTS[2], MAX_NEW[2]  # 30 tokens: chunks 8, 8, 8, 1 x 6
    spec.prefix.clear()
    for resumed in (0, 24):
        out, last = _run(spec, [E.Request(p, max_tokens=n)], late=0, after=0)
        assert last[0].prefix_tokens == resumed
        rows = min(int(spec.cache.length[0]), len(p) + n - 1)  # slot 0 keeps the finished request's rows
        lat = ref(p + out[0])[2]
        np.testing.assert_allclose(
            np.asarray(spec.cache.mtp.latent[0, :rows]), lat[:rows], rtol=1e-4, atol=1e-5
        )


def test_sampled_slots_share_the_step_and_keep_their_tokens(setup):
    """Sampled requests (never verified) next to greedy ones: each token is `sampling.sample`'s draw from the
    reference logits with the key (seed, token index), as in the plain step."""
    spec, ref = setup
    reqs = [E.Request(p, max_tokens=n, temperature=0.8 if i % 2 else 0.0, top_k=10, seed=i)
            for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]  # fmt: skip
    spec.stats.clear()
    out, last = _run(spec, reqs)
    draw = jax.jit(sampling.sample, compiler_options=FAST)
    k = 16  # rows per draw (one shape: one compile)
    for r, o in zip(reqs, out):
        logits = np.zeros((k, 128), np.float32)
        logits[: len(o)] = ref(r.prompt + o)[0][len(r.prompt) - 1 : -1]
        keys = jax.vmap(lambda c, s=r.seed: jax.random.fold_in(jax.random.key(s), c))(np.arange(k))
        t, top_p, top_k = (
            np.full(k, r.temperature, np.float32),
            np.ones(k, np.float32),
            np.full(k, 10, np.int32),
        )
        assert o == list(np.asarray(draw(logits, keys, t, top_p, top_k))[: len(o)])
    assert (
        all(e.drafted == 0 for e in last[1::2])
        and spec.stats["mtp_drafted"] == sum(e.drafted for e in last) > 0
    )


def test_forced_tokens_are_never_drafts_in_the_cache(setup):
    """Request.think_budget forces `close` in place of the next tokens: the slot verifies no draft meanwhile (an
    accepted draft is already in the cache at that position); every other token is the greedy one after the
    sequence so far, forced tokens included."""
    spec, ref = setup
    close = [5, 77]  # never generated by this head (its zero columns tie: argmax 0)
    budgets = (2, 3, 4, 5, 2)
    reqs = [E.Request(p, max_tokens=n, think_budget=(b, close)) for p, n, b in zip(PROMPTS, MAX_NEW, budgets)]
    out, last = _run(spec, reqs)
    for r, o, b in zip(reqs, out, budgets):
        assert o[b : b + 2] == close
        greedy = np.argmax(ref(r.prompt + o)[0][len(r.prompt) - 1 : -1], axis=-1)
        assert all(t == g for j, (t, g) in enumerate(zip(o, greedy)) if j not in (b, b + 1))
    assert sum(e.accepted for e in last) > 0
