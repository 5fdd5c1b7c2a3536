"""`python -m experiments.bench_layers` (glm53.benchmarks.layers) on the tiny config: every sublayer of every
layer is a piece, the pieces replayed in order give the whole forward's logits (so each piece ran on the inputs
the model gives it), the shares add up, the JSON is written; bad phases are usage errors. Timings themselves are
never asserted."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import tiny
from glm53 import build
from glm53.benchmarks import layers as L
from glm53.config import model_config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    c = tiny.get_config()
    return build.random_model(model_config_from_dict(c.model), seed=3, kernels={"moe": "auto"})


@pytest.mark.parametrize("streams, tokens, context", [(1, 8, 0), (2, 1, 5)])
def test_pieces_replay_the_forward(model, streams, tokens, context):
    toks = np.random.default_rng(0).integers(1, model.cfg.vocab_size, (streams, tokens), dtype=np.int32)
    r = L.forward_parts(model, toks, context, repeats=1)
    n = model.cfg.num_hidden_layers
    assert r["tokens"] == [streams, tokens] and r["context"] == context
    assert len(r["pieces"]) == 2 + 6 * n
    assert {(p["layer"], p["part"]) for p in r["pieces"]} == {(None, "embed"), (None, "head")} | {
        (i, part) for i in range(n) for part in L.PARTS[1:-1]
    }
    kinds = {f"{a}+{m}" for a, m in zip(model.cfg.layer_types, model.cfg.mlp_layer_types)}
    assert {p["kind"] for p in r["pieces"] if p["layer"] is not None} == kinds
    assert r["replay_max_abs_diff"] < 1e-4  # the chain of pieces computes the model's logits
    for group in ("by_part", "by_kind"):
        assert sum(v["share"] for v in r[group].values()) == pytest.approx(1.0)
        assert sum(v["median_s"] for v in r[group].values()) == pytest.approx(r["sum_median_s"])
    assert set(r["by_part"]) == set(L.PARTS)
    assert r["whole"]["median_s"] > 0 and all(p["min_s"] <= p["median_s"] <= p["max_s"] for p in r["pieces"])
    # each piece names the kernel implementation it runs (auto resolved for this backend)
    kernels = {(p["kind"], p["part"]): p["kernel"] for p in r["pieces"]}
    assert kernels[None, "embed"] == kernels[None, "head"] == "XLA"
    assert kernels["kda+moe", "attention"] == "kda xla_cpu" and kernels["dsa+moe", "attention"] == "sparse_mla gather"
    assert kernels["kda+moe", "attn_hc"] == kernels["kda+moe", "ffn_expand"] == "mhc xla_cpu"
    assert kernels["kda+dense", "ffn"] == "dense MLP (XLA)"
    moe = kernels["kda+moe", "ffn"]
    assert moe.startswith("moe xla_cpu_decode: " if streams * tokens * model.cfg.num_experts_per_tok <= 64 else
                          "moe xla_cpu_prefill")  # fmt: skip
    assert all(v["kernel"] and v["min_s"] <= v["median_s"] <= v["max_s"] for v in r["by_kind"].values())


def _run(*args):
    return subprocess.run([sys.executable, "-m", "experiments.bench_layers", "--config=configs/tiny.py", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_entry_point_writes_json(tmp_path):
    out = tmp_path / "layers.json"
    proc = _run("--phases=decode_b1", "--context=4", "--repeats=1", "--top=3", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["phases"]) == ["decode_b1"] and r["phases"]["decode_b1"]["replay_max_abs_diff"] < 1e-4
    assert "decode_b1: whole forward" in proc.stdout and r["machine"]["backend"] == "cpu"
    table = proc.stdout.split("decode_b1: whole forward", 1)[1]  # after the start-up block
    assert len([line for line in table.splitlines() if line.startswith("  ")]) == 3


def test_bad_phase_is_a_usage_error():
    proc = _run("--phases=decode_8")
    assert proc.returncode != 0 and "--phases: 'decode_8'" in proc.stderr
