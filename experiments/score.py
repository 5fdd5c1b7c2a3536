"""Score token sequences: full logits and mean next-token NLL.

  python -m experiments.score --config=configs/tiny.py --tokens=tokens.json --out=scores.npz
  python -m experiments.score --weights=HF_DIR --tokens=tokens.json --out=scores.npz
  python -m experiments.score --weights=MODEL.gguf --tokens=tokens.json --out=scores.npz
  python -m experiments.score --weights=HF_DIR --experts=EXPERTS.gguf --tokens=tokens.json --out=scores.npz

tokens.json is a JSON list of token-id lists. OUT.npz holds logits_0, logits_1, ... (float32 [T_i, vocab]) and
nll (mean next-token NLL per sequence). --config without --weights scores the seeded random model of that config.
The model runs on the config's device mesh (``--config.mesh.shape=(1,8) --config.mesh.rules=ep``); --weights
without --config: the default mesh (every device on "model", tensor parallel).
"""

import json

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from glm53 import build, scoring
from glm53.files import atomic_write

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_WEIGHTS = flags.DEFINE_string("weights", None, "HF safetensors folder or GGUF file")
_EXPERTS = flags.DEFINE_string("experts", None, "GGUF file with the routed experts (--weights: HF folder)")
_TOKENS = flags.DEFINE_string("tokens", None, "JSON file: a list of token-id lists", required=True)
_OUT = flags.DEFINE_string("out", "scores.npz", "output .npz")
_DTYPE = flags.DEFINE_string("dtype", "float32", "parameter dtype when loading --weights")


def main(argv):
    del argv
    if (_WEIGHTS.value is None) == (_CONFIG.value is None):
        raise app.UsageError("give exactly one of --weights or --config")
    if _EXPERTS.value and not _WEIGHTS.value:
        raise app.UsageError("--experts needs --weights=HF_DIR")
    try:
        with open(_TOKENS.value) as f:
            seqs = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise app.UsageError(f"--tokens={_TOKENS.value}: {e}") from None
    if not isinstance(seqs, list) or not all(
        isinstance(s, list) and all(isinstance(t, int) for t in s) for s in seqs
    ):
        raise app.UsageError(f"--tokens={_TOKENS.value}: expected a JSON list of lists of integers")
    run = build.sharded_model(
        _CONFIG.value, weights=_WEIGHTS.value, experts=_EXPERTS.value, dtype=build.parse_dtype(_DTYPE.value)
    )
    logging.info("model config: %s", run.cfg)
    print(f"mesh {dict(run.mesh.shape)}, rules {run.rules.name}")
    logits, nll = scoring.score(run.model, seqs)
    arrays = {f"logits_{i}": lg for i, lg in enumerate(logits)}
    arrays["nll"] = nll
    with atomic_write(_OUT.value, "wb") as f:
        np.savez(f, **arrays)
    for i, v in enumerate(nll):
        print(f"sequence {i}: {len(seqs[i])} tokens, mean NLL {v:.4f}")
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
