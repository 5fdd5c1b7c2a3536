"""Dequantization speed per GGUF type: glm53's jitted decoders vs gguf-py and vs ggml (llama.cpp), one process.

Per type, a rows x cols matrix is quantized by llama.cpp's own quantizer (`ggml_quantize_chunk`; `quant_rows`
Gaussian rows, tiled to `rows` because the i-quant quantizers are slow) and decoded to f32 by each impl:

  jax                   glm53.quant.dequant.dequantize (natural GGUF layout), a fresh output array per call
  jax_into              glm53.quant.dequant.dequantize_into: same decode, into one reused (donated) buffer
  jax_planes            glm53.quant.planes.dequantize_planes on pack_planes' layout
  jax_planes_reencoded  glm53.quant.reencode.dequantize_reencoded (IQ2_S / IQ3_S re-encoded, gather-free planes)
  gguf_py               gguf.quants.dequantize (numpy)
  ggml                  ggml's to_float (dequantize_row_*) through ctypes, single-threaded, into a reused buffer

The impls of a type are timed together by `harness.time_calls` (one warm-up call each, then `repeats` rounds).
Ratios are speedups measured in this process: ratio_vs_gguf_py = gguf_py median / impl median (likewise vs
ggml). `exact` says whether the impl's output equals gguf-py's bit for bit. `run` returns a JSON list: one
record per (type, impl) with its median_s, min_s, max_s and samples_s, and a last {"type": "machine", ...}
record; the table prints min / median / max per row.

A fresh 4096 x 2048 f32 result is 32 MiB, which glibc maps anew for every call, so `jax` pays ~8k page faults
per call; GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge pages for malloc) cuts most of that.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.benchmarks import harness
from glm53.quant import dequant, ggml, planes, reencode
from glm53.quant.formats import get_format

BASELINES = ("gguf_py", "ggml")


def _quantized(name: str, rows: int, cols: int, quant_rows: int, seed: int) -> tuple[np.ndarray, float]:
    """uint8 [rows, row_bytes] of `name` made by llama.cpp, and the seconds its quantizer took."""
    q = min(quant_rows, rows)
    x = np.random.default_rng(seed).standard_normal((q, cols)).astype(np.float32)
    t0 = time.perf_counter()
    raw = np.frombuffer(ggml.quantize(x, name), np.uint8).reshape(q, -1)
    took = time.perf_counter() - t0
    reps = -(-rows // q)
    return np.ascontiguousarray(np.tile(raw, (reps, 1))[:rows]), took


def _impls(name: str, raw: np.ndarray, shape: tuple[int, int]) -> dict[str, Callable[[], object]]:
    """impl name -> a no-argument call that decodes the whole matrix (set-up work done here, untimed)."""
    rows, cols = shape
    raw_dev = jnp.asarray(raw.reshape(-1))
    out: dict[str, Callable[[], object]] = {"jax": lambda: dequant.dequantize(raw_dev, name, shape)}
    buf = [jnp.zeros(shape, jnp.float32)]

    def into():
        buf[0] = dequant.dequantize_into(raw_dev, name, buf[0])
        return buf[0]

    out["jax_into"] = into
    try:
        p = jax.tree.map(jnp.asarray, planes.pack_planes(raw, name, shape))
        f = jax.jit(planes.dequantize_planes)
        out["jax_planes"] = lambda: f(p)
    except (NotImplementedError, ValueError) as e:
        logging.info("no planes layout for %s: %s", name, e)
    if name in ("IQ2_S", "IQ3_S"):
        pr = jax.tree.map(jnp.asarray, reencode.pack_reencoded(raw, name, shape))
        fr = jax.jit(reencode.dequantize_reencoded)
        out["jax_planes_reencoded"] = lambda: fr(pr)
    out["gguf_py"] = lambda: gq.dequantize(raw, GGMLQuantizationType[name])
    fn = ggml.dequantize_row_fn(name)
    dst = np.empty(rows * cols, np.float32)
    out["ggml"] = lambda: (fn(raw.ctypes.data, dst.ctypes.data, rows * cols), dst)[1]
    return out


def run(
    types: list[str], rows: int, cols: int, repeats: int, quant_rows: int, impls: list[str], seed: int
) -> list[dict]:
    """Benchmarks every type; returns the JSON records (machine record last). `impls` ([] = all) filters the
    glm53 impls; the baselines gguf_py and ggml always run."""
    records = []
    for name in types:
        name = get_format(name).name
        raw, quant_s = _quantized(name, rows, cols, quant_rows, seed)
        ref = np.asarray(gq.dequantize(raw, GGMLQuantizationType[name]), np.float32).reshape(rows, cols)
        fns = {
            k: fn
            for k, fn in _impls(name, raw, (rows, cols)).items()
            if not impls or k in (*impls, *BASELINES)
        }
        timings = harness.time_calls(fns, warmup=1, repeats=repeats)
        for impl, t in timings.items():
            got = np.asarray(t.result, np.float32).reshape(rows, cols)
            records.append({
                "type": name, "impl": impl, **t.to_dict(), "weights_per_s": rows * cols / t.median_s,
                **{f"ratio_vs_{b}": harness.speedup(timings[b], t) for b in BASELINES},
                "exact": bool(np.array_equal(got.view(np.uint32), ref.view(np.uint32))),
                "rows": rows, "cols": cols, "repeats": repeats, "quantized_rows": min(quant_rows, rows),
                "quantize_s": quant_s,
            })  # fmt: skip
        logging.info("%s done (llama.cpp quantized %d rows in %.1fs)", name, min(quant_rows, rows), quant_s)
    packages = ("numpy", "gguf", "llama-cpp-python")
    records.append(
        {"type": "machine", **harness.machine(packages, glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))}
    )
    return records


def format_table(records: list[dict]) -> str:
    """The records as a table, one line per (type, impl), then the machine."""
    lines = [
        f"{'type':8s} {'impl (decoder that ran)':22s} {harness.SPREAD_HEADER:>30s} {'Mweights/s':>11s} "
        f"{'x gguf-py':>10s} {'x ggml':>8s} exact"
    ]
    for r in records[:-1]:
        lines.append(
            f"{r['type']:8s} {r['impl']:22s} {harness.spread_ms(r, 8, 2)} {r['weights_per_s'] / 1e6:11.0f} "
            f"{r['ratio_vs_gguf_py']:10.1f} {r['ratio_vs_ggml']:8.2f} {'yes' if r['exact'] else 'NO'}"
        )
    lines.append(harness.describe(records[-1]))
    return "\n".join(lines)
