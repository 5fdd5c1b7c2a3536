"""MTP speculative decoding (identity with greedy decoding), sampling through `glm53.serving.offline.generate` (the
serving engine's synchronous front), and the score / generate entry points on the tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving_helpers import greedy_alone

from configs import tiny
from glm53 import build
from glm53.config import model_config_from_dict
from glm53.runtime.sampling import SamplingParams
from glm53.serving import offline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_config_from_dict(tiny.get_config("default").model)
PROMPT = [3, 17, 99, 4, 56, 8, 21, 77, 30, 2, 90, 11, 64]  # 13 tokens: past index_topk, pools dropped
FAST = {"xla_backend_optimization_level": 0}


def _engines(model):
    """(plain, speculative) one-slot engines for PROMPT and 24 new tokens (their programs reused by every test)."""
    return model, *(offline.engine_for(model, [PROMPT], 24, speculative=s, compiler_options=FAST)
                    for s in (False, True))  # fmt: skip


@pytest.fixture(scope="module")
def gen():
    return _engines(build.random_model(CFG, seed=3))


@pytest.fixture(scope="module")
def two_token_gen():
    """A model whose lm_head can only prefer token 0 or token 7: trunk and MTP then agree often but not always,
    so speculative decoding exercises both the accept and the reject branch."""
    model = build.random_model(CFG, seed=4)
    w = np.zeros(model.lm_head.kernel[...].shape, np.float32)
    w[:, 7] = np.random.default_rng(0).normal(size=w.shape[0])
    model.lm_head.kernel[...] = jnp.asarray(w)
    return _engines(model)


@pytest.mark.parametrize("which", ["gen", "two_token_gen"])
def test_speculative_equals_greedy(which, request):
    model, plain, spec_eng = request.getfixturevalue(which)
    greedy = offline.generate(plain, [PROMPT], SamplingParams(max_new=24)).tokens[0]
    assert greedy == greedy_alone(model, PROMPT, 24)  # the engine's greedy tokens: one token per step alone
    spec = offline.generate(spec_eng, [PROMPT], SamplingParams(max_new=24))
    print(f"{which}: acceptance {spec.accepted}/{spec.drafted}")
    assert spec.tokens[0] == greedy
    assert offline.identity_line(spec.tokens[0], greedy).startswith("greedy identity: ")
    if which == "two_token_gen":
        assert 0 < spec.accepted < spec.drafted  # both branches ran
        assert spec.decode_steps < len(greedy) - 1  # accepted drafts saved trunk steps


def test_speculative_stops_on_eos(two_token_gen):
    _, plain, spec_eng = two_token_gen  # the engines of test_speculative_equals_greedy: nothing compiles again
    greedy = offline.generate(plain, [PROMPT], SamplingParams(max_new=24)).tokens[0]
    eos = greedy[3]
    spec = offline.generate(spec_eng, [PROMPT], SamplingParams(max_new=24, eos_ids=(eos,))).tokens[0]
    assert spec == greedy[: greedy.index(eos) + 1]


def test_sampling_is_seeded_and_respects_top_k(gen):
    model = gen[0]
    eng = offline.engine_for(model, [[5, 6, 7], [9]], 8, compiler_options=FAST)
    greedy = offline.generate(eng, [[5, 6, 7]], SamplingParams(max_new=8)).tokens[0]
    sp = SamplingParams(temperature=1.0, top_k=1, max_new=8, seed=1)
    assert offline.generate(eng, [[5, 6, 7]], sp).tokens[0] == greedy  # top-k 1 is greedy
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new=8, seed=5)
    a = offline.generate(eng, [[5, 6, 7], [9]], sp).tokens
    assert a == offline.generate(eng, [[5, 6, 7], [9]], sp).tokens and [len(t) for t in a] == [8, 8]
    assert offline.generate(eng, [[9]], SamplingParams(temperature=1.0, top_p=0.9, max_new=8, seed=6)).tokens[0] \
        == a[1]  # prompt i draws with seed + i: the same tokens alone or in a batch


def test_generate_rejects_empty_prompt(gen):
    with pytest.raises(ValueError, match="at least one token"):
        offline.generate(gen[0], [[]], SamplingParams())


def _run(module, *args):
    # the entry points' programs compile at XLA's backend optimization level 0 too (FAST: shorter compiles, the
    # same programs); the scored logits are still compared with this process's at 1e-5
    xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla)
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
