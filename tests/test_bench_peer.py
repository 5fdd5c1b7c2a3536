"""Smoke test of `python -m experiments.bench_peer` on the GGUF-able tiny config (configs/tiny.py:gguf), F32 and
UD-IQ3_XXS files: the JSON it writes, that its ratios are the quotients of its tokens/s, that glm53's greedy tokens
agree with llama.cpp's on F32, and that the llama.cpp tokens it reports (low-level C API, B streams in one batch)
are llama.cpp's own greedy choices by an independent path (llama-cpp-python's `Llama`, one sequence at a time).
Speed is not asserted."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf_fixtures import llama_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFILL, STEPS, BATCH, SEED = 16, 4, (2,), 0  # batch 2 only: every extra shape is a compile (CI time)
FORMATS = ("F32", "UD-IQ3_XXS")
PHASES = (f"prefill_{PREFILL}", *(f"decode_b{b}" for b in BATCH))
ENGINES = ("glm53", "llama_cpp", "transformers")


def _run(*args):
    # glm53's programs compile at XLA's backend optimization level 0: shorter compiles, the same programs
    # and results (speed is not asserted)
    xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla)
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench_peer", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("peer")
    out = d / "peer.json"
    r = _run(
        "--config=configs/tiny.py:gguf", f"--formats={','.join(FORMATS)}", f"--prefill={PREFILL}",
        f"--decode_steps={STEPS}", f"--batch={','.join(map(str, BATCH))}", "--repeats=1", "--threads=2",
        f"--seed={SEED}", f"--files={d / 'files'}", f"--out={out}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(out.read_text()), d / "files"


@pytest.mark.slow
def test_json_structure_and_ratios(result):
    stdout, res, _ = result
    assert set(res) == {"machine", "settings", "model", "files", "summary"}
    m = res["machine"]
    assert m["threads"] == m["torch_threads"] == m["llama_cpp_threads"] == 2 and "xla_threads" in m
    assert {"jax", "torch", "transformers", "llama-cpp-python", "gguf"} <= set(m["versions"])
    s = res["settings"]
    assert s["config"] == "gguf" and s["formats"] == list(FORMATS) and s["prefill"] == [PREFILL]
    assert s["batch"] == list(BATCH) and s["decode_steps"] == STEPS and s["repeats"] == 1
    assert "non-expert matrices F32" in s["quantized"]
    assert list(res["files"]) == list(FORMATS)
    f32, quant = res["files"]["F32"], res["files"]["UD-IQ3_XXS"]
    assert f32["expert_types"] == {"F32": 15}  # 5 MoE layers x gate / up / down
    assert (
        set(quant["expert_types"]) <= {"IQ2_S", "IQ3_S", "IQ4_XS"}
        and sum(quant["expert_types"].values()) == 15
    )
    assert quant["bytes"] < f32["bytes"]
    for fmt, rec in res["files"].items():
        assert list(rec["phases"]) == list(PHASES)
        for phase, r in rec["phases"].items():
            prefill = phase.startswith("prefill")
            batch = 1 if prefill else int(phase.removeprefix("decode_b"))
            assert r["batch"] == batch and r["tokens"] == (PREFILL if prefill else batch * STEPS)
            for who in ENGINES:
                assert len(r[who]["samples_s"]) == 1 and r[who]["median_s"] > 0
                assert r[who]["tokens_per_s"] == pytest.approx(r["tokens"] / r[who]["median_s"])
            for peer in ("llama_cpp", "transformers"):
                assert r[f"glm53/{peer}"] == pytest.approx(
                    r["glm53"]["tokens_per_s"] / r[peer]["tokens_per_s"]
                )
                assert res["summary"][fmt][phase][f"glm53/{peer}"] == r[f"glm53/{peer}"]
            # transformers runs the dense weights once: its F32 row is the quantized file's reference
            assert (
                quant["phases"][phase]["transformers"]["median_s"]
                == f32["phases"][phase]["transformers"]["median_s"]
            )
            assert line_of(stdout, fmt, phase)
    assert quant["phases"][PHASES[0]]["transformers"]["reference_of"] == "F32"
    assert "| F32 | prefill_16 |" in stdout


def line_of(stdout: str, fmt: str, phase: str) -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(f"[{fmt:10s}] {phase} ")]
    assert len(lines) == 1, (fmt, phase, stdout)
    return lines[0]


@pytest.mark.slow
def test_greedy_agreement_on_f32_is_total(result):
    stdout, res, _ = result
    f32 = res["files"]["F32"]
    for b in BATCH:
        g = f32["greedy"][f"decode_b{b}"]
        for who in ("vs_llama_cpp", "vs_transformers"):
            assert g[who]["agree"] and g[who]["first_mismatch"] == [None] * b, (b, who, g[who])
            assert np.asarray(g[who]["glm53"]).shape == (b, STEPS + 1) and g[who]["glm53"] == g[who]["peer"]
    for who, d in f32["prefill_logits"][PHASES[0]].items():
        assert d["rel"] < 1e-4 and d["top1_agree"], (who, d)
    assert "WARNING" not in stdout
    q = res["files"]["UD-IQ3_XXS"]["greedy"][PHASES[1]]["vs_llama_cpp"]  # reported, not required to agree
    assert len(q["first_mismatch"]) == BATCH[0] and len(q["peer"][0]) == STEPS + 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_llama_cpp_tokens_match_an_independent_run(result, fmt):
    """Each reported llama.cpp stream (batched decode through the C API) is llama.cpp's greedy continuation of
    its prompt, recomputed one sequence at a time with `Llama` (tests/gguf_fixtures.py)."""
    _, res, files = result
    vocab = res["model"]["vocab_size"]
    prompts = np.random.default_rng(SEED).integers(1, vocab, size=(max(BATCH), PREFILL)).astype(np.int32)
    path = str(files / res["files"][fmt]["file"])
    for b in BATCH:
        streams = res["files"][fmt]["greedy"][f"decode_b{b}"]["vs_llama_cpp"]["peer"]
        for s, toks in enumerate(streams):
            seq = [*prompts[s].tolist(), *toks[:-1]]
            got = llama_logits(path, seq)[PREFILL - 1 :].argmax(-1)
            assert got.tolist() == toks, (fmt, b, s)


def test_bad_flags_are_usage_errors():
    for args, match in [
        (("--batch=0",), "--batch: expected one or more positive integers"),
        (("--formats=F32,Q9_K",), "--formats: expected distinct names"),
    ]:
        r = _run(*args)
        assert r.returncode == 2 and f"usage error: {match}" in r.stderr, (args, r.stderr[-2000:])
