"""A request's life in the serving engine (glm53.serving.engine) apart from the device: `Intake`, the thread-safe
table of live requests (submit, cancel, drain, abort), `advance`, a request's own rules after each new token, and
the errors that failures end requests with.

Live requests: submitted and not yet ended (waiting, held for the next prefill group, prefilling, running). The
engine accepts a request while fewer than `capacity` (its slots + max_queue) are live: a burst of that many on an
idle engine is all accepted (they wait here until the engine thread admits them) and the next one is refused
(`QueueFull`). A request leaves the live set the moment it is cancelled or aborted (its place is free at once) or
when its terminal event is sent. Every request gets exactly one terminal event (finish_reason set), always from
the engine thread: a cancel or an abort only records the end here, and the engine thread sends it at its next
step (`ends`). After `drain`, `add` raises `Closed` (the server is shutting down); live requests go on.

Failures (no request can hurt another, every failure is said):
  * a request's own host-side work (its detokenization and stop strings, `until`, its constraint's mask, its
    think budget, its sink) raising ends that request alone, with finish_reason "error" and an error naming
    what failed (`own_error`);
  * a device program shared by several requests raising ends those it served (a prefill group's members; for the
    decode, insert, move and put steps, which write the shared cache, every request in a slot, and the cache is
    rebuilt) with an error that carries neither the exception's text nor anything of another request
    (`shared_error`). The exception and its traceback are logged once (logger "glm53.serving", `log`) with the
    ids of the requests it ended.
"""

from __future__ import annotations

import collections
import logging
import threading

from glm53.serving.admit import Seq
from glm53.serving.request import Closed, QueueFull

log = logging.getLogger("glm53.serving")


class OwnFailure(Exception):
    """A request's own host-side work (`what`) raised (the exception is its __cause__)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def advance(seq: Seq, tok: int, max_len: int) -> tuple[str | None, str, str | None]:
    """A request's rules after its new token `tok` (already in seq.generated): its think budget, detokenization
    and stop strings, `until`, max_tokens and the context. (finish reason or None, the text to send, the stop
    string that ended it). OwnFailure naming the part that raised."""
    what = "think budget"
    try:
        if seq.req.think_budget is not None and not seq.think_done:
            n, close = seq.req.think_budget
            seq.think_done = seq.generated[-len(close) :] == list(close)
            if not seq.think_done and not seq.forced and len(seq.generated) >= n:
                seq.forced = list(close)
        what = "detokenization"
        if tok in seq.eos:
            return "stop", seq.stop.flush(), None
        text, hit = seq.stop.push(tok)
        if hit is not None:
            return "stop", text, hit
        what = "until"
        if seq.req.until is not None and seq.req.until(seq.stop.text):
            return "stop", text + seq.stop.flush(), None
        if len(seq.generated) >= seq.req.max_tokens or len(seq.req.prompt) + len(seq.generated) >= max_len:
            return "length", text + seq.stop.flush(), None
        return None, text, None
    except Exception as e:
        raise OwnFailure(what) from e


def shared_error(step: str) -> str:
    """The error of a request ended by a failed program it shared with others (nothing of theirs, nor the
    exception's text)."""
    return f"internal error: the engine's {step} failed (see the server log)"


def own_error(what: str, e: BaseException) -> str:
    """The error of a request ended by its own host-side work (`what`: e.g. "constraint", "until")."""
    return f"internal error: this request's {what} raised {type(e).__name__} (see the server log)"


class Intake:
    """The live requests, thread-safe: `add` / `cancel` / `abort_all` / `drain` from any thread; `take`, `untake`,
    `ends` and `release` from the engine thread."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._waiting: collections.deque[Seq] = collections.deque()  # not yet taken by the engine thread
        self._live: dict[str, Seq] = {}
        # (request, finish_reason, error): sent at the engine thread's next step
        self._ends: list[tuple[Seq, str, str | None]] = []
        self._closed = False
        self._ids = 0
        self.wake = threading.Event()  # set on every change the engine thread should see

    def add(self, seq: Seq) -> str:
        """Makes `seq` live and waiting; its id (assigned when the request has none). Closed after `drain`,
        QueueFull at capacity, ValueError for the id of a live request."""
        with self._lock:
            if self._closed:
                raise Closed("the server is shutting down: it accepts no new requests")
            if len(self._live) >= self.capacity:
                raise QueueFull(f"the queue is full ({len(self._live)} requests running or waiting; the engine "
                                f"holds {self.capacity})")  # fmt: skip
            rid = seq.req.id
            if rid and rid in self._live:
                raise ValueError(f"id={rid!r}: a live request already has this id")
            while not rid or rid in self._live:
                self._ids += 1
                rid = f"req-{self._ids}"
            seq.req.id = rid
            self._live[rid] = seq
            self._waiting.append(seq)
        self.wake.set()
        return rid

    def cancel(self, rid: str) -> bool:
        """Ends a live request as "cancelled" (its place is free at once; the event follows at the engine thread's
        next step). False when no live request has this id (unknown, or already ended)."""
        return self._end(rid, "cancelled", None)

    def _end(self, rid: str, reason: str, error: str | None) -> bool:
        with self._lock:
            seq = self._live.pop(rid, None)
            if seq is None:
                return False
            try:
                self._waiting.remove(seq)  # Seq compares by identity
            except ValueError:
                pass  # taken by the engine thread already
            self._ends.append((seq, reason, error))
        self.wake.set()
        return True

    def abort_all(self, message: str) -> int:
        """Ends every live request with finish_reason "error" and `message` (sent at the engine thread's next
        step); how many."""
        with self._lock:
            seqs = list(self._live.values())
            self._live.clear()
            self._waiting.clear()
            self._ends.extend((s, "error", message) for s in seqs)
        self.wake.set()
        return len(seqs)

    def drain(self) -> None:
        """From now on `add` raises Closed."""
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def take(self) -> Seq | None:
        """Engine thread: the oldest waiting request (None when none)."""
        with self._lock:
            return self._waiting.popleft() if self._waiting else None

    def untake(self, seq: Seq) -> None:
        """Engine thread: puts a taken request back at the head of the queue (unless it ended meanwhile)."""
        with self._lock:
            if self._live.get(seq.req.id) is seq:
                self._waiting.appendleft(seq)

    def ends(self) -> list[tuple[Seq, str, str | None]]:
        """Engine thread: the ends recorded since the last call (cancels, aborts), oldest first."""
        with self._lock:
            out, self._ends = self._ends, []
        return out

    def release(self, seq: Seq) -> None:
        """Engine thread: `seq` ended (its terminal event is being sent): no longer live."""
        with self._lock:
            if self._live.get(seq.req.id) is seq:
                del self._live[seq.req.id]

    def taken(self) -> list[Seq]:
        """The live requests the engine thread has taken (held, prefilling, running)."""
        with self._lock:
            waiting = {id(s) for s in self._waiting}
            return [s for s in self._live.values() if id(s) not in waiting]

    @property
    def live(self) -> int:
        """Live requests (waiting, held, prefilling, running)."""
        with self._lock:
            return len(self._live)

    @property
    def waiting(self) -> int:
        """Live requests not yet taken by the engine thread."""
        with self._lock:
            return len(self._waiting)

    @property
    def pending(self) -> bool:
        """Whether ends wait for the engine thread."""
        with self._lock:
            return bool(self._ends)
