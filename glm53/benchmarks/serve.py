"""The serving benchmark (experiments.bench_serve): the continuous-batching engine under N concurrent streams.

One run (`run_streams`): an engine of `slots` slots is built and warmed, one untimed request runs, then N greedy
requests (prompts of `prompt_len` tokens: a `shared` prefix common to all, e.g. a system prompt, then a tail of
their own; `max_new` tokens each, no EOS) are submitted at once and run to completion in this thread. Measured:
total and per-stream tokens/s, time to first token (from submission) and inter-token latency (p50 / p99), the
decode steps and their mean wall time, the prefix cache's saved prefill and MTP's acceptance when enabled.

Cost against distinct experts: the engine's decode step touches, per MoE layer, the union of the experts its
active slots are routed to. `distinct_experts` replays each stream's tokens through the model with recording
routers (glm53.train.routing) and, for every decode step, counts that union per layer (the step's (slot,
position) pairs are known from when each token came out). The prior art's decode costs one expert matvec per
(token, expert) pair; ours follows the distinct experts, so the step time should grow with them, not with N x K.
The replay's routing is the full-sequence forward's, which equals decoding's up to float rounding (a near tie
between two experts may differ).

Serving at a token budget (`run_mixed`, experiments.bench_serve --mixed=N): N greedy streams of mixed lengths
(`mixed_lengths`: prompt + max_new log-uniform over [lo, hi] tokens, a fixed seed) submitted at once to one engine
and run to completion: on paged caches (many slots sharing a pool of cache_tokens) or contiguous ones (cache_tokens
// max_len slots of max_len positions: the same DSA cache bytes, fewer streams at once, the rest queue). Measured:
streams in slots at once (the most seen after any step), total tokens/s, TTFT p50 / p99 (from submission), the
finish reasons (streams ended by the pool running out: `finish_out_of_pages`), page waits and the process's peak RSS.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import resource
import time
from collections import defaultdict
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.files import atomic_write
from glm53.serving import engine as E
from glm53.serving.admit import sampling_args
from glm53.train import routing


def _pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) * 1000 if len(xs) else None


def prompts(n: int, prompt_len: int, shared: int, vocab: int) -> list[list[int]]:
    """n prompts of prompt_len tokens: the first `shared` tokens common to all, the rest different per prompt."""
    head = [(11 * j + 3) % vocab for j in range(shared)]
    return [head + [(7 * i + j + 1) % vocab for j in range(prompt_len - shared)] for i in range(n)]


def bench_engine(
    model, *, slots: int, prompt_len: int, max_new: int, engine_kwargs: dict | None = None
) -> E.Engine:
    """The engine `run_streams` measures (several processes: every process builds it, `glm53.serving.multihost`)."""
    return E.Engine(model, slots=slots, max_len=prompt_len + max_new + 2, buckets=(1, 16), eos_ids=(),
                    **(engine_kwargs or {}))  # fmt: skip


def run_streams(model, vocab: int, n: int, *, slots: int, prompt_len: int, max_new: int, shared: int = 0,
                engine_kwargs: dict | None = None, engine: E.Engine | None = None) -> tuple[dict, dict]:  # fmt: skip
    """(row, trace): the row of measurements; trace = {request id: (prompt, generated, [step of each token])}.
    engine: a `bench_engine` of the same arguments (e.g. one led over several processes); None: a new one."""
    eng = engine if engine is not None else bench_engine(model, slots=slots, prompt_len=prompt_len,
                                                         max_new=max_new, engine_kwargs=engine_kwargs)  # fmt: skip
    eng.warmup()
    E.generate(eng, [E.Request([1] * 3, max_tokens=2)])  # one untimed request (shares nothing with the prompts)
    stats0 = dict(eng.stats)
    times: dict[str, list[float]] = defaultdict(list)
    steps: dict[str, list[int]] = defaultdict(list)
    toks: dict[str, list[int]] = defaultdict(list)

    def sink(ev: E.Event) -> None:
        now = time.perf_counter()
        for t in ev.token_ids:
            times[ev.request_id].append(now)
            steps[ev.request_id].append(eng.stats["steps"])
            toks[ev.request_id].append(t)

    ps = prompts(n, prompt_len, shared, vocab)
    reqs = [E.Request(p, max_tokens=max_new) for p in ps]
    t0 = time.perf_counter()
    for r in reqs:
        eng.submit(r, sink)
    eng.run_until_idle()
    dt = time.perf_counter() - t0
    d = {k: eng.stats[k] - stats0.get(k, 0) for k in eng.stats}
    ttft = [ts[0] - t0 for ts in times.values()]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    total = sum(len(ts) for ts in times.values())
    row = {"streams": n, "slots": slots, "prompt_len": prompt_len, "shared_prefix": shared, "max_new": max_new,
           "tokens": total, "seconds": dt, "total_tok_s": total / dt, "per_stream_tok_s": total / dt / n,
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "itl_p50_ms": _pct(itl, 50),
           "itl_p99_ms": _pct(itl, 99), "decode_steps": d.get("steps", 0),
           "prefill_tokens": d.get("prefill_tokens", 0)}  # fmt: skip
    if d.get("decode_us"):
        row["decode_step_ms"] = d["decode_us"] / 1000 / max(d.get("steps", 1), 1)
    for key in ("prefix_hit_tokens", "prefix_hits", "prefix_lookups", "mtp_drafted", "mtp_accepted"):
        if key in eng.stats:
            row[key] = d.get(key, 0)
    if row.get("mtp_drafted"):
        row["mtp_acceptance"] = row["mtp_accepted"] / row["mtp_drafted"]
    trace = {r.id: (r.prompt, toks[r.id], steps[r.id]) for r in reqs}
    return row, trace


def mixed_lengths(n: int, lo: int, hi: int, seed: int = 0, prompt_share: float = 0.75) -> list[tuple[int, int]]:
    """n (prompt, max_new) pairs whose totals are log-uniform over [lo, hi] (rounded; a fixed seed): the prompt
    `prompt_share` of the total (at least 1 token), max_new the rest (at least 1)."""
    if not 2 <= lo <= hi or not 0 <= prompt_share <= 1:
        raise ValueError(f"mixed_lengths: need 2 <= lo={lo} <= hi={hi} and 0 <= prompt_share={prompt_share} <= 1")
    totals = np.exp(np.random.default_rng(seed).uniform(np.log(lo), np.log(hi), n))
    out = []
    for t in np.clip(np.rint(totals).astype(int), lo, hi):
        p = min(max(1, int(t * prompt_share)), int(t) - 1)
        out.append((p, int(t) - p))
    return out


def mixed_prompts(lengths: list[tuple[int, int]], vocab: int) -> list[list[int]]:
    """A prompt of each (prompt, max_new)'s length, different per stream (`prompts`' tokens, nothing shared)."""
    return [[(7 * i + j + 1) % vocab for j in range(p)] for i, (p, _) in enumerate(lengths)]


def _reset_peak_rss() -> bool:
    """Resets the process's peak RSS (Linux VmHWM, /proc/self/clear_refs "5"); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb(reset: bool) -> float:
    """The peak RSS (MiB) since `_reset_peak_rss` (reset True: VmHWM), else the process's (ru_maxrss, KiB on Linux)."""
    if reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mixed(model, vocab: int, lengths: list[tuple[int, int]], *, slots: int, max_len: int,
              cache_tokens: int | None = None, page_tokens: int = 16, buckets=(1, 16, 256),
              engine_kwargs: dict | None = None) -> dict:  # fmt: skip
    """One engine (paged on `cache_tokens` tokens in pages of `page_tokens`; None: contiguous, slots x max_len)
    built and warmed, one untimed request, then one greedy request per (prompt, max_new) of `lengths` (no EOS)
    submitted at once and stepped to completion in this thread: the row of measurements (module docstring)."""
    kw = dict(engine_kwargs or {})
    if cache_tokens is not None:
        kw.update(cache_tokens=cache_tokens, page_tokens=page_tokens, prefix_block=page_tokens)
    buckets = [b for b in buckets if b <= max_len] or [1]  # no warm-up chunk past the cache
    eng = E.Engine(model, slots=slots, max_len=max_len, buckets=buckets, eos_ids=(), **kw)
    compile_s = eng.warmup()
    E.generate(eng, [E.Request([1] * 3, max_tokens=2)])  # one untimed request
    stats0 = dict(eng.stats)
    first: dict[str, float] = {}
    counts: dict[str, int] = defaultdict(int)
    reasons: dict[str, int] = defaultdict(int)

    def sink(ev: E.Event) -> None:
        if ev.token_ids:
            first.setdefault(ev.request_id, time.perf_counter())
            counts[ev.request_id] += len(ev.token_ids)
        if ev.finish_reason is not None:
            reasons[ev.finish_reason] += 1

    reqs = [E.Request(p, max_tokens=m) for p, (_, m) in zip(mixed_prompts(lengths, vocab), lengths)]
    reset = _reset_peak_rss()
    t0, busy_max = time.perf_counter(), 0
    for r in reqs:
        eng.submit(r, sink)
    while True:
        worked = eng.step()
        busy_max = max(busy_max, eng.busy_slots)
        if not worked and eng.idle():
            break
    dt = time.perf_counter() - t0
    d = {k: eng.stats[k] - stats0.get(k, 0) for k in eng.stats}
    ttft = [first[r.id] - t0 for r in reqs if r.id in first]
    total = sum(counts.values())
    pool_bytes = sum(int(a.nbytes) for a in jax.tree.leaves(eng.programs.pool))  # the DSA pages (contiguous: 0)
    cache_bytes = pool_bytes + sum(int(a.nbytes) for a in jax.tree.leaves(eng.programs.rows))  # + per-slot rows
    row = {"mode": "paged" if cache_tokens is not None else "contiguous", "streams": len(reqs), "slots": slots,
           "max_len": max_len, "cache_tokens": cache_tokens if cache_tokens is not None else slots * max_len,
           "page_tokens": page_tokens if cache_tokens is not None else None, "cache_bytes": cache_bytes,
           "pool_bytes": pool_bytes, "prompt_tokens": sum(p for p, _ in lengths),
           "max_new_tokens": sum(m for _, m in lengths),
           "max_busy_slots": busy_max, "tokens": total, "seconds": dt, "total_tok_s": total / dt,
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "finished": sum(reasons.values()),
           "finish_reasons": dict(sorted(reasons.items())), "finish_out_of_pages": d.get("finish_out_of_pages", 0),
           "page_waits": d.get("page_waits", 0), "decode_steps": d.get("steps", 0), "compile_s": compile_s,
           "peak_rss_mb": _peak_rss_mb(reset), "peak_rss_since": "run" if reset else "process"}  # fmt: skip
    return row


