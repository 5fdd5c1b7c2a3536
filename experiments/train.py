"""Train a GLM-5.3 model on the Python standard library's sources.

  python -m experiments.train --config=configs/train.py:tiny --workdir=/tmp/run
  python -m experiments.train --config=configs/train.py:small --workdir=runs/small --config.optim.total_steps=500

The work directory holds the prepared data (tokenizer + token files), the Orbax checkpoints, run.json and
metrics.jsonl and, at the end, loss.png (glm53/train/loop.py); running the command again on it resumes from its latest checkpoint.
``--steps=N`` stops at step N (default: the config's optim.total_steps); ``--progress=false`` turns the progress
bar off (it is off anyway when stderr is not a terminal: the step lines, printed above the bar, are the progress).
tokens/s excludes compilation: the first step is timed apart ("compiled in X s" on its line).
"""

from absl import app, flags
from ml_collections import config_flags

from experiments import cli, startup
from glm53.parallel import distributed
from glm53.train.loop import Trainer

TRAIN_SECTIONS = ("model", "data", "optim", "loss")  # what glm53.train reads beside kernels / mesh / seed
_CONFIG = config_flags.DEFINE_config_file("config", None, "training config (configs/train.py:NAME)",
                                          lock_config=True)  # fmt: skip
_WORKDIR = flags.DEFINE_string("workdir", None, "work directory (created; resumed when it holds a run)")
_STEPS = flags.DEFINE_integer("steps", None, "stop at this step (default: optim.total_steps)")
_PROGRESS = flags.DEFINE_bool(
    "progress", True, "a progress bar on stderr (only when it is a terminal; elsewhere the step lines alone)"
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None or _WORKDIR.value is None:
        raise app.UsageError("give --config=configs/train.py:NAME and --workdir=DIR")
    missing = [s for s in TRAIN_SECTIONS if s not in _CONFIG.value]
    if missing:
        raise app.UsageError(
            f"--config={cli.config_name()}: not a training config (no {', '.join(missing)} section); "
            "use --config=configs/train.py:NAME (tiny, small, mini)"
        )
    trainer = Trainer(
        _CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value
    )  # DataError / TrainingError: one line, exit 1 (cli)
    if distributed.is_main_process():
        print(f"  run record: {startup.write_run_record(_WORKDIR.value, _CONFIG.value)}", flush=True)
    try:
        trainer.train(_STEPS.value)
    finally:
        trainer.close()


if __name__ == "__main__":
    cli.run(main)
