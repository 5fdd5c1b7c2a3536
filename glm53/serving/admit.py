"""Admission in the serving engine (glm53.serving.engine): a request's state while it runs (`Seq`), and which waiting
requests are prefilled together (`Group`, `grouping`).

Batched prefill. A prefill chunk of one request is a [1, C] program: at small C its matmuls have a handful of rows
and cost little more at 8 rows than at 1 (glm53-mini on 2 CPU cores: a 16-token chunk 6.2 ms for one request,
21 ms for eight together, 8 x 6.2 = 50 ms apart). So the engine admits up to `max(widths)` waiting requests at
once when slots are free and prefills them as one group: one staging cache of w rows (w: the smallest prefill
width >= the group's size; the rows past the group are padding, fed token 0 and never inserted), one [w, C]
program per chunk, one insert program that writes each real row into its slot and samples every first token.
A group shares one chunk plan, so its members are requests with the same plan (prompts of the same length after
what the prefix cache restores) whose chunks are all <= `max_chunk` (larger chunks already have rows enough; this
bounds the compiled shapes: [w, C] for every width w and every bucket C <= max_chunk, plus [1, C] for the others).
A request that resumes from the prefix cache is prefilled alone (its staging cache is rebuilt from snapshots).
Requests are taken in arrival order: a group is the head of the queue and the compatible requests right behind
it; the first incompatible one waits for the next group.
Every row of a [w, C] program is the same function of its own tokens and cache as a [1, C] one: greedy tokens
equal those of requests prefilled one at a time (tests/test_serving_engine.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from glm53.model import Cache
from glm53.serving.limits import INT32_MAX
from glm53.serving.request import Request, Sink
from glm53.serving.text import StopText


@dataclasses.dataclass(eq=False)  # compared by identity (glm53.serving.lifecycle.Intake finds it in its queue)
class Seq:
    """A request inside the engine: its slot, stop state and what it has generated."""

    req: Request
    sink: Sink
    slot: int
    eos: frozenset
    stop: StopText
    generated: list[int] = dataclasses.field(default_factory=list)
    resumed: int = 0  # prompt tokens restored from the prefix cache
    drafted: int = 0
    accepted: int = 0
    t_submit: float = 0.0
    t_first: float | None = None
    forced: list[int] = dataclasses.field(default_factory=list)  # ids fed in place of the next sampled ones
    think_done: bool = False  # `</think>` was generated (Request.think_budget)
    done: bool = False  # ended (its terminal event sent): while its group prefills, its row is not inserted


@dataclasses.dataclass
class Group:
    """Requests prefilled together: rows 0 .. len(seqs) - 1 of a staging cache of `width` rows."""

    seqs: list[Seq]
    width: int
    staging: Cache | None
    chunks: list[int]  # the chunks left (every member's plan)
    fed: int = 0  # prompt tokens of each member in the staging cache (restored or prefilled)
    h: object = None  # the staging's last hidden states [width, 1, D] (the MTP block pairs them with next tokens)
    dirty: bool = False  # paged caches: the staging's page tables must be (re)written before the next chunk

    def live(self) -> list[Seq]:
        return [s for s in self.seqs if not s.done]


def width_for(n: int, widths) -> int:
    """The smallest width in `widths` (sorted) holding n rows (decode steps and prefill groups alike)."""
    return next(w for w in widths if w >= n)


def groupable(plan: list[int], max_chunk: int) -> bool:
    """Whether a request with this chunk plan may share a group (every chunk <= max_chunk, at least one)."""
    return bool(plan) and max(plan) <= max_chunk


def sampling_args(seqs, n: int, vocab: int | None = None):
    """(seeds, temperature, top_p, top_k) [n] of program rows `seqs` (None: an idle row, greedy). A top_k of at
    least `vocab` keeps every token: 0 (off); any top_k is clamped into int32 (never an overflow)."""
    seeds, temp = np.zeros(n, np.uint32), np.zeros(n, np.float32)
    top_p, top_k = np.ones(n, np.float32), np.zeros(n, np.int32)
    for i, s in enumerate(seqs):
        if s is not None:
            r, k = s.req, int(s.req.top_k)
            k = 0 if k < 0 or (vocab is not None and k >= vocab) else min(k, INT32_MAX)
            seeds[i], temp[i], top_p[i], top_k[i] = r.seed % 2**32, r.temperature, r.top_p, k
    return seeds, temp, top_p, top_k


def mask_rows(seqs, vocab: int, on_error: Callable[[Seq, Exception], None] | None = None):
    """The allowed next tokens bool [n, vocab] of program rows `seqs` (constrained decoding:
    Request.constraint, on the text so far) or None when no row is constrained (the engine's all-true mask).
    A row whose constraint raises is left all true and passed to `on_error` (which ends that request alone;
    without it, the exception propagates)."""
    rows = [(i, s) for i, s in enumerate(seqs) if s is not None and s.req.constraint is not None]
    if not rows:
        return None
    m = np.ones((len(seqs), vocab), bool)
    for i, s in rows:
        try:
            a = np.asarray(s.req.constraint.allowed(s.stop.text, len(s.generated)), bool).reshape(-1)[:vocab]
        except Exception as e:  # noqa: BLE001 - a request's own constraint: it ends that request only
            if on_error is None:
                raise
            on_error(s, e)
            continue
        m[i] = False
        m[i, : len(a)] = a
    return m
