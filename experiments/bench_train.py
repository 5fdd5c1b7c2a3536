"""Training throughput: glm53's jitted train step against transformers' training step (forward + backward +
AdamW in torch) on the same random model and batch, in one process.

  python -m experiments.bench_train                                   # configs/tiny.py:default, batch 4 x 64
  python -m experiments.bench_train --configs=tiny,small --batch_size=8 --seq_len=128 --repeats=5 --out=t.json
  python -m experiments.bench_train --configs=train:mini --batch_size=8 --seq_len=512 --repeats=3   # a recipe

Prints one line per config: both sides' tokens/s and the ratio glm53 / transformers (> 1: glm53 is faster), and
the first step's loss of each (same weights and batch: they agree). What is timed: glm53/benchmarks/train.py.
"""

from __future__ import annotations

from absl import app, flags

from configs import tiny, train
from experiments import cli
from glm53 import build
from glm53.benchmarks import harness
from glm53.benchmarks import train as bench
from glm53.config import model_config_from_dict

_CONFIGS = flags.DEFINE_list(
    "configs", ["tiny"], "configs/tiny.py variants (tiny = default) or train:NAME, configs/train.py's recipe NAME"
)
_BATCH = flags.DEFINE_integer("batch_size", 4, "sequences per step")
_SEQ = flags.DEFINE_integer("seq_len", 64, "tokens per sequence")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed steps of each (medians are reported)")
_SEED = flags.DEFINE_integer("seed", 0, "weights and batch seed")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")

ALIASES = {"tiny": "default"}
RECIPE = "train:"  # --configs=train:NAME: configs/train.py's recipe NAME (its model section)


def _known(name: str) -> bool:
    if name.startswith(RECIPE):
        return name[len(RECIPE) :] in train.VARIANTS
    return ALIASES.get(name, name) in tiny.VARIANTS


def _model(name: str):
    if name.startswith(RECIPE):
        return model_config_from_dict(train.get_config(name[len(RECIPE) :]).model)
    return model_config_from_dict(tiny.model_config(ALIASES.get(name, name)))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = [c for c in _CONFIGS.value if not _known(c)]
    if unknown:
        raise app.UsageError(
            f"--configs: unknown {unknown}; choose from tiny, {', '.join(sorted(tiny.VARIANTS))} or "
            f"train:NAME with NAME in {sorted(train.VARIANTS)}"
        )
    for flag in (_BATCH, _SEQ, _REPEATS):
        if flag.value < 1:
            raise app.UsageError(f"--{flag.name} must be >= 1, got {flag.value}")
    models = {name: _model(name) for name in _CONFIGS.value}
    kernels = build.kernels_from_experiment_config(train.get_config())  # the kernels training runs
    settings = bench.Settings(_BATCH.value, _SEQ.value, _REPEATS.value, _SEED.value, kernels=kernels)
    result = bench.run(models, settings)
    m = result["machine"]
    print(f"{harness.describe(m)}; torch threads {m['torch_threads']}")
    cli.write_result(_OUT.value, result)


if __name__ == "__main__":
    cli.run(main)
