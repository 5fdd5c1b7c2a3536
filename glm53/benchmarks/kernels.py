"""Routed-expert kernel benchmark: times `moe_experts` implementations on quantized experts, with byte counts.

`run_benchmark(settings)` returns a JSON-able dict (see `experiments/bench_kernels.py`). Per op ("decode": one
token per stream; "prefill": many tokens), layout, implementation and token count it records:

  median_s, min_s, max_s median, fastest and slowest of `repeats` timed jitted calls (after compiling and
  samples_s              `warmup` calls), inputs on device, and every timed call's seconds (glm53.benchmarks.harness)
  kernel                 what ran: the concrete implementation (decode / prefill form), for xla_cpu's decode form
                         whether the C++ kernel (cpu_ffi) or the plain-XLA path ran (moe_cpu.moe_kernel)
  weight_bytes           plane bytes of the distinct routed experts (what a step must read at least)
  weight_bytes_touched   plane bytes the implementation reads (reference / dequant_all: every expert;
                         xla_quant decode: experts_per_step * ceil(U / experts_per_step) experts)
  gb_per_s               weight_bytes / median_s (1e9 bytes)
  distinct_experts       U, measured on the step's routing; distinct_experts_expected = E (1 - (1 - k/E)^N)
  ratio_vs_reference     reference median / this median (> 1: faster than the reference)
  ratio_vs_dequant_all   dequant_all median / this median
  ratio_vs_copy          copy median / this median = fraction of the bandwidth of a jitted device copy of
                         weight_bytes bytes (read + write of a uint32 array) achieved by this implementation

  tflop_per_s            2 x slots x 3 D F / median_s / 1e12: the routed experts' matmul FLOPs per second (the
                         prefill figure; padding and skipped slots not counted)

Implementations: "reference" (api reference: dequantize every expert, sort + ragged_dot), "dequant_all"
(one program dequantizes every expert into HBM, a second runs xla_quant's matmuls on those dense weights: the
"dequantize everything then matmul" baseline; in a single program XLA would fuse the expert gather into the
dequantization), "xla_quant" (decode / prefill form by op), "xla_cpu" (what "auto" runs on CPU; CPU backend
only), "pallas_tpu" (TPU backend only; interpret-mode timings mean nothing, so elsewhere it is not run) and
"pallas_gpu" (the Mosaic GPU kernels; GPU backend only, likewise). `AUTO_PICKS` are the implementations "auto"
can pick on some backend: every set times them where they run. A row not timed is in `not_run` with why (the
backend, reference_max_slots, or the first line of the exception it raised). Routing is uniform: each token picks
top_k distinct experts at random (seeded), as the U(N) formula assumes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm53.benchmarks import harness, moe_cpu
from glm53.config import QuantConfig
from glm53.quant.mixes import MATRICES, parse_mix
from glm53.quant.qweight import QuantizedExperts
from kernels.moe import api, xla_quant

IMPLS = ("reference", "dequant_all", "xla_quant", "xla_cpu", "pallas_tpu", "pallas_gpu")
# the backend each implementation is timed on, and why not elsewhere
BACKEND_ONLY = {
    "xla_cpu": ("cpu", "xla_cpu is shaped for XLA:CPU (auto picks it on cpu only)"),
    "pallas_tpu": ("tpu", "pallas_tpu needs a TPU (interpret mode only here: its timings mean nothing)"),
    "pallas_gpu": ("gpu", "pallas_gpu needs a GPU (interpret mode only here: its timings mean nothing)"),
}
# what moe_experts' "auto" runs by backend (kernels/moe/api.py's table; "reference" elsewhere and as fallback)
AUTO_PICKS = dict(getattr(api, "AUTO_BY_BACKEND", None) or api._AUTO)
LIMIT = 10.0


def _ints(v) -> tuple[int, ...]:
    if isinstance(v, str):
        return tuple(int(x) for x in v.replace(" ", "").split(",") if x)
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def _names(v) -> tuple[str, ...]:
    if isinstance(v, str):
        return tuple(x.strip() for x in v.split(",") if x.strip())
    return tuple(v)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Benchmark settings (configs/bench_kernels.py)."""

    name: str
    n_experts: int
    d_model: int
    d_ff: int
    top_k: int
    streams: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    experts: dict[str, str]
    layouts: tuple[str, ...]
    impls: tuple[str, ...]
    reference_max_slots: int
    experts_per_step: int
    tile_rows: int
    warmup: int
    repeats: int
    dtype: str
    seed: int

    @classmethod
    def from_config(cls, c) -> Settings:
        d = c.to_dict() if hasattr(c, "to_dict") else dict(c)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"bench config: unknown keys {unknown}; valid keys are {sorted(fields)}")
        mix = parse_mix(d["experts"], "bench config field 'experts'")
        if mix is None:
            raise ValueError("bench config field 'experts': 'none' has no quantized experts to benchmark")
        experts = mix.base  # one layer's formats: under UD-IQ3_XXS those of 39 of its 42 layers
        impls = _names(d["impls"])
        bad = sorted(set(impls) - set(IMPLS))
        if bad:
            raise ValueError(f"bench config field 'impls': unknown {bad}; choose from {list(IMPLS)}")
        kw = dict(d)
        kw.update(
            streams=_ints(d["streams"]), prefill_tokens=_ints(d["prefill_tokens"]), experts=experts,
            layouts=_names(d["layouts"]), impls=impls,
        )  # fmt: skip
        for lay in kw["layouts"]:
            QuantConfig(layout=lay)  # validates the name
        return cls(**kw)


