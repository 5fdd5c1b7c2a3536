"""Whole-model throughput: glm53 against transformers' eager `Glm5NextForConditionalGeneration` on the same weights.

  python -m experiments.bench_model                                  # tiny + small, a few minutes on 2 cores
  python -m experiments.bench_model --configs=small --prefill_len=128 --decode_len=32 --repeats=5 --out=b.json
  python -m experiments.bench_model --configs=small --profile=/tmp/trace   # + a JAX profiler trace of glm53

Configs: ``tiny`` = configs/tiny.py:default, ``small`` = configs/tiny.py:small, or any other variant name of
configs/tiny.py. Prints one line per (config, phase): medians, tokens/s of both and the ratio glm53 / transformers
(> 1: glm53 is faster); warns when the greedy tokens differ (first mismatch index). --out writes the JSON result.
What is timed and the result's fields: glm53/benchmarks/model.py.
"""

from __future__ import annotations

from absl import app, flags

from configs import tiny
from experiments import cli, startup
from glm53.benchmarks import harness
from glm53.benchmarks import model as bench
from glm53.config import model_config_from_dict
from glm53.parallel import distributed

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "small"], "configs/tiny.py variants (tiny = default)")
_PREFILL = flags.DEFINE_integer("prefill_len", 64, "prompt tokens (one-shot prefill)")
_DECODE = flags.DEFINE_integer("decode_len", 16, "greedy decode steps at batch 1")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed repeats (medians are reported)")
_SEED = flags.DEFINE_integer("seed", 0, "weights and prompt seed")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")
_PROFILE = flags.DEFINE_string(
    "profile", None, "write a JAX profiler trace of the glm53 calls to DIR/<config>"
)

ALIASES = {"tiny": "default"}


def main(argv):
    del argv
    unknown = [c for c in _CONFIGS.value if ALIASES.get(c, c) not in tiny.VARIANTS]
    if unknown:
        raise app.UsageError(
            f"--configs: unknown {unknown}; choose from tiny, {', '.join(sorted(tiny.VARIANTS))}"
        )
    for flag in (_PREFILL, _DECODE, _REPEATS):
        if flag.value < 1:
            raise app.UsageError(f"--{flag.name} must be >= 1, got {flag.value}")
    variants = {name: ALIASES.get(name, name) for name in _CONFIGS.value}
    models = {name: (v, model_config_from_dict(tiny.model_config(v))) for name, v in variants.items()}
    settings = bench.Settings(_PREFILL.value, _DECODE.value, _REPEATS.value, _SEED.value, _PROFILE.value)
    result = bench.run(models, settings)
    m = result["machine"]
    print(f"{harness.describe(m)}; torch threads {m['torch_threads']}")
    if _OUT.value and distributed.is_main_process():  # several processes: process 0 writes
        harness.write_result(_OUT.value, result)
        print(f"wrote {_OUT.value} (the run: {startup.write_run_record(_OUT.value)})")


if __name__ == "__main__":
    cli.run(main)
