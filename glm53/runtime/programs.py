"""The device programs of one decode path, as one object (`Programs`): the serving engine drives it
(glm53.serving.engine), so does every synchronous caller through it (glm53.serving.offline), and
glm53.serving.multihost replays its named programs.

Programs (each a `jax.jit` function, compiled once at `warmup`; `compiled` counts them), by name:
  * ("decode", b) for each width b in `decode_widths` (default 1, 2, 4, ..., B): one token for each of the first
    b slots (tokens [b] in, next tokens [b] out), the cache donated; per-slot sampling on device (temperature,
    top-p, top-k, a key from (seed, token index)); inactive slots are masked (their length does not advance,
    their tokens are ignored), so a slot's rows hold garbage until it is reused. A step narrower than B reads
    its b rows and returns them (`narrow`), ("put",) writes them back; ("move",) copies a busy slot's rows into
    a free lower one, when that allows a narrower step (the engine's `_compact`);
  * ("prefill",): a chunk [w, C] of w prompts fed into a staging cache of w rows (one compile per shape);
  * ("insert",): the staging cache's rows written over their slots' (every row and position: nothing of a slot's
    previous request survives), each first token sampled from the prefill's last logits;
  * ("init",) a cache of b rows, ("h0", w) a fresh staging's last hidden states [w, 1, D].
The speculative variant (`speculative=True`, glm53.runtime.speculative) has the same names and signatures: its
decode verifies each slot's MTP draft, its prefill and insert also keep the MTP cache.
Constrained decoding: the decode and insert programs always take a bool mask [b, V] of the allowed next tokens.

Narrow decode steps: a decode step over B slots costs B rows of every matmul and attention whatever number of
slots is busy, so the step is compiled for widths b in `widths(B)`: width b takes b rows of tokens, masks and
sampling arguments and reads the first b rows of every cache array. As one program (slice, step, write back into
the donated cache) XLA:CPU copied every cache array whole, twice, per step: hence decode, then put. Every row's
computation is the full-width step's (sampling keys come from (seed, token index), not from the slot): greedy and
sampled tokens are the same at every width (tests/test_serving_engine.py). Slot operations go through
`glm53.runtime.cache.map_rows` (a scanned model's stacked caches: batch axis 1).
Decode programs read `decode_state` (glm53.runtime.weights; a sharded model: its state), the others the state.

Paged caches (`pages=(num_pages, page_tokens)`, glm53.layers.dsa.DSACache): every DSA layer's latent, scales and
pooled keys live in page pools shared by the slots and the staging caches (`pool`), apart from the rows
(`rows`: KDA states, indexer rings, page tables, lengths; glm53.runtime.cache.split_pool). Every program takes the
rows and the pool as two arguments, donated: a step writes its rows into the pool in place, a narrow step slices
only the rows, insert copies only rows (the prefill already wrote the pages), and ("pages",) writes page tables
into a cache's rows. Which pages a stream holds is the caller's (glm53.serving.pages); a contiguous cache is the
same code with an empty pool.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53 import parallel as S
from glm53.model import Cache, Glm53Model
from glm53.runtime import sampling
from glm53.runtime import speculative as spec
from glm53.runtime.cache import join_pool, move, narrow, put, set_pages, split_pool, write_rows
from glm53.runtime.weights import decode_state

# XLA:CPU options of every program but prefill on CPU (`cpu_options`; a caller's compiler_options on top).
# YNNPACK fusions off: XLA:CPU turns the decode step's multi-row dots ([b, 256] x [256, 512] on glm53-mini) into
# YNNPACK fusions that ran slower than its own dot emitter / Eigen; a 1-row dot is a gemv either way. Measured
# (glm53-mini, decode step alone, `experiments.bench_serve --step_costs`, 300 interleaved calls per program, p10,
# 2 loaded cores): time without / with the fusions at 1 / 2 / 4 / 8 / 16 slots = 0.92 / 0.94 / 0.80 / 0.76 /
# 0.75. xla_cpu_prefer_vector_width=512 on top: 0.86 / 0.96 / 1.02 / 1.05 / 1.04 (noise: not taken);
# xla_cpu_parallel_codegen_split_count=1, xla_cpu_multi_thread_eigen=false: no consistent change;
# xla_cpu_use_thunk_runtime no longer exists. The fusions also crashed XLA:CPU on the train step
# (glm53.train.step.CPU_OPTIONS); in jaxlib 0.10.2 they crash or hang on some rank-7/8 broadcast-multiply-reduces
# (jax-ml/jax#39257). Prefill keeps them (2.4x faster with quantized experts, below): its fusions are of rank <= 5
# on glm53-mini (checked in an XLA dump); the test suite runs with them off (tests/conftest.py).
CPU_OPTIONS: dict = {"xla_cpu_experimental_ynn_fusion_type": ""}


def cpu_options(options: dict | None) -> dict | None:
    """The options the programs compile with: on CPU `CPU_OPTIONS` updated by `options` (a None value drops the
    option: XLA's default); elsewhere `options`."""
    if jax.default_backend() != "cpu":
        return options
    return {k: v for k, v in {**CPU_OPTIONS, **(options or {})}.items() if v is not None} or None


def widths(slots: int) -> tuple[int, ...]:
    """The decode widths compiled for `slots` slots: the powers of two below it, then `slots`."""
    return tuple(1 << i for i in range(slots.bit_length()) if 1 << i < slots) + (slots,)


def check_widths(ws, slots: int) -> tuple[int, ...]:
    """`ws` sorted and checked (ValueError naming decode_widths): integers in [1, slots] including slots."""
    out = tuple(sorted(set(ws)))
    if not out or out[-1] != slots or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in out):
        raise ValueError(f"decode_widths={tuple(ws)!r}: integers in [1, slots={slots}] including {slots}")
    return out


