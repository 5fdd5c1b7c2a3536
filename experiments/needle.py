"""Needle in a haystack for a code model: retrieval accuracy by depth x context length, the unquantized model and
each expert-format variant side by side on the same trials.

  python -m experiments.needle --out=runs/needle                      # the shipped model, default grid and variants
  python -m experiments.needle --variants=UD-IQ3_XXS --contexts=256,512,1024 --depths=0,0.5,0.9 --trials=4 --out=DIR
  python -m experiments.needle --weights=HF_DIR --variants= --haystack=SRC_DIR      # the base model alone

Each trial is exactly N tokens of Python (the haystack: by default the held-out test split of the corpus the
model was trained on, its card's data config, else this Python's standard library) with a needle line
``NAME = VALUE`` (a fresh identifier, a 5-digit integer) inserted at a line boundary at the given depth and the
query ``NAME =`` at the end (--query); exact match: greedy decoding writes the value (decided by one teacher-forced
forward, glm53/ablation/needle.py). Variants (glm53/ablation/variants.py syntax, as experiments.ablate) are quantized
by llama.cpp's quantizer into OUT/<variant>.gguf and run with the experts kept quantized; the base runs first as
"base". Outputs in OUT (default: a new run folder): results.json (rewritten atomically after each model; a rerun
of the same setup skips the models already there), needle (.md: the tables), needle.png (heatmaps; matplotlib),
glm53_run.json (the run record).
"""

import os

from absl import app, flags

from experiments import cli, startup
from glm53 import assets
from glm53.ablation import needle, needle_report
from glm53.ablation.pipeline import split_sources
from glm53.ablation.variants import FIELD, parse_variants
from glm53.build import weights_config
from glm53.errors import ConfigError, DataError

_WEIGHTS = flags.DEFINE_string(
    "weights", None, "HF safetensors folder, GGUF file or Orbax checkpoint (default: the shipped glm53-mini)"
)
_VARIANTS = flags.DEFINE_string(
    "variants", "UD-IQ3_XXS,F32+latent_int8",
    "expert-format variants beside the base (experiments.ablate's syntax: FMT, UD-IQ3_XXS, gate=..,up=..,down=.., "
    "+int8, +q8_0, +imatrix, +latent_int8 ...; ',' or ';' between variants; empty: the base alone)",
)  # fmt: skip
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "512", "1024", "2048"], "context lengths in tokens")
_DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "needle depths in [0, 1] (0: first line)")
_TRIALS = flags.DEFINE_integer("trials", 4, "trials per (context, depth) cell")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the trials (haystack windows, names, values)")
_HAYSTACK = flags.DEFINE_string(
    "haystack", "", "folder of .py files (default: the held-out test split of the model's training corpus)"
)
_QUERY = flags.DEFINE_enum("query", needle.DEFAULT_QUERY, sorted(needle.QUERIES), "the query line's form")
_BATCH_TOKENS = flags.DEFINE_integer("batch_tokens", 8192, "tokens per forward (rows x context)")
_LAYOUT = flags.DEFINE_enum("layout", "planes", ["planes", "reencoded"], "how variants keep quantized experts")
_IMATRIX = flags.DEFINE_string("imatrix", "", "imatrix GGUF for +imatrix variants (default: computed)")
_OUT = flags.DEFINE_string("out", None, "output folder (default: a new run folder; a rerun continues it)")


def _numbers(flag: str, values: list[str], kind):
    try:
        return tuple(kind(v) for v in values)
    except ValueError:
        raise app.UsageError(f"--{flag}={','.join(values)}: expected {kind.__name__} values") from None


def haystack(weights: str) -> needle.Haystack:
    """--haystack, or the held-out test split of the weights' training corpus."""
    if _HAYSTACK.value:
        if not os.path.isdir(_HAYSTACK.value):
            raise app.UsageError(f"--haystack={_HAYSTACK.value}: not a folder")
        return needle.folder_haystack(_HAYSTACK.value)
    try:
        corpus, files = split_sources(weights, "test")
    except DataError as e:
        raise app.UsageError(f"--haystack (default, the test split): {e}; give --haystack=FOLDER") from None
    if not files:
        raise app.UsageError(f"--haystack: the test split of {corpus.root} is empty; give --haystack=FOLDER")
    return needle.haystack_from(corpus, files, f"the test split of {corpus.root} ({len(files)} files)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        setup = needle.NeedleSetup(
            contexts=_numbers("contexts", _CONTEXTS.value, int), depths=_numbers("depths", _DEPTHS.value, float),
            trials=_TRIALS.value, seed=_SEED.value, query=_QUERY.value, batch_tokens=_BATCH_TOKENS.value,
            layout=_LAYOUT.value, imatrix=_IMATRIX.value,
        )  # fmt: skip
    except ConfigError as e:
        raise app.UsageError(str(e)) from None
    if _WEIGHTS.value is not None and not os.path.exists(_WEIGHTS.value):
        raise app.UsageError(f"--weights={_WEIGHTS.value}: no such file or folder")
    weights, label = assets.resolve(_WEIGHTS.value, None)
    label = label or weights
    spec = _VARIANTS.value.strip()
    try:
        variants = parse_variants(spec, weights_config(weights)) if spec.strip(",; ") else []
    except ConfigError as e:
        raise app.UsageError(f"--variants={spec}: {str(e).replace(FIELD + ': ', '', 1)}") from None
    hay = haystack(weights)
    out = _OUT.value or startup.run_folder()
    results = needle.run(weights, label, variants, hay, setup, out)
    record = startup.write_run_record(out)
    print(f"{len(results['variants'])} models in {out}/{needle.RESULTS}; tables in {out}/{needle_report.REPORT} "
          f"(the run: {record})")  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
