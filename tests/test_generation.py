"""MTP speculative decoding (identity with greedy decoding), sampling through the generator, and the score /
generate entry points on the tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from glm53 import build, generate
from glm53.config import model_config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_config_from_dict(tiny.get_config("default").model)


@pytest.fixture(scope="module")
def gen():
    return generate.Generator(build.random_model(CFG, seed=3))


@pytest.fixture(scope="module")
def two_token_gen():
    """A model whose lm_head can only prefer token 0 or token 7: trunk and MTP then agree often but not always,
    so speculative decoding exercises both the accept and the reject branch."""
    model = build.random_model(CFG, seed=4)
    w = np.zeros(model.lm_head.kernel[...].shape, np.float32)
    w[:, 7] = np.random.default_rng(0).normal(size=w.shape[0])
    model.lm_head.kernel[...] = jnp.asarray(w)
    return generate.Generator(model)


@pytest.mark.parametrize("which", ["gen", "two_token_gen"])
def test_speculative_equals_greedy(which, request):
    g = request.getfixturevalue(which)
    prompt = [3, 17, 99, 4, 56, 8, 21, 77, 30, 2, 90, 11, 64]  # 13 tokens: past index_topk, pools dropped
    greedy = g.generate([prompt], generate.SamplingParams(max_new=24)).tokens[0]
    spec = g.generate_speculative(prompt, 24)
    print(f"{which}: acceptance {spec.accepted}/{spec.drafted}")
    assert spec.tokens[0] == greedy
    if which == "two_token_gen":
        assert 0 < spec.accepted < spec.drafted  # both branches ran
        assert spec.decode_steps < len(greedy) - 1  # accepted drafts saved trunk steps


def test_speculative_stops_on_eos(two_token_gen):
    # the prompt and length of test_speculative_equals_greedy: the same cache shape, so no program compiles again
    prompt = [3, 17, 99, 4, 56, 8, 21, 77, 30, 2, 90, 11, 64]
    greedy = two_token_gen.generate([prompt], generate.SamplingParams(max_new=24)).tokens[0]
    eos = greedy[3]
    spec = two_token_gen.generate_speculative(prompt, 24, eos_ids=(eos,)).tokens[0]
    assert spec == greedy[: greedy.index(eos) + 1]


def test_sampling_is_seeded_and_respects_top_k(gen):
    sp = generate.SamplingParams(temperature=1.0, top_k=1, max_new=8, seed=1)
    greedy = gen.generate([[5, 6, 7]], generate.SamplingParams(max_new=8)).tokens[0]
    assert gen.generate([[5, 6, 7]], sp).tokens[0] == greedy  # top-k 1 is greedy
    sp = generate.SamplingParams(temperature=1.0, top_p=0.9, max_new=8, seed=5)
    a = gen.generate([[5, 6, 7], [9]], sp).tokens
    b = gen.generate([[5, 6, 7], [9]], sp).tokens
    assert a == b


def test_generate_rejects_empty_prompt(gen):
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[]], generate.SamplingParams())


def _run(module, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_score_entry_point(tmp_path, gen):
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 9]]
    (tmp_path / "t.json").write_text(json.dumps(seqs))
    out = tmp_path / "s.npz"
    r = _run(
        "experiments.score", "--config=configs/tiny.py", f"--tokens={tmp_path / 't.json'}", f"--out={out}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    z = np.load(out)
    assert z["logits_0"].shape == (14, CFG.vocab_size) and z["logits_1"].shape == (2, CFG.vocab_size)
    # The entry point's random model is build.random_model(cfg, seed=0): recompute the NLL independently in numpy.
    logits = nnx.jit(lambda m, x: m(x)[0])(build.random_model(CFG, seed=0), jnp.asarray([seqs[0]]))
    lg = np.asarray(logits[0], np.float64)
    lp = (
        lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    )
    nll = -np.mean([lp[t, seqs[0][t + 1]] for t in range(13)])
    np.testing.assert_allclose(z["nll"][0], nll, rtol=1e-5)
    np.testing.assert_allclose(z["logits_0"], lg, rtol=1e-5, atol=1e-5)
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2], [500]]")
    r = _run(
        "experiments.score", "--config=configs/tiny.py", f"--tokens={bad}", f"--out={tmp_path / 'x.npz'}"
    )
    assert r.returncode != 0 and "sequence 1" in r.stderr
    assert not (tmp_path / "x.npz").exists()


def test_generate_entry_point():
    r = _run("experiments.generate", "--config=configs/tiny.py", "--prompt=hello", "--max_new=6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "new ids:" in r.stdout and "tok/s" in r.stdout
    r = _run("experiments.generate", "--config=configs/tiny.py", "--prompt_ids=1,2,3,4,5,6,7", "--max_new=6",
             "--speculative", "--repeats=1")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "MTP drafts accepted" in r.stdout
