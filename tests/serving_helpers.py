"""Shared by the serving tests: an oracle of greedy decoding (one prompt alone, one token per step, numpy argmax),
driving an engine through a staggered batch of requests; a model-free engine and an in-process server for the HTTP
tests."""

from __future__ import annotations

import collections
import functools
import http.client
import json
import socket
import threading
import time

import jax
import numpy as np
from flax import nnx

from glm53.runtime.weights import decode_state


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2,))
def _step(graphdef, state, cache, tokens):
    m = nnx.merge(graphdef, state)
    h, cache = m.hidden(tokens, cache=cache)
    return m.logits(h)[:, -1], cache


def greedy_alone(model, prompt, n: int, max_len: int = 40) -> list[int]:
    """Greedy decoding of one prompt alone: a batch-1 cache fed one token per step (prompt included) on the
    decode state (glm53.runtime.weights), numpy argmax: the reference batched engines must reproduce."""
    gd, state = nnx.split(model)
    state = decode_state(model, state)
    cache = model.init_cache(1, max_len)
    for t in prompt:
        logits, cache = _step(gd, state, cache, np.asarray([[t]], np.int32))
    out = []
    for _ in range(n):
        out.append(int(np.argmax(np.asarray(logits[0]))))
        logits, cache = _step(gd, state, cache, np.asarray([[out[-1]]], np.int32))
    return out


def run_staggered(eng, reqs, late: int = 2, after: int = 3):
    """Submits all but the last `late` requests, steps `after` times, submits the rest, runs to the end; returns
    (tokens, last event) per request."""
    ev = {}
    sink = lambda e: ev.setdefault(e.request_id, []).append(e)  # noqa: E731
    for r in reqs[: len(reqs) - late]:
        eng.submit(r, sink)
    for _ in range(after):
        eng.step()
    for r in reqs[len(reqs) - late :]:
        eng.submit(r, sink)
    eng.run_until_idle()
    return [[t for e in ev[r.id] for t in e.token_ids] for r in reqs], [ev[r.id][-1] for r in reqs]


# ------------------------------------------------------------------------------------------------ HTTP tests
FAIL_TOKENS = 7  # a FakeEngine request with this max_tokens fails after 3 tokens (an "error" event)


class FakeEngine:
    """The engine's interface to the HTTP app (glm53.serving.app) without a model, for fast HTTP tests: every
    step (each `delay` s, in `run`'s thread) each live request gets the token "a" until max_tokens ("length");
    a request with max_tokens == FAIL_TOKENS ends with an "error" event after 3 tokens. Submit, cancel, drain,
    abort_all, QueueFull (slots + max_queue live) and Closed behave as the real engine's; `submitted` and
    `cancelled` record request ids."""

    def __init__(self, slots=2, max_queue=2, max_len=4096, delay=0.01, vocab_size=1000, warm=True):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(vocab_size=vocab_size)
        self.slots, self.max_queue, self.max_len, self.delay = slots, max_queue, max_len, delay
        self.warm_at_start, self.warm = warm, False
        self.stats = collections.Counter()
        self.submitted, self.cancelled = [], []
        self._live: dict = {}  # id -> [request, sink, tokens so far]
        self._ends: list = []
        self._closed = False
        self._lock = threading.Lock()

    def warmup(self, log=None):
        self.warm = self.warm_at_start

    def run(self, stop):
        while not stop.is_set():
            self.step()
            time.sleep(self.delay)

    def step(self):
        from glm53.serving.engine import Event

        with self._lock:
            ends, self._ends = self._ends, []
            live = list(self._live.items())
        for (req, sink, n), reason, error in ends:
            sink(Event(req.id, [], "", reason, len(req.prompt), n, error))
        for rid, s in live:
            req, sink, n = s
            s[2] = n = n + 1
            fail = req.max_tokens == FAIL_TOKENS and n > 3
            end = "error" if fail else "length" if n >= req.max_tokens else None
            if end is not None:
                with self._lock:
                    if self._live.pop(rid, None) is None:
                        continue
            sink(Event(rid, [] if fail else [97], "" if fail else "a", end, len(req.prompt), n - fail,
                       "internal error" if fail else None))  # fmt: skip

    def submit(self, req, sink):
        from glm53.serving.engine import Closed, QueueFull

        with self._lock:
            if self._closed:
                raise Closed("the server is shutting down: it accepts no new requests")
            if len(self._live) >= self.slots + self.max_queue:
                raise QueueFull("the queue is full")
            req.id = req.id or f"req-{len(self.submitted)}"
            self._live[req.id] = [req, sink, 0]
            self.submitted.append(req.id)
        return req.id

    def cancel(self, rid):
        with self._lock:
            s = self._live.pop(rid, None)
            if s is not None:
                self.cancelled.append(rid)
                self._ends.append((s, "cancelled", None))

    def drain(self):
        with self._lock:
            self._closed = True

    def abort_all(self, message):
        with self._lock:
            seqs, self._live = list(self._live.values()), {}
            self._ends.extend((s, "error", message) for s in seqs)
        return len(seqs)

    @property
    def live_requests(self):
        with self._lock:
            return len(self._live)

    @property
    def queue_depth(self):
        return max(self.live_requests - self.slots, 0)

    @property
    def busy_slots(self):
        return min(self.live_requests, self.slots)


class AppServer:
    """An app served by uvicorn (glm53.serving.http.server_config) in a thread on a free loopback port."""

    def __init__(self, app, limits):
        import uvicorn

        from glm53.serving.http import server_config

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(server_config(app, limits, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the app did not start"
            time.sleep(0.02)

    def request(self, method, path, body=None, headers=None, timeout=30):
        """(status, headers (lower-case names), body text) on a fresh connection; a dict body is sent as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, dict):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
