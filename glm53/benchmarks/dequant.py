"""Dequantization speed per GGUF type: glm53's jitted decoders vs gguf-py and vs ggml (llama.cpp), one process.

    python -m experiments.bench_dequant [--types=IQ2_S,Q4_K] [--rows=4096] [--cols=2048] [--repeats=5]
                                        [--out=bench_dequant.json]

Per type, a rows x cols matrix is quantized by llama.cpp's own quantizer (`ggml_quantize_chunk`; --quant_rows
Gaussian rows, tiled to --rows because the i-quant quantizers are slow) and decoded to f32 by each impl:

  jax                   glm53.quant.dequant.dequantize (natural GGUF layout), a fresh output array per call
  jax_into              glm53.quant.dequant.dequantize_into: same decode, into one reused (donated) buffer
  jax_planes            glm53.quant.planes.dequantize_planes on pack_planes' layout (when that module has it)
  jax_planes_reencoded  glm53.quant.reencode.dequantize_reencoded (IQ2_S / IQ3_S re-encoded, gather-free planes)
  gguf_py               gguf.quants.dequantize (numpy)
  ggml                  ggml's to_float (dequantize_row_*) through ctypes, single-threaded, into a reused buffer

Times are medians of --repeats calls after a warm-up call, each call waited for (block_until_ready); the
impls of a type take turns call by call, so background load hits them alike. Ratios
are speedups measured in this process: ratio_vs_gguf_py = gguf_py median / impl median (likewise vs ggml).
`exact` says whether the impl's output equals gguf-py's bit for bit. Prints a table and writes a JSON list:
one record per (type, impl) and one {"type": "machine", ...} record.

A fresh 4096 x 2048 f32 result is 32 MiB, which glibc maps anew for every call, so `jax` pays ~8k page faults
per call; GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge pages for malloc) cuts most of that.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.quant import dequant, ggml
from glm53.quant.formats import get_format


def _timed_round_robin(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float, object]]:
    """impl -> (median s, min s, last result): one warm-up call each, then `repeats` rounds over all impls.

    Round-robin order spreads a noisy neighbour's load over every impl instead of one.
    """
    outs = {k: jax.block_until_ready(fn()) for k, fn in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            outs[k] = jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v), outs[k]) for k, v in times.items()}


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
    qtype = GGMLQuantizationType[name]
    raw_dev = jnp.asarray(raw.reshape(-1))
    out: dict[str, Callable[[], object]] = {
        "jax": lambda: dequant.dequantize(raw_dev, name, shape),
    }
    buf = [jnp.zeros(shape, jnp.float32)]

    def into():
        buf[0] = dequant.dequantize_into(raw_dev, name, buf[0])
        return buf[0]

    out["jax_into"] = into
    try:
        from glm53.quant import planes as planes_mod

        p = jax.tree.map(jnp.asarray, planes_mod.pack_planes(raw, name, shape))
        f = jax.jit(planes_mod.dequantize_planes)
        out["jax_planes"] = lambda: f(p)
    except (ImportError, NotImplementedError, AttributeError, ValueError) as e:  # benchmark-only fallback
        logging.info("no planes layout for %s: %s", name, e)
    if name in ("IQ2_S", "IQ3_S"):
        try:
            from glm53.quant import reencode

            pr = jax.tree.map(jnp.asarray, reencode.pack_reencoded(raw, name, shape))
            fr = jax.jit(reencode.dequantize_reencoded)
            out["jax_planes_reencoded"] = lambda: fr(pr)
        except (ImportError, NotImplementedError, AttributeError, ValueError) as e:
            logging.info("no re-encoded planes for %s: %s", name, e)
    out["gguf_py"] = lambda: gq.dequantize(raw, qtype)
    fn = ggml.dequantize_row_fn(name)
    dst = np.empty(rows * cols, np.float32)
    n = rows * cols
    out["ggml"] = lambda: (fn(raw.ctypes.data, dst.ctypes.data, n), dst)[1]
    return out


def _machine() -> dict:
    import gguf

    try:
        from importlib.metadata import version

        llama_version = version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - informational only
        llama_version = None
    return {
        "type": "machine",
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy_version": np.__version__,
        "gguf_version": getattr(gguf, "__version__", None),
        "llama_cpp_python_version": llama_version,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "load_average": list(os.getloadavg()),
    }


def run(
    types: list[str], rows: int, cols: int, repeats: int, quant_rows: int, impls: list[str], seed: int
) -> list:
    """Benchmarks every type; returns the JSON records (machine record last)."""
    records = []
    for name in types:
        name = get_format(name).name
        raw, quant_s = _quantized(name, rows, cols, quant_rows, seed)
        ref = np.asarray(gq.dequantize(raw, GGMLQuantizationType[name]), np.float32)
        fns = {
            k: fn
            for k, fn in _impls(name, raw, (rows, cols)).items()
            if not impls or k in impls or k in ("gguf_py", "ggml")
        }
        timings = {}
        for impl, (med, best, out) in _timed_round_robin(fns, repeats).items():
            got = np.asarray(out, np.float32).reshape(rows, cols)
            exact = bool(np.array_equal(got.view(np.uint32), ref.reshape(rows, cols).view(np.uint32)))
            timings[impl] = (med, best, exact)
        for impl, (med, best, exact) in timings.items():
            records.append(
                {
                    "type": name,
                    "impl": impl,
                    "median_s": med,
                    "min_s": best,
                    "weights_per_s": rows * cols / med,
                    "ratio_vs_gguf_py": timings["gguf_py"][0] / med,
                    "ratio_vs_ggml": timings["ggml"][0] / med,
                    "exact": exact,
                    "rows": rows,
                    "cols": cols,
                    "repeats": repeats,
                    "quantized_rows": min(quant_rows, rows),
                    "quantize_s": quant_s,
                }
            )
        logging.info("%s done (llama.cpp quantized %d rows in %.1fs)", name, min(quant_rows, rows), quant_s)
    records.append(_machine())
    return records


def format_table(records: list) -> str:
    lines = [
        f"{'type':8s} {'impl':22s} {'median ms':>10s} {'Mweights/s':>11s} {'x gguf-py':>10s} {'x ggml':>8s} exact"
    ]
    for r in records:
        if r["type"] == "machine":
            continue
        lines.append(
            f"{r['type']:8s} {r['impl']:22s} {r['median_s'] * 1e3:10.2f} {r['weights_per_s'] / 1e6:11.0f} "
            f"{r['ratio_vs_gguf_py']:10.1f} {r['ratio_vs_ggml']:8.2f} {'yes' if r['exact'] else 'NO'}"
        )
    m = records[-1]
    lines.append(
        f"jax {m['jax_version']} on {m['backend']}, {m['cpu_count']} CPUs ({m['cpu_affinity']} usable), "
        f"load average {m['load_average']}"
    )
    return "\n".join(lines)
