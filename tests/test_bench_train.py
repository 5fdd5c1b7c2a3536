"""experiments.bench_train's logic (glm53/benchmarks/train.py) on a 2-layer tiny model: both steps train the same
weights on the same batch (their first losses agree to rel 1e-4), the JSON record has both sides' tokens/s and
the ratio, and the second step lowers each side's loss. Speed itself is not asserted (a loaded machine)."""

from __future__ import annotations

import json
import math

import pytest

from configs import tiny
from configs import train as train_configs
from glm53 import build
from glm53.benchmarks import harness
from glm53.benchmarks import train as bench
from glm53.config import model_config_from_dict

pytestmark = pytest.mark.slow  # one train-step compile (fast-compile mode): about a minute on 2 loaded cores

_d = tiny.model_config("default")
_d.num_hidden_layers, _d.layer_types, _d.mlp_layer_types = 2, ["kda", "dsa"], ["dense", "moe"]
_d.indexer_types = ["full"] * 2
CFG = model_config_from_dict(_d)


def test_bench_train_record(tmp_path):
    kernels = build.kernels_from_experiment_config(train_configs.get_config())  # the kernels training runs
    s = bench.Settings(batch_size=2, seq_len=16, repeats=2, fast_compile=True, kernels=kernels)
    lines = []
    result = bench.run({"tiny2": CFG}, s, log=lines.append)
    rec = result["configs"]["tiny2"]
    first = rec["first_loss"]
    assert first["glm53"] == pytest.approx(first["transformers"], rel=1e-4)
    assert 0 < first["glm53"] < math.log(CFG.vocab_size) + 2
    assert all(rec["last_loss"][k] < first[k] for k in first)  # both really train (the same batch, 3 steps)
    for side in ("glm53", "transformers"):
        assert (
            rec[side]["tokens_per_s"] == pytest.approx(32 / rec[side]["median_s"])
            and len(rec[side]["samples_s"]) == 2
        )
    assert rec["ratio"] == pytest.approx(rec["glm53"]["tokens_per_s"] / rec["transformers"]["tokens_per_s"])
    assert len(lines) == 1 and "ratio" in lines[0]
    harness.write_result(tmp_path / "r.json", result)
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["batch_size"] == 2


def test_bad_settings():
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        bench.Settings(seq_len=0)
