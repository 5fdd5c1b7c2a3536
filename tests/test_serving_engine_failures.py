"""Failures and limits in the serving engine (glm53.serving.engine, glm53.serving.lifecycle), tiny random model:
no request can hurt another, every failure is said.

Failures are injected deterministically: one of the engine's jitted programs is wrapped by a function that raises
for a marked input (a token in a prompt, a seed), or a request's own callback raises. A concurrent victim either
completes with its tokens or ends with an "error" event that carries nothing of the attacker (nor the exception's
text); every request gets exactly one terminal event; afterwards the engine returns the same greedy tokens as
before the failure, without compiling anything.
"""

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from configs import tiny
from glm53 import build
from glm53.config import model_config_from_dict
from glm53.serving import engine as E
from glm53.serving.admit import sampling_args
from glm53.serving.limits import INT32_MAX, Limits
from glm53.serving.request import check_request
from glm53.serving.text import StopText

FAST = {"xla_backend_optimization_level": 0}
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [9, 4, 4, 9, 30, 31, 32]]
SECRET = "attacker-secret-4711"
MARK = 99  # a prompt token that makes the wrapped prefill raise
ATTACK_SEED = 4242  # a seed that makes the wrapped decode / insert raise


class Events:
    """A sink recording every event per request."""

    def __init__(self):
        self.ev: dict[str, list] = {}

    def __call__(self, e):
        self.ev.setdefault(e.request_id, []).append(e)

    def tokens(self, rid):
        return [t for e in self.ev[rid] for t in e.token_ids]

    def end(self, rid):
        """The request's one terminal event (asserts there is exactly one, and that it is the last)."""
        ends = [e for e in self.ev[rid] if e.finish_reason is not None]
        assert len(ends) == 1 and self.ev[rid][-1] is ends[0], self.ev[rid]
        return ends[0]


