"""Quantization ablation: what each routed-expert format costs, end to end, with llama-perplexity's statistics.

  python -m experiments.ablate --config=configs/ablate.py:ladder --out=runs/ablate
  python -m experiments.ablate --config=configs/ablate.py --config.variants="IQ2_S,UD-IQ3_XXS+int8" --out=DIR
  python -m experiments.ablate --config=configs/ablate.py:roles --config.weights=HF_DIR --out=DIR

Base model: the shipped glm53-mini unless --config.weights (HF folder, GGUF or Orbax checkpoint). Each variant's
routed experts are quantized by llama.cpp's quantizer into DIR/<variant>.gguf (a complete GGUF: llama.cpp and
experiments.score load it), then scored against the unquantized base on held-out text by glm53 (experts kept
quantized) and by llama.cpp (llama-cpp-python, F32 KV cache). Outputs in DIR: results.json (one entry per
variant, rewritten atomically after each; a rerun skips the variants already there), tokens.json (the scored
chunks), report (.md: the table), kld_vs_bpw.png / roles.png / layers.png, base.gguf, imatrix.gguf (+imatrix).
"""

from absl import app, flags
from ml_collections import config_flags

from experiments import cli, startup
from glm53.ablation import llama, pipeline, report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ablate.py", "configs/ablate.py[:SWEEP]")
_OUT = flags.DEFINE_string("out", None, "output folder (created; a rerun continues it)", required=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = pipeline.ablate_config(_CONFIG.value)
    llama.quiet()
    results = pipeline.run(c, _OUT.value)
    startup.write_run_record(_OUT.value, _CONFIG.value)  # DIR/glm53_run.json
    print(
        f"{len(results['variants'])} variants in {_OUT.value}/results.json; table in {_OUT.value}/{report.REPORT}"
    )


if __name__ == "__main__":
    cli.run(main)
