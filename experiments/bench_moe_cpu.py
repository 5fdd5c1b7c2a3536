"""Routed-expert layer times on the CPU, dense vs UD-IQ3_XXS experts; fields: glm53/benchmarks/moe_cpu.py.

  python -m experiments.bench_moe_cpu --tokens=1,8 --impls=xla_quant,xla_cpu,mlp \\
      --weights=dense,split,planes,reencoded --repeats=5 --out=bench_moe_cpu.json

Prints one line per (tokens, weights, impl): the fastest, median and slowest timed call, the slowdown vs the
same impl on dense weights and the kernel that ran (for xla_cpu's decode form: the C++ kernel, cpu_ffi, or the
plain-XLA path and why); a pair left out says why ("not run: ..."). --out writes {"shape", "records",
"not_run", "machine"} as JSON.
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli
from glm53.benchmarks import harness, moe_cpu

_TOKENS = flags.DEFINE_list("tokens", ["1", "8", "64", "512"], "Token counts T (decode form for T*K <= 64).")
_IMPLS = flags.DEFINE_list(
    "impls", ["reference", "xla_quant", "xla_cpu", "mlp"], "moe_experts impls, or mlp."
)
_WEIGHTS = flags.DEFINE_list("weights", list(moe_cpu.KINDS), "Expert weights: dense, split (per-expert views), planes, reencoded.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (after one warm-up call each).")
_EXPERTS = flags.DEFINE_integer("experts", 32, "Routed experts E.")
_HIDDEN = flags.DEFINE_integer("hidden", 1024, "Hidden size D (a multiple of 256).")
_WIDTH = flags.DEFINE_integer("width", 256, "Expert width F (a multiple of 256).")
_TOP_K = flags.DEFINE_integer("top_k", 4, "Experts per token K.")
_OUT = flags.DEFINE_string("out", "", "JSON output path ('' to skip writing).")


def main(argv):
    del argv
    try:
        tokens = [int(t) for t in _TOKENS.value]
    except ValueError:
        raise app.UsageError(f"--tokens: integers expected, got {_TOKENS.value}") from None
    try:
        shape = moe_cpu.Shape(_EXPERTS.value, _HIDDEN.value, _WIDTH.value, _TOP_K.value)
        moe_cpu.check_names(_IMPLS.value, _WEIGHTS.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    try:
        result = moe_cpu.run(tokens, _IMPLS.value, _WEIGHTS.value, _REPEATS.value, shape)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    print(harness.describe(result["machine"]))
    cli.write_result(_OUT.value, result)


if __name__ == "__main__":
    cli.run(main)
