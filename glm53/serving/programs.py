"""The serving engine's programs (glm53.serving.engine): the plain decode / prefill / insert functions, the decode
step narrowed to the first b slots, the XLA:CPU options the engine compiles them with, and an engine's jitted
programs (`build_programs`) and their compilation (`warmup`).

Narrow decode steps: a decode step over B slots costs B rows of every matmul and attention whatever number of
slots is busy. The engine therefore compiles the step for widths b in `widths(B)` = (1, 2, 4, ..., B): width b
takes b rows of tokens, masks and sampling arguments and reads the first b rows of every cache array. Requests
are admitted into the lowest free slot and each step runs the smallest width covering the highest busy slot, so
one stream in a 16-slot engine pays a 1-slot step. When requests leave holes below the highest busy slot and
moving it down would allow a narrower step, the engine moves it (`move`: its cache rows copied to the free slot).
A narrower step is two programs: the step, which reads its b rows of the cache and returns their new values, then
`put`, which writes them back in place (the cache donated). As one program (slice, step, write back into the
donated cache) XLA:CPU copied every cache array whole, twice, per step. Every row's computation is the
full-width step's (the same function per row; sampling keys come from (seed, token index), not from the slot):
greedy and sampled tokens are the same (tests/test_serving_engine.py).
Every slot operation goes through `glm53.generate.map_rows`, which names each cache array's batch axis (1 in a
scanned model's stacked caches, whose leading axis is the repeats; 0 otherwise).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53 import sampling
from glm53.generate import map_rows
from glm53.model import Cache
from glm53.serving.admit import Group, sampling_args

# XLA:CPU options of every engine program on CPU (`cpu_options`; a caller's compiler_options are added on top).
# YNNPACK fusions off: XLA:CPU turns the decode step's multi-row dots ([b, 256] x [256, 512] on glm53-mini) into
# YNNPACK fusions that ran slower than its own dot emitter / Eigen; a 1-row dot is a gemv either way. Measured
# (glm53-mini, decode step alone, `experiments.bench_serve --step_costs`, 300 interleaved calls per program, p10,
# 2 loaded cores): time without / with the fusions at 1 / 2 / 4 / 8 / 16 slots = 0.92 / 0.94 / 0.80 / 0.76 /
# 0.75. xla_cpu_prefer_vector_width=512 on top: 0.86 / 0.96 / 1.02 / 1.05 / 1.04 (noise: not taken);
# xla_cpu_parallel_codegen_split_count=1, xla_cpu_multi_thread_eigen=false: no consistent change;
# xla_cpu_use_thunk_runtime no longer exists. The fusions also crashed XLA:CPU on the train step
# (glm53.train.step.CPU_OPTIONS).
CPU_OPTIONS: dict = {"xla_cpu_experimental_ynn_fusion_type": ""}


def cpu_options(options: dict | None) -> dict | None:
    """The options the engine compiles with: on CPU `CPU_OPTIONS` updated by `options` (a None value drops the
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


def narrow(decode: Callable, b: int) -> Callable:
    """`decode(state, cache, *rows)` (every `rows` argument has b rows) on the first b rows of a wider cache,
    which it only reads: -> (out, the b rows' new cache), which `put` writes back (a second program)."""

    def run(state, cache, *rows):
        return decode(state, map_rows(lambda a, axis: jax.lax.slice_in_dim(a, 0, b, axis=axis), cache), *rows)

    return run


def put(cache, rows):
    """The cache with `rows` (a cache of its first b slots) written over its first b slots (donate `cache`)."""

    def one(a, n, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, n.astype(a.dtype), 0, axis)

    return map_rows(one, cache, rows)


def move(cache, src, dst):
    """The cache with slot `src`'s rows (every array, every position) copied over slot `dst`'s."""

    def one(a, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis), dst, axis)

    return map_rows(one, cache)


def build(graphdef, keys: Callable):
    """The plain decode, prefill and insert functions (not compiled; the engine's docstring says what each
    does); `keys(seeds, counts)` makes the per-slot sampling keys."""
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


def write_rows(cache, staging, slots):
    """The cache with staging row i written over slot `slots[i]` for every i whose slot is >= 0 (the others, a
    group's padding and cancelled rows, write nothing: slot 0's own rows back). Every array, every position."""
    for i in range(slots.shape[0]):
        ok = slots[i] >= 0
        dst = jnp.where(ok, slots[i], 0)

        def one(a, s, axis, i=i, ok=ok, dst=dst):
            row = jax.lax.slice_in_dim(s, i, i + 1, axis=axis).astype(a.dtype)
            row = jnp.where(ok, row, jax.lax.dynamic_slice_in_dim(a, dst, 1, axis))
            return jax.lax.dynamic_update_slice_in_dim(a, row, dst, axis)

        cache = map_rows(one, cache, staging)
    return cache


