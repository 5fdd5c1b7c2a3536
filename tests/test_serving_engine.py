"""The continuous-batching engine (glm53.serving.engine) on the tiny random model.

Reference: `serving_helpers.greedy_alone` (a separate program: a batch-1 cache, one token per step, argmax in
numpy) run on each prompt alone. Batched greedy decoding with requests joining and leaving must give exactly its tokens, and no
request may cause a compilation after warm-up.
"""

import jax
import numpy as np
import pytest
from serving_helpers import greedy_alone

from configs import tiny
from glm53 import build
from glm53.config import model_config_from_dict
from glm53.runtime import programs as P
from glm53.serving import engine as E
from glm53.serving.prefix import chunk_plan
from glm53.serving.text import StopText
from glm53.testing.params import randomize_params

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3] * 20, [7], [9, 4, 4, 9, 30, 31, 32]]
MAX_NEW = [6, 9, 4, 12, 7]
FAST = {"xla_backend_optimization_level": 0}  # compiles in ~60% of the time; the results are the same


@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = randomize_params(build.random_model(cfg, seed=0, with_mtp=False))  # no constant inits
    eng = E.Engine(model, slots=3, max_len=40, buckets=(1, 8), max_queue=8, compiler_options=FAST)
    eng.warmup()
    ref = [greedy_alone(model, p, n) for p, n in zip(PROMPTS, MAX_NEW)]  # one batch-1 program for every prompt
    return eng, ref, model


def test_batched_greedy_equals_each_alone_without_recompiling(setup):
    eng, ref, _ = setup
    n0 = eng.compiled_programs()
    # decode x 3 widths (1, 2, 3 slots), put x 2 (1, 2), move; prefill x 2 buckets x 3 prefill widths (1, 2, 3
    # requests), insert, cache init and fresh h x 3 prefill widths (the width-3 init also makes the 3-slot cache)
    assert n0 == 21
    # 5 requests over 3 slots: some wait, join when others leave, and prefill in 1- and 8-token chunks.
    out = E.generate(eng, [E.Request(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_NEW)])
    assert out == ref
    assert [len(o) for o in out] == MAX_NEW
    # Sampled requests: a request's tokens depend only on its seed, not on its batch neighbours.
    reqs = [
        E.Request(p, max_tokens=5, temperature=0.9, top_p=0.9, top_k=20, seed=i)
        for i, p in enumerate(PROMPTS)
    ]
    together = E.generate(eng, reqs)
    alone = [E.generate(eng, [E.Request(p, max_tokens=5, temperature=0.9, top_p=0.9, top_k=20, seed=i)])[0]
             for i, p in enumerate(PROMPTS[:2])]  # fmt: skip
    assert together[:2] == alone
    assert E.generate(eng, [E.Request(PROMPTS[0], max_tokens=5, temperature=0.9, seed=99)])[0] != together[0]
    # EOS: a request whose EOS is its first greedy token stops after it.
    events = []
    eng.submit(E.Request(PROMPTS[1], max_tokens=9, eos_ids=(ref[1][2],)), events.append)
    eng.run_until_idle()
    assert [t for e in events for t in e.token_ids] == ref[1][: ref[1].index(ref[1][2]) + 1]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == ref[1].index(ref[1][2]) + 1
    assert eng.compiled_programs() == n0
    assert eng.busy_slots == 0 and eng.idle()


def test_cancel_frees_the_slot_and_queue_full_refuses(setup):
    eng, ref, _ = setup
    n0 = eng.compiled_programs()
    ev: dict[str, list] = {}

    def sink(e):
        ev.setdefault(e.request_id, []).append(e)

    keep = eng.submit(E.Request(PROMPTS[1], max_tokens=9), sink)
    gone = eng.submit(E.Request(PROMPTS[3], max_tokens=30), sink)
    for _ in range(6):
        eng.step()
    assert eng.busy_slots == 2
    eng.cancel(gone)
    eng.step()
    assert ev[gone][-1].finish_reason == "cancelled" and eng.busy_slots == 1
    # A cancelled request still waiting in the queue never runs (and no longer counts against the queue).
    waiting = eng.submit(E.Request(PROMPTS[0], max_tokens=5), sink)
    eng.cancel(waiting)
    # 3 slots + a queue of 8: 11 live requests (`keep` and these 10); the 12th is refused at once.
    ids = [eng.submit(E.Request([1, 2], max_tokens=2), sink) for _ in range(10)]
    assert eng.live_requests == 11 and eng.queue_depth == 10
    with pytest.raises(E.QueueFull, match="queue is full"):
        eng.submit(E.Request([1, 2], max_tokens=2), sink)
    eng.run_until_idle()
    assert [t for e in ev[keep] for t in e.token_ids] == ref[1]
    assert [e.finish_reason for e in ev[waiting]] == ["cancelled"] and not ev[waiting][0].token_ids
    assert all(ev[i][-1].finish_reason == "length" for i in ids)
    assert eng.compiled_programs() == n0 and eng.busy_slots == 0


