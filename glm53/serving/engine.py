"""Continuous batching: B slots of one fixed-shape jitted decode step that requests join and leave freely.

The device programs are one `glm53.runtime.programs.Programs` (`programs`: decode per width, prefill, insert,
put / move, cache init; its docstring says what each does), all compiled once at `warmup` (`compiled_programs`
counts them). New requests take the lowest free slot and each step runs the smallest decode width covering the
highest busy slot (idle slots above it cost nothing; `move`: a busy slot's rows copied into a free lower one, when
that allows a narrower step). New requests are fed, a chunk per engine step between decode steps, into a staging
cache of w rows, up to max(prefill_widths) requests of one chunk plan together (glm53.serving.admit; the prefill
methods are glm53.serving.prefill's `Prefill`, a base of `Engine`); a prompt is
split into bucket-sized chunks, largest first (buckets include 1: no chunk is ever padded); insert writes the
staging rows over their slots and samples each first token.
Options: `prefix_cache_bytes` > 0: a prompt sharing whole blocks of `prefix_block` tokens with an earlier one
resumes from their snapshots (glm53.serving.prefix; chunks then end on block boundaries, 4 more programs);
`speculative=True`: the decode step verifies each slot's MTP draft (glm53.runtime.speculative: the programs'
speculative variant, which also keeps the MTP cache).
Constrained decoding (`Request.constraint`, glm53.serving.constrain): the decode and insert programs always take a
bool mask [B, V] / [1, V] of the allowed next tokens (all true, already on the device, when no slot is constrained).
One host transfer of all slots' tokens per decode step. Stops: EOS ids, stop strings (on the detokenized text;
text that may begin a stop string is held back), max_tokens, the cache's length, cancellation (frees the slot).
Requests (glm53.serving.lifecycle): `submit`, `cancel`, `drain`, `abort_all` and the counters are thread-safe;
`step` runs in one thread (the engine thread, `run`). At most slots + max_queue requests are live (waiting or
in a slot; `QueueFull` past it); a cancelled or aborted request frees its place at once. Every request gets
exactly one terminal event. Failures end only the requests they concern: a request's own host-side work
raising ends it alone; a failed prefill chunk ends its group; a failed decode / insert / move step ends every
request in a slot (the cache is rebuilt); the errors they receive never carry another request's data or a
shared step's exception, which is logged once (logger "glm53.serving") with the ids of the requests it ended.
"""

from __future__ import annotations

import collections
import numbers
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm53.model import Glm53Model
from glm53.runtime.programs import Programs, widths
from glm53.serving.admit import Group, Seq, mask_rows, sampling_args, width_for
from glm53.serving.lifecycle import Intake, OwnFailure, advance, log, own_error, shared_error
from glm53.serving.limits import Limits
from glm53.serving.prefill import Prefill
from glm53.serving.prefix import PrefixCache
from glm53.serving.request import Closed, Event, QueueFull, Request, Sink, check_request  # noqa: F401 - the API
from glm53.serving.slotpages import SlotPages
from glm53.serving.text import StopText


