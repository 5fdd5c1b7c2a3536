"""The quantization ablation end to end (glm53.ablation.pipeline, experiments.ablate) on a tiny random model:
two variants (F32: KLD 0, same top-1 100%; Q8_0), an interrupted sweep, the rerun that finishes it, the outputs
and bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import tiny
from glm53 import build
from glm53.ablation import pipeline, report, stats
from glm53.checkpoint.gguf import open_gguf_model
from glm53.checkpoint.gguf_export import model_params, write_gguf
from glm53.config import model_config_from_dict
from glm53.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_CTX, N_CHUNKS = 24, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("ablate")
    # hidden 64, experts of width 32: Q8_0 blocks fit
    cfg = model_config_from_dict(tiny.get_config("default").model)
    model = build.random_model(cfg, seed=0, with_mtp=False)
    write_gguf(d / "base_in.gguf", cfg, model_params(model))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (N_CHUNKS, N_CTX)).tolist()
    (d / "tokens.json").write_text(json.dumps(tokens))
    return d, tokens


def _config(d, **kw):
    fields = dict(
        weights=str(d / "base_in.gguf"), tokens=str(d / "tokens.json"), variants="F32,Q8_0", threads=2
    )
    return pipeline.ablate_config(fields | kw)


def test_sweep_end_to_end(base, monkeypatch):
    d, tokens = base
    out = str(d / "out")
    real = pipeline._variant

    def interrupted(c, o, cfg, params, chunks, v, *a):
        if v.name == "Q8_0":
            raise KeyboardInterrupt
        return real(c, o, cfg, params, chunks, v, *a)

    monkeypatch.setattr(pipeline, "_variant", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(_config(d), out, log=lambda s: None)
    with open(os.path.join(out, "results.json")) as f:
        first = json.load(f)  # valid after the interruption, with the finished variant
    assert [v["name"] for v in first["variants"]] == ["F32"]
    monkeypatch.setattr(pipeline, "_variant", real)
    lines = []  # the rerun computes only Q8_0 (the base logits come from base_logits.npz)
    r = json.loads(json.dumps(pipeline.run(_config(d), out, log=lines.append)))
    assert "1 already in results.json" in lines[0] and r["variants"][0] == first["variants"][0]
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f) == r
    sl = stats.scored_positions(N_CTX)
    assert (r["n_ctx"], r["scored_from"], r["n_tokens_scored"]) == (
        N_CTX,
        N_CTX // 2,
        N_CHUNKS * (sl.stop - sl.start),
    )
    keys = {"mean", "sem", "max", "p99_9", "p99", "p95", "p90", "median", "p10", "p5", "p1", "p0_1", "min"}
    f32, q8 = r["variants"]
    for v in (f32, q8):
        assert set(v["kld"]) == keys and set(v["delta_p"]) >= keys | {"rms"}
        assert set(v["weight_rel_frobenius"]) == {"gate", "up", "down"}
        assert v["gguf"] == f"{v['name']}.gguf" and os.path.isfile(os.path.join(out, v["gguf"]))
        for k in ("ppl", "ppl_base", "ln_ppl_ratio", "same_top1", "same_top1_sem", "bpw", "expert_bytes"):
            assert k in v and k in (v["llama_cpp"] if k not in ("bpw", "expert_bytes") else v)
        assert v["llama_cpp_max_abs_logit_diff"] < 1e-3  # llama.cpp's logits on the same GGUF agree with ours
    assert f32["kld"]["mean"] < 1e-9 and f32["same_top1"] == 1 and f32["bpw"] == 32
    assert f32["llama_cpp"]["kld"]["mean"] < 1e-9 and max(f32["weight_rel_frobenius"].values()) == 0
    assert 0 < q8["kld"]["mean"] < 1e-2 and q8["bpw"] == 8.5 and 0 < q8["weight_rel_frobenius"]["down"] < 0.02
    assert q8["expert_bytes"] * 32 == f32["expert_bytes"] * 8.5
    # llama.cpp's CPU matmuls quantize the activations of quantized weights (Q8_0 here): not bit-identical
    assert abs(q8["llama_cpp"]["kld"]["mean"] - q8["kld"]["mean"]) < 1e-6
    with open(os.path.join(out, "tokens.json")) as f:
        assert json.load(f) == tokens
    with open_gguf_model(os.path.join(out, "Q8_0.gguf")) as g:
        assert g.tensor("blk.3.ffn_down_exps.weight").type_name == "Q8_0"
    with open(os.path.join(out, report.REPORT)) as f:
        md = f.read()
    assert "| Q8_0 | 8.500 |" in md and os.path.isfile(os.path.join(out, "kld_vs_bpw.png"))
    lines.clear()
    assert pipeline.run(_config(d), out, log=lines.append) == r and "2 already in results.json" in lines[0]
    # another setup in the same folder is refused before any work
    (d / "t2.json").write_text(json.dumps([t[:20] for t in tokens]))
    with pytest.raises(ConfigError, match="another setup"):
        pipeline.run(_config(d, tokens=str(d / "t2.json")), out)


def test_bad_input(base, monkeypatch, tmp_path):
    d, _ = base
    with pytest.raises(ConfigError, match="Q4_K blocks of 256 do not divide the expert width"):
        pipeline.run(_config(d, variants="Q4_K"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()  # nothing done
    monkeypatch.setattr(pipeline.llama.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install llama-cpp-python"):
        pipeline.run(_config(d), str(tmp_path / "x"))
    with pytest.raises(ConfigError, match="n_ctx"):
        pipeline.ablate_config(dict(n_ctx=2))
    p = subprocess.run(
        [sys.executable, "-m", "experiments.ablate", "--config=configs/ablate.py", "--config.variants=F32,IQ9_Q",
         f"--out={tmp_path / 'y'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 1 and "config.variants" in p.stderr and "IQ9_Q" in p.stderr, p.stderr[-1500:]
    assert not (tmp_path / "y").exists()