def test_bad_requests_name_the_field(setup):
    eng, _, model = setup
    for kw, field in ((dict(prompt=[1], max_tokens=0), "max_tokens"), (dict(prompt=[1], temperature=-1), "temperature"),
                      (dict(prompt=[1], top_p=0.0), "top_p"), (dict(prompt=[1], stop=("",)), "stop")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            E.Request(**kw)
    for req, field in ((E.Request([], max_tokens=1), "prompt"), (E.Request([1000], max_tokens=1), "prompt"),
                       (E.Request([1] * 30, max_tokens=11), "max_tokens")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            eng.submit(req, lambda e: None)
    with pytest.raises(ValueError, match="buckets"):
        E.Engine(model, buckets=(4, 8))


@pytest.fixture(scope="module")
def full(setup):
    """An engine of all-slot decode steps that prefills one request at a time (decode, prefill x 2, insert, cache
    init x 2, fresh h)."""
    full = E.Engine(setup[2], slots=3, max_len=40, buckets=(1, 8), compiler_options=FAST, decode_widths=(3,),
                    prefill_batch=1)  # fmt: skip
    full.warmup()
    return full


def test_batched_prefill_gives_each_request_alone(setup, full):
    """Requests with the same chunk plan are prefilled together (6 requests with 9-token prompts, chunks 8 + 1, in
    two groups of 3 through the [3, C] programs; then one request of a group cancelled while it prefills):
    greedy tokens equal each prompt decoded alone (`greedy_alone`), sampled ones equal the one-at-a-time
    engine's, and nothing compiles."""
    eng, _, model = setup
    n0 = eng.compiled_programs()
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 128, 9)] for _ in range(6)]
    reqs = lambda: [E.Request(p, max_tokens=5, temperature=0.9 * (i % 2), top_k=20, seed=i)  # noqa: E731
                    for i, p in enumerate(prompts)]  # fmt: skip
    eng.stats.clear()
    out = E.generate(eng, reqs())
    assert eng.stats["prefill_groups"] == 2 and eng.stats["prefill_tokens"] == 6 * 9
    assert out == E.generate(full, reqs()) and full.stats["prefill_groups"] == 6
    assert out[0::2] == [greedy_alone(model, p, 5) for p in prompts[0::2]]
    # a cancel inside a group: the request ends "cancelled", the group's others are unaffected
    events = {}
    rs = [E.Request(p, max_tokens=4) for p in prompts[:3]]
    for r in rs:
        eng.submit(r, lambda ev: events.setdefault(ev.request_id, []).append(ev))
    eng.step()  # admits the three as one group and prefills its first chunk
    assert eng.busy_slots == 3 and not eng._active
    eng.cancel(rs[1].id)
    eng.run_until_idle()
    assert events[rs[1].id][-1].finish_reason == "cancelled" and eng.busy_slots == 0
    assert [[t for ev in events[r.id] for t in ev.token_ids] for r in (rs[0], rs[2])] == [out[0][:4], out[2][:4]]
    assert eng.compiled_programs() == n0


