"""The benchmark harness (timer, machine record, JSON writer) and the dequantization entry point end to end.
Timings are never asserted beyond being positive."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from glm53.benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_time_calls_warms_up_then_takes_turns():
    order = []

    def fn(name):
        def call(*args):
            order.append((name, args))
            return jnp.ones(3) * len(order)

        return call

    t = harness.time_calls({"a": fn("a"), "b": fn("b")}, warmup=2, repeats=3, setup={"b": lambda: "fresh"})
    assert order == [("a", ()), ("b", ("fresh",))] * 5
    for k in ("a", "b"):
        assert len(t[k].warmup_s) == 2 and len(t[k].samples_s) == 3
        assert 0 < t[k].min_s <= t[k].median_s and all(x > 0 for x in t[k].samples_s)
        assert t[k].to_dict() == {
            "median_s": t[k].median_s,
            "min_s": t[k].min_s,
            "max_s": t[k].max_s,
            "samples_s": list(t[k].samples_s),
        }
    assert float(t["a"].result[0]) == 9 and float(t["b"].result[0]) == 10  # the last call's output
    one = harness.time_call(lambda: 1, warmup=0, repeats=0)
    assert one.warmup_s == () and len(one.samples_s) == 1 and one.result == 1


def test_timing_statistics_and_speedup():
    t = harness.Timing((3.0, 1.0, 2.0, 10.0))
    assert (t.median_s, t.min_s, t.max_s) == (2.5, 1.0, 10.0)
    assert harness.speedup(harness.Timing((5.0,)), t) == 2.0


def test_spread_and_first_line():
    t = harness.Timing((0.00058, 0.0012, 0.00467))
    assert harness.spread_ms(t) == "   0.580 /    1.200 /    4.670"
    assert harness.spread_ms(t.to_dict(), 0, 2) == "0.58 / 1.20 / 4.67"  # a record's fields alike
    assert harness.SPREAD_HEADER == "min / median / max ms"
    assert harness.first_line(ValueError("bad shape\nmore detail")) == "ValueError: bad shape"
    assert harness.first_line(NotImplementedError()) == "NotImplementedError"


def test_machine_record_has_the_fields():
    m = harness.machine(("numpy", "no-such-distribution"), extra_field=7)
    for key in ("platform", "python", "processor", "cpu_count", "cpu_usable", "load_average", "backend", "devices",
                "xla_flags", "versions"):  # fmt: skip
        assert key in m, key
    assert m["backend"] == "cpu" and len(m["devices"]) >= 1 and m["cpu_count"] >= m["cpu_usable"] >= 1
    assert m["versions"]["jax"] and m["versions"]["jaxlib"] and m["versions"]["numpy"]
    assert m["versions"]["no-such-distribution"] is None and m["extra_field"] == 7
    assert "backend cpu" in harness.describe(m)
    json.dumps(m)


def test_write_result_writes_json_atomically(tmp_path):
    out = tmp_path / "r.json"
    harness.write_result(out, {"records": [{"median_s": 0.5}], "machine": harness.machine()})
    assert json.loads(out.read_text())["records"] == [{"median_s": 0.5}]
    assert os.listdir(tmp_path) == ["r.json"]
    with pytest.raises(FileNotFoundError):
        harness.write_result(tmp_path / "missing" / "r.json", {})


def test_bench_dequant_entry_point_writes_the_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_dequant", "--types=Q8_0,IQ2_S", "--rows=8", "--cols=256",
         "--repeats=1", "--quant_rows=4", f"--out={out}"],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    machine = records[-1]
    assert machine["type"] == "machine" and machine["backend"] == "cpu" and machine["versions"]["gguf"]
    impls = {(r["type"], r["impl"]) for r in records[:-1]}
    assert {("IQ2_S", "jax_planes_reencoded"), ("Q8_0", "jax_planes"), ("Q8_0", "ggml")} <= impls
    for r in records[:-1]:
        assert r["exact"] and r["median_s"] > 0 and len(r["samples_s"]) == 1
        assert r["min_s"] == r["median_s"] == r["max_s"]  # one sample
        assert r["ratio_vs_ggml"] > 0 and r["ratio_vs_gguf_py"] > 0
    assert "x gguf-py" in proc.stdout and f"wrote {out}" in proc.stdout
    # every row prints min / median / max and the decoder (impl) that ran
    assert "min / median / max ms" in proc.stdout and "impl (decoder that ran)" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("Q8_0 ", "IQ2_S "))]
    assert len(rows) == len(records) - 1 and all(line.count(" / ") == 2 for line in rows)
