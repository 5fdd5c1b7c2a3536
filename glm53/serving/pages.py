"""Paged caches, the host side (docs/serving.md "Paged caches"; the device side is glm53.layers.dsa.DSACache).

A `PagePool` owns `num_pages` pages of `page_tokens` cache rows each, shared by every stream; a `PageTable` is
one stream's list of pages (its token t lives in row t % page_tokens of page pages[t // page_tokens]);
`Admission` decides, by pages, whether a request starts now, waits or is refused, and tells a running stream
that cannot grow to finish with "length". Pure Python + numpy: the serving engine (glm53.serving.engine) keeps
its slots' tables here and hands them to the programs as int32 rows (`as_array`).

Layout over devices. Pages are split over `devices` in contiguous blocks: device d holds pages
d * P/D .. (d+1) * P/D - 1 (P/D = `pages_per_device`), i.e. exactly the block device d gets of an array
[P, page_tokens, ...] sharded on its page axis; its local page index is ``page % pages_per_device``. A stream's
i-th page is always taken on device i % D, so every stream is spread evenly (per device its page counts differ
by at most one), as the sequence-sharded cache rules spread a stream's pools over the chips.

Scratch pages and the pad. The first page of each device's block (`scratch(d)` = d * P/D) is reserved and never
handed out. `PageTable.as_array` pads a row with them: entry i is scratch(i % D), a valid index on the device
that entry i belongs to. So a gather through the padded table never reads out of bounds, and a fixed-shape step's
writes for inactive slots or positions past a stream's pages land in scratch, never in another stream's page
(the validity of what is read comes from the stream's length, as today). `capacity` = P - D usable pages.

Prefix sharing. `share_prefix` gives a fresh table another table's full pages covering a prefix (reference
counted, read-only from then on: both streams only write at positions past the prefix, which lie in pages of
their own) and, when the prefix ends inside a page, a fresh page that the caller fills by the returned `Copy`
(copy-on-write of the partial page).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence

import numpy as np


class OutOfPages(RuntimeError):
    """A request for pages the pool cannot satisfy (nothing was taken). `needed` / `free`: totals;
    `needed_per_device` / `free_per_device`: per device."""

    def __init__(self, needed_per_device: Sequence[int], free_per_device: Sequence[int]):
        self.needed_per_device, self.free_per_device = tuple(needed_per_device), tuple(free_per_device)
        self.needed, self.free = sum(self.needed_per_device), sum(self.free_per_device)
        per = ""
        if len(self.free_per_device) > 1:
            per = f" (per device: needed {list(self.needed_per_device)}, free {list(self.free_per_device)})"
        super().__init__(f"out of cache pages: needed {self.needed}, free {self.free}{per}")


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy rows 0 .. rows-1 of page `src` into page `dst` (every page-indexed cache array; same device)."""

    src: int
    dst: int
    rows: int