def expected_distinct(n_experts: int, top_k: int, tokens: int) -> float:
    """U(N) = E (1 - (1 - k/E)^N): expected distinct experts of N tokens under uniform top-k routing."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def uniform_routing(rng: np.random.Generator, tokens: int, n_experts: int, top_k: int):
    """(ids [T, k] int32, distinct per token, weights [T, k] f32 summing to 2.5 per token)."""
    ids = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k].astype(np.int32)
    w = rng.random((tokens, top_k)).astype(np.float32)
    return ids, 2.5 * w / w.sum(axis=1, keepdims=True)


def time_jitted(fn: Callable, args: tuple, s: Settings) -> harness.Timing:
    """`s.repeats` timed calls fn(*args) after the compiling call and `s.warmup` more."""
    return harness.time_call(lambda: fn(*args), warmup=1 + s.warmup, repeats=s.repeats)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_weights(key, kernel_shape, fmt, layout, std):
    return QuantizedExperts.random(key, kernel_shape, fmt, layout, std)


def make_weights(s: Settings, layout: str, key) -> dict[str, QuantizedExperts]:
    """Random gate / up / down QuantizedExperts of the settings' shapes, on the default device."""
    e, d, f = s.n_experts, s.d_model, s.d_ff
    shapes = {"gate": (e, d, f), "up": (e, d, f), "down": (e, f, d)}
    keys = jax.random.split(key, 3)
    return {m: _random_weights(k, shapes[m], s.experts[m], layout, 0.02) for m, k in zip(MATRICES, keys)}


def _impl_fn(impl: str, op: str, s: Settings) -> Callable:
    """A jitted fn(x, ids, w, gate, up, down) -> y for implementation `impl` and op "decode" | "prefill"."""
    if impl == "reference":
        run = functools.partial(api.moe_experts, implementation="reference")
    elif impl == "xla_quant":
        run = (
            functools.partial(xla_quant.moe_experts_decode, experts_per_step=s.experts_per_step)
            if op == "decode"
            else functools.partial(xla_quant.moe_experts_prefill, tile_rows=s.tile_rows)
        )
    elif impl == "dequant_all":
        inner = jax.jit(
            lambda x, ids, w, g, u, d: (
                xla_quant.moe_experts_decode(x, ids, w, g, u, d, LIMIT, experts_per_step=s.experts_per_step)
                if op == "decode"
                else xla_quant.moe_experts_prefill(x, ids, w, g, u, d, LIMIT, tile_rows=s.tile_rows)
            )
        )
        # Two programs: inside one, XLA fuses the expert gather into the dequantization and dequantizes only
        # the gathered experts; here every expert is dequantized and materialized, then the matmuls run.
        dequant_all = jax.jit(
            lambda g, u, d, dtype: tuple(q.dequantize(dtype) for q in (g, u, d)), static_argnums=3
        )
        return lambda x, ids, w, g, u, d: inner(x, ids, w, *dequant_all(g, u, d, x.dtype))
    elif impl in BACKEND_ONLY:
        run = functools.partial(api.moe_experts, implementation=f"{impl}_{op}")
    else:  # pragma: no cover - Settings validates
        raise ValueError(impl)
    return jax.jit(lambda x, ids, w, g, u, d: run(x, ids, w, g, u, d, LIMIT))


