"""One `glm53.serving.engine.Engine` over several JAX processes: process 0 leads, the others replay its programs.

Multi-controller JAX needs every process to call the same jitted programs, in the same order, with the same
inputs. The engine's host logic (queue, scheduler, stop strings, constraints, sinks, HTTP) runs on process 0
only, so its program calls are announced: `lead(engine)` replaces every named program of the engine's runtime
object (`engine.programs.fns`, glm53.runtime.programs: decode per width, prefill, insert, cache init, slot moves,
...) by a proxy that first broadcasts the call (`multihost_utils.broadcast_one_to_all` of a pickled record, the
program's name in it) and then runs it; `follow(engine)` on every other process receives the records and calls
the same named program of its own engine. Device arrays travel as handles: the arrays the runtime object holds
when it is wrapped (`Programs.held`: model state, decode states, cache) and every output of every announced call are numbered in the same order in all processes; the leader
announces the handles it no longer holds (weak references) so the followers drop them too. Host values (tokens,
slots, sampling parameters, masks) travel by value; a process-local device array (e.g. the all-true mask) by its
value. Outputs come to the host as usual (a replicated output: no gather).

Both processes must build the same engine (same model placement, options) before `lead` / `follow`, and the
leader calls `stop(engine)` at the end (the followers return). Not replayed: the prefix cache (its programs are
chosen by host state): `prefix_cache_bytes` must be 0.

Threads: the leader's records are sent under one lock (a program call holds it until the program is dispatched),
so the engine thread, the heartbeat and `stop` never interleave; a program call after `stop` is a RuntimeError.
Idle: a follower waits for the next record inside a collective, and XLA's CPU collectives (gloo) fail after
``xla_cpu_collective_timeout_seconds`` (30 minutes by default) without data. So while no program runs, the leader
sends a no-op record at least every `heartbeat` seconds (`lead`'s argument; a daemon thread).
"""

from __future__ import annotations

import pickle
import threading
import time
import weakref
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

_STOP, _CALL, _BEAT = "stop", "call", "beat"
HEARTBEAT_S = 60.0  # the idle leader's no-op record, far below the CPU collectives' 30-minute timeout


def _broadcast(record) -> object:
    """The leader's `record` in every process (followers pass None)."""
    leader = jax.process_index() == 0
    data = np.frombuffer(pickle.dumps(record), np.uint8) if leader else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.asarray([data.size], np.int64))[0])
    buf = np.zeros(max(1024, 1 << (n - 1).bit_length()), np.uint8)  # a power of two: few programs to compile
    buf[: data.size] = data
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes())


class _Leader:
    def __init__(self, engine, heartbeat: float):
        if getattr(engine, "prefix", None):
            raise ValueError(
                "several processes: the prefix cache is not replayed (prefix_cache_bytes must be 0)"
            )
        if heartbeat < 0:
            raise ValueError(f"heartbeat={heartbeat}: seconds >= 0 (0: no heartbeat)")
        self.next = 0
        self.handles: dict[int, tuple[int, weakref.ref]] = {}  # id(array) -> (handle, weak reference)
        self.dropped: list[int] = []
        for x in engine.programs.held():
            self._register(x)
        self.lock = threading.RLock()  # one record (and its program's dispatch) at a time
        self.stopped = threading.Event()
        self.last = time.monotonic()  # when the last record went out
        self.beats = None
        if heartbeat:
            self.beats = threading.Thread(
                target=self._beat, args=(heartbeat,), name="multihost-heartbeat", daemon=True
            )
            self.beats.start()

    def _send(self, record) -> None:
        """Broadcasts `record` (hold the lock)."""
        _broadcast(record)
        self.last = time.monotonic()

    def _beat(self, every: float) -> None:
        """A no-op record whenever none went out for half of `every` seconds (at most `every` without one)."""
        while not self.stopped.wait(every / 2):
            with self.lock:
                if self.stopped.is_set():
                    return
                if time.monotonic() - self.last >= every / 2:
                    self._send((_BEAT,))

    def stop(self) -> None:
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
            self._send((_STOP,))
        if self.beats is not None:
            self.beats.join()

    def _register(self, x: jax.Array) -> None:
        h, self.next = self.next, self.next + 1
        key = id(x)
        self.handles[key] = (h, weakref.ref(x, lambda _, key=key, h=h: self._gone(key, h)))

    def _gone(self, key: int, h: int) -> None:
        if self.handles.get(key, (None,))[0] == h:
            del self.handles[key]
        self.dropped.append(h)

    def _encode(self, x):
        if isinstance(x, jax.Array):
            entry = self.handles.get(id(x))
            if entry is not None and entry[1]() is x:
                return ("h", entry[0])
            if not x.is_fully_addressable:
                raise ValueError("a device array spanning processes that no announced program produced")
            return ("v", np.asarray(x))
        return ("v", x)

    def call(self, key: tuple, fn, args, kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        with self.lock:
            if self.stopped.is_set():
                raise RuntimeError(
                    f"{'.'.join(map(str, key))}: called after multihost.stop (the followers are gone)"
                )
            dropped, self.dropped = self.dropped, []
            self._send((_CALL, key, tree, [self._encode(x) for x in leaves], dropped))
            out = fn(*args, **kwargs)
        for x in jax.tree.leaves(out):
            if isinstance(x, jax.Array):
                self._register(x)
        return out


class _Proxy:
    """A named program whose calls are announced first (`Engine.compiled_programs` still counts its cache)."""

    def __init__(self, leader: _Leader, key: tuple, fn):
        self.leader, self.key, self.fn = leader, key, fn

    def __call__(self, *args, **kwargs):
        return self.leader.call(self.key, self.fn, args, kwargs)

    def _cache_size(self) -> int:
        return self.fn._cache_size()


def lead(engine, heartbeat: float = HEARTBEAT_S) -> None:
    """Process 0: every jitted program of `engine` is announced to the other processes before it runs; with no
    record for `heartbeat` seconds (0: never), a no-op one goes out (module docstring: the collectives' timeout)."""
    leader = _Leader(engine, heartbeat)
    fns = engine.programs.fns
    for key, fn in list(fns.items()):
        fns[key] = _Proxy(leader, key, fn)
    engine._multihost_leader = leader


def stop(engine) -> None:
    """Process 0: the followers return from `follow` (at the end; once the engine's program calls are over, a
    call in flight finishes first; a second call does nothing)."""
    leader = getattr(engine, "_multihost_leader", None)
    if leader is None:
        raise ValueError("multihost.stop: the engine is not led (call multihost.lead(engine) first)")
    leader.stop()


class Followed(NamedTuple):
    calls: int  # program calls replayed
    beats: int  # the idle leader's no-op records


def follow(engine) -> Followed:
    """Every process but 0: replays the leader's program calls on `engine` until `stop`; returns their counts."""
    programs = dict(engine.programs.fns)
    held = engine.programs.held()
    table, nxt, n, beats = dict(enumerate(held)), len(held), 0, 0
    while True:
        record = _broadcast(None)
        if record[0] == _STOP:
            return Followed(n, beats)
        if record[0] == _BEAT:
            beats += 1
            continue
        _, key, tree, leaves, dropped = record
        for h in dropped:
            table.pop(h, None)
        args, kwargs = jax.tree.unflatten(tree, [table[v] if k == "h" else v for k, v in leaves])
        out = programs[key](*args, **kwargs)
        for x in jax.tree.leaves(out):
            if isinstance(x, jax.Array):
                table[nxt], nxt = x, nxt + 1
        n += 1
