"""Smoke test of `python -m experiments.bench_kernels` on the tiny shape set: it runs, and its JSON has the
documented fields with consistent byte counts (timings are never asserted)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs import bench_kernels
from glm53.benchmarks import kernels as bench
from glm53.quant import budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_entry_point_writes_the_json(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_kernels", "--config=configs/bench_kernels.py:tiny", f"--out={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["set"] == "tiny" and r["machine"]["backend"] == "cpu" and "jax" in r["machine"]["versions"]
    s = bench.Settings.from_config(bench_kernels.get_config("tiny"))
    per_expert = {}
    seen = set()
    for rec in r["records"]:
        for key in ("median_s", "weight_bytes", "gb_per_s", "distinct_experts", "ratio_vs_reference",
                    "ratio_vs_dequant_all", "ratio_vs_copy", "copy_gb_per_s", "weight_bytes_touched"):  # fmt: skip
            assert key in rec, key
        seen.add((rec["op"], rec["impl"], rec["tokens"]))
        assert rec["median_s"] > 0 and rec["distinct_experts"] <= min(rec["slots"], s.n_experts)
        # bytes: distinct experts x one expert's gate + up + down plane bytes, the same for every impl
        per_expert.setdefault(rec["layout"], rec["weight_bytes"] / rec["distinct_experts"])
        assert rec["weight_bytes"] == per_expert[rec["layout"]] * rec["distinct_experts"]
        if rec["impl"] in ("reference", "dequant_all"):
            assert rec["weight_bytes_touched"] == per_expert[rec["layout"]] * s.n_experts
    for t in s.streams:
        assert {("decode", impl, t) for impl in ("reference", "dequant_all", "xla_quant", "xla_cpu")} <= seen
    assert {("prefill", i, s.prefill_tokens[0]) for i in ("xla_quant", "xla_cpu")} <= seen
    # what "auto" runs on CPU (xla_cpu) is timed, and each row names its kernel (C++ cpu_ffi or plain XLA)
    assert r["auto"] == "xla_cpu" and "auto runs xla_cpu on this backend: timed above" in proc.stdout
    kernels = {(x["op"], x["impl"]): x["kernel"] for x in r["records"]}
    assert kernels["decode", "xla_quant"] == "xla_quant_decode" and kernels["prefill", "xla_cpu"] == "xla_cpu_prefill"
    assert kernels["decode", "xla_cpu"].startswith(("xla_cpu_decode: cpu_ffi (C++)", "xla_cpu_decode: XLA ("))
    assert all(x["min_s"] <= x["median_s"] <= x["max_s"] for x in r["records"])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("planes ")]
    assert len(rows) == len(r["records"]) and all(line.count(" / ") == 2 for line in rows)
    # the rows not timed say why; no verdict is bare
    assert [(x["impl"], x["why"]) for x in r["not_run"]] == [
        ("pallas_tpu", "pallas_tpu needs a TPU (interpret mode only here: its timings mean nothing)"),
        ("pallas_gpu", "pallas_gpu needs a GPU (interpret mode only here: its timings mean nothing)"),
    ]
    assert "pallas_tpu   not run: pallas_tpu needs a TPU" in proc.stdout
    for line in proc.stdout.splitlines():
        assert "MISSED" not in line or "MISSED: time grew x" in line, line
    # IQ2_S gate/up + IQ3_S down, D = F = 256: (2 x 82 + 110) GGUF bytes per row of 256 weights, plus 2 bytes
    # per row and matrix because a row holds one block and the f16 `d` is stored in a whole word (planes.py)
    assert per_expert["planes"] == (2 * 82 + 110) * 256 + 3 * 2 * 256
    assert per_expert["planes"] == sum(
        budget.plane_nbytes((1, 256, 256), f) for f in ("IQ2_S", "IQ2_S", "IQ3_S")
    )
    assert {x["streams"] for x in r["scaling"]} == set(s.streams) - {1}
    assert all(x["meets_target"] or x["why"].startswith("time grew") for x in r["scaling"])
    assert "decode scaling" in proc.stdout


def test_a_failing_row_says_why_and_the_rest_run(monkeypatch):
    s = bench.Settings.from_config(bench_kernels.get_config("tiny"))
    s = dataclasses.replace(s, streams=(1, 2), prefill_tokens=(), impls=("xla_quant", "xla_cpu"))
    real = bench._impl_fn

    def impl_fn(impl, op, settings):
        if impl == "xla_quant":
            raise RuntimeError("no such kernel on this machine\ntraceback detail")
        return real(impl, op, settings)

    monkeypatch.setattr(bench, "_impl_fn", impl_fn)
    lines = []
    r = bench.run_benchmark(s, log=lines.append)
    assert [(x["impl"], x["tokens"]) for x in r["records"]] == [("xla_cpu", 1), ("xla_cpu", 2)]
    assert [(x["tokens"], x["why"]) for x in r["not_run"]] == [
        (t, "RuntimeError: no such kernel on this machine") for t in (1, 2)
    ]
    assert sum("xla_quant    not run: RuntimeError: no such kernel" in line for line in lines) == 2
    assert [x["impl"] for x in r["scaling"]] == ["xla_cpu"]


def test_settings_of_every_set_and_bad_settings():
    real = bench.Settings.from_config(bench_kernels.get_config("real"))
    assert (real.n_experts, real.d_model, real.d_ff, real.top_k) == (288, 4096, 2048, 8)
    assert real.streams == (1, 3, 8, 32, 64) and real.prefill_tokens == (512, 1024, 2048, 4096)
    assert real.experts == {"gate": "IQ2_S", "up": "IQ2_S", "down": "IQ3_S"}
    assert round(bench.expected_distinct(288, 8, 32), 1) == 171.1  # U(32), docs/architecture.md §12
    assert bench.Settings.from_config(bench_kernels.get_config("cpu")).layouts == ("planes", "reencoded")
    assert set(bench.AUTO_PICKS.values()) <= set(real.impls)  # every set times what auto can pick
    assert "xla_cpu" in bench.Settings.from_config(bench_kernels.get_config("cpu")).impls
    c = bench_kernels.get_config("tiny")
    c.impls = "reference,xla_cpu"
    assert bench.Settings.from_config(c).impls == ("reference", "xla_cpu")  # was "unknown ['xla_cpu']"
    c.impls = "reference,fastest"
    with pytest.raises(ValueError, match="impls"):
        bench.Settings.from_config(c)
    with pytest.raises(ValueError, match="unknown set"):
        bench_kernels.get_config("huge")
