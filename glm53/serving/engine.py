"""Continuous batching: B slots of one fixed-shape jitted decode step that requests join and leave freely.

Programs (all compiled once, at `warmup`; `compiled_programs` counts them; built in glm53.serving.programs):
  * decode [b] for each width b in `decode_widths` (default 1, 2, 4, ..., B): one token for each of the first b
    slots (tokens [b] in, next tokens [b] out), the cache donated; per-slot sampling on device (temperature,
    top-p, top-k, a key from (seed, token index)); inactive slots are masked (their length does not advance,
    their tokens are ignored), so a slot's rows hold garbage until it is reused. New requests take the lowest
    free slot and each step runs the smallest width covering the highest busy slot (idle slots above it cost
    nothing; a narrower step returns its b rows, which `put` writes back); move: a busy slot's rows copied
    into a free lower one, when that allows a narrower step;
  * prefill [w, C] per bucket C: new requests are fed, a chunk per engine step between decode steps, into a
    staging cache of w rows, up to max(prefill_widths) requests of one chunk plan together (glm53.serving.admit);
    a prompt is split into bucket-sized chunks, largest first (buckets include 1: no chunk is ever padded);
  * insert [w]: the staging cache's rows written over their slots' (every row and position: nothing of a slot's
    previous request survives), each first token sampled from the prefill's last logits.
Options: `prefix_cache_bytes` > 0: a prompt sharing whole blocks of `prefix_block` tokens with an earlier one
resumes from their snapshots (glm53.serving.prefix; chunks then end on block boundaries, 4 more programs);
`speculative=True`: the decode step verifies each slot's MTP draft (glm53.serving.speculative; the decode,
prefill and insert programs are its variants, which also keep the MTP cache).
Constrained decoding (`Request.constraint`, glm53.serving.constrain): the decode and insert programs always take a
bool mask [B, V] / [1, V] of the allowed next tokens (all true, already on the device, when no slot is constrained).
One host transfer of all slots' tokens per decode step. Stops: EOS ids, stop strings (on the detokenized text;
text that may begin a stop string is held back), max_tokens, the cache's length, cancellation (frees the slot).
`submit` / `cancel` are thread-safe (bounded queue: `QueueFull` when full); `step` runs in one thread.
"""

from __future__ import annotations

import collections
import functools
import numbers
import queue
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53 import parallel as S
from glm53.generate import decode_state
from glm53.model import Glm53Model
from glm53.serving import programs as P
from glm53.serving import speculative as spec
from glm53.serving.admit import Group, Seq, groupable, mask_rows, sampling_args, width_for
from glm53.serving.prefix import PrefixCache, chunk_plan
from glm53.serving.request import Event, QueueFull, Request, Sink, check_request  # noqa: F401 - the engine's API
from glm53.serving.text import StopText


