"""The quantization ablation end to end (glm53.ablation.pipeline, experiments.ablate) on a tiny random model:
two variants (F32: KLD 0, same top-1 100%; Q8_0), an interrupted sweep, the rerun that finishes it, the outputs
and bad input; the latent-cache variants (+latent_int8 vs the exact latent)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from configs import tiny
from glm53 import build, logs
from glm53.ablation import llama, pipeline, report, stats
from glm53.ablation.variants import parse_variants
from glm53.checkpoint.gguf import open_gguf_model
from glm53.checkpoint.gguf_export import model_params, write_gguf
from glm53.config import model_config_from_dict
from glm53.errors import ConfigError
from glm53.layers.dsa import DSA

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


def test_latent_cache_variants(base, monkeypatch, tmp_path):
    """+latent_int8 scores the variant with the DSA latent cache stored as int8 (one scale per token) against the
    base's exact f32 latent: a small KLD > 0 where the same model with an f32 latent cache (+latent_f32) gives
    exactly the F32 variant's figures; it composes with an expert format (Q8_0+latent_int8)."""
    d, _ = base
    models = {}  # variant GGUF -> the model loaded from it (the one scored; read after the run)
    real = pipeline.build.load_model

    def load_model(path, **kw):
        cfg, model = real(path, **kw)
        models[os.path.basename(path)] = model
        return cfg, model

    monkeypatch.setattr(pipeline.build, "load_model", load_model)
    variants = "F32,F32+latent_f32,F32+latent_int8,Q8_0+latent_int8"
    r = pipeline.run(_config(d, variants=variants), str(tmp_path), log=lambda s: None)
    # the latent_cache_dtype of every DSA layer of each model scored
    built = {k: {m.cfg.latent_cache_dtype for _, m in nnx.iter_graph(v) if isinstance(m, DSA)} for k, v in models.items()}
    assert built == {"base_in.gguf": {"auto"}, "F32.gguf": {"auto"}, "F32+latent_f32.gguf": {"float32"},
                     "F32+latent_int8.gguf": {"int8"}, "Q8_0+latent_int8.gguf": {"int8"}}  # fmt: skip
    f32, f32_latent, int8_latent, q8_int8_latent = r["variants"]
    assert f32_latent["latent_cache_dtype"] == "float32" and "latent_cache_dtype" not in f32
    for k in ("kld", "same_top1", "ppl", "delta_p"):  # an f32 latent cache is the base's: identical logits
        assert f32_latent[k] == f32[k], k
    assert f32["kld"]["mean"] < 1e-9
    assert int8_latent["latent_cache_dtype"] == "int8" and q8_int8_latent["latent_cache_dtype"] == "int8"
    # the int8 rounding of the latent (relative step 1/254 of a row's absmax) is small on this random model
    # (KLD ~1e-8), still orders of magnitude above the F32 variant's floor
    floor = max(1e-10, 1e3 * f32["kld"]["mean"])
    assert floor < int8_latent["kld"]["mean"] < 1e-3, (f32["kld"], int8_latent["kld"])
    assert int8_latent["same_top1"] > 0.9 and abs(int8_latent["ln_ppl_ratio"]) < 0.05
    assert int8_latent["bpw"] == 32 and max(int8_latent["weight_rel_frobenius"].values()) == 0
    assert q8_int8_latent["kld"]["mean"] > floor and q8_int8_latent["bpw"] == 8.5
    # llama.cpp (F32 KV cache) cannot score the latent layouts: no cross-check column for them
    assert (
        f32["llama_cpp"] is not None and int8_latent["llama_cpp"] is None and f32_latent["llama_cpp"] is None
    )
    with open(tmp_path / report.REPORT) as f:
        md = f.read()
    assert "| F32+latent_int8 | 32.000 |" in md and "| Q8_0+latent_int8 | 8.500 |" in md
    with pytest.raises(ConfigError, match=r"\+latent_int8 and \+latent_bf16 both set the latent cache"):
        parse_variants("F32+latent_int8+latent_bf16")
    cfg = build.weights_config(str(d / "base_in.gguf"))
    assert [v.latent for v in parse_variants("F32,Q8_0+int8+latent_bf16", cfg)] == ["auto", "bfloat16"]
    no_dsa = cfg.replace(layer_types=("kda",) * cfg.num_hidden_layers)
    with pytest.raises(ConfigError, match="no DSA layer"):
        parse_variants("F32+latent_int8", no_dsa)
    parse_variants("F32", no_dsa)


def test_llama_cpp_loads_print_nothing_at_default_verbosity(base, capfd):
    """Each llama.cpp load (`glm53.ablation.llama`, as every ablation variant does) prints nothing at the default
    verbosity: no "load: adding N dummy tokens", no metadata dump (`glm53.logs.quiet_llama_cpp`); asked for
    (--verbosity=0), llama.cpp logs again."""
    d, tokens = base
    capfd.readouterr()
    with llama.LlamaLogits(d / "base_in.gguf", N_CTX, threads=1) as m:
        assert m.logits(tokens[0]).shape == (N_CTX, m.n_vocab)
    assert capfd.readouterr().err == ""
    try:
        with llama.LlamaLogits(d / "base_in.gguf", N_CTX, threads=1, quiet=False):
            pass
        assert "llama_model_loader" in capfd.readouterr().err
    finally:
        logs.quiet_llama_cpp()
