"""glm53.ablation.stats (llama-perplexity's KL-divergence statistics) against an independent float64 numpy
computation, and the ablation's variant specs and bad input (glm53.ablation.variants). No model is built."""

import math

import numpy as np
import pytest

from configs import tiny
from glm53.ablation import stats
from glm53.ablation.variants import check_variant, expert_bytes, parse_variants
from glm53.config import model_config_from_dict
from glm53.errors import ConfigError


def _reference(lq, lb, targets):
    """Independent: softmax by division, per-token loops, numpy's percentile / median / corrcoef / std."""
    pq = np.exp(lq - lq.max(1, keepdims=True))
    pq /= pq.sum(1, keepdims=True)
    pb = np.exp(lb - lb.max(1, keepdims=True))
    pb /= pb.sum(1, keepdims=True)
    n = len(targets)
    nll = np.array([-math.log(pq[i, targets[i]]) for i in range(n)])
    nllb = np.array([-math.log(pb[i, targets[i]]) for i in range(n)])
    kld = np.array(
        [sum(pb[i, j] * math.log(pb[i, j] / pq[i, j]) for j in range(lq.shape[1])) for i in range(n)]
    )
    dp = np.exp(-nll) - np.exp(-nllb)
    sem = lambda x: np.std(x) / math.sqrt(n - 1)  # noqa: E731
    q = {"p99_9": 99.9, "p99": 99, "p95": 95, "p90": 90, "p10": 10, "p5": 5, "p1": 1, "p0_1": 0.1}

    def dist(x):
        d = {k: np.percentile(x, v) for k, v in q.items()}
        return dict(d, mean=x.mean(), sem=sem(x), max=x.max(), min=x.min(), median=np.median(x))

    same = np.mean(lq.argmax(1) == lb.argmax(1))
    out = {
        "ppl": math.exp(nll.mean()), "ppl_base": math.exp(nllb.mean()), "ln_ppl_ratio": nll.mean() - nllb.mean(),
        "ln_ppl_ratio_sem": sem(nll - nllb), "cor_ln_ppl": np.corrcoef(nll, nllb)[0, 1],
        "kld": dist(kld), "delta_p": dict(dist(dp), rms=math.sqrt(np.mean(dp**2))),
        "same_top1": same, "same_top1_sem": math.sqrt(same * (1 - same) / (n - 1)),
    }  # fmt: skip
    return out


def _close(ours, ref, path=""):
    for k, v in ref.items():
        if isinstance(v, dict):
            _close(ours[k], v, f"{path}{k}.")
        else:
            assert ours[k] == pytest.approx(v, rel=1e-9, abs=1e-12), f"{path}{k}"


def test_statistics_match_numpy_float64():
    rng = np.random.default_rng(0)
    n, v = 301, 40  # logits of moderate range: every base log-probability is above llama.cpp's -16 cut-off
    lb = rng.normal(0, 2, (n, v))
    lq = lb + rng.normal(0, 0.3, (n, v))
    targets = rng.integers(0, v, n)
    s = stats.summarize(stats.token_stats(lq, lb, targets))
    assert s["n_tokens"] == n and 0 < s["same_top1"] < 1 and s["kld"]["min"] >= 0
    _close(s, _reference(lq, lb, targets))
    # the percentile estimator is llama.cpp's linear interpolation at fraction * (n - 1): numpy's default
    x = np.sort(rng.normal(size=57))
    assert stats.percentile(x, 0.999) == pytest.approx(np.percentile(x, 99.9))
    assert stats.percentile(x, 0.0) == x[0] and stats.percentile(x, 1.0) == x[-1]


