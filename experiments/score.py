"""Score token sequences: full logits and mean next-token NLL.

  python -m experiments.score --tokens=tokens.json --out=scores.npz          # the shipped model
  python -m experiments.score --config=configs/tiny.py --tokens=tokens.json --out=scores.npz
  python -m experiments.score --weights=HF_DIR --tokens=tokens.json --out=scores.npz
  python -m experiments.score --weights=MODEL.gguf --tokens=tokens.json --out=scores.npz
  python -m experiments.score --weights=HF_DIR --experts=EXPERTS.gguf --tokens=tokens.json --out=scores.npz

tokens.json is a JSON list of token-id lists. OUT.npz (default: scores.npz in a new run folder under
$GLM53_RUNS, ~/glm53_runs; beside it scores.run.json, the run record) holds logits_0, logits_1, ... (float32 [T_i, vocab]) and
nll (mean next-token NLL per sequence). Without --weights and --config it scores the trained model shipped with
glm53 (`glm53.assets`, exactly as ``--weights=glm53/assets/mini``; the first line names it); --config without
--weights scores the seeded random model of that config.
The model runs on the config's device mesh (``--config.mesh.shape=(1,8) --config.mesh.rules=ep``); --weights
without --config: the default mesh (every device on "model", tensor parallel).
"""

import json
import os

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli, startup
from glm53 import assets, build, scoring
from glm53.config import model_config_from_dict
from glm53.files import atomic_write
from glm53.parallel import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_WEIGHTS = flags.DEFINE_string(
    "weights", None,
    "HF safetensors folder, Orbax checkpoint or GGUF file (neither this nor --config: the shipped glm53-mini)",
)  # fmt: skip
_EXPERTS = flags.DEFINE_string("experts", None, "GGUF file with the routed experts (--weights: HF folder)")
_TOKENS = flags.DEFINE_string("tokens", None, "JSON file: a list of token-id lists", required=True)
_OUT = flags.DEFINE_string("out", None, "output .npz (default: scores.npz in a new run folder, docs/workbench.md)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(build.DTYPES), "parameter dtype when loading --weights")
_MTP = flags.DEFINE_enum(
    "mtp", "auto", list(build.MTP_CHOICES), "build the MTP block (auto: if the weights have it)"
)
_VERIFY = flags.DEFINE_bool("verify", True, "check the CRC-32 of every tensor of an Orbax checkpoint")


def read_tokens(path: str, vocab_size: int | None = None, max_len: int | None = None) -> list[list[int]]:
    """The sequences of a --tokens file (`scoring.check_sequences`); UsageError naming the flag otherwise."""
    try:
        with open(path) as f:
            seqs = json.load(f)
        scoring.check_sequences(seqs, vocab_size, max_len)
    except (OSError, ValueError) as e:
        raise app.UsageError(f"--tokens={path}: {e}") from None
    return seqs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _EXPERTS.value and _CONFIG.value is not None and not _WEIGHTS.value:
        raise app.UsageError(
            "--experts needs --weights=HF_DIR (or neither --weights nor --config: the shipped model)"
        )
    if _OUT.value is not None:
        out_dir = os.path.dirname(os.path.abspath(_OUT.value))
        if not os.path.isdir(out_dir):
            raise app.UsageError(f"--out={_OUT.value}: folder {out_dir} does not exist")
    seqs = read_tokens(_TOKENS.value)
    weights, label = assets.resolve(_WEIGHTS.value, _CONFIG.value)
    cfg = build.weights_config(weights) if weights else model_config_from_dict(_CONFIG.value.model)
    read_tokens(_TOKENS.value, cfg.vocab_size, cfg.max_position_embeddings)
    run = build.sharded_model(
        _CONFIG.value, weights=weights, experts=_EXPERTS.value, dtype=build.parse_dtype(_DTYPE.value),
        with_mtp=build.MTP_CHOICES[_MTP.value], verify=_VERIFY.value,
    )  # fmt: skip
    logging.debug("model config: %s", run.cfg)
    print(build.describe_run(run, config_name=cli.config_name("config"), seed=_CONFIG.value and _CONFIG.value.seed,
                             weights=weights, label=label))  # fmt: skip
    logits, nll = scoring.score(run.model, seqs)
    arrays = {f"logits_{i}": lg for i, lg in enumerate(logits)}
    arrays["nll"] = nll
    if not distributed.is_main_process():  # several processes: process 0 writes and reports
        return
    out = startup.output_path(_OUT.value, "scores.npz")
    with atomic_write(out, "wb") as f:
        np.savez(f, **arrays)
    record = startup.write_run_record(out, _CONFIG.value)
    for i, v in enumerate(nll):
        print(f"sequence {i}: {len(seqs[i])} tokens, mean NLL {v:.4f}")
    print(f"wrote {out} (the run: {record})")


if __name__ == "__main__":
    cli.run(main)