class Engine:
    """B slots over one model. `detokenize(ids) -> str` turns generated ids into text (None: no text, no stop
    strings). compiler_options go to every `jax.jit` (e.g. {"xla_backend_optimization_level": 0}: faster
    compiles for tests), on CPU on top of `programs.CPU_OPTIONS`. decode_widths: the decode step's widths
    (None: 1, 2, 4, ..., slots; a sharded model: slots only). Not thread-safe except `submit`, `cancel` and the
    counters; drive it with `step` / `run`.
    prefix_cache_bytes: the prefix cache's byte budget (0: off), prefix_block its block (tokens, a multiple of
    index_kpool); speculative: MTP speculative decoding (the model needs its MTP block). mesh / rules: the mesh
    and rule set a sharded model was placed with (caches are created in the rules' shardings).
    prefill_batch: the most requests prefilled together (None: min(slots, 8); a sharded model: 1), in groups of
    the widths 1, 2, 4, ..., prefill_batch, for chunks of at most prefill_batch_chunk tokens (glm53.serving.admit)."""

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
        if speculative and model.mtp is None:
            raise ValueError("speculative=True: the model has no MTP block (build it with with_mtp=True)")
        self.cfg = model.cfg
        self.speculative = bool(speculative)
        self.slots, self.max_len, self.buckets = slots, max_len, tuple(buckets)
        if decode_widths is None:
            decode_widths = P.widths(slots) if mesh is None else (slots,)
        self.decode_widths = P.check_widths(decode_widths, slots)
        prefill_batch = (min(slots, 8) if mesh is None else 1) if prefill_batch is None else prefill_batch
        if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= slots:
            raise ValueError(f"prefill_batch={prefill_batch!r}: must be an integer in [1, slots={slots}]")
        self.prefill_widths, self.prefill_batch_chunk = P.widths(prefill_batch), prefill_batch_chunk
        compiler_options = P.cpu_options(compiler_options)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.detokenize = detokenize
        self.graphdef, self.state = nnx.split(model)
        # decode steps read dense routed experts as per-expert views on CPU where the xla_cpu decode form runs
        # (glm53.generate.decode_state: no copy of each expert's slice); a sharded model keeps its state
        rows = 2 if self.speculative else 1  # tokens per slot in a step
        self._dstates = {b: self.state if mesh is not None else decode_state(model, self.state, b * rows)
                         for b in self.decode_widths}  # fmt: skip
        self._h_dtype = model.dtype
        self.stats = collections.Counter()  # steps, tokens, prefill_tokens, requests, finished, refused, ...
        self.prefix = None
        if prefix_cache_bytes:
            jit = functools.partial(jax.jit, compiler_options=compiler_options)
            self.prefix = PrefixCache(block=prefix_block, budget=prefix_cache_bytes, kpool=self.cfg.index_kpool,
                                      with_mtp=self.speculative, jit=jit, stats=self.stats)  # fmt: skip
        self._place = (lambda c: c) if mesh is None else (  # caches in the rules' shardings (a sharded model)
            lambda c: jax.lax.with_sharding_constraint(c, S.cache_shardings(c, mesh, rules)))  # fmt: skip
        self._rep = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._build_programs(compiler_options)
        self.cache = self._init(self.state, slots)
        self._waiting: queue.Queue = queue.Queue(maxsize=max_queue)
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled: set[str] = set()
        self._wake = threading.Event()
        self._active: dict[int, Seq] = {}
        self._held: collections.deque[Seq] = collections.deque()  # taken from the queue, not yet in a group
        self._group: Group | None = None  # the requests being prefilled
        self._tokens = np.zeros(slots, np.int32)
        self._drafts = np.zeros(slots, np.int32)  # speculative: each slot's draft of the token after its next
        self._ids = 0
        self._true: dict[int, jax.Array] = {}  # n -> the all-true mask [n, V] (no slot constrained)
        self.warm = False

    # ------------------------------------------------------------------------------------------- programs
    def _build_programs(self, compiler_options):
        gd = self.graphdef
        jit = functools.partial(jax.jit, compiler_options=compiler_options)

        def keys(seeds, counts):
            return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counts)

        decode, prefill, insert = (spec if self.speculative else P).build(gd, keys)
        if self._rep is not None:  # sharded: outputs placed as the inputs come (no second compile per program)
            decode, prefill, insert = (functools.partial(P.placed, f, self._place, self._rep)
                                       for f in (decode, prefill, insert))  # fmt: skip
        d, dt = self.cfg.hidden_size, self._h_dtype  # a fresh staging's h [w, 1, D], where prefill's h lives
        self._h0 = {w: jit(lambda w=w: jnp.zeros((w, 1, d), dt), out_shardings=self._rep) for w in self.prefill_widths}
        self._prefill, self._insert = jit(prefill, donate_argnums=(1,)), jit(insert, donate_argnums=(1,))
        self._decodes = {b: jit(P.narrow(decode, b)) for b in self.decode_widths[:-1]}  # then `put`
        self._decodes[self.slots] = jit(decode, donate_argnums=(1,))
        # fresh functions: jit's cache, which `compiled_programs` counts, is per function (not per engine)
        self._move = jit(lambda cache, src, dst: P.move(cache, src, dst), donate_argnums=(0,))
        self._put = jit(lambda cache, rows: P.put(cache, rows), donate_argnums=(0,))
        self._init = jit(
            lambda state, b: self._place(nnx.merge(gd, state).init_cache(b, self.max_len)), static_argnums=(1,)
        )

    def compiled_programs(self) -> int:
        """Programs compiled so far (decode per width, put per narrower width, move, prefill per (prefill width,
        bucket), insert, cache init and fresh h per prefill width, the prefix cache's four and two more per prefill
        width > 1): constant after `warmup`."""
        extra = (*self._decodes.values(), *self._h0.values(), *(self.prefix.programs if self.prefix else ()))
        extra += (self._move, self._put) if len(self.decode_widths) > 1 else ()
        return sum(f._cache_size() for f in (self._prefill, self._insert, self._init, *extra))

    def warmup(self, log: Callable[[str], None] | None = None) -> float:
        """Compiles every program once (a line per program to `log`); returns the seconds it took."""
        t0 = time.perf_counter()
        for b in self.decode_widths:
            t, z, none = time.perf_counter(), np.zeros(b, bool), [None] * b
            self._run_decode(z, z, self._masks(none), np.zeros(b, np.int32), sampling_args(none, b))
            if log:
                log(f"compiled decode [{b} slots{', speculative' if self.speculative else ''}] "
                    f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
        for w in self.prefill_widths:
            g = Group([], w, self._init(self.state, w), [], h=self._h0[w]())
            for c in self.buckets if w == 1 else [c for c in self.buckets if c <= self.prefill_batch_chunk]:
                t = time.perf_counter()
                logits, g.h, g.staging = self._prefill(self.state, g.staging, np.zeros((w, c), np.int32), g.h)
                jax.block_until_ready(logits)
                if log:
                    log(f"compiled prefill chunk {c}" + (f" x {w} requests" if w > 1 else "")
                        + f" ({time.perf_counter() - t:.1f} s)")  # fmt: skip
            if self.prefix:
                jax.block_until_ready(self.prefix.warmup(g.staging, g.h if self.speculative else None))
            g.staging, g.h = self._init(self.state, w), self._h0[w]()  # fresh: the warm-up chunks may pass max_len
            self._run_insert(g, logits)
        if len(self.decode_widths) > 1:
            self.cache = self._move(self.cache, 0, 0)
        self.warm = True
        dt = time.perf_counter() - t0
        if log:
            log(f"engine warm: {self.compiled_programs()} programs in {dt:.1f} s")
        return dt

    def _run_insert(self, g: Group, logits) -> list[int]:
        """Writes the group's live rows into their slots; their first tokens (draft kept per slot)."""
        rows = [None if s is None or s.cancelled else s for s in g.seqs + [None] * (g.width - len(g.seqs))]
        slots = np.asarray([-1 if s is None else s.slot for s in rows], np.int32)
        args = self._masks(rows), *sampling_args(rows, g.width)
        out, self.cache = self._insert(self.state, self.cache, g.staging, slots, logits, g.h, *args)
        out = np.asarray(out)
        for s, (_, draft) in zip(rows, out):
            if s is not None:
                self._drafts[s.slot] = draft
        return [int(t) for t in out[:, 0]]

    def _run_decode(self, active, verify, mask, counts, args) -> np.ndarray:
        """The step of width b = len(active) over the first b slots: tokens [b] (plain), or rows (y0, y1,
        accepted, next draft) [b, 4] (speculative): the host transfer."""
        b = len(active)
        a = (self._dstates[b], self.cache, self._tokens[:b], self._drafts[:b], active, verify, mask, counts, *args)
        out, new = self._decodes[b](*a)
        self.cache = new if b == self.slots else self._put(self.cache, new)
        return np.asarray(out)

    # ---- constrained decoding (Request.constraint): a bool mask [n, V] per step; no slot constrained: the
    # all-true mask already on the device (no transfer). Every program always takes it: no program added.
    def _masks(self, seqs) -> jax.Array:
        m = mask_rows(seqs, self.cfg.vocab_size)
        if m is not None:
            return jnp.asarray(m)  # a device array like the all-true one (a numpy one would be another program)
        if len(seqs) not in self._true:
            self._true[len(seqs)] = jnp.ones((len(seqs), self.cfg.vocab_size), bool)
        return self._true[len(seqs)]

    # ------------------------------------------------------------------------------------------- requests
    def check(self, req: Request) -> None:
        """ValueError naming the field when the request cannot run on this engine."""
        check_request(req, self.cfg.vocab_size, self.max_len, self.detokenize is not None)

    def submit(self, req: Request, sink: Sink) -> str:
        """Queues a request (thread-safe); returns its id. ValueError for a bad request, QueueFull when full."""
        self.check(req)
        if not req.id:
            self._ids += 1
            req.id = f"req-{self._ids}"
        seq = Seq(req, sink, -1, frozenset(self.eos_ids if req.eos_ids is None else req.eos_ids),
                   StopText(req.stop, self.detokenize), t_submit=time.perf_counter())  # fmt: skip
        try:
            self._waiting.put_nowait(seq)
        except queue.Full:
            self.stats["refused"] += 1
            raise QueueFull(f"the queue is full ({self._waiting.maxsize} waiting requests)") from None
        self.stats["requests"] += 1
        self._wake.set()
        return req.id

    def cancel(self, request_id: str) -> None:
        """Stops a request (thread-safe): its slot is freed at the next step; its sink gets "cancelled"."""
        self._cancels.put(request_id)
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return self._waiting.qsize() + len(self._held)

    @property
    def busy_slots(self) -> int:
        return len(self._active) + (len(self._group.live()) if self._group else 0)

    def idle(self) -> bool:
        return not self._active and self._group is None and not self._held and self._waiting.empty()

    # ------------------------------------------------------------------------------------------- the loop
    def _finish(self, seq: Seq, reason: str, tokens: list[int], text: str, error=None, stop=None) -> None:
        if seq.slot >= 0:
            self._active.pop(seq.slot, None)
        self.stats["finished"] += 1
        self.stats[f"finish_{reason}"] += 1
        n_prompt, n_gen = len(seq.req.prompt), len(seq.generated)
        seq.sink(Event(seq.req.id, tokens, text, reason, n_prompt, n_gen, error, stop,
                       drafted=seq.drafted, accepted=seq.accepted, prefix_tokens=seq.resumed))  # fmt: skip

    def _handle_cancels(self) -> None:
        while True:
            try:
                rid = self._cancels.get_nowait()
            except queue.Empty:
                return
            hit = [s for s in self._active.values() if s.req.id == rid]
            g = self._group
            for s in [s for s in g.live() if s.req.id == rid] if g else []:
                s.cancelled = True  # its row is still prefilled (the group's shapes), never inserted
                hit.append(s)
            if g and not g.live():
                self._group = None
            for s in hit:
                self._finish(s, "cancelled", [], "")
            if not hit:
                self._cancelled.add(rid)

    def _next_waiting(self) -> Seq | None:
        """The oldest request not yet admitted (held ones first); cancelled ones are finished on the way."""
        while True:
            try:
                seq = self._held.popleft() if self._held else self._waiting.get_nowait()
            except queue.Empty:
                return None
            if seq.req.id not in self._cancelled:
                return seq
            self._cancelled.discard(seq.req.id)
            self._finish(seq, "cancelled", [], "")

    def _plan(self, seq: Seq) -> list[int]:
        return chunk_plan(len(seq.req.prompt) - seq.resumed, self.buckets, self.prefix.block if self.prefix else 0)

    def _admit(self) -> None:
        """Starts a group when none is prefilling and a slot is free: the oldest waiting request, and behind it
        the requests with its chunk plan (glm53.serving.admit); a prefix-cache hit is prefilled alone."""
        free = sorted(set(range(self.slots)) - set(self._active))
        if self._group is not None or not free:
            return
        head = self._next_waiting()
        if head is None:
            return
        seqs, staging, h = [head], None, None
        if self.prefix and self.prefix.match(head.req.prompt):
            head.resumed, staging, h = self.prefix.restore(head.req.prompt, self._init(self.state, 1))
        plan = self._plan(head)
        if not head.resumed and groupable(plan, self.prefill_batch_chunk):
            while len(seqs) < min(len(free), self.prefill_widths[-1]):
                seq = self._next_waiting()
                if seq is None:
                    break
                if (self.prefix and self.prefix.match(seq.req.prompt)) or self._plan(seq) != plan:
                    self._held.appendleft(seq)  # the next group's head
                    break
                seqs.append(seq)
        if self.prefix:
            self.stats["prefix_lookups"] += len(seqs) - bool(head.resumed)  # restore counted the hit's
        w = width_for(len(seqs), self.prefill_widths)
        for seq, slot in zip(seqs, free):
            seq.slot = slot
        staging = self._init(self.state, w) if staging is None else staging
        self._group = Group(seqs, w, staging, plan, fed=head.resumed, h=self._h0[w]() if h is None else h)
        self.stats["prefill_groups"] += 1

    def _prefill_chunk(self) -> None:
        g = self._group
        c = g.chunks.pop(0)
        toks = np.zeros((g.width, c), np.int32)
        for i, s in enumerate(g.seqs):
            toks[i] = s.req.prompt[g.fed : g.fed + c]
        logits, g.h, g.staging = self._prefill(self.state, g.staging, toks, g.h)
        g.fed += c
        self.stats["prefill_tokens"] += c * len(g.live())
        if self.prefix:
            for i, s in enumerate(g.seqs):
                if not s.cancelled:
                    self.prefix.store(s.req.prompt, g.staging, g.fed - c, g.fed, g.h if self.speculative else None, i)
        if g.chunks:
            return
        toks = self._run_insert(g, logits)
        self._group = None
        for s, tok in zip(g.seqs, toks):
            if not s.cancelled:
                self._active[s.slot] = s
                self._emit(s, tok)

    def _emit(self, seq: Seq, tok: int) -> None:
        """Records a sampled token and sends what may be sent; finishes the request on a stop."""
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
            self.stats["ttft_ms_sum"] += int(1000 * (seq.t_first - seq.t_submit))
            self.stats["ttft_count"] += 1
        if seq.forced:
            tok = seq.forced.pop(0)
        seq.generated.append(tok)
        self.stats["tokens"] += 1
        if seq.req.think_budget is not None and not seq.think_done:
            n, close = seq.req.think_budget
            seq.think_done = seq.generated[-len(close) :] == close
            if not seq.think_done and not seq.forced and len(seq.generated) >= n:
                seq.forced = list(close)
        self._tokens[seq.slot] = tok
        if tok in seq.eos:
            text = seq.stop.flush()
            return self._finish(seq, "stop", [tok], text)
        text, hit = seq.stop.push(tok)
        if hit is not None:
            return self._finish(seq, "stop", [tok], text, stop=hit)
        if seq.req.until is not None and seq.req.until(seq.stop.text):
            return self._finish(seq, "stop", [tok], text + seq.stop.flush())
        if (
            len(seq.generated) >= seq.req.max_tokens
            or len(seq.req.prompt) + len(seq.generated) >= self.max_len
        ):
            return self._finish(seq, "length", [tok], text + seq.stop.flush())
        seq.sink(Event(seq.req.id, [tok], text))

    def _width(self, n: int) -> int:
        return width_for(n, self.decode_widths)

    def _compact(self) -> None:
        """Moves the highest busy slot into the lowest free one while that allows a narrower decode step (a
        prefilling request's reserved slot is simply reassigned: its rows are written at insert)."""
        pre = {s.slot: s for s in self._group.live()} if self._group else {}
        while True:
            busy = set(self._active) | set(pre)
            top, free = max(busy), min(set(range(self.slots)) - busy, default=self.slots)
            if free > top or self._width(len(busy)) >= self._width(top + 1):
                return
            if top in pre:
                seq = pre.pop(top)
                seq.slot, pre[free] = free, seq
                continue
            seq = self._active.pop(top)
            self.cache = self._move(self.cache, top, free)
            self._tokens[free], self._drafts[free], seq.slot = self._tokens[top], self._drafts[top], free
            self._active[free] = seq
            self.stats["slot_moves"] += 1

    def _decode_step(self) -> None:
        if len(self.decode_widths) > 1:
            self._compact()
        b = self._width(max(self._active) + 1)  # the smallest width covering the busy slots
        self.stats[f"decode_width_{b}"] += 1
        active = np.zeros(b, bool)
        counts = np.zeros(b, np.int32)
        seqs = [self._active.get(i) for i in range(b)]
        for i, s in enumerate(seqs):
            if s is not None:
                active[i], counts[i] = True, len(s.generated)
        drafts = self._drafts[:b].copy()
        verify = np.asarray([s is not None and s.req.temperature <= 0 and not s.forced
                             and s.req.constraint is None for s in seqs])  # fmt: skip
        t0 = time.perf_counter()
        mask = self._masks(seqs)
        out = self._run_decode(active, verify, mask, counts, sampling_args(seqs, b))  # one host transfer
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
        """One round: cancellations, admission, one prefill chunk, one decode step. False when idle."""
        self._handle_cancels()
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
        """The engine thread's loop: steps while there is work, sleeps on new work until `stop` is set. A failed
        step finishes every request with "error" (the engine keeps serving)."""
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                self._fail_all(f"{type(e).__name__}: {e}")
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _fail_all(self, msg: str) -> None:
        seqs = list(self._active.values()) + (self._group.live() if self._group else [])
        self._group = None
        self.cache = self._init(self.state, self.slots)
        for s in seqs:
            self._finish(s, "error", [], "", msg)


def generate(engine: Engine, requests: Sequence[Request]) -> list[list[int]]:
    """Runs `requests` to completion on `engine` (in this thread); the new token ids of each."""
    out: dict[str, list[int]] = {}
    for r in requests:
        rid = engine.submit(r, lambda ev: out.setdefault(ev.request_id, []).extend(ev.token_ids))
        out.setdefault(rid, [])
    engine.run_until_idle()
    return [out[r.id] for r in requests]
