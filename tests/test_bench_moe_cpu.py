"""Smoke test of `python -m experiments.bench_moe_cpu` at tiny sizes: it runs, its JSON has the documented
structure, and the ratios are the ones its medians give (timings themselves are never asserted)."""

import json
import os
import subprocess
import sys

import pytest

from glm53.benchmarks import moe_cpu
from kernels.moe import xla_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--experts=4", "--hidden=256", "--width=256", "--top_k=2"]


def _bench(*args, tmp_path=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench_moe_cpu", *TINY, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_entry_point_writes_the_json(tmp_path):
    out = tmp_path / "moe_cpu.json"
    proc = _bench(
        "--tokens=2", "--impls=xla_cpu,mlp", "--weights=dense,split,reencoded", "--repeats=2", f"--out={out}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["shape"] == {"experts": 4, "hidden": 256, "width": 256, "top_k": 2}
    assert r["machine"]["backend"] == "cpu" and "jax" in r["machine"]["versions"]
    recs = {(x["tokens"], x["weights"], x["impl"]): x for x in r["records"]}
    assert set(recs) == {(t, k, i) for t in (2,) for k, i in
                         (("dense", "xla_cpu"), ("split", "xla_cpu"), ("reencoded", "xla_cpu"), ("mlp", "mlp"))}  # fmt: skip
    for (t, _kind, impl), x in recs.items():
        assert len(x["samples_s"]) == 2 and x["min_s"] <= x["median_s"] and x["median_s"] > 0
        assert 1 <= x["distinct_experts"] <= min(t * 2, 4)
        mlp = recs[t, "mlp", "mlp"]["median_s"]
        assert x["vs_mlp"] == pytest.approx(x["median_s"] / mlp)
        if impl == "mlp":
            assert x["vs_dense"] is None and x["runs"] == "mlp"
        else:
            assert x["runs"] == "xla_cpu_decode"  # T*K <= 64
            assert x["vs_dense"] == pytest.approx(x["median_s"] / recs[t, "dense", impl]["median_s"])
    assert all(recs[t, "dense", "xla_cpu"]["vs_dense"] == 1.0 for t in (2,))
    assert "x 1.00 of dense" in proc.stdout
    # each row names the kernel that ran: the C++ kernel (cpu_ffi) or the plain-XLA path, and why
    assert recs[2, "dense", "xla_cpu"]["kernel"] == "xla_cpu_decode: XLA (dense weights)"
    assert recs[2, "split", "xla_cpu"]["kernel"] == "xla_cpu_decode: XLA (dense weights, per-expert views)"
    assert recs[2, "mlp", "mlp"]["kernel"] == "dense SwiGLU (XLA)"
    want = "xla_cpu_decode: cpu_ffi (C++)" if xla_cpu._ffi_unsupported(moe_cpu.make_weights(
        "reencoded", moe_cpu.Shape(4, 256, 256, 2)).values()) is None else "xla_cpu_decode: XLA ("  # fmt: skip
    assert recs[2, "reencoded", "xla_cpu"]["kernel"].startswith(want)
    # and the spread: min / median / max on every timed row
    rows = [line for line in proc.stdout.splitlines() if line.startswith("T=2 ")]
    assert len(rows) == 4 and all(line.count(" / ") == 2 and " ms" in line for line in rows)
    assert all(x["min_s"] <= x["median_s"] <= x["max_s"] for x in r["records"]) and r["not_run"] == []


def test_left_out_pairs_say_why():
    r = moe_cpu.run([64], ["xla_cpu"], ["split", "dense"], repeats=1, shape=moe_cpu.Shape(4, 256, 256, 2), log=lambda s: None)
    assert [x["weights"] for x in r["records"]] == ["dense"] and r["records"][0]["kernel"] == "xla_cpu_prefill"
    assert r["not_run"] == [dict(weights="split", tokens=64, impl="xla_cpu", why=(
        "per-expert views are read by the xla_cpu decode form only (xla_cpu runs xla_cpu_prefill)"))]  # fmt: skip


def test_moe_kernel_names_the_path():
    ws = list(moe_cpu.make_weights("planes", moe_cpu.Shape(4, 256, 256, 2)).values())
    assert moe_cpu.moe_kernel("xla_cpu", 200, ws) == "xla_cpu_prefill"
    assert moe_cpu.moe_kernel("auto", 4, ws, backend="tpu") == "pallas_tpu_decode"
    assert moe_cpu.moe_kernel("xla_cpu_xla_decode", 4, ws) == "xla_cpu_xla_decode: XLA"
    assert moe_cpu.moe_kernel("xla_cpu", 4, ws, backend="gpu").startswith("xla_cpu_decode: XLA (the C++ kernel")


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="impls"):
        moe_cpu.check_names(["fastest"], ["dense"])
    with pytest.raises(ValueError, match="weights"):
        moe_cpu.check_names(["xla_cpu"], ["f16"])
    with pytest.raises(ValueError, match="hidden"):
        moe_cpu.Shape(hidden=100)
    with pytest.raises(ValueError, match="tokens"):
        moe_cpu.run([0], ["xla_cpu"], ["dense"], shape=moe_cpu.Shape(4, 256, 256, 2))