def build(graphdef, keys: Callable):
    """The plain decode, prefill and insert functions (not compiled; the module docstring says what each does);
    `keys(seeds, counts)` makes the per-slot sampling keys."""
    gd = graphdef

    def decode(state, cache, tokens, drafts, active, verify, mask, counts, seeds, temp, top_p, top_k):
        m = nnx.merge(gd, state)
        h, new = m.hidden(tokens[:, None], cache=cache)
        logits = jnp.where(mask, m.logits(h)[:, -1], -jnp.inf)  # mask [B, V]: constrained decoding
        new = new.replace(length=jnp.where(active, new.length, cache.length))
        return sampling.sample(logits, keys(seeds, counts), temp, top_p, top_k), new

    def prefill(state, staging, tokens, h_prev):  # h_prev, h: used by the speculative variant
        m = nnx.merge(gd, state)
        h, staging = m.hidden(tokens, cache=staging)
        return m.logits(h[:, -1:])[:, -1], h[:, -1:], staging

    def insert(state, cache, staging, slots, logits, h_last, mask, seed, temp, top_p, top_k):
        logits = jnp.where(mask, logits, -jnp.inf)
        tok = sampling.sample(logits, keys(seed, jnp.zeros_like(slots)), temp, top_p, top_k)
        return jnp.stack([tok, tok], axis=1), write_rows(cache, staging, slots)  # (first token, its draft: none)

    return decode, prefill, insert


def _pooled(decode, prefill, insert):
    """The programs on (rows, pool) pairs (module docstring): each joins its cache arguments with the pool, runs,
    and returns the new rows and pool apart. decode -> (out, rows, pool); prefill -> (logits, h, staging rows,
    pool); insert -> (out, rows, pool)."""

    def decode_p(state, rows, pool, *args):
        out, new = decode(state, join_pool(rows, pool), *args)
        return (out, *split_pool(new))

    def prefill_p(state, staging, pool, tokens, h_prev):
        logits, h, staging = prefill(state, join_pool(staging, pool), tokens, h_prev)
        return (logits, h, *split_pool(staging))

    def insert_p(state, rows, staging, pool, *args):
        out, new = insert(state, join_pool(rows, pool), join_pool(staging, pool), *args)
        return (out, *split_pool(new))

    return decode_p, prefill_p, insert_p


def placed(fn: Callable, place: Callable, replicated, *args):
    """`fn(*args)` (decode, prefill or insert: a tuple) with every Cache in the cache's shardings (`place`) and
    every other output replicated: a sharded model's programs then take back the layouts they return (one
    compile per program and shape, not one more per input layout)."""
    return tuple(place(x) if isinstance(x, Cache) else jax.lax.with_sharding_constraint(x, replicated)
                 for x in fn(*args))  # fmt: skip


def greedy_args(n: int):
    """(seeds, temperature, top_p, top_k) [n] of n idle (greedy) rows: the sampling arguments' dtypes."""
    return np.zeros(n, np.uint32), np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32)