def test_narrow_decode_steps_give_the_full_width_tokens(setup, full):
    """Steps over the first b slots only (b = the smallest width covering the busy slots) give exactly the tokens of
    an engine that always runs all slots, greedy and sampled, with requests joining and leaving (slots freed out
    of order, so holes below the highest busy slot too)."""
    eng, ref, model = setup
    assert full.compiled_programs() == 7 and eng.decode_widths == (1, 2, 3)
    reqs = lambda: [E.Request(p, max_tokens=n, temperature=0.8 * (i % 2), top_k=30, seed=i)  # noqa: E731
                    for i, (p, n) in enumerate(zip(PROMPTS + PROMPTS[:2], MAX_NEW + [3, 12]))]  # fmt: skip
    eng.stats.clear()
    out = E.generate(eng, reqs())
    assert out == E.generate(full, reqs())
    assert out[0::2][:3] == [ref[0], ref[2], ref[4]]  # the greedy ones: the reference too
    assert all(eng.stats[f"decode_width_{b}"] > 0 for b in (1, 2, 3)) and eng.stats["slot_moves"] > 0
    assert eng.compiled_programs() == 21 and full.compiled_programs() == 7  # moves, narrow steps: no compile
    assert set(full.stats) & {"decode_width_1", "decode_width_2"} == set() and full.stats["decode_width_3"] > 0
    assert P.widths(1) == (1,) and P.widths(6) == (1, 2, 4, 6) and P.widths(16) == (1, 2, 4, 8, 16)
    for bad in ((1, 2), (0, 3), (4,), ()):
        with pytest.raises(ValueError, match="decode_widths"):
            E.Engine(model, slots=3, decode_widths=bad)


def test_chunk_plan_and_stop_text():
    assert chunk_plan(27, (1, 8)) == [8, 8, 8, 1, 1, 1]
    assert sum(chunk_plan(300, (1, 4, 16, 64, 256))) == 300
    text = "Hello, world! END here"
    detok = lambda ids: text[: len(ids)]  # one character per token
    st = StopText(("END", "!!"), detok)
    sent = []
    for i in range(len(text)):
        out, hit = st.push(i)
        sent.append(out)
        if hit:
            break
    assert "".join(sent) == "Hello, world! " and hit == "END"
    # "!" could begin "!!": held back until the next character shows it does not.
    st = StopText(("!!",), detok)
    assert [st.push(i)[0] for i in range(13)][-1] == "" and st.push(13)[0] == "! "
    # An incomplete UTF-8 sequence (U+FFFD at the end) is held back.
    st = StopText((), lambda ids: "ab\ufffd" if len(ids) == 1 else "ab\u00e9")
    assert st.push(0) == ("ab", None) and st.push(1) == ("\u00e9", None) and st.flush() == ""
    assert StopText(("x",), None).push(3) == ("", None)
    np.testing.assert_equal(chunk_plan(0, (1,)), [])


def test_until_ends_a_request_early(setup):
    """`Request.until` (what a forced tool call uses) sees the text so far and ends the request: the tokens are
    the reference's first ones."""
    eng, ref, _ = setup
    eng.detokenize = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # one character a token
    try:
        seen = []
        out = E.generate(
            eng, [E.Request(PROMPTS[0], max_tokens=6, until=lambda t: seen.append(t) or len(t) >= 3)]
        )
    finally:
        eng.detokenize = None
    assert out == [ref[0][:3]] and [len(t) for t in seen] == [1, 2, 3]


def test_think_budget_feeds_the_closing_ids(setup):
    """Request.think_budget=(N, close): after N tokens without `close`, `close` is fed in place of the sampled
    tokens, and decoding goes on from there: exactly the greedy tokens of the prompt extended by them."""
    eng, ref, _ = setup
    p, close = PROMPTS[1], [5, 77]
    head = E.generate(eng, [E.Request(p, max_tokens=3)])[0]
    tail = E.generate(eng, [E.Request(p + head + close, max_tokens=4)])[0]
    out = E.generate(eng, [E.Request(p, max_tokens=9, think_budget=(3, close))])[0]
    assert head == ref[1][:3] and out == head + close + tail
    # `close` generated by the model before the budget: nothing is forced.
    natural = E.generate(eng, [E.Request(p, max_tokens=6, think_budget=(4, ref[1][1:2]))])[0]
    assert natural == ref[1][:6]


def test_the_programs_are_one_named_object(setup):
    """The engine's device programs live in one `glm53.runtime.programs.Programs`, by name (what
    glm53.serving.multihost replays); it holds the state, the decode states and the slots' cache."""
    eng = setup[0]
    fns = eng.programs.fns
    assert {k[0] for k in fns} == {"decode", "put", "move", "prefill", "insert", "init", "h0"}
    assert tuple(sorted(k[1] for k in fns if k[0] == "decode")) == eng.decode_widths
    assert tuple(sorted(k[1] for k in fns if k[0] == "h0")) == eng.prefill_widths
    held = {id(x) for x in eng.programs.held()}
    assert all(id(x) in held for x in jax.tree.leaves(eng.cache))
    assert all(id(x) in held for x in jax.tree.leaves(eng.programs.state))
