"""Exporting a trained run as the shipped HF folder (glm53.checkpoint.hf_export, experiments/export.py,
glm53.train.card), on a 2-step tiny training run made here.

References: transformers' `Glm5NextForConditionalGeneration` loading the folder (logits), the trained model's own
parameters (our loader reads them back), numpy float64 from the logits of `glm53.scoring.score` (perplexity), a
Counter over the train tokens (unigram), the arithmetic of greedy speculative decoding (acceptance counts).
"""

import collections
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Glm5NextForConditionalGeneration

from configs import train as train_configs
from glm53 import scoring
from glm53.checkpoint.hf import load_hf_model
from glm53.checkpoint.hf_export import MTP_FILE, TRUNK_FILE, export_hf, model_params
from glm53.data.packing import open_tokens
from glm53.train import card, export
from glm53.train.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = dict(test_tokens=2048, prompts=2, prompt_len=16, max_new=8)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run (8 indexer heads: with 4, exactly-zero pool scores tie and torch.topk breaks ties
    differently from jax.lax.top_k) and its export."""
    config = train_configs.get_config("tiny")
    config.model.index_n_heads = 8
    config.data.max_files = 12
    config.optim.total_steps = 2
    config.eval_every = config.save_every = 2
    base = tmp_path_factory.mktemp("export")
    workdir, out = str(base / "run"), str(base / "out" / "model")
    trainer = Trainer(config, workdir, log=lambda m: None, progress=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    doc, summary = export.export_run(workdir, out, **EVAL)
    return dict(workdir=workdir, out=out, doc=doc, summary=summary, config=config)


def _test_tokens(run) -> np.ndarray:
    tokens, _ = open_tokens(os.path.join(run["workdir"], "data", "test.bin"))
    return np.asarray(tokens, np.int64)


def test_folder_and_card(run):
    out, doc = run["out"], run["doc"]
    assert sorted(os.listdir(out)) == sorted([TRUNK_FILE, MTP_FILE, "config.json", "generation_config.json",
                                              "tokenizer.json", "tokenizer_config.json", "card.json", "README.md"])  # fmt: skip
    assert not [f for f in os.listdir(os.path.dirname(out)) if f != "model"]  # no temporary folder left
    with open(os.path.join(out, "card.json")) as f:
        assert json.load(f) == json.loads(json.dumps(doc))
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "glm5_next" and hf["text_config"]["index_n_heads"] == 8
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == list(run["config"].model.eos_token_ids)
    ev, tr = doc["evaluation"], doc["training"]
    assert tr["steps"] == 2 and doc["export"]["checkpoint_step"] == 2
    assert tr["tokens_seen"] == 2 * run["config"].batch_size * run["config"].seq_len
    assert doc["data"]["splits"]["test"]["files"] == 12
    assert (
        doc["architecture"]["mtp_layers"] == 1 and doc["architecture"]["params"] == run["summary"]["params"]
    )
    with open(os.path.join(out, "README.md")) as f:
        readme = f.read()
    t = ev["texts"]["test"]
    assert t["model"] == ev["test"] and t["unigram"] == ev["unigram"] and set(ev["texts"]) == {"test"}  # stdlib only
    # the unigram fitted to the scored targets is the best unigram for them: no worse than the train split's
    assert t["self_unigram"]["tokens"] == t["unigram"]["tokens"]
    assert t["self_unigram"]["nll"] <= t["unigram"]["nll"] + 1e-12
    for s in (f"{ev['test']['ppl']:.2f}", f"{ev['unigram']['nll']:.4f}", f"{t['self_unigram']['nll']:.4f}",
              f"{ev['test']['nll'] / t['self_unigram']['nll']:.3f}", f"{ev['mtp']['acceptance']:.3f}",
              "python -m experiments.train --config=<the config in run.json>", "python -m experiments.export"):  # fmt: skip
        assert s in readme, s


def test_transformers_logits_equal_ours(run):
    """transformers loads the folder (only the placeholder vision tower missing, nothing unexpected) and its
    logits equal ours, f32 compute on the same bf16 weights, on a sequence where the DSA indexer drops pools."""
    out = run["out"]
    cfg, ours_model = load_hf_model(out, dtype=jnp.float32)
    t = 96
    assert (
        t > cfg.index_topk + cfg.index_kpool
    )  # the indexer keeps index_topk / kpool pools: some are dropped
    ids = _test_tokens(run)[1000 : 1000 + t][None]
    ours = np.asarray(ours_model(jnp.asarray(ids, jnp.int32))[0])
    hf, info = Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                                output_loading_info=True)  # fmt: skip
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    with torch.no_grad():
        theirs = hf.eval()(input_ids=torch.as_tensor(ids), use_cache=False).logits.float().numpy()
    rel = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
    assert rel <= 1e-4, rel


def test_loader_reads_back_identical_arrays(run):
    """Every parameter of the trained model comes back exactly: in bf16, or f32 where glm53 keeps f32."""
    cfg, trained, _ = export.restore(run["workdir"], run["config"], log=lambda m: None)
    want = model_params(trained)
    _, loaded = load_hf_model(run["out"], dtype=jnp.float32)
    got = model_params(loaded)
    _, loaded_bf16 = load_hf_model(run["out"])
    f32 = {p for p, v in model_params(loaded_bf16).items() if v.dtype == np.float32}
    assert set(got) == set(want) and any(p[0] == "mtp" for p in got)
    assert (
        any(p[-1] == "kernel" for p in f32) and len(f32) < len(got) // 2
    )  # the router kernels; most are bf16
    for p, w in want.items():
        stored = w.astype(np.float32 if p in f32 else ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got[p], stored, err_msg=".".join(map(str, p)))


def _spaced_windows(tokens: np.ndarray, seq: int, n: int) -> np.ndarray:
    """n of the text's full seq-token windows, the first, the last and the rest evenly between (card.eval_windows)."""
    total = len(tokens) // seq
    n = min(n, total)
    picks = [0] if n == 1 else [round(i * (total - 1) / (n - 1)) for i in range(n)]
    return np.stack([tokens[w * seq : (w + 1) * seq] for w in picks])


