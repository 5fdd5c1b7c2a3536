"""Routed-expert kernel benchmark: times `moe_experts` implementations on quantized experts, with byte counts.

`run_benchmark(settings)` returns a JSON-able dict (see `experiments/bench_kernels.py`). Per op ("decode": one
token per stream; "prefill": many tokens), layout, implementation and token count it records:

  median_s, min_s        median and fastest of `repeats` timed jitted calls (after compiling and `warmup` calls),
  samples_s              inputs on device, and every timed call's seconds (glm53.benchmarks.harness)
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
dequantization), "xla_quant" (decode / prefill form by op), "pallas_tpu" (TPU backend only; interpret-mode
timings mean nothing, so elsewhere it is skipped with a note) and "pallas_gpu" (the Mosaic GPU kernels; GPU
backend only, likewise). Routing is uniform: each token picks top_k distinct
experts at random (seeded), as the U(N) formula assumes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm53.benchmarks import harness
from glm53.config import QuantConfig
from glm53.quant.mixes import MATRICES, parse_mix
from glm53.quant.qweight import QuantizedExperts
from kernels.moe import api, xla_quant

IMPLS = ("reference", "dequant_all", "xla_quant", "pallas_tpu", "pallas_gpu")
_PALLAS_BACKEND = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}  # the backend each Pallas implementation needs
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
    elif impl in _PALLAS_BACKEND:
        run = functools.partial(api.moe_experts, implementation=f"{impl}_{op}")
    else:  # pragma: no cover - Settings validates
        raise ValueError(impl)
    return jax.jit(lambda x, ids, w, g, u, d: run(x, ids, w, g, u, d, LIMIT))


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
    notes = []
    impls = list(s.impls)
    for impl, needs in _PALLAS_BACKEND.items():
        if impl in impls and backend != needs:
            impls.remove(impl)
            notes.append(f"{impl} skipped: backend is {backend}; interpret-mode timings are meaningless")
    records = []
    key = jax.random.key(s.seed)
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
                for impl in impls:
                    if impl == "reference" and slots > s.reference_max_slots:
                        notes.append(
                            f"reference skipped at {op} {tokens} tokens ({slots} slots > reference_max_slots)"
                        )
                        continue
                    try:
                        t = time_jitted(_impl_fn(impl, op, s), args, s)
                    except NotImplementedError as e:
                        notes.append(f"{impl} {op} {layout}: not implemented ({e})")
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
                        "op": op, "impl": impl, "layout": layout, "formats": formats, "tokens": tokens,
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
                    log(f"{layout:9s} {op:7s} T={tokens:<5d} U={u:<4d} {impl:12s} {t.median_s * 1e3:10.3f} ms  "
                        f"{rec['gb_per_s']:8.3f} GB/s  copy {rec['ratio_vs_copy']:6.3f}  "
                        f"{rec['tflop_per_s']:7.2f} TFLOP/s")  # fmt: skip
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
        "records": records,
        "scaling": scaling(records, s),
        "notes": notes,
    }


def scaling(records: list[dict], s: Settings) -> list[dict]:
    """Decode time(N streams) / time(1 stream) against U(N) / U(1) (target: <= 1.1 x U(N) / U(1))."""
    out = []
    base = {(r["layout"], r["impl"]): r for r in records if r["op"] == "decode" and r["tokens"] == 1}
    for r in records:
        b = base.get((r["layout"], r["impl"]))
        if r["op"] != "decode" or r["tokens"] == 1 or b is None:
            continue
        t_ratio = r["median_s"] / b["median_s"]
        u_ratio = r["distinct_experts"] / b["distinct_experts"]
        out.append({
            "layout": r["layout"], "impl": r["impl"], "streams": r["tokens"], "time_ratio": t_ratio,
            "distinct_ratio": u_ratio, "target": 1.1 * u_ratio, "meets_target": t_ratio <= 1.1 * u_ratio,
        })  # fmt: skip
    return out
