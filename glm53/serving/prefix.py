"""Prefix cache of the serving engine: a prompt that shares whole blocks with an earlier one resumes from them.

A prompt's blocks are its consecutive runs of K tokens (K = `block`, a multiple of index_kpool), each named by a
chain hash (the hash of the previous block's name and the block's tokens, as vLLM does): equal names mean equal
prefixes. Two kinds of snapshot are taken from the batch-1 staging cache while a prompt is prefilled, after
each chunk (`chunk_plan(..., block=K)` below makes the chunks over whole blocks start and end on boundaries):

  * rows, once per block: the block's positions of every DSA layer's MLA latent (and its per-token scales when
    int8) and pooled keys (its pools are complete), and of the MTP block's cache when speculative decoding keeps it. The
    MTP row of position p pairs h_p with token p+1, so a block's MTP rows are taken one position (and one pool)
    earlier: positions iK-1 .. iK+K-2 depend on the block's prefix only (the first block's are clamped to 0..K-1
    and the next block overwrites its last row; the last restored block's last row is redone by the prefill);
  * state, at a chunk's end on a boundary: every KDA layer's conv and recurrent state there, every DSA cache's
    indexer ring (the per-token keys and gates of the last 2 * kpool positions: the MTP block's open pool is not
    empty at a boundary, its rows being one position earlier) (all small: O(1) in the length), plus the trunk's
    last hidden state (the MTP block pairs it with the next prompt token). The KDA
    kernels return the state at a chunk's end only, so a chunk of several blocks (a bucket that is a multiple of
    K) leaves a state at its end alone: larger buckets prefill faster, and resume points are that much coarser.

Paged caches (`pages`, a glm53.serving.pages.PagePool; block = page_tokens): a block's rows ARE a page of the
prompt's stream, so a block keeps that page (one more reference) instead of a copy of its rows, and a restore
hands the matched blocks' pages to the new stream's table (shared: every holder only writes past the prefix)
instead of writing rows into the staging cache; the state snapshots are as above. A shared system prompt then
costs its pages once. A block's bytes are its page's (every DSA layer's rows of page_tokens positions), counted
against the budget; `evict_one` frees pages when the engine's pool runs short.

A lookup walks the prompt's block names from the first; it resumes after the deepest matched block that has a
state (at most (L-1) // K blocks: one token at least is left to prefill, for the logits). The staging cache is
rebuilt from the blocks' rows (one program writes one block at a traced offset) and that state, and the engine
prefills only the rest. Snapshots stay on the device (jax arrays): a restore is device-to-device copies with no
host transfer, and the budget is device memory, counted exactly (the bytes of every array held).
LRU eviction under the byte budget removes the least recently used block that no other block extends (a leaf),
then any ancestor left without children and without a state (it can no longer be resumed from).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm53.layers.dsa import DSACache
from glm53.layers.kda import KDACache
from glm53.model import Cache
from glm53.runtime.cache import map_layers, map_rows


@dataclasses.dataclass
class _Block:
    parent: bytes | None
    rows: tuple
    state: tuple | None = None  # (KDA states per layer, hidden [1, 1, D] or None)
    nbytes: int = 0
    children: int = 0


def _nbytes(tree) -> int:
    return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


def block_names(prompt: Sequence[int], block: int, n_blocks: int | None = None) -> list[bytes]:
    """Chain hashes of the prompt's first `n_blocks` whole blocks (default: all)."""
    n = len(prompt) // block if n_blocks is None else n_blocks
    toks = np.asarray(prompt[: n * block], np.int64)
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.blake2b(prev + toks[i * block : (i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


def chunk_plan(n: int, buckets: Sequence[int], block: int = 0) -> list[int]:
    """Chunk sizes covering n tokens, largest bucket first (buckets contain 1, so the sum is exact). block > 0:
    a chunk ends on every multiple of `block` it reaches (whole blocks in chunks of the buckets that are
    multiples of it, the rest block by block, then the tail), so the prefix cache can snapshot there."""
    out, rest = [], n
    if block:
        head = chunk_plan(n - n % block, [b for b in buckets if b % block == 0])
        per_block = chunk_plan(block, buckets)
        out = head + per_block * ((n - n % block - sum(head)) // block)
        return out + chunk_plan(n % block, buckets)
    for b in sorted(buckets, reverse=True):
        while rest >= b:
            out.append(b)
            rest -= b
    return out


class PrefixCache:
    """Block snapshots of prompts under an LRU byte budget. `stats` (a Counter, shared with the engine) gets
    prefix_lookups, prefix_hits, prefix_hit_tokens (prefill saved), prefix_evicted_blocks; `nbytes` / `blocks`
    are the held bytes and blocks. `jit` compiles the four programs (rows, state, put_rows, put_state)."""

    def __init__(self, *, block: int, budget: int, kpool: int, with_mtp: bool, jit: Callable, stats, pages=None,
                 page_bytes: int = 0):  # fmt: skip
        if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block % kpool:
            raise ValueError(f"prefix_block={block!r}: must be a positive multiple of index_kpool={kpool}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(
                f"prefix_cache_bytes={budget!r}: must be a positive integer (0 turns the cache off)"
            )
        self.block, self.budget, self.kpool, self.with_mtp = block, budget, kpool, with_mtp
        if pages is not None and (pages.page_tokens != block or with_mtp):
            raise ValueError(f"prefix cache on pages: prefix_block={block} must equal page_tokens="
                             f"{pages.page_tokens}, without the MTP cache")  # fmt: skip
        self.pages, self.page_bytes = pages, page_bytes
        self.stats = stats
        self.nbytes = 0
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        k, kp = block, block // kpool

        # Every function below takes one layer's cache at a time (glm53.runtime.cache.map_layers): `lead` is 1 for a
        # scanned model's stacked caches (arrays [repeats, B, ...]: every repeat snapshot and restored at once, in
        # place), else 0; its batch axis is `lead`, its sequence axis lead + 1.
        # rows s .. s+n-1, s clamped at 0 (lax wraps a negative start); a layer that shares its indexer holds
        # 0-row index arrays
        def take(a, s, n, lead):
            ax = 1 + lead
            return a if a.shape[ax] == 0 else jax.lax.dynamic_slice_in_dim(a, jnp.maximum(s, 0), n, axis=ax)

        def put(a, x, s, lead):
            ax = 1 + lead
            return a if a.shape[ax] == 0 else jax.lax.dynamic_update_slice_in_dim(a, x, jnp.maximum(s, 0), axis=ax)

        def mtp(c):
            return c.mtp if with_mtp else None

        def rows(staging: Cache, start, row):  # the staging cache's row `row` (a batched prefill's member)
            staging = map_rows(lambda a, axis: jax.lax.dynamic_slice_in_dim(a, row, 1, axis), staging)

            def one(c, s, lead=0):
                if not isinstance(c, DSACache):
                    return None
                return (take(c.latent, s, k, lead), take(c.latent_scale, s, k, lead),
                        take(c.pooled, s // kpool, kp, lead))  # fmt: skip

            # the MTP block's rows: one position earlier (module docstring)
            return map_layers(lambda c, lead: one(c, start, lead), staging.layers), one(mtp(staging), start - 1)

        def state(staging: Cache, h, row):
            sl = lambda a, lead=0: jax.lax.dynamic_slice_in_dim(a, row, 1, lead)  # noqa: E731

            def kda(c, lead):
                return (sl(c.conv_state, lead), sl(c.state, lead)) if isinstance(c, KDACache) else None

            # the indexer's per-token ring (the open pools' members) of every DSA cache, the MTP block's included
            def ring(c, lead=0):
                return (sl(c.recent_k, lead), sl(c.recent_gate, lead)) if isinstance(c, DSACache) else None

            snap = map_layers(kda, staging.layers), map_layers(ring, staging.layers), ring(mtp(staging))
            return snap, None if h is None else sl(h)

        def put_rows(staging: Cache, rows, start):
            def one(c, r, s, lead=0):
                if r is None:
                    return c
                return c.replace(latent=put(c.latent, r[0], s, lead), latent_scale=put(c.latent_scale, r[1], s, lead),
                                 pooled=put(c.pooled, r[2], s // kpool, lead))  # fmt: skip

            layers = map_layers(lambda c, r, lead: one(c, r, start, lead), staging.layers, rows[0])
            mtp = one(staging.mtp, rows[1], start - 1) if with_mtp else staging.mtp
            return staging.replace(layers=layers, mtp=mtp)

        def put_state(staging: Cache, st, length):
            kda, ring, mtp_ring = st

            def one(c, s, r, lead=0):
                c = c if s is None else KDACache(s[0], s[1])
                return c if r is None else c.replace(recent_k=r[0], recent_gate=r[1])

            layers = map_layers(one, staging.layers, kda, ring)
            mtp = one(staging.mtp, None, mtp_ring) if with_mtp else staging.mtp
            return staging.replace(layers=layers, mtp=mtp, length=jnp.full_like(staging.length, length))

        self._rows, self._state = jit(rows), jit(state)
        self._put_rows = jit(put_rows, donate_argnums=(0,))
        self._put_state = jit(put_state, donate_argnums=(0,))
        self.programs = (self._rows, self._state, self._put_rows, self._put_state)
        if pages is not None:  # blocks keep pages: the rows programs are not used
            self.programs = (self._state, self._put_state)

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        """Drops every snapshot (the counters stay; on pages, their references)."""
        if self.pages is not None:
            for b in self._blocks.values():
                self.pages.decref(b.rows)
        self._blocks.clear()
        self.nbytes = 0

    def warmup(self, staging: Cache, h=None):
        """Compiles the programs for a staging cache of this many rows (`h`: its hidden states [rows, 1, D] when
        states keep them): all four for one row (restores rebuild one-row staging caches), the two snapshot ones
        for more (a batched prefill's). Returns what to wait on; `staging` is donated."""
        s, _ = self._state(staging, h, 0)
        if self.pages is not None:
            return s if staging.length.shape[0] > 1 else self._put_state(staging, s, 0)
        r = self._rows(staging, 0, 0)
        if staging.length.shape[0] > 1:
            return r, s
        return self._put_state(self._put_rows(staging, r, 0), s, 0)

    # ------------------------------------------------------------------------------------------ lookup
    def match(self, prompt: Sequence[int]) -> int:
        """The prompt tokens a `restore` would resume (no side effect)."""
        return self._lookup(prompt)[1] * self.block

    def _lookup(self, prompt):
        chain, depth = [], 0
        for name in block_names(prompt, self.block, (len(prompt) - 1) // self.block):
            b = self._blocks.get(name)
            if b is None:
                break
            chain.append(name)
            if b.state is not None:
                depth = len(chain)
        return chain, depth

    def matched_pages(self, prompt: Sequence[int]) -> list[int]:
        """Paged: the pages of the blocks a `restore` would resume (no side effect)."""
        chain, depth = self._lookup(prompt)
        return [self._blocks[n].rows for n in chain[:depth]]

    def restore(self, prompt: Sequence[int], staging: Cache) -> tuple[int, Cache, jnp.ndarray | None, list[int]]:
        """(tokens resumed, the staging cache rebuilt to that point, the hidden state there or None, and on pages
        the matched blocks' pages for the stream's table: the caller takes its references). 0 tokens: the staging
        cache is returned as is."""
        self.stats["prefix_lookups"] += 1
        chain, depth = self._lookup(prompt)
        if not depth:
            return 0, staging, None, []
        for name in chain:  # the matched chain is now the most recently used
            self._blocks.move_to_end(name)
        if self.pages is None:
            for i, name in enumerate(chain[:depth]):
                staging = self._put_rows(staging, self._blocks[name].rows, i * self.block)
        kda, h = self._blocks[chain[depth - 1]].state
        n = depth * self.block
        self.stats["prefix_hits"] += 1
        self.stats["prefix_hit_tokens"] += n
        return n, self._put_state(staging, kda, n), h, self.matched_pages(prompt) if self.pages is not None else []

    # ------------------------------------------------------------------------------------------ store
    def store(self, prompt: Sequence[int], staging: Cache, start: int, end: int, h=None, row: int = 0,
              table=None) -> None:  # fmt: skip
        """Snapshots the blocks that the chunk [start, end) completed (and the state at `end` when it is a
        boundary) from row `row` of `staging` (h: its hidden states [rows, 1, D] or None), whose length is `end`,
        then evicts down to the budget. On pages, `table` is the stream's glm53.serving.pages.PageTable: a block
        keeps its page."""
        k = self.block
        first, last = start // k, end // k  # the blocks ending in (start, end]
        names = block_names(prompt, k, last)
        for i in range(first, last):
            name = names[i]
            if name in self._blocks:
                self._blocks.move_to_end(name)
                continue
            parent = names[i - 1] if i else None
            if parent is not None and parent not in self._blocks:
                break  # the chain was cut by eviction: nothing deeper could be found
            if self.pages is not None:
                rows = table.pages[i]
                self.pages.incref(rows)
                self._blocks[name] = _Block(parent, rows, nbytes=self.page_bytes)
            else:
                rows = self._rows(staging, i * k, row)
                self._blocks[name] = _Block(parent, rows, nbytes=_nbytes(rows))
            self.nbytes += self._blocks[name].nbytes
            if parent is not None:
                self._blocks[parent].children += 1
        if end % k == 0 and last and names[last - 1] in self._blocks:
            b = self._blocks[names[last - 1]]
            if b.state is None:
                b.state = self._state(staging, h, row)
                n = _nbytes(b.state)
                b.nbytes += n
                self.nbytes += n
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.budget and self._blocks:
            self.evict_one()

    def evict_one(self) -> bool:
        """Evicts the least recently used leaf (and the ancestors it leaves without use); False when empty. On
        pages, a block's page returns to the pool when no stream holds it."""
        if not self._blocks:
            return False
        name = next(n for n, b in self._blocks.items() if b.children == 0)  # a chain's leaf: the LRU one
        while name is not None:
            b = self._blocks.pop(name)
            self.nbytes -= b.nbytes
            if self.pages is not None:
                self.pages.decref(b.rows)
            self.stats["prefix_evicted_blocks"] += 1
            name = b.parent
            if name is None:
                break
            p = self._blocks[name]
            p.children -= 1
            if p.children or p.state is not None:
                break
        return True
