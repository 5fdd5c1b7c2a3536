"""The serving engine's prefill side (`Prefill`, a base of glm53.serving.engine.Engine): waiting requests admitted
into a prefill group (glm53.serving.admit: the head of the queue and the compatible requests right behind it, a
prefix-cache hit alone; on paged caches only when their pages are free, glm53.serving.slotpages), the group's
chunks fed into its staging cache one per engine step, then insert: the staging rows written over their slots and
each first token sampled. A failure ends the requests it concerns (glm53.serving.lifecycle), as the engine's
docstring says.
"""

from __future__ import annotations

import numpy as np

from glm53.serving.admit import Group, Seq, groupable, sampling_args, width_for
from glm53.serving.prefix import chunk_plan


class Prefill:
    """The Engine's prefill methods; they use the engine's state (its programs, intake, prefix cache, paging,
    group, slots and counters) and its `_finish`, `_fail_shared`, `_masks` and `_emit`."""

    def _run_insert(self, g: Group, logits) -> list[int]:
        """Writes the group's live rows into their slots; their first tokens (draft kept per slot). A row whose
        constraint raises ends alone and is not written."""
        rows = [None if s is None or s.done else s for s in g.seqs + [None] * (g.width - len(g.seqs))]
        mask = self._masks(rows)
        rows = [None if s is None or s.done else s for s in rows]
        slots = np.asarray([-1 if s is None else s.slot for s in rows], np.int32)
        args = mask, *sampling_args(rows, g.width, self.cfg.vocab_size)
        out = self.programs.insert(g.staging, slots, logits, g.h, *args)
        for s, (_, draft) in zip(rows, out):
            if s is not None:
                self._drafts[s.slot] = draft
        return [int(t) for t in out[:, 0]]

    def _plan(self, seq: Seq) -> list[int]:
        return chunk_plan(len(seq.req.prompt) - seq.resumed, self.buckets, self.prefix.block if self.prefix else 0)

    def _admit(self) -> None:
        """Starts a group when none is prefilling and a slot is free: the oldest waiting request, and behind it
        the requests with its chunk plan (glm53.serving.admit); a prefix-cache hit is prefilled alone."""
        free = sorted(set(range(self.slots)) - set(self._active))
        if self._group is not None or not free:
            return
        head = self._intake.take()
        if head is None:
            return
        if self.paging and not self.paging.free_for(head, self.prefix, self.stats):
            return self._intake.untake(head)  # it waits for pages (running streams end, or prefixes go)
        seqs, staging, h, shared = [head], None, None, []
        if self.prefix and self.prefix.match(head.req.prompt):
            try:
                head.resumed, staging, h, shared = self.prefix.restore(head.req.prompt, self.programs.init(1))
            except Exception as e:  # noqa: BLE001 - a failed program ends the requests it served only
                return self._fail_shared("prefix cache restore", seqs, e)
        if self.paging:
            self.paging.start(head, shared)
        plan = self._plan(head)
        if not head.resumed and groupable(plan, self.prefill_batch_chunk):
            while len(seqs) < min(len(free), self.prefill_widths[-1]):
                seq = self._intake.take()
                if seq is None:
                    break
                if ((self.prefix and self.prefix.match(seq.req.prompt)) or self._plan(seq) != plan
                        or (self.paging and not self.paging.free_for(seq, self.prefix, self.stats, evict=False))):  # fmt: skip
                    self._intake.untake(seq)  # the next group's head
                    break
                if self.paging:
                    self.paging.start(seq)
                seqs.append(seq)
        if self.prefix:
            self.stats["prefix_lookups"] += len(seqs) - bool(head.resumed)  # restore counted the hit's
        w = width_for(len(seqs), self.prefill_widths)
        for seq, slot in zip(seqs, free):
            seq.slot = slot
        try:
            staging = self.programs.init(w) if staging is None else staging
            h = self.programs.h0(w) if h is None else h
        except Exception as e:  # noqa: BLE001
            return self._fail_shared("prefill step", seqs, e)
        self._group = Group(seqs, w, staging, plan, fed=head.resumed, h=h, dirty=self.paging is not None)
        self.stats["prefill_groups"] += 1

    def _prefill_chunk(self) -> None:
        g = self._group
        c = g.chunks.pop(0)
        toks = np.zeros((g.width, c), np.int32)
        for i, s in enumerate(g.seqs):
            toks[i] = s.req.prompt[g.fed : g.fed + c]
        try:  # the group's own staging cache: a failure ends the group only
            if g.dirty:  # the members' page tables (a member that ended: scratch)
                g.staging, g.dirty = self.programs.set_pages(g.staging, self.paging.group_tables(g)), False
            logits, g.h, g.staging = self.programs.prefill(g.staging, toks, g.h)
            hs = g.h if self.speculative else None
            for i, s in enumerate(g.seqs if self.prefix else ()):
                if not s.done:
                    table = self.paging.table_of(s) if self.paging else None
                    self.prefix.store(s.req.prompt, g.staging, g.fed, g.fed + c, hs, i, table=table)
        except Exception as e:  # noqa: BLE001
            self._group = None
            return self._fail_shared("prefill step", g.live(), e)
        g.fed += c
        self.stats["prefill_tokens"] += c * len(g.live())
        if g.chunks:
            return
        try:  # writes the shared cache (donated): a failure ends every request in a slot
            toks = self._run_insert(g, logits)
        except Exception as e:  # noqa: BLE001
            self._group = None
            return self._fail_shared("insert step", g.live() + list(self._active.values()), e, reset=True)
        self._group = None
        for s, tok in zip(g.seqs, toks):
            if not s.done:
                self._active[s.slot] = s
                if self.paging:
                    self.paging.placed(s)
                self._emit(s, tok)