def test_eval_windows_are_spread_over_the_text():
    tokens = np.arange(1000)
    w = card.eval_windows(tokens, 10, 40)  # 100 windows, budget 4: windows 0, 33, 66, 99
    assert w.dtype == np.int32 and [int(r[0]) for r in w] == [0, 330, 660, 990]
    assert (w == np.arange(10) + w[:, :1]).all()  # whole consecutive windows
    assert len(card.eval_windows(tokens, 10, 10**6)) == 100  # a budget over the text: every window once
    assert len(card.eval_windows(tokens[:15], 10, 5)) == 1  # at least one window; a partial one is never scored
    with pytest.raises(ValueError, match="fewer than one window"):
        card.eval_windows(tokens[:9], 10, 100)


def test_card_perplexity_equals_numpy(run):
    ev = run["doc"]["evaluation"]
    seq = run["config"].seq_len
    n = EVAL["test_tokens"] // seq
    windows = _spaced_windows(_test_tokens(run), seq, n)
    _, model = load_hf_model(run["out"], dtype=jnp.float32)
    logits, _ = scoring.score(model, [list(map(int, w)) for w in windows])
    nll = []
    for lg, w in zip(logits, windows, strict=True):
        lg = np.asarray(lg[:-1], np.float64)
        lse = np.log(np.sum(np.exp(lg - lg.max(-1, keepdims=True)), -1)) + lg.max(-1)
        nll.append(lse - lg[np.arange(seq - 1), w[1:]])
    nll = float(np.mean(np.concatenate(nll)))
    assert ev["test"]["tokens"] == n * (seq - 1)
    assert ev["test"]["nll"] == pytest.approx(nll, rel=1e-5)
    assert ev["test"]["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_unigram_perplexity_equals_counts(run):
    ev = run["doc"]["evaluation"]
    train, meta = open_tokens(os.path.join(run["workdir"], "data", "train.bin"))
    counts, total, vocab = collections.Counter(train.tolist()), len(train), int(meta["vocab_size"])
    seq = run["config"].seq_len
    n = EVAL["test_tokens"] // seq
    targets = [int(t) for w in _spaced_windows(_test_tokens(run), seq, n) for t in w[1:]]
    nll = -sum(math.log((counts[t] + 1) / (total + vocab)) for t in targets) / len(targets)
    assert ev["unigram"]["tokens"] == len(targets)
    assert ev["unigram"]["ppl"] == pytest.approx(math.exp(nll), rel=1e-9)


def test_mtp_acceptance_counts(run):
    """Greedy speculative decoding emits 1 + drafts + accepted tokens per prompt (the last step may add one more
    than max_new asks): the counts must add up, and acceptance = accepted / drafted."""
    m = run["doc"]["evaluation"]["mtp"]
    p, k = EVAL["prompts"], EVAL["max_new"]
    assert m["prompts"] == p and 0 <= m["accepted"] <= m["drafted"]
    assert p * (k - 1) <= m["drafted"] + m["accepted"] <= p * k
    assert m["acceptance"] == pytest.approx(m["accepted"] / m["drafted"])


def test_mtp_acceptance_skipped_with_no_prompts(run):
    """experiments.export --prompts=0 skips the acceptance: nothing decoded, no acceptance (it once failed inside
    the serving engine on an empty prompt list)."""
    _, model = load_hf_model(run["out"], dtype=jnp.float32)
    assert model.mtp is not None
    m = card.mtp_acceptance(model, _test_tokens(run), prompts=0, prompt_len=16, max_new=8)
    assert m == dict(prompts=0, accepted=0, drafted=0, acceptance=None)


def test_training_summary_from_metrics():
    recs = [dict(kind="train", step=10, tokens=100.0, tokens_per_s=50.0, lm_loss=3.0, loss=4.0),
            dict(kind="eval", step=10, loss=3.5, ppl=33.0),
            dict(kind="train", step=20, tokens=100.0, tokens_per_s=200.0, lm_loss=2.0, loss=2.5)]  # fmt: skip
    s = card.training_summary(recs, batch_size=4, seq_len=26)
    assert s["train_time_s"] == pytest.approx(10 * 100 / 50 + 10 * 100 / 200)
    assert (s["steps"], s["tokens_seen"], s["final_train_loss"], s["validation_loss"]) == (
        20,
        20 * 4 * 26,
        2.0,
        3.5,
    )
    with pytest.raises(ValueError, match="no train records"):
        card.training_summary(recs[1:2], batch_size=4, seq_len=26)


def test_failed_export_leaves_no_folder(run, tmp_path, monkeypatch):
    cfg, model, _ = export.restore(run["workdir"], run["config"], log=lambda m: None)
    with pytest.raises(ValueError, match="dtype"):
        export_hf(model, cfg, tmp_path / "a", dtype="int8")
    model.bogus = nnx.Param(jnp.zeros(3))
    with pytest.raises(ValueError, match="'bogus' has no HF name"):
        export_hf(model, cfg, tmp_path / "b")
    del model.bogus
    export_hf(model, cfg, tmp_path / "c")
    with pytest.raises(ValueError, match="already exists"):
        export_hf(model, cfg, tmp_path / "c")

    def boom(*a, **k):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(card, "evaluate", boom)  # after the HF files are written into the staging folder
    with pytest.raises(RuntimeError, match="evaluation failed"):
        export.export_run(run["workdir"], str(tmp_path / "d"), **EVAL)
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_cli_bad_workdir(tmp_path):
    r = subprocess.run([sys.executable, "-m", "experiments.export", f"--workdir={tmp_path / 'nope'}",
                        f"--out={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: ") and "run.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