def placed(fn: Callable, place: Callable, replicated, *args):
    """`fn(*args)` (decode, prefill or insert: a tuple) with every Cache in the cache's shardings (`place`) and
    every other output replicated: a sharded engine's programs then take back the layouts they return (one
    compile per program and shape, not one more per input layout)."""
    return tuple(place(x) if isinstance(x, Cache) else jax.lax.with_sharding_constraint(x, replicated)
                 for x in fn(*args))  # fmt: skip


def build_programs(eng, compiler_options, build_fn: Callable) -> None:
    """Sets engine `eng`'s jitted programs (attributes of the engine itself, which glm53.serving.multihost finds
    there): `build_fn` is `build` or its speculative variant (glm53.serving.speculative.build)."""
    gd = eng.graphdef
    jit = functools.partial(jax.jit, compiler_options=compiler_options)

    def keys(seeds, counts):
        return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counts)

    decode, prefill, insert = build_fn(gd, keys)
    if eng._rep is not None:  # sharded: outputs placed as the inputs come (no second compile per program)
        decode, prefill, insert = (functools.partial(placed, f, eng._place, eng._rep)
                                   for f in (decode, prefill, insert))  # fmt: skip
    d, dt = eng.cfg.hidden_size, eng._h_dtype  # a fresh staging's h [w, 1, D], where prefill's h lives
    eng._h0 = {w: jit(lambda w=w: jnp.zeros((w, 1, d), dt), out_shardings=eng._rep) for w in eng.prefill_widths}
    eng._prefill, eng._insert = jit(prefill, donate_argnums=(1,)), jit(insert, donate_argnums=(1,))
    eng._decodes = {b: jit(narrow(decode, b)) for b in eng.decode_widths[:-1]}  # then `put`
    eng._decodes[eng.slots] = jit(decode, donate_argnums=(1,))
    # fresh functions: jit's cache, which `compiled_programs` counts, is per function (not per engine)
    eng._move = jit(lambda cache, src, dst: move(cache, src, dst), donate_argnums=(0,))
    eng._put = jit(lambda cache, rows: put(cache, rows), donate_argnums=(0,))
    place, max_len = eng._place, eng.max_len
    eng._init = jit(lambda state, b: place(nnx.merge(gd, state).init_cache(b, max_len)), static_argnums=(1,))


def compiled(eng) -> int:
    """Programs engine `eng` compiled so far (decode per width, put per narrower width, move, prefill per (prefill
    width, bucket), insert, cache init and fresh h per prefill width, the prefix cache's four and two more per
    prefill width > 1)."""
    extra = (*eng._decodes.values(), *eng._h0.values(), *(eng.prefix.programs if eng.prefix else ()))
    extra += (eng._move, eng._put) if len(eng.decode_widths) > 1 else ()
    return sum(f._cache_size() for f in (eng._prefill, eng._insert, eng._init, *extra))


def warmup(eng, log: Callable[[str], None] | None = None) -> float:
    """Compiles every program of engine `eng` once (a line per program to `log`); returns the seconds it took."""
    t0 = time.perf_counter()
    for b in eng.decode_widths:
        t, z, none = time.perf_counter(), np.zeros(b, bool), [None] * b
        eng._run_decode(z, z, eng._masks(none), np.zeros(b, np.int32), sampling_args(none, b))
        if log:
            log(f"compiled decode [{b} slots{', speculative' if eng.speculative else ''}] "
                f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
    for w in eng.prefill_widths:
        g = Group([], w, eng._init(eng.state, w), [], h=eng._h0[w]())
        for c in eng.buckets if w == 1 else [c for c in eng.buckets if c <= eng.prefill_batch_chunk]:
            t = time.perf_counter()
            logits, g.h, g.staging = eng._prefill(eng.state, g.staging, np.zeros((w, c), np.int32), g.h)
            jax.block_until_ready(logits)
            if log:
                log(f"compiled prefill chunk {c}" + (f" x {w} requests" if w > 1 else "")
                    + f" ({time.perf_counter() - t:.1f} s)")  # fmt: skip
        if eng.prefix:
            jax.block_until_ready(eng.prefix.warmup(g.staging, g.h if eng.speculative else None))
        g.staging, g.h = eng._init(eng.state, w), eng._h0[w]()  # fresh: the warm-up chunks may pass max_len
        eng._run_insert(g, logits)
    if len(eng.decode_widths) > 1:
        eng.cache = eng._move(eng.cache, 0, 0)
    eng.warm = True
    dt = time.perf_counter() - t0
    if log:
        log(f"engine warm: {eng.compiled_programs()} programs in {dt:.1f} s")
    return dt
