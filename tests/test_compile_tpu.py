"""`experiments.compile_tpu` on the release widths, 2 layers (a dense KDA layer and a DSA + MoE layer with UD
planes), one stream, one small prefill bucket and a short context: compiled by libtpu for a v5e-8 slice on this
host, the JSON holds every figure the README's table reads, the Mosaic expert kernels and their gathers, and the
compile census."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from glm53.benchmarks import compiled_hlo
from glm53.benchmarks.compile_tpu import Settings

pytestmark = pytest.mark.tpu_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_tpu") / "r.json"
    cmd = [sys.executable, "-m", "experiments.compile_tpu", "--config=configs/glm53_flash.py",
           "--topology=v5e:2x4", "--experts=ud_iq3_xxs", "--layers=2", "--streams=1", "--prefill=16",
           "--context=256", f"--out={out}"]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "| decode 1x1 |" in p.stdout and "| prefill 1x16 |" in p.stdout
    assert not os.path.exists(f"{out}.partial")
    return json.loads(out.read_text())


def test_programs_and_units(result):
    assert result["mesh"]["shape"] == {"data": 1, "model": 8} and result["mesh"]["rules"] == "tp"
    assert "v5" in result["mesh"]["device_kind"].lower()
    progs = result["programs"]
    assert [(p["phase"], p["streams"], p["tokens"]) for p in progs] == [("decode", 1, 1), ("prefill", 1, 16)]
    for p in progs:
        names = [u["name"] for u in p["units"]]
        assert names == ["embed+head", "kda+dense", "dsa+moe[IQ3_S/IQ3_S/IQ4_XS]"], names
        assert sum(u["count"] for u in p["units"][1:]) == 2
        for u in p["units"]:
            assert "error" not in u
            assert u["lower_s"] > 0 and u["compile_s"] > 0
            mem = u["memory"]
            assert all(mem[k] >= 0 for k in ("argument", "output", "temp", "alias", "code", "total"))
            # the compiler's argument bytes = the weights and caches placed by the rules (+ tiny activations)
            held = sum(u["weights"].values()) + u["cache"]
            assert held <= mem["argument"] <= held + (1 << 20)
            assert u["cost"]["flops"] > 0 and u["cost"]["bytes_accessed"] > 0
            r = u["roofline"]
            assert r["memory_s"] == pytest.approx(u["cost"]["bytes_accessed"] / 819e9)
            assert r["roofline_s"] == max(r["memory_s"], r["flops_s"])
            assert set(u["collectives"]) == set(compiled_hlo.COLLECTIVES)
        moe = p["units"][2]
        assert moe["mosaic_kernels"] == 2  # gate+up and down, no interpreter
        assert moe["mosaic_gathers"]["kernels"] == 2 and moe["mosaic_gathers"]["dynamic_gather"] > 0
        assert moe["weights"]["routed_experts"] > 0
        assert moe["collectives"]["all-reduce"] >= 1  # the MoE layer's one all-reduce of the experts
        assert p["units"][1]["mosaic_kernels"] == 0


def test_totals(result):
    for p in result["programs"]:
        t = p["total"]
        units = p["units"]
        assert t["weights"] == sum(sum(u["weights"].values()) * u["count"] for u in units)
        assert t["temp"] == max(u["memory"]["temp"] for u in units)
        assert t["total"] == t["weights"] + t["cache"] + t["temp"] + t["code"] + t["output"]
        assert t["hbm"] == 16 * (1 << 30) and t["fits"]
        assert t["context_sets_fit"] >= 1 and t["cache_per_stream"] == t["cache"] // p["streams"]
        assert t["mosaic_kernels"] == 2 and t["cost"]["bytes_accessed"] > 0


def test_census(result):
    c = result["census"]
    assert c["distinct_programs"] == {"decode": 1, "prefill": 1, "units_per_program": [3, 3]}
    assert c["cold"]["compile_s"] > 0 and c["warm_persistent_cache"]["compile_s"] > 0
    assert c["cache_entries"] >= 1
    if importlib.util.find_spec("flatbuffers"):
        e = c["export"]
        assert e["bytes"] > 0 and e["deserialize_s"] >= 0 and e["compile_s"] > 0
        assert e["lower_s"] < c["cold"]["lower_s"]  # the deserialized program is not traced again
    else:
        assert "flatbuffers" in c["export"]["error"]


@pytest.mark.parametrize(
    "streams, prefill, ok",
    [((), (2048,), True), ((1,), (), True), ((), (), False), ((0,), (16,), False), ((1,), (-1,), False)],
)
def test_settings_program_lists(streams, prefill, ok):
    """Either list may be empty (a run of only the prefill buckets), not both; every entry is positive."""
    if ok:
        assert Settings(streams=streams, prefill=prefill).streams == streams
    else:
        with pytest.raises(ValueError, match="--streams / --prefill must be positive"):
            Settings(streams=streams, prefill=prefill)
