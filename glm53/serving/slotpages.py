"""The serving engine's side of paged caches (`Engine(cache_tokens=...)`, docs/serving.md "Paged caches"): the page
pool and admission of glm53.serving.pages for the engine's slots and prefill groups, and the slots' page tables
as the host keeps them (int32 [slots, M], uploaded to the device when they change: `upload`).

The rules the engine relies on: a request starts only when the pages for its prompt + 1 token are free (`free_for`,
which evicts prefix-cache blocks while they are what stands in the way); a running stream takes a page when it
crosses a page boundary and ends with "length" when none is free (`grow`); a stream's pages go back the moment it
ends (`end`), and every slot or staging row that no live stream owns has the scratch table (all page 0), so the
fixed-shape programs' masked writes for it land in scratch, never in a page another stream holds.
"""

from __future__ import annotations

import numbers

import numpy as np

from glm53.serving.admit import Group, Seq
from glm53.serving.pages import ADMIT, Admission, PagePool


class SlotPages:
    """Pages of `cache_tokens` tokens (ceil(cache_tokens / page_tokens) pages + one scratch page) for `slots`
    slots whose requests hold up to `max_len` tokens. ValueError naming the option that cannot be served."""

    def __init__(self, *, slots: int, max_len: int, cache_tokens: int, page_tokens: int, kpool: int,
                 speculative: bool, sharded: bool, prefix_cache_bytes: int, prefix_block: int):  # fmt: skip
        for name, v in (("cache_tokens", cache_tokens), ("page_tokens", page_tokens)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if page_tokens % kpool:
            raise ValueError(f"page_tokens={page_tokens}: must be a multiple of index_kpool={kpool}")
        if prefix_cache_bytes and prefix_block != page_tokens:
            raise ValueError(f"prefix_block={prefix_block}: on paged caches the prefix cache's block is the page "
                             f"(page_tokens={page_tokens})")  # fmt: skip
        if sharded or (speculative and prefix_cache_bytes):
            raise ValueError("cache_tokens: paged caches run on one device, and speculative decoding on them "
                             "without the prefix cache, for now (pass cache_tokens=None: contiguous caches)")  # fmt: skip
        self.pool = PagePool(-(-cache_tokens // page_tokens) + 1, page_tokens)  # + the scratch page
        self.admission = Admission(self.pool)
        self.max_len = max_len
        self.rows = 2 if speculative else 1  # positions a decode step writes per stream (a draft: one more)
        self.max_pages = -(-max_len // page_tokens)
        self.table = np.zeros((slots, self.max_pages), np.int32)  # the slots' tables (0: scratch)
        self.dirty = False

    @property
    def spec(self) -> tuple[int, int]:
        """(num_pages, page_tokens): `Programs(pages=...)`."""
        return self.pool.num_pages, self.pool.page_tokens

    @property
    def context_limit(self) -> int:
        """The most tokens one request may hold: max_len, and what the pool holds."""
        return min(self.max_len, self.pool.capacity * self.pool.page_tokens)

    def free_for(self, seq: Seq, prefix, stats, evict: bool = True) -> bool:
        """Whether `seq` can start now (its prompt + 1 tokens' pages, less those of a prefix the prefix cache
        shares); with `evict`, prefix blocks are evicted (least recently used first) while they stand in the way."""
        prompt = seq.req.prompt
        while True:
            shared = len(prefix.matched_pages(prompt)) if prefix else 0
            if self.admission.decide(len(prompt), seq.req.max_tokens, shared) == ADMIT:
                return True
            if not (evict and prefix and prefix.evict_one()):
                stats["page_waits"] += 1
                return False

    def start(self, seq: Seq, prefix_pages=()) -> None:
        """Pages for `seq`'s prompt + 1 tokens (after the prefix cache's `prefix_pages`); `free_for` said yes."""
        self.admission.start(seq, len(seq.req.prompt), seq.req.max_tokens, prefix_pages=prefix_pages)

    def end(self, seq: Seq) -> None:
        """`seq` ended: its pages go back (those the prefix cache also holds stay with it)."""
        self.admission.end(seq)

    def table_of(self, seq: Seq):
        return self.admission.tables[seq]

    def group_tables(self, g: Group) -> np.ndarray:
        """The staging rows' tables int32 [width, M] (padding and ended members: scratch)."""
        rows = np.zeros((g.width, self.max_pages), np.int32)
        for i, s in enumerate(g.seqs):
            if not s.done:
                rows[i] = self.admission.tables[s].as_array(self.max_pages)
        return rows

    def placed(self, seq: Seq) -> None:
        """`seq` now runs in its slot (insert copied its staging row's table there)."""
        self.table[seq.slot] = self.admission.tables[seq].as_array(self.max_pages)

    def clear(self, slot: int) -> None:
        """`slot` is free: the scratch table."""
        self.table[slot] = 0
        self.dirty = True

    def moved(self, src: int, dst: int) -> None:
        """The rows of `src` moved to `dst` (their table with them); `src` gets the scratch table."""
        self.table[dst] = self.table[src]
        self.clear(src)

    def grow(self, active: dict[int, Seq]) -> list[Seq]:
        """Pages for the positions each running stream writes next (its pending token's, and its draft's when
        speculative); -> those that cannot grow (to end "length")."""
        stuck = []
        for slot, seq in sorted(active.items()):
            length = min(len(seq.req.prompt) + len(seq.generated) + self.rows - 1, self.max_len)
            table = self.admission.tables[seq]
            n = len(table)
            if not self.admission.grow(seq, length):
                stuck.append(seq)
            elif len(table) != n:
                self.table[slot] = table.as_array(self.max_pages)
                self.dirty = True
        return stuck

    def upload(self, programs) -> None:
        """The slots' tables to the device when they changed since the last upload."""
        if self.dirty:
            programs.set_pages(None, self.table)
            self.dirty = False

    def reset(self) -> None:
        """The device pool was rebuilt (every slot's table is scratch there): so are the host's."""
        self.table[:] = 0
        self.dirty = False