def test_identity_and_llama_cpp_conventions():
    rng = np.random.default_rng(1)
    lb = rng.normal(0, 3, (50, 20))
    s = stats.summarize(stats.token_stats(lb, lb.copy(), rng.integers(0, 20, 50)))
    assert s["kld"]["mean"] == 0 and s["kld"]["max"] == 0 and s["ln_ppl_ratio"] == 0
    assert s["same_top1"] == 1 and s["same_top1_sem"] == 0 and s["delta_p"]["rms"] == 0
    assert s["cor_ln_ppl"] == pytest.approx(1)
    # KL terms of base log-probabilities <= -16 are left out, as llama.cpp does
    base = np.array([[0.0, -30.0, 0.0]])
    q = np.array([[0.0, 0.0, 0.0]])
    kld = stats.token_stats(q, base, np.array([0])).kld[0]
    p = np.exp(base[0] - np.logaddexp.reduce(base[0]))
    lq = q[0] - np.logaddexp.reduce(q[0])
    assert kld == pytest.approx(sum(p[j] * (np.log(p[j]) - lq[j]) for j in (0, 2)))
    # standard errors are 0 for 10 or fewer values (llama.cpp's mean_and_uncertainty)
    assert stats.mean_and_uncertainty(np.arange(10.0))[1] == 0
    assert stats.mean_and_uncertainty(np.arange(11.0))[1] == pytest.approx(
        np.std(np.arange(11.0)) / math.sqrt(10)
    )
    # chunks: positions n_ctx/2 .. n_ctx-2 predict the next token
    assert stats.scored_positions(8) == slice(4, 7)
    toks = rng.integers(0, 20, (2, 8))
    lg = rng.normal(size=(2, 8, 20))
    ts = stats.chunk_stats(lg, lg + 0.1 * rng.normal(size=lg.shape), toks)
    assert len(ts.nll) == 6
    assert ts.nll[0] == pytest.approx(-(lg[0, 4] - np.logaddexp.reduce(lg[0, 4]))[toks[0, 5]])
    with pytest.raises(ValueError, match="n_ctx"):
        stats.scored_positions(3)
    assert "Same top p" in stats.render(s)


@pytest.fixture(scope="module")
def cfg():
    return model_config_from_dict(tiny.get_config("gguf").model)  # hidden 256, experts of width 256


def test_variant_specs(cfg):
    vs = parse_variants(
        "F32,gate=IQ2_S,up=IQ2_S,down=IQ3_S+imatrix,Q4_K,down=Q6_K;UD-IQ3_XXS+int8,IQ2_S+q8_0", cfg
    )
    assert [v.name for v in vs] == [
        "F32", "gate=IQ2_S,up=IQ2_S,down=IQ3_S+imatrix", "Q4_K,down=Q6_K", "UD-IQ3_XXS+int8", "IQ2_S+q8_0",
    ]  # fmt: skip
    assert vs[1].imatrix and vs[3].int8 and vs[4].q8_0 and vs[4].dense_type == "Q8_0"
    assert vs[1].file == "gate-IQ2_S_up-IQ2_S_down-IQ3_S+imatrix.gguf"
    assert vs[2].formats(cfg)[(7, "down")] == "Q6_K" and vs[2].formats(cfg)[(7, "up")] == "Q4_K"
    nbytes, n = expert_bytes(vs[0], cfg)
    assert nbytes == 4 * n == 4 * 5 * 3 * 16 * 256 * 256
    roles = parse_variants("per_role:IQ2_S", cfg)
    assert [v.name for v in roles] == ["gate=IQ2_S,up=F32,down=F32", "gate=F32,up=IQ2_S,down=F32",
                                       "gate=F32,up=F32,down=IQ2_S"]  # fmt: skip
    layers = parse_variants("per_layer:IQ3_S", cfg)
    assert [v.name for v in layers] == [
        f"F32,{i}.gate=IQ3_S,{i}.up=IQ3_S,{i}.down=IQ3_S" for i in range(3, 8)
    ]


@pytest.mark.parametrize(
    "spec, match",
    [
        ("Q4_K,IQ9_Z", "unknown quantization format 'IQ9_Z'"),
        ("gate=IQ2_S,up=IQ2_S", r"no type for \['down'\]"),
        ("gate=IQ2_S,upp=IQ2_S,down=Q4_K", "cannot parse 'upp'"),
        ("IQ2_S+fast", r"unknown flag \+fast"),
        ("IQ2_S+int8+q8_0", "choose one"),
        ("Q4_K,Q4_K", "listed twice"),
        ("F32,0.down=IQ2_S", "layer 0 is not a MoE layer"),
        ("", "non-empty"),
    ],
)
def test_bad_variants(cfg, spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_variants(spec, cfg)


def test_block_size_must_divide_the_expert_width():
    small = model_config_from_dict(tiny.get_config("default").model)  # hidden 64, expert width 32
    (v,) = parse_variants("Q8_0")
    check_variant(v, small)  # blocks of 32 fit
    with pytest.raises(ConfigError, match="Q4_K blocks of 256 do not divide the expert width"):
        parse_variants("Q4_K", small)
    dense = model_config_from_dict(dict(tiny.get_config("default").model, mlp_layer_types=["dense"] * 6))
    with pytest.raises(ConfigError, match="no routed experts"):
        parse_variants("Q8_0", dense)