def step_costs(model, slots: list[int], options: dict[str, dict | None], *, max_len: int, rounds: int = 200,
               full_slots: int = 0) -> list[dict]:  # fmt: skip
    """The decode step's wall time (ms) at each slot count under each set of compile options (name -> the
    engine's compiler_options), every program called in turn `rounds` times (interleaved: load on a shared
    machine hits all alike): p10 and median per (slots, options). With full_slots, also the narrow steps of one
    engine of full_slots slots ("narrow" rows: width b of full_slots, the engine's default options). Idle slots
    cost what busy ones do (fixed shapes), so the steps run with every slot idle (no length advances)."""
    progs = {}
    for n in slots:
        for name, opts in options.items():
            eng = E.Engine(model, slots=n, max_len=max_len, buckets=(1,), decode_widths=(n,), compiler_options=opts)
            progs[(n, name)] = eng, n
    if full_slots:
        eng = E.Engine(model, slots=full_slots, max_len=max_len, buckets=(1,))
        for b in eng.decode_widths:
            progs[(b, f"narrow of {full_slots}")] = eng, b
    calls = {}
    for key, (eng, b) in progs.items():
        z, zi, none = np.zeros(b, bool), np.zeros(b, np.int32), [None] * b
        args = (zi, zi, z, z, eng._masks(none), zi, sampling_args(none, b))
        calls[key] = functools.partial(eng.programs.decode, *args)  # an idle step of width b (compiles here)
        calls[key]()
    times: dict = defaultdict(list)
    for _ in range(rounds):
        for key, call in calls.items():
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
    return [{"slots": n, "options": name, "step_p10_ms": _pct(ts, 10), "step_p50_ms": _pct(ts, 50)}
            for (n, name), ts in times.items()]  # fmt: skip


