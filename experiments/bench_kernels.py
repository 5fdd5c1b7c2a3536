"""Routed-expert kernel benchmark: every `moe_experts` implementation on quantized experts, as JSON.

  python -m experiments.bench_kernels --config=configs/bench_kernels.py:cpu --out=bench_kernels.json
  python -m experiments.bench_kernels --config=configs/bench_kernels.py:real --out=bench_real.json  # accelerator

Prints one line per (layout, op, tokens, implementation): min / median / max time, effective GB/s of the distinct
experts' weight bytes, the fraction of a plain device copy's bandwidth and the kernel that ran (for xla_cpu's
decode form: the C++ kernel, cpu_ffi, or the plain-XLA path); a row not timed says why ("not run: ..."); then the
decode scaling (time(N) / time(1) against U(N) / U(1), a missed target with its figures) and the notes. --out
writes the full result (machine, settings, auto, records with median_s, min_s, max_s, kernel, weight_bytes,
gb_per_s, distinct_experts, ratio_vs_reference, ratio_vs_dequant_all, ratio_vs_copy; not_run; scaling; notes)
as JSON. Field meanings: glm53/benchmarks/kernels.py.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from glm53.benchmarks import harness
from glm53.benchmarks import kernels as bench

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "benchmark set (configs/bench_kernels.py:NAME)", lock_config=True
)
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")


def main(argv):
    del argv
    cli.require_config(_CONFIG.value, "configs/bench_kernels.py:cpu")
    try:
        settings = bench.Settings.from_config(_CONFIG.value)
    except (ValueError, KeyError) as e:
        raise app.UsageError(str(e)) from None
    print(f"moe_experts benchmark, set {settings.name!r}: E={settings.n_experts} D={settings.d_model} "
          f"F={settings.d_ff} top-{settings.top_k}, experts {settings.experts}")  # fmt: skip
    result = bench.run_benchmark(settings)
    print("\ndecode scaling: time(N) / time(1) vs target 1.1 x U(N) / U(1)")
    for r in result["scaling"]:
        head = f"  {r['layout']:9s} {r['impl']:12s} N={r['streams']:<3d}"
        if r["time_ratio"] is None:
            print(f"{head} {r['why']}")
            continue
        verdict = "ok" if r["meets_target"] else f"MISSED: {r['why']}"
        print(f"{head} {r['time_ratio']:7.3f} vs {r['target']:7.3f}  {verdict}")
    timed = {r["impl"] for r in result["records"]}
    auto = result["auto"]
    print(f"auto runs {auto} on this backend: {'timed above' if auto in timed else 'not timed (see not run)'}")
    for n in result["notes"]:
        print(f"note: {n}")
    print(harness.describe(result["machine"]))
    cli.write_result(_OUT.value, result)


if __name__ == "__main__":
    cli.run(main)