def _kernel(impl: str, op: str, ws: dict) -> str:
    """What a row ran (the record's `kernel`): the concrete form, and for xla_cpu's decode form C++ or XLA."""
    if impl in ("reference", "dequant_all"):
        return impl
    if impl == "xla_quant":
        return f"xla_quant_{op}"
    return moe_cpu.moe_kernel(f"{impl}_{op}", 1, [ws[m] for m in MATRICES])


@jax.jit
def _copy(a):
    return a + jnp.uint32(1)  # reads and writes every word (not elided, unlike an identity)


def _copy_timing(nbytes: int, s: Settings) -> harness.Timing:
    return time_jitted(_copy, (jnp.zeros((max(1, nbytes // 4),), jnp.uint32),), s)


def run_benchmark(settings: Settings, log: Callable[[str], None] = print) -> dict:
    """Runs every (layout, op, token count, implementation) of `settings`; returns the result dict."""
    s = settings
    backend = jax.default_backend()
    dtype = jnp.dtype(s.dtype)
    notes, not_run = [], []
    impls = list(s.impls)
    for impl, (needs, why) in BACKEND_ONLY.items():
        if impl in impls and backend != needs:
            impls.remove(impl)
            not_run.append(dict(impl=impl, layout=None, op=None, tokens=None, why=why))
            log(f"{impl:12s} not run: {why}")
    auto = AUTO_PICKS.get(backend, "reference")
    if auto not in impls:
        notes.append(f"auto runs {auto} on {backend}, which this set's impls leave out")
    records = []
    key = jax.random.key(s.seed)
    log(f"{'layout':9s} {'op':7s} {'T':7s} {'U':6s} {'impl':12s} {harness.SPREAD_HEADER:>33s}  "
        f"{'GB/s':>13s}  {'of copy':>11s}  {'TFLOP/s':>15s}  kernel")  # fmt: skip
    for layout in s.layouts:
        key, wkey = jax.random.split(key)
        ws = make_weights(s, layout, wkey)
        per_expert = sum(w.nbytes_per_expert for w in ws.values())
        formats = {m: f"{ws[m].format_name} ({ws[m].layout})" for m in MATRICES}
        for op, sizes in (("decode", s.streams), ("prefill", s.prefill_tokens)):
            for tokens in sizes:
                rng = np.random.default_rng([s.seed, tokens])
                ids, w = uniform_routing(rng, tokens, s.n_experts, s.top_k)
                x = jnp.asarray(rng.standard_normal((tokens, s.d_model)), dtype)
                u = int(len(np.unique(ids)))
                slots = tokens * s.top_k
                args = (x, jnp.asarray(ids), jnp.asarray(w), ws["gate"], ws["up"], ws["down"])
                copy = _copy_timing(u * per_expert, s)
                timings: dict[str, harness.Timing] = {}
                group = []
                row = f"{layout:9s} {op:7s} T={tokens:<5d} U={u:<4d}"
                for impl in impls:
                    why = None
                    if impl == "reference" and slots > s.reference_max_slots:
                        why = f"{slots} slots > reference_max_slots ({s.reference_max_slots})"
                    else:
                        try:
                            t = time_jitted(_impl_fn(impl, op, s), args, s)
                        except Exception as e:  # a row that fails says why; the others still run
                            why = harness.first_line(e)
                    if why is not None:
                        not_run.append(dict(impl=impl, layout=layout, op=op, tokens=tokens, why=why))
                        log(f"{row} {impl:12s} not run: {why}")
                        continue
                    timings[impl] = t
                    if impl in ("reference", "dequant_all"):
                        touched = s.n_experts
                    elif impl == "xla_quant" and op == "decode":
                        c = max(1, min(s.experts_per_step, s.n_experts, slots))
                        touched = c * math.ceil(u / c)
                    else:
                        touched = u
                    rec = {
                        "op": op, "impl": impl, "kernel": _kernel(impl, op, ws), "layout": layout,
                        "formats": formats, "tokens": tokens,
                        "slots": slots, "n_experts": s.n_experts, "d_model": s.d_model, "d_ff": s.d_ff,
                        "top_k": s.top_k, "dtype": s.dtype, **t.to_dict(),
                        "weight_bytes": u * per_expert, "weight_bytes_touched": touched * per_expert,
                        "gb_per_s": u * per_expert / t.median_s / 1e9, "distinct_experts": u,
                        "distinct_experts_expected": expected_distinct(s.n_experts, s.top_k, tokens),
                        "copy_median_s": copy.median_s, "copy_gb_per_s": u * per_expert / copy.median_s / 1e9,
                        "ratio_vs_copy": harness.speedup(copy, t),
                        "tflop_per_s": 2 * int(np.sum(ids < s.n_experts)) * 3 * s.d_model * s.d_ff / t.median_s / 1e12,
                    }  # fmt: skip
                    group.append(rec)
                    log(f"{row} {impl:12s} {harness.spread_ms(t)} ms  {rec['gb_per_s']:8.3f} GB/s  "
                        f"copy {rec['ratio_vs_copy']:6.3f}  {rec['tflop_per_s']:7.2f} TFLOP/s  {rec['kernel']}")  # fmt: skip
                for rec in group:
                    for base in ("reference", "dequant_all"):
                        rec[f"ratio_vs_{base}"] = (
                            harness.speedup(timings[base], timings[rec["impl"]]) if base in timings else None
                        )
                records.extend(group)
    return {
        "benchmark": "moe_experts",
        "set": s.name,
        "machine": harness.machine(("flax", "numpy")),
        "settings": dataclasses.asdict(s),
        "auto": auto,
        "records": records,
        "not_run": not_run,
        "scaling": scaling(records, s),
        "notes": notes,
    }


def scaling(records: list[dict], s: Settings) -> list[dict]:
    """Decode time(N streams) / time(1 stream) against U(N) / U(1) (target: <= 1.1 x U(N) / U(1)). `why` says
    what a missed target means, or why a row has no ratio (no 1-stream time of that implementation)."""
    out = []
    base = {(r["layout"], r["impl"]): r for r in records if r["op"] == "decode" and r["tokens"] == 1}
    for r in records:
        if r["op"] != "decode" or r["tokens"] == 1:
            continue
        row = {"layout": r["layout"], "impl": r["impl"], "streams": r["tokens"]}
        b = base.get((r["layout"], r["impl"]))
        if b is None:
            out.append(row | {"time_ratio": None, "distinct_ratio": None, "target": None, "meets_target": None,
                              "why": "not compared: this implementation has no 1-stream time"})  # fmt: skip
            continue
        t_ratio = r["median_s"] / b["median_s"]
        u_ratio = r["distinct_experts"] / b["distinct_experts"]
        meets = t_ratio <= 1.1 * u_ratio
        why = "" if meets else (
            f"time grew x{t_ratio:.2f} for x{u_ratio:.2f} the distinct experts: the step is not bound by reading "
            "the experts' weights alone (the target, 1.1 x, is an accelerator's; see also the rows' min / max)"
        )  # fmt: skip
        out.append(row | {"time_ratio": t_ratio, "distinct_ratio": u_ratio, "target": 1.1 * u_ratio,
                          "meets_target": meets, "why": why})  # fmt: skip
    return out