def median_rows(runs: list[tuple], settings: int) -> tuple[list[tuple[dict, dict]], dict]:
    """From runs (setting index, round, row, trace): per setting, in setting order, the (row, trace) of the round
    whose total tokens/s is the median (the lower middle of an even count), and {(streams, setting): every
    round's total tokens/s}."""
    out, totals = [], {}
    for i in range(settings):
        mine = sorted((r for r in runs if r[0] == i), key=lambda r: r[2]["total_tok_s"])
        if not mine:
            continue
        _, _, row, trace = mine[(len(mine) - 1) // 2]
        row["rounds"] = len(mine)
        out.append((row, trace))
        totals[row["streams"], setting(row)] = [r[2]["total_tok_s"] for r in sorted(mine, key=lambda r: r[1])]
    return out, totals


def distinct_experts(model, trace: dict) -> dict | None:
    """Mean distinct experts per MoE layer per decode step, and (token, expert) pairs per layer per step, from
    the replayed routing (module docstring); None for a model without routed experts."""
    names = routing.instrument_routers(model)  # in place; routes exactly as before
    names = [n for n in names if not n.startswith("mtp")]
    if not names:
        return None
    graphdef, state = nnx.split(model)

    @jax.jit
    def route(state, tokens):
        m = nnx.merge(graphdef, state)
        with routing.record_routing() as rec:
            m.hidden(tokens)
        return {k: rec[k][0] for k in names}

    per_step: dict[int, list[np.ndarray]] = defaultdict(list)  # step -> the fed positions' ids [layers, K]
    for prompt, gen, steps in trace.values():
        if len(gen) < 2:
            continue
        fed = jnp.asarray([prompt + gen[:-1]], jnp.int32)
        ids = np.stack([np.asarray(v) for v in route(state, fed).values()])  # [layers, T, K]
        for j in range(1, len(gen)):  # token j came out of decode step steps[j], which fed gen[j - 1]
            per_step[steps[j]].append(ids[:, len(prompt) + j - 1])
    if not per_step:
        return None
    distinct, pairs = [], []
    for fed in per_step.values():
        a = np.stack(fed, axis=1)  # [layers, slots active, K]
        distinct.append(np.mean([len(np.unique(layer)) for layer in a]))
        pairs.append(a.shape[1] * a.shape[2])
    return {"distinct_experts_per_layer_step": float(np.mean(distinct)), "pairs_per_layer_step": float(np.mean(pairs)),
            "routed_layers": len(names)}  # fmt: skip


def plot(rows: list[dict], png_path: str | os.PathLike, *, log: Callable = print) -> bool:
    """Total and per-stream tokens/s against streams (one line per MTP / prefix-cache setting), and the decode
    step's time against the distinct experts it touched; False (one log line) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        log(f"matplotlib is not installed (pip install glm53[plot]): no PNG {png_path}")
        return False
    # optional dependency (the `plot` extra): imported only when a PNG is wanted; Figure needs no GUI backend
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), dpi=100)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[setting(r)].append(r)
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["streams"])
        x = [r["streams"] for r in rs]
        ax1.plot(x, [r["total_tok_s"] for r in rs], "o-", label=f"total, {name}")
        ax1.plot(x, [r["per_stream_tok_s"] for r in rs], "x:", label=f"per stream, {name}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent streams")
    ax1.set_ylabel("tokens / s")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    pts = [r for r in rows if r.get("distinct_experts_per_layer_step") and r.get("decode_step_ms")]
    if pts:
        ax2.plot([r["distinct_experts_per_layer_step"] for r in pts], [r["decode_step_ms"] for r in pts], "o")
        for r in pts:
            ax2.annotate(f"{r['streams']}", (r["distinct_experts_per_layer_step"], r["decode_step_ms"]), fontsize=7)
    ax2.set_xlabel("distinct experts per MoE layer per step")
    ax2.set_ylabel("decode step (ms)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_write(png_path, "wb") as f:
        fig.savefig(f, format="png")
    return True


def setting(row: dict) -> str:
    narrow = ", full-width steps" if row.get("narrow") is False else ""
    return f"MTP {'on' if row.get('mtp') else 'off'}, prefix cache {'on' if row.get('prefix_cache') else 'off'}{narrow}"
