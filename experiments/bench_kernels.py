"""Routed-expert kernel benchmark: every `moe_experts` implementation on quantized experts, as JSON.

  python -m experiments.bench_kernels --config=configs/bench_kernels.py:cpu --out=bench_kernels.json
  python -m experiments.bench_kernels --config=configs/bench_kernels.py:real --out=bench_real.json  # accelerator

Prints one line per (layout, op, tokens, implementation): median time, effective GB/s of the distinct experts'
weight bytes, and the fraction of a plain device copy's bandwidth; then the decode scaling (time(N) / time(1)
against U(N) / U(1)) and the notes (skipped implementations). --out writes the full result (machine, settings,
records with median_s, weight_bytes, gb_per_s, distinct_experts, ratio_vs_reference, ratio_vs_dequant_all,
ratio_vs_copy; scaling; notes) as JSON. Field meanings: glm53/benchmarks/kernels.py.
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
        print(f"  {r['layout']:9s} {r['impl']:12s} N={r['streams']:<3d} {r['time_ratio']:7.3f} vs "
              f"{r['target']:7.3f}  {'ok' if r['meets_target'] else 'MISSED'}")  # fmt: skip
    for n in result["notes"]:
        print(f"note: {n}")
    print(harness.describe(result["machine"]))
    cli.write_result(_OUT.value, result)


if __name__ == "__main__":
    cli.run(main)
