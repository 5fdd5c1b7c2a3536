"""Peer benchmark: glm53 vs llama.cpp vs transformers eager on the same weights (a random model of a config, its
F32 GGUF and the same file with the routed experts re-quantized), all in one process.

  python -m experiments.bench_peer --out=peer.json                   # small config, 5 files, several minutes
  python -m experiments.bench_peer --config=configs/tiny.py:gguf --formats=F32,UD-IQ3_XXS --prefill=16 \\
      --decode_steps=4 --batch=1,2 --repeats=1 --out=quick.json

Per file and phase (prefill_P at batch 1, decode_bB) one progress line (above a tqdm bar over the files on a
terminal; llama.cpp's load logs only with --verbosity=0): tokens/s of each engine and the ratios
glm53 / llama.cpp and glm53 / transformers (> 1: glm53 is faster; transformers runs the F32 weights only, its row
is every file's reference). Warns when glm53's greedy tokens differ from llama.cpp's on the F32 file. --out
writes the JSON result (rewritten after each file, so an interrupted run keeps what it measured), --profile=DIR a JAX profiler trace of one call of each glm53 phase per file (DIR/FORMAT).
What is timed and the result's fields: glm53/benchmarks/peer.py.
"""

from __future__ import annotations

import os

from absl import app, flags

from configs import tiny
from experiments import cli, startup
from glm53.benchmarks import harness, peer
from glm53.config import model_config_from_dict
from glm53.parallel import distributed

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py:small", "model config: configs/tiny.py:VARIANT")
_FORMATS = flags.DEFINE_list("formats", list(peer.FORMATS), f"GGUF files, among {','.join(peer.FORMATS)}")
_PREFILL = flags.DEFINE_list(
    "prefill", ["64", "512"], "prompt lengths (batch 1); the first is the decode prompt"
)
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "decode batch sizes (streams decoded together)")
_STEPS = flags.DEFINE_integer("decode_steps", 32, "greedy decode steps per stream")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed repeats (medians are reported)")
_THREADS = flags.DEFINE_integer("threads", None, "threads for llama.cpp and torch (default: os.cpu_count())")
_SEED = flags.DEFINE_integer("seed", 0, "weights and prompt seed")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")
_PROFILE = flags.DEFINE_string(
    "profile", None, "write a JAX profiler trace of the glm53 calls under this folder"
)
_LAYOUT = flags.DEFINE_enum(
    "layout", "reencoded", ["planes", "reencoded"], "glm53's routed-expert layout (reencoded: fast CPU decode)"
)
_KEEP = flags.DEFINE_string(
    "files", None, "keep the HF folder and GGUF files in this folder (default: temporary)"
)


def _ints(flag) -> list[int]:
    try:
        return [int(v) for v in flag.value]
    except ValueError:
        raise app.UsageError(f"--{flag.name}: expected integers, got {','.join(flag.value)}") from None


def main(argv):
    del argv
    prefix, _, variant = startup.resolve_config_arg(_CONFIG.value).partition(":")
    if os.path.realpath(prefix) != os.path.realpath(os.path.join(startup.CONFIGS_DIR, "tiny.py")):
        raise app.UsageError(f"--config: expected configs/tiny.py:VARIANT, got {_CONFIG.value!r}")
    variant = variant or "default"
    if variant not in tiny.VARIANTS:
        raise app.UsageError(
            f"--config: unknown variant {variant!r}; choose from {', '.join(sorted(tiny.VARIANTS))}"
        )
    try:
        settings = peer.Settings(
            formats=tuple(f.upper() for f in _FORMATS.value), prefill=tuple(_ints(_PREFILL)),
            batch=tuple(_ints(_BATCH)), decode_steps=_STEPS.value, repeats=_REPEATS.value,
            threads=_THREADS.value or os.cpu_count() or 1, seed=_SEED.value, profile_dir=_PROFILE.value,
            layout=_LAYOUT.value,
        )  # fmt: skip
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None
    for d in (_KEEP.value, _PROFILE.value):
        if d:
            os.makedirs(d, exist_ok=True)
    cfg = model_config_from_dict(tiny.model_config(variant))
    save = (
        (lambda r: harness.write_result(_OUT.value, r)) if _OUT.value and distributed.is_main_process() else None
    )  # each file's results at once
    result = peer.run(cfg, variant, settings, folder=_KEEP.value, on_file=save)
    print(f"{harness.describe(result['machine'])}; threads {settings.threads}")
    print(peer.table(result))
    if _OUT.value and distributed.is_main_process():  # several processes: process 0 writes
        print(f"wrote {_OUT.value} (the run: {startup.write_run_record(_OUT.value)})")


if __name__ == "__main__":
    cli.run(main)