class Programs:
    """The programs over one model and a cache of `slots` rows of `max_len` positions (`cache`, which `decode`,
    `insert`, `move` and `reset` replace). decode_widths: the decode step's widths (None: 1, 2, ..., slots; a
    sharded model: slots only); prefill_widths: the staging caches' widths; speculative: the MTP variant (the
    model needs its MTP block); compiler_options go to every `jax.jit` (on CPU all but prefill on top of
    `CPU_OPTIONS`); mesh / rules: the mesh and rule set a sharded model was placed with (caches are made in the rules' shardings).
    `fns` maps each program's name (module docstring) to its jitted function: the methods call them there, so
    replacing an entry (glm53.serving.multihost, a test's fault) changes what runs."""

    def __init__(self, model: Glm53Model, *, slots: int, max_len: int, decode_widths=None, prefill_widths=(1,),
                 speculative: bool = False, compiler_options: dict | None = None, mesh=None, rules="tp",
                 pages: tuple[int, int] | None = None):  # fmt: skip
        if speculative and model.mtp is None:
            raise ValueError("speculative=True: the model has no MTP block (build it with with_mtp=True)")
        if pages is not None and mesh is not None:
            raise NotImplementedError("paged caches run on one device for now: pass pages=None with a mesh")
        self.pages = pages
        self.cfg, self.speculative, self.slots, self.max_len = model.cfg, bool(speculative), slots, max_len
        if decode_widths is None:
            decode_widths = widths(slots) if mesh is None else (slots,)
        self.decode_widths, self.prefill_widths = check_widths(decode_widths, slots), tuple(prefill_widths)
        self.jit = functools.partial(jax.jit, compiler_options=cpu_options(compiler_options))
        # prefill: XLA's own CPU options (`CPU_OPTIONS` were measured on the decode step; with the YNNPACK fusions
        # off a 64-token prefill of configs/tiny.py:small with Q8_0 experts ran 166 vs 397 tok/s, dense 698 vs 742)
        prefill_jit = functools.partial(jax.jit, compiler_options={
            k: v for k, v in (compiler_options or {}).items() if v is not None} or None)  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        gd = self.graphdef
        rows = 2 if self.speculative else 1  # tokens per slot in a step
        self.dstates = {b: self.state if mesh is not None else decode_state(model, self.state, b * rows)
                        for b in self.decode_widths}  # fmt: skip
        place = (lambda c: c) if mesh is None else (  # caches in the rules' shardings (a sharded model)
            lambda c: jax.lax.with_sharding_constraint(c, S.cache_shardings(c, mesh, rules)))  # fmt: skip
        rep = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def keys(seeds, counts):
            return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counts)

        decode, prefill, insert = (spec.build if self.speculative else build)(gd, keys)
        if rep is not None:  # sharded: outputs placed as the inputs come (no second compile per program)
            decode, prefill, insert = (functools.partial(placed, f, place, rep) for f in (decode, prefill, insert))
        decode, prefill, insert = _pooled(decode, prefill, insert)
        jit, d, dt = self.jit, self.cfg.hidden_size, model.dtype
        fns = {("decode", b): jit(narrow(decode, b), donate_argnums=(2,)) for b in self.decode_widths[:-1]}  # put
        fns["decode", slots] = jit(decode, donate_argnums=(1, 2))
        fns.update({("h0", w): jit(lambda w=w: jnp.zeros((w, 1, d), dt), out_shardings=rep)
                    for w in self.prefill_widths})  # fmt: skip
        # fresh functions: jit's cache, which `compiled` counts, is per function (not per object)
        fns["prefill",] = prefill_jit(prefill, donate_argnums=(1, 2))
        fns["insert",] = jit(insert, donate_argnums=(1, 3))
        fns["move",] = jit(lambda cache, src, dst: move(cache, src, dst), donate_argnums=(0,))
        fns["put",] = jit(lambda cache, rows: put(cache, rows), donate_argnums=(0,))

        def init(state, b):  # the rows of an empty cache of b rows; b = 0: the page pool (None: contiguous)
            rows, pool = split_pool(place(nnx.merge(gd, state).init_cache(max(b, 1), max_len, pages=pages)))
            return pool if b == 0 else rows

        fns["init",] = jit(init, static_argnums=(1,))
        if pages is not None:
            fns["pages",] = jit(set_pages, donate_argnums=(0,))
        self.fns: dict[tuple, Callable] = dict(sorted(fns.items(), key=str))
        self.pool = self._init_pool()
        self.rows = self.init(slots)

    # -------------------------------------------------------------------------------------------- calls
    @property
    def cache(self) -> Cache:
        """The slots' cache (their rows with the page pool; a contiguous cache: the rows)."""
        return join_pool(self.rows, self.pool)

    def init(self, b: int) -> Cache:
        """The rows of an empty cache of b rows (a paged cache's tables all scratch; its pages are the pool's)."""
        return self.fns["init",](self.state, b)

    def reset(self) -> None:
        """The slots' cache rebuilt empty (after a failed step that had it donated), the pool too."""
        self.pool = self._init_pool()
        self.rows = self.init(self.slots)

    def _init_pool(self):
        """The page pools, empty (a contiguous cache's: a tree without arrays, nothing compiled)."""
        if self.pages is None:
            return self.fns["init",].eval_shape(self.state, 0)
        return self.fns["init",](self.state, 0)

    def set_pages(self, rows: Cache | None, table) -> Cache | None:
        """`rows` (a staging cache's; None: the slots') with page tables `table` int32 [rows, M] (donated)."""
        if rows is None:
            self.rows = self.fns["pages",](self.rows, np.asarray(table, np.int32))
            return None
        return self.fns["pages",](rows, np.asarray(table, np.int32))

    def h0(self, w: int):
        return self.fns["h0", w]()

    def prefill(self, staging: Cache, tokens, h):
        """(last logits [w, V], last hidden [w, 1, D], staging) after the chunk `tokens` [w, C] (staging donated;
        a paged staging writes into the pool)."""
        logits, h, staging, self.pool = self.fns["prefill",](self.state, staging, self.pool, tokens, h)
        return logits, h, staging

    def insert(self, staging: Cache, slots, logits, h, mask, *args) -> np.ndarray:
        """Writes staging row i over slot slots[i] (< 0: not written); int32 [w, 2] (first token, its draft)."""
        out, self.rows, self.pool = self.fns["insert",](self.state, self.rows, staging, self.pool, slots, logits, h,
                                                        mask, *args)  # fmt: skip
        return np.asarray(out)

    def decode(self, tokens, drafts, active, verify, mask, counts, args) -> np.ndarray:
        """The step of width b = len(active) over the first b slots: tokens [b] (plain) or rows (y0, y1, accepted,
        next draft) [b, 4] (speculative): the one host transfer."""
        b = len(active)
        out, new, self.pool = self.fns["decode", b](self.dstates[b], self.rows, self.pool, tokens, drafts, active,
                                                    verify, mask, counts, *args)  # fmt: skip
        self.rows = new if b == self.slots else self.fns["put",](self.rows, new)
        return np.asarray(out)

    def move(self, src: int, dst: int) -> None:
        self.rows = self.fns["move",](self.rows, src, dst)

    # -------------------------------------------------------------------------------------------- compiling
    def compiled(self) -> int:
        """Programs compiled so far (decode per width, put and move when narrower widths exist, prefill per (width,
        bucket), insert per width, cache init and fresh h per width)."""
        skip = () if len(self.decode_widths) > 1 else (("move",), ("put",))
        return sum(f._cache_size() for k, f in self.fns.items() if k not in skip)

    def held(self) -> list[jax.Array]:
        """The device arrays this object holds, in a fixed order: the state, the decode states, the cache."""
        trees = (self.state, *(self.dstates[b] for b in self.decode_widths), self.rows, self.pool)
        return [x for t in trees for x in jax.tree.leaves(t) if isinstance(x, jax.Array)]

    def warmup(self, buckets, max_chunk: int, log: Callable[[str], None] | None = None,
               staged: Callable | None = None) -> None:  # fmt: skip
        """Compiles every program once: decode per width, prefill per (width, chunk: every bucket at width 1, those
        <= max_chunk wider), insert per width; `staged(staging, h)` after each width's chunks (the prefix
        cache's programs); a line per program to `log`."""
        vocab = self.cfg.vocab_size
        for b in self.decode_widths:
            t, z, zi = time.perf_counter(), np.zeros(b, bool), np.zeros(b, np.int32)
            self.decode(zi, zi, z, z, jnp.ones((b, vocab), bool), zi, greedy_args(b))
            if log:
                log(f"compiled decode [{b} slots{', speculative' if self.speculative else ''}] "
                    f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
        m = None if self.pages is None else -(-self.max_len // self.pages[1])  # paged: the tables' width
        if m is not None:
            self.set_pages(None, np.zeros((self.slots, m), np.int32))
        for w in self.prefill_widths:
            staging, h = self.init(w), self.h0(w)
            if m is not None:
                staging = self.set_pages(staging, np.zeros((w, m), np.int32))
            for c in buckets if w == 1 else [c for c in buckets if c <= max_chunk]:
                t = time.perf_counter()
                logits, h, staging = self.prefill(staging, np.zeros((w, c), np.int32), h)
                jax.block_until_ready(logits)
                if log:
                    log(f"compiled prefill chunk {c}" + (f" x {w} requests" if w > 1 else "")
                        + f" ({time.perf_counter() - t:.1f} s)")  # fmt: skip
            if staged:
                staged(staging, h)
            staging, h = self.init(w), self.h0(w)  # fresh: the warm-up chunks may pass max_len
            self.insert(staging, np.full(w, -1, np.int32), logits, h, jnp.ones((w, vocab), bool), *greedy_args(w))
        if len(self.decode_widths) > 1:
            self.move(0, 0)