class Engine(Prefill):
    """B slots over one model. `detokenize(ids) -> str` turns generated ids into text (None: no text, no stop
    strings). compiler_options go to every `jax.jit` (e.g. {"xla_backend_optimization_level": 0}: faster
    compiles for tests), on CPU on top of `glm53.runtime.programs.CPU_OPTIONS` (prefill: XLA's defaults). decode_widths: the decode step's
    widths (None: 1, 2, 4, ..., slots; a sharded model: slots only). Not thread-safe except `submit`, `cancel`, `drain`,
    `abort_all` and the counters; drive it with `step` / `run`.
    prefix_cache_bytes: the prefix cache's byte budget (0: off), prefix_block its block (tokens, a multiple of
    index_kpool); speculative: MTP speculative decoding (the model needs its MTP block). mesh / rules: the mesh
    and rule set a sharded model was placed with (caches are created in the rules' shardings).
    prefill_batch: the most requests prefilled together (None: min(slots, 8); a sharded model: 1), in groups of
    the widths 1, 2, 4, ..., prefill_batch, for chunks of at most prefill_batch_chunk tokens (glm53.serving.admit).
    max_queue: live requests beyond the slots (waiting); limits: what a request may ask for (its stop strings).
    cache_tokens: serve at a token budget (paged DSA caches, docs/serving.md "Paged caches"): every DSA layer's
    cache is one pool of ceil(cache_tokens / page_tokens) pages shared by the slots (plus a scratch page), a
    request may grow up to max_len tokens while pages last, waits for pages when none are free and finishes with
    "length" when it cannot grow; None: every slot owns max_len positions (contiguous). page_tokens: the page
    size (None: prefix_block; a multiple of index_kpool; the prefix cache's block is the page)."""

    def __init__(
        self,
        model: Glm53Model,
        *,
        slots: int = 4,
        max_len: int = 512,
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
        eos_ids: Sequence[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        max_queue: int = 64,
        compiler_options: dict | None = None,
        prefix_cache_bytes: int = 0,
        prefix_block: int = 16,
        speculative: bool = False,
        decode_widths: Sequence[int] | None = None,
        mesh=None,
        rules="tp",
        prefill_batch: int | None = None,
        prefill_batch_chunk: int = 64,
        limits: Limits | None = None,
        cache_tokens: int | None = None,
        page_tokens: int | None = None,
    ):
        for name, v, lo in (("slots", slots, 1), ("max_len", max_len, 2), ("max_queue", max_queue, 1),
                            ("prefill_batch_chunk", prefill_batch_chunk, 1)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
                raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
        buckets = sorted(set(buckets))
        if not buckets or buckets[0] != 1 or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(
                f"buckets={buckets!r}: positive integers including 1 (so any length splits exactly)"
            )
        if limits is not None and not isinstance(limits, Limits):
            raise ValueError(f"limits={limits!r}: a glm53.serving.limits.Limits")
        self.limits = Limits() if limits is None else limits
        self.cfg = model.cfg
        self.speculative = bool(speculative)
        self.slots, self.max_len, self.buckets = slots, max_len, tuple(buckets)
        prefill_batch = (min(slots, 8) if mesh is None else 1) if prefill_batch is None else prefill_batch
        if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= slots:
            raise ValueError(f"prefill_batch={prefill_batch!r}: must be an integer in [1, slots={slots}]")
        self.prefill_batch_chunk = prefill_batch_chunk
        self.paging, self.page_bytes = None, 0
        if cache_tokens is not None:
            self.paging = SlotPages(slots=slots, max_len=max_len, cache_tokens=cache_tokens,
                                    page_tokens=page_tokens or prefix_block, kpool=self.cfg.index_kpool,
                                    speculative=speculative, sharded=mesh is not None,
                                    prefix_cache_bytes=prefix_cache_bytes, prefix_block=prefix_block)  # fmt: skip
        pages = self.paging.spec if self.paging else None
        self.programs = Programs(model, slots=slots, max_len=max_len, decode_widths=decode_widths,
                                 prefill_widths=widths(prefill_batch), speculative=speculative,
                                 compiler_options=compiler_options, mesh=mesh, rules=rules, pages=pages)  # fmt: skip
        self.decode_widths, self.prefill_widths = self.programs.decode_widths, self.programs.prefill_widths
        if self.paging:  # one page: every DSA layer's rows of page_tokens positions
            self.page_bytes = sum(int(a.nbytes) for a in jax.tree.leaves(self.programs.pool)) // self.pool.num_pages
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.detokenize = detokenize
        self.stats = collections.Counter()  # steps, tokens, prefill_tokens, requests, finished, refused, ...
        self.prefix = None
        if prefix_cache_bytes:
            self.prefix = PrefixCache(block=prefix_block, budget=prefix_cache_bytes, kpool=self.cfg.index_kpool,
                                      with_mtp=self.speculative, jit=self.programs.jit, stats=self.stats,
                                      pages=self.pool, page_bytes=self.page_bytes)  # fmt: skip
        self.max_queue = max_queue
        self._intake = Intake(slots + max_queue)  # the live requests (thread-safe)
        self._active: dict[int, Seq] = {}
        self._group: Group | None = None  # the requests being prefilled
        self._tokens = np.zeros(slots, np.int32)
        self._drafts = np.zeros(slots, np.int32)  # speculative: each slot's draft of the token after its next
        self._true: dict[int, jax.Array] = {}  # n -> the all-true mask [n, V] (no slot constrained)
        self.warm = False

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + generated) one request may hold: max_len, on pages also what the pool holds."""
        return self.max_len if self.paging is None else self.paging.context_limit

    @property
    def pool(self):
        """The page pool (glm53.serving.pages.PagePool) of a paged engine, else None."""
        return None if self.paging is None else self.paging.pool

    # ------------------------------------------------------------------------------------------- programs
    @property
    def cache(self):
        """The slots' cache (the programs' `cache`)."""
        return self.programs.cache

    def compiled_programs(self) -> int:
        """Programs compiled so far (`Programs.compiled` and the prefix cache's): constant after `warmup`."""
        return self.programs.compiled() + sum(f._cache_size() for f in (self.prefix.programs if self.prefix else ()))

    def warmup(self, log: Callable[[str], None] | None = None) -> float:
        """Compiles every program once (a line per program to `log`); returns the seconds it took."""
        t0 = time.perf_counter()
        staged = None
        if self.prefix:
            def staged(staging, h):
                jax.block_until_ready(self.prefix.warmup(staging, h if self.speculative else None))
        self.programs.warmup(self.buckets, self.prefill_batch_chunk, log, staged)
        self.warm = True
        dt = time.perf_counter() - t0
        if log:
            log(f"engine warm: {self.compiled_programs()} programs in {dt:.1f} s")
        return dt

    # ---- constrained decoding (Request.constraint): a bool mask [n, V] per step; no slot constrained: the
    # all-true mask already on the device (no transfer). Every program always takes it: no program added.
    # A row whose constraint raises ends that request alone ("error"); its row stays all true.
    def _masks(self, seqs) -> jax.Array:
        m = mask_rows(seqs, self.cfg.vocab_size, lambda s, e: self._fail_own(s, "constraint", e))
        if m is not None:
            return jnp.asarray(m)  # a device array like the all-true one (a numpy one would be another program)
        if len(seqs) not in self._true:
            self._true[len(seqs)] = jnp.ones((len(seqs), self.cfg.vocab_size), bool)
        return self._true[len(seqs)]

    # ------------------------------------------------------------------------------------------- requests
    def check(self, req: Request) -> None:
        """ValueError naming the field when the request cannot run on this engine."""
        check_request(req, self.cfg.vocab_size, self.context_limit, self.detokenize is not None, self.limits)

    def submit(self, req: Request, sink: Sink) -> str:
        """Queues a request (thread-safe); returns its id. ValueError naming the field for a bad request, Closed
        after `drain`, QueueFull when slots + max_queue requests are live. `sink` receives the request's events
        in the engine thread, the last one with finish_reason set (exactly one such event per request)."""
        self.check(req)
        seq = Seq(req, sink, -1, frozenset(self.eos_ids if req.eos_ids is None else req.eos_ids),
                  StopText(req.stop, self.detokenize), t_submit=time.perf_counter())  # fmt: skip
        try:
            rid = self._intake.add(seq)
        except QueueFull:
            self.stats["refused"] += 1
            raise
        self.stats["requests"] += 1
        return rid

    def cancel(self, request_id: str) -> None:
        """Stops a request (thread-safe): it stops counting against the queue at once; its slot is freed and its
        sink gets one "cancelled" event at the engine thread's next step. An unknown or ended id: nothing."""
        self._intake.cancel(request_id)

    def drain(self) -> None:
        """Shutting down (thread-safe): from now on `submit` raises Closed; waiting and running requests go on."""
        self._intake.drain()

    def abort_all(self, message: str) -> int:
        """Ends every live request (waiting, prefilling, running; thread-safe) with finish_reason "error" and
        `message` as its error, at the engine thread's next step; returns how many. New requests are still
        accepted unless `drain` was called."""
        return self._intake.abort_all(message)

    @property
    def live_requests(self) -> int:
        """Requests submitted and not yet ended: waiting, held, prefilling, running (thread-safe)."""
        return self._intake.live

    @property
    def queue_depth(self) -> int:
        """Live requests waiting for a slot (thread-safe)."""
        return self._intake.waiting

    @property
    def busy_slots(self) -> int:
        return len(self._active) + (len(self._group.live()) if self._group else 0)

    def idle(self) -> bool:
        return not self._active and self._group is None and not self._intake.waiting and not self._intake.pending

    # ------------------------------------------------------------------------------------------- the loop
    def _finish(self, seq: Seq, reason: str, tokens: list[int], text: str, error=None, stop=None) -> None:
        """Ends `seq` (once): frees its slot and sends its terminal event (a sink that raises is logged)."""
        if seq.done:
            return
        seq.done = True
        if self._active.get(seq.slot) is seq:
            del self._active[seq.slot]
            if self.paging:
                self.paging.clear(seq.slot)
        if self.paging:
            self.paging.end(seq)
            if self._group is not None and seq in self._group.seqs:
                self._group.dirty = True  # a prefilling member's row must stop writing into its freed pages
        if self._group is not None and seq in self._group.seqs and not self._group.live():
            self._group = None
        self._intake.release(seq)
        self.stats["finished"] += 1
        self.stats[f"finish_{reason}"] += 1
        n_prompt, n_gen = len(seq.req.prompt), len(seq.generated)
        try:
            seq.sink(Event(seq.req.id, tokens, text, reason, n_prompt, n_gen, error, stop,
                           drafted=seq.drafted, accepted=seq.accepted, prefix_tokens=seq.resumed))  # fmt: skip
        except Exception:  # noqa: BLE001 - its own sink: nothing more can be told to it
            log.exception("request %s: its sink raised on its last event (%s)", seq.req.id, reason)

    def _fail_own(self, seq: Seq, what: str, e: Exception) -> None:
        """`seq`'s own host-side work (`what`) raised: it ends alone with "error" (logged once)."""
        if seq.done:
            return
        log.error("request %s: its %s raised; it ends with an error", seq.req.id, what, exc_info=e)
        self._finish(seq, "error", [], "", own_error(what, e))

    def _fail_shared(self, step: str, seqs, e: Exception, reset: bool = False) -> None:
        """A program shared by `seqs` raised: each ends with a generic error (the exception and their ids logged
        once); reset: the cache is rebuilt (the step had it donated, or wrote it half)."""
        seqs = list({id(s): s for s in seqs if not s.done}.values())
        log.error("the engine's %s failed; it ended requests %s", step, [s.req.id for s in seqs], exc_info=e)
        self.stats["step_failures"] += 1
        for s in seqs:
            self._finish(s, "error", [], "", shared_error(step))
        if reset:
            self.programs.reset()
            self._tokens[:], self._drafts[:] = 0, 0
            if self.paging:  # the pool was rebuilt: every slot's table is scratch again, no page is kept
                self.paging.reset()
                if self.prefix:
                    self.prefix.clear()

    def _handle_ends(self) -> None:
        """Sends the ends recorded by `cancel` / `abort_all` (frees their slots)."""
        for seq, reason, error in self._intake.ends():
            self._finish(seq, reason, [], "", error)

    def _emit(self, seq: Seq, tok: int) -> None:
        """Records a sampled token and sends what may be sent; finishes the request on a stop. The request's own
        host-side work (`lifecycle.advance`, its sink) raising ends it alone."""
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
            self.stats["ttft_ms_sum"] += int(1000 * (seq.t_first - seq.t_submit))
            self.stats["ttft_count"] += 1
        if seq.forced:
            tok = seq.forced.pop(0)
        seq.generated.append(tok)
        self.stats["tokens"] += 1
        self._tokens[seq.slot] = tok
        try:
            reason, text, hit = advance(seq, tok, self.max_len)
        except OwnFailure as e:
            return self._fail_own(seq, e.what, e.__cause__)
        if reason is not None:
            return self._finish(seq, reason, [tok], text, stop=hit)
        try:
            seq.sink(Event(seq.req.id, [tok], text))
        except Exception as e:  # noqa: BLE001 - its own sink: it ends this request only
            self._fail_own(seq, "sink", e)

    def _compact(self) -> None:
        """Moves the highest busy slot into the lowest free one while that allows a narrower decode step (a
        prefilling request's reserved slot is simply reassigned: its rows are written at insert)."""
        pre = {s.slot: s for s in self._group.live()} if self._group else {}
        while True:
            busy = set(self._active) | set(pre)
            top, free = max(busy), min(set(range(self.slots)) - busy, default=self.slots)
            if free > top or width_for(len(busy), self.decode_widths) >= width_for(top + 1, self.decode_widths):
                return
            if top in pre:
                seq = pre.pop(top)
                seq.slot, pre[free] = free, seq
                continue
            seq = self._active.pop(top)
            self.programs.move(top, free)
            if self.paging:  # the table moved with the rows; the old slot's goes back to scratch
                self.paging.moved(top, free)
            self._tokens[free], self._drafts[free], seq.slot = self._tokens[top], self._drafts[top], free
            self._active[free] = seq
            self.stats["slot_moves"] += 1

    def _decode_step(self) -> None:
        try:  # the decode, move and put programs write the shared cache: a failure ends every request in a slot
            if len(self.decode_widths) > 1:
                self._compact()
        except Exception as e:  # noqa: BLE001
            return self._fail_shared("slot move", list(self._active.values()), e, reset=True)
        if self.paging:  # pages for the positions this step writes; a stream that cannot grow ends "length"
            for seq in self.paging.grow(self._active):
                self.stats["finish_out_of_pages"] += 1
                self._finish(seq, "length", [], seq.stop.flush())
            if not self._active:
                return
        b = width_for(max(self._active) + 1, self.decode_widths)  # the smallest width covering the busy slots
        self.stats[f"decode_width_{b}"] += 1
        seqs = [self._active.get(i) for i in range(b)]
        mask = self._masks(seqs)  # a row whose constraint raises ends (that request only)
        seqs = [None if s is None or s.done else s for s in seqs]
        active = np.asarray([s is not None for s in seqs])
        counts = np.asarray([0 if s is None else len(s.generated) for s in seqs], np.int32)
        drafts = self._drafts[:b].copy()
        verify = np.asarray([s is not None and s.req.temperature <= 0 and not s.forced
                             and s.req.constraint is None for s in seqs])  # fmt: skip
        t0 = time.perf_counter()
        try:
            if self.paging:  # tables changed since the last step: one upload
                self.paging.upload(self.programs)
            args = sampling_args(seqs, b, self.cfg.vocab_size)
            out = self.programs.decode(self._tokens[:b], drafts, active, verify, mask, counts, args)  # to the host
        except Exception as e:  # noqa: BLE001
            return self._fail_shared("decode step", list(self._active.values()), e, reset=True)
        self.stats["decode_us"] += int(1e6 * (time.perf_counter() - t0))
        self.stats["steps"] += 1
        for i, s in enumerate(seqs):
            if s is None:
                continue
            if not self.speculative:
                self._emit(s, int(out[i]))
                continue
            y0, y1, acc, self._drafts[i] = (int(v) for v in out[i])
            if verify[i]:
                s.drafted, s.accepted = s.drafted + 1, s.accepted + acc
                self.stats["mtp_drafted"] += 1
                self.stats["mtp_accepted"] += acc
            for tok in (drafts[i], y1) if acc else (y0,):
                if self._active.get(i) is s:  # a stop on the first token drops the second
                    self._emit(s, int(tok))

    def step(self) -> bool:
        """One round: cancellations and aborts, admission, one prefill chunk, one decode step. False when idle.
        A program's failure ends the requests it concerns (module docstring) and the step returns normally."""
        self._handle_ends()
        self._admit()
        if self._group is None and not self._active:
            return False
        if self._group is not None:
            self._prefill_chunk()
        if self._active:
            self._decode_step()
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step() and self.idle():
                return
        raise RuntimeError(f"the engine did not finish in {max_steps} steps")

    def run(self, stop: threading.Event) -> None:
        """The engine thread's loop: steps while there is work, sleeps on new work until `stop` is set. An
        exception escaping a step (a bug) ends the requests the engine thread holds (generic error, logged once;
        the cache is rebuilt) and the engine keeps serving. Once `stop` is set: no new request is accepted
        (`drain`), the pending cancels and aborts are sent, every request still live ends with an error, and it
        returns: no request is left without its terminal event."""
        wake = self._intake.wake
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                self._step_failed(e)
                busy = False
            if not busy:
                wake.wait(0.05)
                wake.clear()
        self.drain()
        self._handle_ends()
        self.abort_all("internal error: the server stopped before this request finished")
        self._handle_ends()

    def _step_failed(self, e: Exception) -> None:
        seqs = list(self._active.values()) + (self._group.live() if self._group else []) + self._intake.taken()
        self._group = None
        try:
            self._fail_shared("step", seqs, e, reset=True)
        except Exception:  # noqa: BLE001 - the cache could not be rebuilt: the next step will say so again
            log.exception("the engine could not rebuild its cache")


def generate(engine: Engine, requests: Sequence[Request]) -> list[list[int]]:
    """Runs `requests` to completion on `engine` (in this thread); the new token ids of each."""
    out: dict[str, list[int]] = {}
    for r in requests:
        rid = engine.submit(r, lambda ev: out.setdefault(ev.request_id, []).extend(ev.token_ids))
        out.setdefault(rid, [])
    engine.run_until_idle()
    return [out[r.id] for r in requests]
