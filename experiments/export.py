"""Export a training run as the HF folder glm53 ships, with its model card.

  python -m experiments.export --workdir=runs/mini --out=glm53/assets/mini

Restores the latest checkpoint of the work directory (`glm53.train.loop.Trainer`, built from the run's own
run.json), writes the HF folder (`glm53.checkpoint.hf_export`: config.json, model.safetensors,
model-mtp.safetensors, generation_config.json) plus the run's tokenizer files, reads the folder back with
glm53's HF loader and measures on the exported weights (float32 compute) the held-out test-split perplexity
(``--test_tokens`` tokens), the unigram baseline and the MTP draft acceptance; then writes card.json and the
model card README.md (`glm53.train.card`). Everything is written into a temporary folder next to ``--out`` and
renamed at the end: a failed export leaves no folder. An existing ``--out`` is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from configs import train as train_configs
from experiments import cli
from glm53.checkpoint.hf_export import EXPORT_DTYPES
from glm53.errors import ConfigError
from glm53.train import card
from glm53.train.export import export_run

_WORKDIR = flags.DEFINE_string("workdir", None, "training work directory (experiments.train --workdir)")
_OUT = flags.DEFINE_string("out", None, "the HF folder to write (must not exist unless --overwrite)")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", sorted(EXPORT_DTYPES), "tensor dtype of the exported weights")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "replace an existing --out folder")
_TEST_TOKENS = flags.DEFINE_integer("test_tokens", 65536, "test-split tokens to score (whole windows)")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "test-split prompts for the MTP acceptance (0: skip)")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "tokens per acceptance prompt")
_MAX_NEW = flags.DEFINE_integer("max_new", 32, "new tokens per acceptance prompt")
_NAME = flags.DEFINE_string("name", None, "model name in the card (default: glm53-<basename of --workdir>)")
_MACHINE = flags.DEFINE_string("machine", None, "the training machine in words (default: this machine)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _WORKDIR.value is None or _OUT.value is None:
        raise app.UsageError("give --workdir=RUN_DIR (a training work directory) and --out=FOLDER")
    for f in (_TEST_TOKENS, _PROMPT_LEN, _MAX_NEW):
        if f.value < 1:
            raise app.UsageError(f"--{f.name} must be >= 1, got {f.value}")
    if _PROMPTS.value < 0:
        raise app.UsageError(f"--prompts must be >= 0, got {_PROMPTS.value}")
    out = _OUT.value
    if os.path.exists(out) and not _OVERWRITE.value:
        raise app.UsageError(f"--out={out} already exists (add --overwrite to replace it)")
    t0 = time.perf_counter()
    used = [
        f"--{f.name}={f.value}" for f in (_DTYPE, _TEST_TOKENS, _PROMPTS, _PROMPT_LEN, _MAX_NEW) if f.present
    ]
    try:
        doc, summary = export_run(_WORKDIR.value, out, dtype=_DTYPE.value, overwrite=_OVERWRITE.value,
                                  test_tokens=_TEST_TOKENS.value, prompts=_PROMPTS.value,
                                  prompt_len=_PROMPT_LEN.value, max_new=_MAX_NEW.value, name=_NAME.value,
                                  machine=_MACHINE.value, flags_used=used,
                                  variants={n: train_configs.get_config(n) for n in train_configs.VARIANTS})  # fmt: skip
    except ValueError as e:  # bad input found while writing: one error line (cli); nothing is left behind
        raise ConfigError(str(e)) from None
    ev = doc["evaluation"]
    print(f"exported step {doc['export']['checkpoint_step']} of {os.path.abspath(_WORKDIR.value)}: "
          f"{summary['params']:,} parameters, {summary['tensors']} tensors "
          f"({summary['bytes'] / 2**20:.1f} MiB {_DTYPE.value})")  # fmt: skip
    print(f"test perplexity {ev['test']['ppl']:.2f} over {ev['test']['tokens']:,} tokens (unigram "
          f"{ev['unigram']['ppl']:.2f}); MTP acceptance {card.fmt(ev['mtp'].get('acceptance'), '.3f')}")  # fmt: skip
    print(f"wrote {os.path.abspath(out)} ({', '.join(summary['files'] + ['card.json', 'README.md'])}) in "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