def _errors(caplog):
    return [r for r in caplog.records if r.name == "glm53.serving" and r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = build.random_model(cfg, seed=0, with_mtp=False)
    eng = E.Engine(model, slots=3, max_len=40, buckets=(1, 8), max_queue=8, compiler_options=FAST)
    eng.warmup()
    long = E.generate(eng, [E.Request(p, max_tokens=25) for p in PROMPTS])
    return eng, [t[:8] for t in long], model, long


def _healthy(eng, ref, n0):
    """The engine serves the same greedy tokens as before, nothing compiled, nothing left live."""
    assert E.generate(eng, [E.Request(p, max_tokens=8) for p in PROMPTS]) == ref
    assert eng.compiled_programs() == n0 and eng.live_requests == 0 and eng.idle() and eng.busy_slots == 0


def test_what_the_programs_cannot_represent_is_refused_naming_the_field(setup):
    eng, ref, *_ = setup
    v = eng.cfg.vocab_size
    for kw, field in ((dict(top_k=2**31, temperature=1.0), "top_k="), (dict(top_k=-1), "top_k="),
                      (dict(temperature=1e39), "temperature="), (dict(seed=-1), "seed="),
                      (dict(stop=[""]), "stop:"), (dict(stop=5), "stop:")):  # fmt: skip
        with pytest.raises(ValueError, match="^" + field):
            E.Request([1], **kw)
    assert E.Request([1], top_k=INT32_MAX).top_k == INT32_MAX
    late = E.Request([1])
    late.top_k = 2**31  # set after construction: the engine's check refuses it all the same
    nope = lambda e: None  # noqa: E731
    refused = eng.stats["refused"]
    for req, msg in ((late, "^top_k="),
                     (E.Request([1] * 40, max_tokens=1), "^prompt: 40 tokens; the context holds 40"),
                     (E.Request([1] * 39, max_tokens=2), "^max_tokens"),
                     (E.Request([1], stop=[f"s{i}" for i in range(17)]), "^stop: 17 stop sequences; at most 16"),
                     (E.Request([1], stop=["x" * 257]), "^stop: a stop sequence of 257 characters; at most 256"),
                     (E.Request([1], eos_ids=(2**31,)), "^eos_ids"),
                     (E.Request([1], think_budget=(2, [v])), "^think_budget")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            eng.submit(req, nope)
    assert eng.live_requests == 0 and eng.stats["refused"] == refused
    lim = Limits(max_stop=2, max_stop_chars=3)
    check_request(E.Request([1], stop=["ab", "abc"]), v, 40, True, lim)
    for stop in (["a", "b", "c"], ["abcd"]):
        with pytest.raises(ValueError, match="^stop: "):
            check_request(E.Request([1], stop=stop), v, 40, True, lim)
    # top_k at or past the vocabulary filters nothing: the draws of top_k=0 (seeds go mod 2**32); no overflow
    draws = [E.generate(eng, [E.Request(PROMPTS[0], max_tokens=6, temperature=1.0, top_k=k, seed=2**70 + 5)])[0]
             for k in (0, v, INT32_MAX)]  # fmt: skip
    assert draws[0] == draws[1] == draws[2] and len(draws[0]) == 6
    # the int32 / uint32 arrays never overflow, whatever a row holds
    rows = [SimpleNamespace(req=SimpleNamespace(seed=2**70 + 3, temperature=1.0, top_p=1.0, top_k=2**40)), None]
    seeds, _, _, top_k = sampling_args(rows, 2)
    assert seeds.tolist() == [3, 0] and top_k.tolist() == [INT32_MAX, 0]
    assert sampling_args(rows, 2, vocab=v)[3].tolist() == [0, 0]


def test_stop_text_holds_back_exactly_what_may_begin_a_stop_string():
    """StopText._hold (scans the text's tail from each occurrence of a stop string's first character) equals its
    definition: the longest proper prefix of any stop string that the text ends with."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        stops = ["".join(rng.choice(list("ab\ufffd"), rng.integers(1, 6))) for _ in range(rng.integers(1, 4))]
        text = "".join(rng.choice(list("abc"), rng.integers(0, 12)))
        want = max([k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])],
                   default=0)  # fmt: skip
        assert StopText(stops, None)._hold(text) == want, (stops, text)


def test_a_request_failing_on_the_host_ends_alone(setup, caplog):
    """A request's own `until`, constraint or sink raising ends that request ("error", naming what failed, never
    the exception's text); the request beside it in the batch gets all its tokens."""
    eng, ref, *_ = setup
    n0, ev, got = eng.compiled_programs(), Events(), []
    v = eng.cfg.vocab_size

    def until(text):
        if len(text) >= 2:
            raise RuntimeError(SECRET)
        return False

    class Constraint:
        def allowed(self, text, n):
            if n >= 1:
                raise ValueError(SECRET)
            return np.ones(v, bool)

    def bad_sink(e):
        got.append(e)
        if len(got) == 1:
            raise RuntimeError(SECRET)

    eng.detokenize = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # one character a token
    try:
        with caplog.at_level(logging.ERROR, logger="glm53.serving"):
            victim = eng.submit(E.Request(PROMPTS[1], max_tokens=8), ev)
            a = eng.submit(E.Request(PROMPTS[0], max_tokens=8, until=until), ev)
            c = eng.submit(E.Request(PROMPTS[2], max_tokens=8, constraint=Constraint()), ev)
            b = eng.submit(E.Request(PROMPTS[0], max_tokens=8), bad_sink)
            eng.run_until_idle()
    finally:
        eng.detokenize = None
    assert ev.tokens(victim) == ref[1] and ev.end(victim).finish_reason == "length"
    for rid, i, what, exc in ((a, 0, "until", "RuntimeError"), (c, 2, "constraint", "ValueError")):
        assert ev.end(rid).finish_reason == "error" and ev.tokens(rid) == ref[i][:1]  # raised at the 2nd token
        assert ev.end(rid).error == f"internal error: this request's {what} raised {exc} (see the server log)"
    assert [e.finish_reason for e in got] == [None, "error"] and "sink raised RuntimeError" in got[-1].error
    assert all(SECRET not in (e.error or "") for es in [*ev.ev.values(), got] for e in es)
    logged = _errors(caplog)
    assert len(logged) == 3 and all(r.exc_info for r in logged)
    assert sorted(rid for rid in (a, b, c) for r in logged if rid in r.getMessage()) == sorted([a, b, c])
    _healthy(eng, ref, n0)


def test_a_failed_prefill_ends_only_its_group(setup, caplog):
    """The prefill program raising for a marked prompt ends that prefill group's requests (the generic error, the
    exception logged once with their ids); the request decoding meanwhile completes."""
    eng, ref, *_ = setup
    n0, ev, real = eng.compiled_programs(), Events(), eng.programs.fns["prefill",]

    def prefill(state, staging, pool, tokens, h):
        if np.any(np.asarray(tokens) == MARK):
            raise RuntimeError(f"{SECRET}: {np.asarray(tokens).tolist()}")
        return real(state, staging, pool, tokens, h)

    eng.programs.fns["prefill",] = prefill
    try:
        with caplog.at_level(logging.ERROR, logger="glm53.serving"):
            victim = eng.submit(E.Request(PROMPTS[1], max_tokens=8), ev)  # chunks 8, 1, 1, 1: its own group
            eng.step()
            attacker = eng.submit(E.Request([MARK, 5, 6], max_tokens=8), ev)  # chunks 1, 1, 1: one group ...
            partner = eng.submit(E.Request([7, 8, 9], max_tokens=8), ev)  # ... with this one
            eng.run_until_idle()
    finally:
        eng.programs.fns["prefill",] = real
    assert ev.tokens(victim) == ref[1] and ev.end(victim).finish_reason == "length"
    for rid in (attacker, partner):
        assert ev.end(rid).finish_reason == "error" and not ev.tokens(rid)
        assert ev.end(rid).error == "internal error: the engine's prefill step failed (see the server log)"
    (rec,) = _errors(caplog)
    assert attacker in rec.getMessage() and partner in rec.getMessage() and victim not in rec.getMessage()
    assert rec.exc_info and SECRET in str(rec.exc_info[1])
    _healthy(eng, ref, n0)


@pytest.mark.parametrize("program,seed_arg,step", [("decode", 9, "decode step"), ("insert", 8, "insert step")])
def test_a_failed_shared_step_ends_every_running_request_and_the_engine_recovers(setup, caplog, program,
                                                                                  seed_arg, step):  # fmt: skip
    """The decode (every slot's step) or insert (writes the shared cache) program raising for an attacker's seed
    ends every request in a slot, each with one "error" event that says which step failed and nothing else; the
    cache is rebuilt and the same requests then give the same greedy tokens; a request still waiting runs."""
    eng, ref, _, long = setup
    n0, ev = eng.compiled_programs(), Events()
    fns = eng.programs.fns
    real = {k: f for k, f in fns.items() if k[0] == program}

    def wrap(fn):
        def raising(*args):
            if ATTACK_SEED in np.asarray(args[seed_arg]).tolist():
                raise RuntimeError(SECRET)
            return fn(*args)

        return raising

    fns.update({k: wrap(f) for k, f in real.items()})
    try:
        with caplog.at_level(logging.ERROR, logger="glm53.serving"):
            victims = [eng.submit(E.Request(p, max_tokens=25), ev) for p in PROMPTS[1:]]  # 2 groups (plans differ)
            while len(eng._active) < 2:
                eng.step()
            attacker = eng.submit(E.Request([MARK] * 11, max_tokens=8, seed=ATTACK_SEED), ev)
            waiting = [eng.submit(E.Request(PROMPTS[0], max_tokens=8), ev) for _ in range(2)]
            eng.run_until_idle()
    finally:
        fns.update(real)
    for rid, r in zip(victims, long[1:]):
        got = ev.tokens(rid)
        assert ev.end(rid).finish_reason == "error" and got == r[: len(got)] and len(got) < 25
        assert ev.end(rid).error == f"internal error: the engine's {step} failed (see the server log)"
    assert ev.end(attacker).finish_reason == "error" and ev.end(attacker).error == ev.end(victims[0]).error
    assert all(ev.tokens(w) == ref[0] and ev.end(w).finish_reason == "length" for w in waiting)
    (rec,) = _errors(caplog)
    assert all(rid in rec.getMessage() for rid in (*victims, attacker)) and rec.exc_info
    assert eng.stats["step_failures"] >= 1
    _healthy(eng, ref, n0)


def test_admission_counts_live_requests_only(setup):
    """slots + max_queue requests are accepted by an idle engine (the next is refused); a cancelled waiting request
    frees its place at once and still gets its one "cancelled" event; queue_depth counts live waiting ones."""
    eng = setup[0]
    cap, ev, cancelled = eng.slots + 8, Events(), eng.stats["finish_cancelled"]
    ids = [eng.submit(E.Request([1, 2], max_tokens=2), ev) for _ in range(cap)]
    assert eng.live_requests == cap and eng.queue_depth == cap
    with pytest.raises(E.QueueFull, match="queue is full"):
        eng.submit(E.Request([1, 2], max_tokens=2), ev)
    eng.cancel(ids[5])
    eng.cancel(ids[5])  # twice: one end
    assert eng.live_requests == cap - 1 and eng.queue_depth == cap - 1
    ids.append(eng.submit(E.Request([1, 2], max_tokens=2), ev))
    with pytest.raises(E.QueueFull):
        eng.submit(E.Request([1, 2], max_tokens=2), ev)
    eng.step()  # sends the cancel, admits a group of 3
    assert eng.queue_depth == cap - 3 and eng.live_requests == cap and eng.stats["finish_cancelled"] == cancelled + 1
    eng.run_until_idle()
    assert ev.end(ids[5]).finish_reason == "cancelled" and len(ev.ev[ids[5]]) == 1
    assert all(ev.end(i).finish_reason == "length" for i in ids if i != ids[5])
    assert eng.live_requests == 0 and eng.queue_depth == 0
    # concurrent submits: exactly `cap` accepted
    ok, full, go = [], [], threading.Barrier(8)

    def burst():
        go.wait()
        for _ in range(5):
            try:
                ok.append(eng.submit(E.Request([3], max_tokens=1), ev))
            except E.QueueFull:
                full.append(1)

    threads = [threading.Thread(target=burst) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == cap and len(full) == 40 - cap and len(set(ok)) == cap
    eng.run_until_idle()
    assert all(ev.end(i).finish_reason == "length" for i in ok)


@pytest.fixture(scope="module")
def small(setup):
    """Two slots of all-slot steps, a queue of 2 (its own programs: it is drained and stopped by the last test)."""
    eng = E.Engine(setup[2], slots=2, max_len=40, buckets=(1, 8), max_queue=2, compiler_options=FAST,
                   decode_widths=(2,), prefill_batch=1)  # fmt: skip
    return eng


def test_abort_all_ends_every_live_request(small, setup):
    eng, ref = small, setup[1]
    ev = Events()
    ids = [eng.submit(E.Request(p, max_tokens=8), ev) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2])]
    for _ in range(4):
        eng.step()  # the first one decodes, the second one prefills, two wait
    assert len(eng._active) == 1 and eng.busy_slots == 2 and eng.queue_depth == 2
    assert eng.abort_all("the server is shutting down") == 4 and eng.live_requests == 0
    late = eng.submit(E.Request(PROMPTS[0], max_tokens=8), ev)  # not draining: accepted
    eng.run_until_idle()
    for rid in ids:
        assert ev.end(rid).finish_reason == "error" and ev.end(rid).error == "the server is shutting down"
    assert ev.tokens(late) == ref[0] and ev.end(late).finish_reason == "length"
    assert eng.live_requests == 0 and eng.idle()


def test_run_survives_a_failed_step_drains_and_ends_every_request_at_stop(small, setup, caplog):
    """In `run`: a step that raises (a bug) ends the requests the engine thread holds with a generic error and the
    loop goes on (a waiting request and a new one get their tokens); after `drain`, submit raises Closed while running requests go on; once
    `stop` is set, every live request ends (pending cancels as "cancelled", the rest "error") before run returns."""
    eng, ref, long = small, setup[1], setup[3]
    ev, stop, real, calls, out = Events(), threading.Event(), eng._decode_step, [], {}

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(SECRET)
        return real()

    def sink(e):
        ev(e)
        if e.request_id == out.get("x") and e.finish_reason:  # ended by the failure: a fresh request
            out["f"] = eng.submit(E.Request(PROMPTS[0], max_tokens=8), sink)
        elif e.request_id == out.get("f") and e.finish_reason:  # then two long ones and one waiting
            out["a"], out["b"], out["c"] = (eng.submit(E.Request(p, max_tokens=25), sink) for p in PROMPTS)
            out["d"] = eng.submit(E.Request(PROMPTS[0], max_tokens=25), sink)
            eng.cancel(out["d"])
        elif e.request_id == out.get("a") and len(ev.ev[e.request_id]) == 3:
            eng.drain()
            try:
                eng.submit(E.Request([1], max_tokens=1), sink)
            except E.Closed as c:
                out["closed"] = str(c)
        elif e.request_id == out.get("a") and len(ev.ev[e.request_id]) == 6:
            stop.set()

    eng._decode_step = flaky
    try:
        with caplog.at_level(logging.ERROR, logger="glm53.serving"):
            out["x"] = eng.submit(E.Request(PROMPTS[1], max_tokens=8), sink)
            out["y"] = eng.submit(E.Request(PROMPTS[2], max_tokens=8), sink)
            t = threading.Thread(target=eng.run, args=(stop,))
            t.start()
            t.join(timeout=300)
    finally:
        del eng._decode_step
    assert not t.is_alive() and len(calls) > 6
    assert ev.end(out["x"]).error == "internal error: the engine's step failed (see the server log)"
    assert ev.tokens(out["y"]) == ref[2] and ev.tokens(out["f"]) == ref[0]
    assert ev.end(out["y"]).finish_reason == ev.end(out["f"]).finish_reason == "length"
    assert "shutting down" in out["closed"]
    assert ev.tokens(out["a"]) == long[0][:6] and ev.tokens(out["b"]) == long[1][: len(ev.tokens(out["b"]))]
    assert len(ev.tokens(out["b"])) < 25 and not ev.tokens(out["c"])
    for k in "abc":
        assert ev.end(out[k]).error == "internal error: the server stopped before this request finished"
    assert ev.end(out["d"]).finish_reason == "cancelled"
    assert all(SECRET not in (e.error or "") for es in ev.ev.values() for e in es)
    (rec,) = _errors(caplog)
    assert out["x"] in rec.getMessage() and out["y"] not in rec.getMessage()
    with pytest.raises(E.Closed, match="shutting down"):
        eng.submit(E.Request([1], max_tokens=1), sink)
    assert eng.live_requests == 0 and eng.queue_depth == 0