def spread(start: int, stop: int, devices: int) -> list[int]:
    """Pages per device of a stream's pages start .. stop-1 (page i on device i % devices)."""
    n, lo = stop - start, start % devices
    return [n // devices + ((d - lo) % devices < n % devices) for d in range(devices)]


class PagePool:
    """`num_pages` pages of `page_tokens` rows split over `devices` (module docstring): per-device free lists
    (lowest id first), a reference count per page. ValueError on a bad argument or a page not in use."""

    def __init__(self, num_pages: int, page_tokens: int, devices: int = 1):
        if devices < 1 or page_tokens < 1 or num_pages % devices or num_pages // devices < 2:
            raise ValueError(
                f"PagePool(num_pages={num_pages}, page_tokens={page_tokens}, devices={devices}): page_tokens and "
                "devices must be >= 1 and num_pages a multiple of devices with >= 2 pages per device "
                "(one is the device's scratch page)"
            )
        self.num_pages, self.page_tokens, self.devices = num_pages, page_tokens, devices
        self.pages_per_device = num_pages // devices
        self.refs = np.zeros(num_pages, np.int32)  # read-only outside: use incref / decref
        self._free = [
            list(range(self.scratch(d) + 1, self.scratch(d) + self.pages_per_device)) for d in range(devices)
        ]

    # ---------------------------------------------------------------------------------------------- layout
    def scratch(self, device: int = 0) -> int:
        """Device `device`'s reserved page (never allocated): the pad of `PageTable.as_array`."""
        return device * self.pages_per_device

    def device_of(self, page: int) -> int:
        return page // self.pages_per_device

    def pages_for(self, tokens: int) -> int:
        """Pages holding `tokens` tokens."""
        return -(-tokens // self.page_tokens)

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the scratch pages)."""
        return self.num_pages - self.devices

    def free_count(self, device: int | None = None) -> int:
        """Free pages on `device` (None: in total)."""
        return sum(map(len, self._free)) if device is None else len(self._free[device])

    def free_per_device(self) -> tuple[int, ...]:
        return tuple(len(f) for f in self._free)

    def fits(self, needed_per_device: Sequence[int], reserved: Sequence[int] | None = None) -> bool:
        """Whether `needed_per_device` pages are free now, beyond `reserved` ones per device."""
        reserved = reserved or (0,) * self.devices
        return all(n <= len(f) - r for n, f, r in zip(needed_per_device, self._free, reserved))

    # ---------------------------------------------------------------------------------------------- pages
    def alloc(self, devices: Iterable[int]) -> list[int]:
        """One page per entry of `devices` (the device each goes on), reference count 1: all or none
        (OutOfPages, the pool unchanged)."""
        devices = list(devices)
        need = [0] * self.devices
        for d in devices:
            need[d] += 1
        if not self.fits(need):
            raise OutOfPages(need, self.free_per_device())
        pages = [heapq.heappop(self._free[d]) for d in devices]
        self.refs[pages] = 1
        return pages

    def _in_use(self, page: int, what: str) -> None:
        if not (0 <= page < self.num_pages) or self.refs[page] <= 0:
            raise ValueError(f"{what}: page {page} is not in use")

    def incref(self, page: int) -> None:
        """One more holder of `page` (in use)."""
        self._in_use(page, "incref")
        self.refs[page] += 1

    def decref(self, page: int) -> bool:
        """One holder less of `page`; at zero it returns to its device's free list (-> True)."""
        self._in_use(page, "decref")
        self.refs[page] -= 1
        if self.refs[page]:
            return False
        heapq.heappush(self._free[self.device_of(page)], page)
        return True


class PageTable:
    """One stream's pages in the pool, in token order (page i on device i % devices). `length`: the tokens it
    holds pages for (`ensure`'s largest length since the last `release`)."""

    def __init__(self, pool: PagePool):
        self.pool, self._pages, self.length = pool, [], 0

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self._pages)

    def __len__(self) -> int:
        return len(self._pages)

    def locate(self, position: int) -> tuple[int, int]:
        """(page, row) holding token `position` (< length)."""
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} outside the table's {self.length} tokens")
        return self._pages[position // self.pool.page_tokens], position % self.pool.page_tokens

    def needs(self, length: int) -> list[int]:
        """Pages per device `ensure(length)` would take."""
        return spread(len(self._pages), max(len(self._pages), self.pool.pages_for(length)), self.pool.devices)

    def ensure(self, length: int) -> list[int]:
        """Grows the table to hold `length` tokens: the new pages (all or none: OutOfPages, nothing changed)."""
        want = self.pool.pages_for(length)
        new = self.pool.alloc(i % self.pool.devices for i in range(len(self._pages), want))
        self._pages += new
        self.length = max(self.length, length)
        return new

    def release(self) -> int:
        """Gives every page back (decref); -> the pages that became free. The table is then empty."""
        freed = sum(self.pool.decref(p) for p in self._pages)
        self._pages, self.length = [], 0
        return freed

    def share_prefix(self, other: PageTable, tokens: int) -> list[Copy]:
        """Makes this (empty) table hold `other`'s first `tokens` tokens: `other`'s full pages among them are
        shared (incref, read-only for both from now on); a partial last page gets a fresh page of this table's
        own, and the returned `Copy` (at most one) says which rows the caller must copy into it. All or none:
        OutOfPages, nothing changed."""
        if self._pages or self.length:
            raise ValueError("share_prefix: the table must be empty (release it first)")
        if other.pool is not self.pool or not 0 <= tokens <= other.length:
            raise ValueError(f"share_prefix: {tokens} tokens of a table of this pool holding {other.length}")
        full, rows = divmod(tokens, self.pool.page_tokens)
        copies = []
        if rows:
            (dst,) = self.pool.alloc([full % self.pool.devices])
            copies.append(Copy(other._pages[full], dst, rows))
        for p in other._pages[:full]:
            self.pool.incref(p)
        self._pages = other._pages[:full] + [c.dst for c in copies]
        self.length = tokens
        return copies

    def adopt(self, pages: Sequence[int]) -> None:
        """Makes this (empty) table start with `pages` (full pages another holder keeps, e.g. the prefix cache's:
        shared, incref'd, read-only from then on)."""
        if self._pages or self.length:
            raise ValueError("adopt: the table must be empty (release it first)")
        for p in pages:
            self.pool.incref(p)
        self._pages = list(pages)
        self.length = len(self._pages) * self.pool.page_tokens

    def as_array(self, max_pages: int) -> np.ndarray:
        """int32 [max_pages]: the pages, then each entry i past them padded with scratch(i % devices) (valid
        indices on the right device; module docstring). ValueError when the table has more pages."""
        if len(self._pages) > max_pages:
            raise ValueError(
                f"as_array: the table has {len(self._pages)} pages, more than max_pages={max_pages}"
            )
        row = np.array([self.pool.scratch(i % self.pool.devices) for i in range(max_pages)], np.int32)
        row[: len(self._pages)] = self._pages
        return row


ADMIT, WAIT, REJECT = "admit", "wait", "reject"


class Admission:
    """Admission by pages over one pool, for streams keyed by any hashable id.

    `decide(prompt, max_new)`: REJECT when the request could never start (its prompt and first generated token
    do not fit in the empty pool; with `reserve`, when prompt + max_new do not: HTTP 429 / 400 is the caller's
    choice), ADMIT when its pages are free now, else WAIT. Free means on the free lists and, with `reserve`,
    not reserved by running streams: pages of running streams are never counted, so admission never takes what
    running streams hold.

    - reserve=False (optimistic): a request needs pages for prompt + 1 tokens to start. A running stream grows as
      it decodes (`grow`), and when no page is free `grow` returns False: the caller finishes it with "length".
    - reserve=True: a request needs pages for prompt + max_new tokens, which it keeps reserved (counted against
      later admissions) until it ends; `grow` then never fails within prompt + max_new tokens.

    `start(key, prompt, max_new, share=(other_key, tokens))` admits it (first `decide` said ADMIT) and returns
    (its table, the copies of `share_prefix`); `end(key)` releases its pages and reservation (finished,
    cancelled or failed alike).
    """

    def __init__(self, pool: PagePool, *, reserve: bool = False):
        self.pool, self.reserve = pool, reserve
        self.tables: dict = {}
        self._limit: dict = {}  # key -> prompt + max_new

    def _reserved(self, skip=None) -> list[int]:
        """Pages per device still reserved by running streams (beyond those they hold)."""
        out = [0] * self.pool.devices
        if self.reserve:
            for k, t in self.tables.items():
                if k != skip:
                    out = [a + b for a, b in zip(out, t.needs(self._limit[k]))]
        return out

    def _need(self, prompt: int, max_new: int, shared: int = 0) -> list[int]:
        """Pages per device a request needs to start (its first `shared` pages already held by another)."""
        total = self.pool.pages_for(prompt + (max_new if self.reserve else 1))
        return spread(min(shared, total), total, self.pool.devices)

    def decide(self, prompt: int, max_new: int, shared: int = 0) -> str:
        """ADMIT / WAIT / REJECT (class docstring); `shared`: its first pages are held already (a prefix)."""
        if any(n > self.pool.pages_per_device - 1 for n in self._need(prompt, max_new)):
            return REJECT
        return ADMIT if self.pool.fits(self._need(prompt, max_new, shared), self._reserved()) else WAIT

    def start(self, key, prompt: int, max_new: int, share=None, prefix_pages: Sequence[int] = ()
              ) -> tuple[PageTable, list[Copy]]:  # fmt: skip
        """Pages for the request's prompt + 1 tokens (after `share`'s prefix, or the full pages `prefix_pages`
        another holder keeps, if given). OutOfPages (nothing taken) when `decide` would not say ADMIT;
        ValueError on a key already running."""
        if key in self.tables:
            raise ValueError(f"Admission.start: {key!r} is already running")
        if self.decide(prompt, max_new, len(prefix_pages)) != ADMIT:
            raise OutOfPages(
                self._need(prompt, max_new, len(prefix_pages)),
                [f - r for f, r in zip(self.pool.free_per_device(), self._reserved())],
            )
        table, copies = PageTable(self.pool), []
        if share is not None:
            copies = table.share_prefix(self.tables[share[0]], share[1])
        elif prefix_pages:
            table.adopt(prefix_pages)
        try:
            table.ensure(prompt + 1)
        except OutOfPages:
            table.release()
            raise
        self.tables[key], self._limit[key] = table, prompt + max_new
        return table, copies

    def grow(self, key, length: int) -> bool:
        """Pages for `length` tokens of a running stream; False (nothing taken) when they are not free (with
        `reserve`: not free beyond other streams' reservations): finish it with "length"."""
        table = self.tables[key]
        if not self.pool.fits(table.needs(length), self._reserved(skip=key)):
            return False
        table.ensure(length)
        return True

    def end(self, key) -> int:
        """Releases a stream (finished, cancelled, failed); -> pages freed. Unknown keys are ignored."""
        self._limit.pop(key, None)
        table = self.tables.pop(key, None)
        return 0 if table is None else table.release()
