"""Bad input at the entry points: every flag is checked before any work, by the library's validation functions
(`glm53.runtime.sampling`: `check_params`, `SamplingParams`, `check_prompts`; `glm53.scoring.
check_sequences`), and every error reaches the user as one line (`experiments.cli`): exit 2 for usage, 1 for bad
input files. Fuzzed: random sampling flags, prompt lengths, token files and ``--config.model.*`` overrides give
a named error or a correct result; a handful of real subprocess runs check the exit codes and the one line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st

from configs import tiny
from glm53 import build, scoring
from glm53.config import ConfigError, model_config_from_dict
from glm53.runtime import sampling
from glm53.runtime.sampling import SamplingParams, check_prompts
from glm53.serving import offline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_config_from_dict(tiny.get_config("default").model)
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-10, 10),
    st.booleans(),
    st.sampled_from([0.0, 1.0]),
)


@pytest.fixture(scope="module")
def gen():
    return build.random_model(CFG, seed=3)


# ------------------------------------------------------------------------------------------------ sampling flags
@pytest.mark.parametrize(
    "kw,flag",
    [({"temperature": -1.0}, "temperature"), ({"top_p": 2.0}, "top_p"), ({"top_p": 0.0}, "top_p"),
     ({"top_k": -5}, "top_k"), ({"max_new": -3}, "max_new"), ({"temperature": float("nan")}, "temperature"),
     ({"top_k": 1.5}, "top_k"), ({"max_new": True}, "max_new")],
)  # fmt: skip
def test_sampling_params_outside_their_domain_name_the_field(kw, flag):
    with pytest.raises(ValueError, match=f"^{flag}="):
        SamplingParams(**kw)


@fuzz(600)
@given(t=NUMBERS, p=NUMBERS, k=st.one_of(st.integers(-10, 300), st.floats(), st.booleans()), n=NUMBERS)
def test_fuzz_sampling_flags_are_valid_or_a_named_error(t, p, k, n):
    """Property: SamplingParams accepts exactly the documented domain; anything else names its field."""
    ok = (
        all(not isinstance(v, bool) and math.isfinite(v) for v in (t, p))
        and t >= 0
        and 0 < p <= 1
        and isinstance(k, int) and not isinstance(k, bool) and k >= 0
        and isinstance(n, int) and not isinstance(n, bool) and n >= 0
    )  # fmt: skip
    try:
        SamplingParams(temperature=t, top_p=p, top_k=k, max_new=n)
    except ValueError as e:
        assert not ok
        assert str(e).split("=", 1)[0] in ("temperature", "top_p", "top_k", "max_new"), e
    else:
        assert ok


@fuzz(60)
@given(t=st.floats(0, 5), p=st.floats(0.01, 1), k=st.integers(0, 200))
def test_fuzz_valid_sampling_draws_a_token_of_the_filtered_set(t, p, k):
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 64)), jnp.float32)
    sampling.check_params(t, p, k)
    tok = np.asarray(sampling.sample(logits, jnp.asarray([0, 1], jnp.uint32), t, p, k))
    lp = np.asarray(sampling.filtered_logprobs(logits, t, p, k))
    assert all(np.isfinite(lp[b, tok[b]]) for b in range(2))


def test_max_new_zero_generates_nothing(gen):
    assert offline.generate(gen, [[1, 2, 3]], SamplingParams(max_new=0)).tokens == [[]]
    assert offline.generate(gen, [[1, 2, 3]], SamplingParams(max_new=0), speculative=True).tokens == [[]]
    with pytest.raises(ValueError, match="max_new=-3"):
        SamplingParams(max_new=-3)


def test_prompt_longer_than_the_model_allows(gen):
    short = build.random_model(CFG.replace(max_position_embeddings=8), seed=3)
    with pytest.raises(ValueError, match="max_position_embeddings 8"):
        offline.generate(short, [[1] * 6], SamplingParams(max_new=3))
    assert len(offline.generate(short, [[1] * 5], SamplingParams(max_new=3)).tokens[0]) == 3


@fuzz(400)
@given(
    prompts=st.one_of(
        st.lists(
            st.lists(st.one_of(st.integers(-3, 200), st.booleans(), st.floats()), max_size=12), max_size=3
        ),
        st.integers(),
        st.text(max_size=3),
    ),
    max_new=st.integers(0, 8),
)
def test_fuzz_prompts_are_valid_or_a_named_error(prompts, max_new):
    ok = (
        isinstance(prompts, list)
        and len(prompts) > 0
        and all(
            isinstance(p, list) and 0 < len(p) and len(p) + max_new <= 16
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < CFG.vocab_size for t in p)
            for p in prompts
        )
    )  # fmt: skip
    try:
        check_prompts(prompts, CFG.vocab_size, 16, max_new)
    except ValueError as e:
        assert not ok and ("prompt" in str(e)), e
    else:
        assert ok


# ------------------------------------------------------------------------------------------------ token files
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.floats() | st.text(max_size=3),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=2), kids, max_size=3),
    max_leaves=20,
)


@fuzz(1500)
@given(doc=st.one_of(JSON, st.lists(st.lists(st.integers(-2, 130), max_size=6), max_size=4)))
def test_fuzz_token_files_are_valid_or_a_named_error(doc):
    """Property: check_sequences accepts exactly a non-empty list of lists of >= 2 ints (not bools) in the vocab."""
    doc = json.loads(json.dumps(doc))  # what a token file reads back as
    ok = (
        isinstance(doc, list)
        and len(doc) > 0
        and all(
            isinstance(s, list) and len(s) >= 2
            and all(type(t) is int and 0 <= t < CFG.vocab_size for t in s)
            for s in doc
        )
    )  # fmt: skip
    try:
        scoring.check_sequences(doc, CFG.vocab_size, CFG.max_position_embeddings)
    except ValueError as e:
        assert not ok and ("sequence" in str(e)), e
    else:
        assert ok


def test_score_rejects_one_token_sequences_and_booleans(gen):
    model = build.random_model(CFG, seed=3)
    for bad, match in (([[5]], "at least 2"), ([], "non-empty"), ([[True, False]], "integers")):
        with pytest.raises(ValueError, match=match):
            scoring.score(model, bad)
    _, nll = scoring.score(model, [[5, 6]])
    assert np.isfinite(nll).all()


# ------------------------------------------------------------------------------------------------ config overrides
FIELDS = [
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "index_topk",
    "nonexistent",
    "hc_mult",
]


@fuzz(300)
@given(
    field=st.sampled_from(FIELDS),
    value=st.one_of(NUMBERS, st.text(max_size=4), st.none(), st.lists(st.integers())),
)
def test_fuzz_config_overrides_are_a_config_or_a_config_error(field, value):
    d = dict(tiny.get_config("default").model)
    d[field] = value
    try:
        model_config_from_dict(d)
    except ConfigError as e:
        assert field in str(e), e


# ------------------------------------------------------------------------------------------------ subprocesses
def _run(module, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_entry_points_print_one_line_and_exit_nonzero(tmp_path):
    one = tmp_path / "one.json"
    one.write_text("[[5]]")
    good = tmp_path / "good.json"
    good.write_text("[[5, 6]]")
    cases = [
        (["experiments.generate", "--config=configs/tiny.py", "--prompt=hi", "--max_new=-3"], 2, "--max_new=-3"),
        (["experiments.generate", "--config=configs/tiny.py", "--prompt=hi", "--top_p=2"], 2, "--top_p=2"),
        (["experiments.score", "--config=configs/tiny.py", f"--tokens={one}"], 2, "--tokens="),
        (["experiments.score", "--config=configs/tiny.py", f"--tokens={good}", "--out=/no/such/dir/o.npz"], 2,
         "--out=/no/such/dir/o.npz"),
        (["experiments.score", "--config=configs/tiny.py", "--config.model.nonexistent=1", f"--tokens={good}"], 2,
         "--config.model.nonexistent"),
        (["experiments.score", f"--weights={tmp_path / 'none'}", f"--tokens={good}"], 1, "none"),
        (["experiments.convert", f"--hf={tmp_path}", f"--out={tmp_path / 'o'}"], 1, "config.json"),
    ]  # fmt: skip
    for args, code, needle in cases:
        r = _run(*args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == code, (args, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and len(lines) == 1, (args, r.stderr[-2000:])
        assert needle in lines[0] and lines[0].startswith(("usage error:", "error:")), (args, lines)


def test_a_model_section_beside_weights_must_match_them():
    """--config beside --weights gives the mesh / quant sections; a model section that disagrees with the
    weights' config is a ConfigError naming the field."""
    config = tiny.get_config("default")
    build.check_model_section(config, CFG)  # agrees
    with pytest.raises(
        ConfigError, match="config.model.hidden_size=64, but the weights have hidden_size=128"
    ):
        build.check_model_section(config, CFG.replace(hidden_size=128))
