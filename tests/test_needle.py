"""The needle-in-a-haystack test (glm53.ablation.needle, experiments.needle) on a tiny random model: the trials'
geometry (exact length, the needle at the depth asked for, a fresh name, the query last) with the byte tokenizer
and the shipped model's BPE; the teacher-forced exact match against the serving engine's greedy decoding (passes
and failures); a run of the entry point with one variant (results.json, the report and its heatmap PNG, the GGUF, the run
record) and its rerun; bad input naming the flag."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from configs import tiny
from glm53 import assets, build
from glm53.ablation import needle, needle_report
from glm53.ablation.variants import parse_variants
from glm53.checkpoint.gguf_export import model_params, write_gguf
from glm53.config import model_config_from_dict
from glm53.errors import ConfigError
from glm53.runtime.sampling import SamplingParams
from glm53.serving.offline import generate
from glm53.tokenizer import ByteTokenizer, load_tokenizer
from tests.forkrun import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_config_from_dict(tiny.get_config("default").model)  # vocab 128: bytes of ASCII code are tokens
SOURCES = ("bisect.py", "colorsys.py", "keyword.py", "sched.py")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """(folder, the tiny model, its GGUF, a haystack folder of four standard-library files)."""
    d = tmp_path_factory.mktemp("needle")
    hay = d / "hay"
    hay.mkdir()
    for name in SOURCES:
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), hay / name)
    model = build.random_model(CFG, seed=0, with_mtp=False)
    write_gguf(d / "tiny.gguf", CFG, model_params(model))
    return d, model, str(d / "tiny.gguf"), str(hay)


def test_trials_byte_tokenizer_exact_length_depth_and_fresh_name(work):
    d, _, _, hay_dir = work
    hay = needle.folder_haystack(hay_dir)
    tok = ByteTokenizer(CFG.vocab_size)
    longest = max(len(line) for line in hay.lines)
    trials = needle.build_trials(hay, tok, (96, 300), (0.0, 0.3, 0.7, 1.0), 3, seed=5)
    assert len(trials) == 2 * 4 * 3 and len({t.name for t in trials}) > 20
    for t in trials:
        text = tok.decode(t.tokens)
        needle_line = f"{t.name} = {t.number}\n"
        assert len(t.tokens) == t.context and 10_000 <= t.number <= 99_999
        assert t.value == tuple(tok.encode(f" {t.number}"))
        # the needle line at its position, indented like the line it precedes; the query, equally indented, last
        at = tok.decode(t.tokens[t.position : t.position + t.needle_tokens])
        assert at.endswith(needle_line) and not at[: -len(needle_line)].strip(), at
        indent = at[: -len(needle_line)]
        assert text.endswith(f"\n{indent}{t.name} =") and t.query_tokens == len(indent) + len(t.name) + 2
        assert t.position == 0 or text[t.position - 1] == "\n"  # at a line boundary
        assert text.count(t.name) == 2  # fresh: only the needle and the query name it
        span = t.context - t.needle_tokens - t.query_tokens
        assert abs(t.position - t.depth * span) <= longest, (t.depth, t.position, span)
        if t.depth == 1.0:
            assert t.position + t.needle_tokens == t.context - t.query_tokens  # the line before the query
    # a cell's trials depend on (seed, context, depth index, trial) only
    again = needle.build_trials(hay, tok, (300,), (0.0, 0.3), 3, seed=5)
    assert [t.tokens for t in again] == [t.tokens for t in trials if t.context == 300 and t.depth < 0.5]


def test_trials_with_the_shipped_tokenizer(work):
    """The shipped BPE (newlines merged with indentation, numbers in pieces): the text is tokenized as one piece,
    the context is still exactly N tokens, holds the needle line and ends with the query."""
    _, _, _, hay_dir = work
    tok = load_tokenizer(assets.require_default_model())
    trials = needle.build_trials(needle.folder_haystack(hay_dir), tok, (256, 512), (0.0, 0.5, 1.0), 2, seed=0)
    for t in trials:
        text = tok.decode(list(t.tokens))
        assert len(t.tokens) == t.context and f"{t.name} = {t.number}\n" in text
        assert text.endswith(f"{t.name} =") and text.count(t.name) == 2
        assert tok.decode(list(t.value)) == f" {t.number}"
        assert abs(t.depth_actual - t.depth) < 0.25, t.record()


def test_teacher_forced_exact_match_is_greedy_decoding(work):
    """`predict` + `exact_match` (one forward over context + value) decide exactly what greedy decoding on the
    serving engine writes: the needle's value (a random model fails), the greedy continuation itself as the value
    (passes unless the next greedy token continues the number), and that continuation with its last token changed
    (fails)."""
    _, model, _, hay_dir = work
    tok = ByteTokenizer(CFG.vocab_size)
    continues = needle.number_continuations(tok, CFG.vocab_size)
    assert np.flatnonzero(continues).tolist() == [ord(c) for c in ".0123456789_"]
    trials = needle.build_trials(needle.folder_haystack(hay_dir), tok, (64,), (0.0, 1.0), 2, seed=1)
    contexts = [list(t.tokens) for t in trials]
    greedy = generate(model, contexts, SamplingParams(max_new=8)).tokens

    def decoded(g, value):  # what greedy decoding shows: the value, then a token that ends the number
        n = len(value)
        return g[:n] == list(value) and not continues[g[n]]

    cases = []  # (context, value, greedy says)
    for c, t, g in zip(contexts, trials, greedy):
        cases.append((c, list(t.value), decoded(g, t.value)))
        for k in (1, 3, 5):
            cases.append((c, g[:k], decoded(g, g[:k])))
            cases.append((c, g[: k - 1] + [(g[k - 1] + 1) % CFG.vocab_size], False))
    preds, logps = needle.predict(model, [c for c, _, _ in cases], [v for _, v, _ in cases], rows=8)
    got = [needle.exact_match(p, v, continues) for p, (_, v, _) in zip(preds, cases)]
    assert got == [want for _, _, want in cases]
    assert any(got) and not all(got)
    for (c, v, _), p in zip(cases, preds):  # along the greedy path the argmax is greedy decoding's token
        g = greedy[contexts.index(c)]
        if v == g[: len(v)]:
            assert p.tolist() == g[: len(v) + 1]
    assert all(lp < 0 for lp in logps)


def test_entry_point_base_and_a_variant_end_to_end(work):
    d, _, gguf, hay_dir = work
    out = d / "out"
    args = [sys.executable, "-m", "experiments.needle", f"--weights={gguf}", "--variants=Q8_0+latent_int8",
            "--contexts=64,128", "--depths=0,1", "--trials=1", f"--haystack={hay_dir}", f"--out={out}"]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "base: exact match" in p.stdout and "Q8_0+latent_int8: exact match" in p.stdout, p.stdout
    with open(out / "results.json") as f:
        r = json.load(f)
    assert [v["name"] for v in r["variants"]] == ["base", "Q8_0+latent_int8"]
    assert r["contexts"] == [64, 128] and r["depths"] == [0.0, 1.0] and len(r["trials"]) == 4
    for v in r["variants"]:
        assert sorted((c["context"], c["depth"], c["trials"]) for c in v["cells"]) == [
            (64, 0.0, 1), (64, 1.0, 1), (128, 0.0, 1), (128, 1.0, 1)]  # fmt: skip
        assert len(v["results"]) == 4 and all(0 <= c["accuracy"] <= 1 for c in v["cells"])
    q8 = r["variants"][1]
    assert q8["latent_cache_dtype"] == "int8" and q8["bpw"] == 8.5 and q8["gguf"] == "Q8_0+latent_int8.gguf"
    assert (out / q8["gguf"]).is_file() and (out / "glm53_run.json").is_file()
    md = (out / needle_report.REPORT).read_text()
    assert "| model | exact match |" in md and "**Q8_0+latent_int8**" in md and "| depth \\ context | 64 | 128 |" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / needle_report.PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a rerun of the same setup finds every model done; another setup in the folder is refused
    lines = []
    hay = needle.folder_haystack(hay_dir)
    setup = needle.NeedleSetup(contexts=(64, 128), depths=(0.0, 1.0), trials=1)
    variants = parse_variants("Q8_0+latent_int8", CFG)
    assert needle.run(gguf, gguf, variants, hay, setup, str(out), log=lines.append)["variants"] == r["variants"]
    assert "2 already in results.json" in lines[0]
    with pytest.raises(ConfigError, match="another setup"):
        needle.run(gguf, gguf, variants, hay, needle.NeedleSetup(contexts=(64,), depths=(0.0, 1.0), trials=1),
                   str(out), log=lines.append)  # fmt: skip


def test_bad_input_names_the_flag(work, tmp_path):
    d, _, gguf, hay_dir = work
    with pytest.raises(ConfigError, match=r"--depths: every depth must be in \[0, 1\]"):
        needle.NeedleSetup(contexts=(64,), depths=(0.5, 1.5))
    with pytest.raises(ConfigError, match="--contexts: 16 tokens cannot hold the needle line"):
        needle.build_trials(needle.folder_haystack(hay_dir), ByteTokenizer(128), (16,), (0.5,), 1, seed=0)
    with pytest.raises(ConfigError, match="--haystack: .* holds fewer tokens than a context of 100000"):
        needle.build_trials(needle.folder_haystack(hay_dir), ByteTokenizer(128), (100_000,), (0.5,), 1, seed=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="--haystack=.*no readable UTF-8 .py files"):
        needle.folder_haystack(str(tmp_path / "empty"))
    base = ["--weights=" + gguf, "--variants=", f"--haystack={hay_dir}", f"--out={tmp_path / 'o'}"]
    for args, code, text in [
        (["--depths=0,1.5"], 2, "usage error: --depths: every depth must be in [0, 1]"),
        (["--depths=0,half"], 2, "usage error: --depths=0,half: expected float values"),
        (["--variants=IQ9_Q"], 2, "usage error: --variants=IQ9_Q: "),
        (["--variants=Q4_K"], 2, "Q4_K blocks of 256 do not divide the expert width"),
        (["--contexts=16,64", "--variants="], 1, "error: --contexts: 16 tokens cannot hold the needle line"),
        ([f"--haystack={tmp_path / 'empty'}"], 1, f"error: --haystack={tmp_path / 'empty'}: corpus root"),
        (["--weights=/no/such.gguf"], 2, "usage error: --weights=/no/such.gguf: no such file or folder"),
    ]:
        rc, _, err = run_forked("experiments.needle", *base, *args)
        assert rc == code and text in err and "Traceback" not in err, (args, rc, err[-2000:])
    assert not (tmp_path / "o").exists()  # nothing written
