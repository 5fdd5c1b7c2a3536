"""llama.cpp's importance matrix of the routed experts, computed by glm53, for ``llama-quantize --imatrix``.

  python -m experiments.imatrix --out=imatrix.gguf                        # the shipped model, validation split
  python -m experiments.imatrix --weights=HF_DIR --tokens=calib.json --out=imatrix.gguf

Per MoE layer and routed-expert matrix (gate, up, down), per expert and input column: the sum of squared
activations reaching that matrix over the calibration chunks, with the number of tokens routed to each expert
(glm53/ablation/imatrix.py). Written in llama.cpp's GGUF imatrix format (what llama-imatrix writes by default:
``<tensor>.in_sum2`` and ``<tensor>.counts`` per matrix, general.type "imatrix"); the experts only (llama.cpp's
tool also covers the dense matrices). Calibration text: --tokens (a JSON list of token-id lists), else
--n_chunks chunks of --n_ctx tokens of the base model's --split of its training corpus.
"""

import os

import jax.numpy as jnp
from absl import app, flags

from experiments import cli, startup
from glm53 import build
from glm53.ablation import imatrix as imx
from glm53.ablation import pipeline
from glm53.config import model_config_to_dict

_WEIGHTS = flags.DEFINE_string(
    "weights", None, "HF folder, GGUF or Orbax checkpoint (default: the shipped model)"
)
_TOKENS = flags.DEFINE_string("tokens", None, "JSON list of equal-length token-id lists (calibration chunks)")
_SPLIT = flags.DEFINE_string("split", "validation", "corpus split for calibration when --tokens is not given")
_N_CTX = flags.DEFINE_integer("n_ctx", 256, "tokens per calibration chunk (without --tokens)")
_N_CHUNKS = flags.DEFINE_integer("n_chunks", 16, "calibration chunks (without --tokens)")
_OUT = flags.DEFINE_string("out", None, "output imatrix file (.gguf)", required=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for f in (_N_CTX, _N_CHUNKS):
        if f.value < 1:
            raise app.UsageError(f"--{f.name} must be positive, got {f.value}")
    folder = os.path.dirname(os.path.abspath(_OUT.value))
    if not os.path.isdir(folder):
        raise app.UsageError(f"--out={_OUT.value}: folder {folder} does not exist")
    c = pipeline.ablate_config(dict(weights=_WEIGHTS.value or "", tokens=_TOKENS.value or ""))
    weights, label = pipeline.base_weights(c)
    cfg = build.weights_config(weights)
    if "moe" not in model_config_to_dict(cfg)["mlp_layer_types"]:
        raise app.UsageError(f"--weights={weights}: the model has no MoE layer (no routed experts)")
    if c.tokens:
        chunks = pipeline.read_tokens(c.tokens, cfg)
    else:
        chunks = pipeline.corpus_chunks(weights, _SPLIT.value, _N_CTX.value, _N_CHUNKS.value)
    _, model = build.load_model(weights, dtype=jnp.float32, with_mtp=False)
    im = imx.collect(model, chunks, dataset=_TOKENS.value or f"{_SPLIT.value} split")
    imx.write_imatrix(_OUT.value, im)
    startup.write_run_record(_OUT.value)
    print(
        f"{label}: {im.chunks} chunks of {im.chunk_size} tokens; {len(im.entries)} matrices -> {_OUT.value}"
    )


if __name__ == "__main__":
    cli.run(main)
