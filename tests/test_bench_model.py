"""Smoke test of `python -m experiments.bench_model` on the tiny config: the JSON it writes, and that glm53's greedy
tokens and last prefill logits agree with transformers (same weights, run by the benchmark in one process).
Speed is not asserted. The same run writes a profiler trace (--profile), checked here too."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFILL, DECODE = 32, 8  # past index_topk = 8: the sparse selection fires in prefill and decode


def _run(*args):
    # glm53's programs compile at XLA's backend optimization level 0: shorter compiles, the same programs
    # and results (speed is not asserted)
    xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla)
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench_model", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out, trace = tmp / "bench.json", tmp / "trace"
    r = _run(
        "--configs=tiny", f"--prefill_len={PREFILL}", f"--decode_len={DECODE}", "--repeats=2", f"--out={out}",
        f"--profile={trace}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(out.read_text()), trace


def test_json_keys_and_counts(result):
    stdout, res, _ = result
    assert set(res) == {"machine", "settings", "configs"}
    assert {"backend", "cpu_count", "torch_threads", "versions"} <= set(res["machine"])
    assert {"jax", "jaxlib", "flax", "torch", "transformers"} <= set(res["machine"]["versions"])
    assert res["settings"]["prefill_len"] == PREFILL and res["settings"]["decode_len"] == DECODE
    assert list(res["configs"]) == ["tiny"]
    rec = res["configs"]["tiny"]
    assert rec["variant"] == "default" and rec["model"]["hidden_size"] == 64
    for phase, tokens in (("prefill", PREFILL), ("decode", DECODE)):
        r = rec[phase]
        assert r["tokens"] == tokens
        for who in ("glm53", "transformers"):
            assert len(r[who]["samples_s"]) == 2 and r[who]["median_s"] > 0
            assert r[who]["tokens_per_s"] == pytest.approx(tokens / r[who]["median_s"])
        assert r["ratio"] == pytest.approx(r["transformers"]["median_s"] / r["glm53"]["median_s"])
    for line in ("[tiny] prefill", "[tiny] decode", "ratio", "greedy tokens agree"):
        assert line in stdout


def test_greedy_tokens_agree_with_transformers(result):
    stdout, res, _ = result
    g = res["configs"]["tiny"]["greedy"]
    print("glm53", g["glm53"], "transformers", g["transformers"])
    assert len(g["glm53"]) == DECODE + 1 and len(g["transformers"]) == DECODE + 1
    assert g["agree"] and g["first_mismatch"] is None and g["glm53"] == g["transformers"]
    assert "WARNING" not in stdout
    assert res["configs"]["tiny"]["prefill_last_logits_rel_diff"] <= 1e-4


def test_profile_flag_writes_a_trace(result):
    """--profile=DIR writes a JAX profiler trace (an .xplane.pb under DIR/<config>/plugins/profile/<run>/) that
    holds the glm53 calls' annotations."""
    stdout, _, trace = result
    traces = list((trace / "tiny").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, list(trace.rglob("*"))
    data = traces[0].read_bytes()
    assert b"glm53_prefill" in data and b"glm53_decode" in data
    assert f"profiler trace of the glm53 calls: {trace / 'tiny'}" in stdout


def test_unknown_config_is_rejected():
    r = _run("--configs=tiny,huge")
    assert r.returncode != 0 and "unknown ['huge']" in r.stderr
