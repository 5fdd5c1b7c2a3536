"""`experiments.compile_tpu` on the release widths, 2 layers (a dense KDA layer and a DSA + MoE layer with UD
planes), one stream, one small prefill bucket and a short context: compiled by libtpu for a v5e-8 slice on this
host, the JSON holds every figure docs/tpu.md's table reads, the Mosaic expert kernels and their gathers, and the
compile census."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import glm53_flash, tiny
from glm53.benchmarks import compile_tpu, compiled_hlo
from glm53.benchmarks.compile_tpu import Settings
from glm53.config import QuantConfig, model_config_from_dict
from glm53.memory.weights import non_expert_by_class
from glm53.testing import tpu

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
    # quiet by default (glm53/logs.py): libtpu's start-up messages held back, no progress carriage returns
    assert "InitGoogle" not in p.stderr and "host bounds" not in p.stderr and "\r" not in p.stdout + p.stderr
    return json.loads(out.read_text())


def test_programs_and_units(result):
    assert result["mesh"]["shape"] == {"data": 1, "model": 8} and result["mesh"]["rules"] == "tp"
    assert "v5" in result["mesh"]["device_kind"].lower()
    progs = result["programs"]
    assert [(p["phase"], p["streams"], p["tokens"]) for p in progs] == [("decode", 1, 1), ("prefill", 1, 16)]
    for p in progs:
        names = [u["name"] for u in p["units"]]
        assert names == ["embed+head", "kda+dense", "dsa+moe[IQ2_S/IQ2_S/IQ3_S]"], names  # the mix scaled to 1 MoE layer
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
        # the expert kernels' reads: min(T * top-8, 288) experts of the MoE layer's planes, on top of XLA's count
        slots = min(p["streams"] * p["tokens"] * 8, 288)
        moe = units[2]
        assert moe["expert_reads"] == moe["weights"]["routed_experts"] // 288 * slots > 0
        assert t["expert_bytes_read"] == moe["expert_reads"]
        assert t["cost"]["bytes_accessed"] == t["cost"]["bytes_accessed_xla"] + t["expert_bytes_read"]
        assert t["roofline"]["memory_s"] == pytest.approx(t["cost"]["bytes_accessed"] / 819e9)


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


def test_release_layers_non_expert_weights_equal_the_budget(result):
    """The release widths' 2 layers under the config's tp rules: compiled weight parameters = placed = budget."""
    w = result["non_expert_weights"]
    assert result["mesh"]["placement"] == "tp"
    assert w["compiled"] == w["model"] == w["budget"] and w["compiled_total"] == w["budget_total"]
    assert w["budget"]["embedding"] == w["budget"]["lm_head"]  # int8 vocabulary rows / columns + f32 scales


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


# ------------------------------------------------------------------------ weights as the memory budget stores them
def _narrow_config() -> ml_collections.ConfigDict:
    """A KDA + dense and a DSA + MoE layer at narrow widths that every split of the rules divides over 8 chips
    (heads, low-rank outputs, vocabulary) and whose routed experts the Pallas kernels take (IQ4_XS blocks: hidden
    256, expert width 2048 = 8 devices x one block of 256): compiles in seconds."""
    model = tiny.model_config("gguf").to_dict()
    model.update(vocab_size=1024, num_hidden_layers=2, layer_types=["kda", "dsa"], mlp_layer_types=["dense", "moe"],
                 indexer_types=["full", "full"], moe_intermediate_size=2048, n_routed_experts=8,
                 num_experts_per_tok=2, linear_num_heads=8, num_attention_heads=8, index_n_heads=8)  # fmt: skip
    return ml_collections.ConfigDict(
        dict(
            model=model,
            quant=dict(experts="iq4_xs", layout="planes", decode_max_slots=64),
            mesh=dict(axes=("data", "model"), shape=(1, -1), rules="tp"),
            seed=0,
            param_dtype="bfloat16",
        )
    )


@pytest.mark.parametrize("placement", ["prior_art", "tp"])
def test_compiled_non_expert_weights_equal_the_budget(placement):
    """The compiled programs' weight parameters per chip (the entry parameters of every unit, summed by tensor
    class over the layers) equal the memory budget's non-expert bytes per chip for the same config, 8 devices and
    placement, to the byte and per class: int8 embedding rows (`Int8Rows`) and lm_head columns, a bf16 router, f32
    norms, and under "prior_art" the low-rank projections split by output. The compiler's argument bytes are
    these, the routed experts, caches and activations, plus the TPU tile padding of small arrays."""
    config = _narrow_config()
    settings = Settings(experts="iq4_xs", streams=(1,), prefill=(16,), context=256, census=False,
                        placement=placement)  # fmt: skip
    r = compile_tpu.run(config, settings, progress=lambda _: None)
    cfg = model_config_from_dict(config.model)
    budget = {k: v["bytes_per_device"] for k, v in non_expert_by_class(cfg, 8, placement).items()}
    w = r["non_expert_weights"]
    assert r["mesh"]["placement"] == placement
    assert w["compiled"] == w["model"] == w["budget"] == budget
    assert w["compiled_total"] == sum(budget.values())
    for p in r["programs"]:
        t = p["total"]["weights_compiled"]
        assert {k: v for k, v in t.items() if k != "routed_experts"} == budget
        assert t["routed_experts"] == sum(u["weights"]["routed_experts"] for u in p["units"])
        for u in p["units"]:
            held = sum(u["weights"].values()) + u["cache"]
            assert sum(u["weights_compiled"].values()) == sum(u["weights"].values())
            assert held <= u["parameter_bytes"] <= u["memory"]["argument"] < u["parameter_bytes"] + (64 << 10)
    other = "tp" if placement == "prior_art" else "prior_art"
    other_budget = {k: v["bytes_per_device"] for k, v in non_expert_by_class(cfg, 8, other).items()}
    changed = {k for k in budget if budget[k] != other_budget[k]}
    assert changed == {"attention", "indexer"}  # the low-rank split: q_a, kv_a, f_a, g_a, indexer wk / gate
    vocab_rows = cfg.vocab_size // 8
    assert budget["embedding"] == vocab_rows * cfg.hidden_size + vocab_rows * 4  # int8 + f32 scale per row


@pytest.mark.parametrize("placement, gb", [("prior_art", 1_280_122_792), ("tp", 1_402_269_992)])
def test_release_non_expert_weights_equal_the_budget(placement, gb):
    """The release model as compile_tpu builds it (abstract, placed on v5e:2x4; nothing compiled): its non-expert
    weights per chip equal the memory budget's per class (docs/tpu.md "Memory budget": 1.28 GB prior_art, 1.40 GB tp)."""
    config = glm53_flash.get_config()
    cfg = model_config_from_dict(config.model)
    quant = QuantConfig(experts="ud_iq3_xxs", layout="planes")
    mesh = tpu.topology_mesh("v5e:2x4", (1, 8), ("data", "model"))
    model = compile_tpu.abstract_model(cfg, quant, mesh, placement, kernels={"moe": "pallas_tpu"})
    budget = {k: v["bytes_per_device"] for k, v in non_expert_by_class(cfg, 8, placement).items()}
    assert compile_tpu.weights_by_class(model) == budget
    assert sum(budget.values()) == gb


# ------------------------------------------------------------------------------ whole programs with scanned layers
def test_whole_scanned_program_counts_every_loop_iteration():
    """--compose=full on a scanned model (KDA + dense, then 3 identical KDA + MoE layers: one loop of 3): the
    program compiles whole with one loop unit whose 2 further iterations are added to XLA's count (its cost
    analysis counts a loop body once), so flops equal the unrolled program's, and the unrolled program's bytes
    accessed lie between XLA's count (lower bound) and the count with every iteration measured on the loop
    compiled alone (upper bound: that program's one-time reads count once more per iteration)."""
    config = _narrow_config()
    config.model.update(num_hidden_layers=4, layer_types=["kda"] * 4, mlp_layer_types=["dense"] + ["moe"] * 3,
                        indexer_types=["full"] * 4)  # fmt: skip
    settings = Settings(experts="iq4_xs", streams=(2,), prefill=(), context=256, census=False, compose="full")
    totals = {}
    for scan in (True, False):
        config.model.scan_layers = scan
        r = compile_tpu.run(config, settings, progress=lambda _: None)
        p = r["programs"][0]
        assert all("error" not in u for u in p["units"])
        totals[scan] = p["total"]
        if scan:
            assert r["model"]["groups"] == "layers: 2 traced for 4 (0, 1-3 (scan: 3 x 1))"
            assert [(u["name"], u["count"]) for u in p["units"]] == [("model", 1), ("loop 1-3 (scan: 3 x 1)", 2)]
            loop = p["units"][1]
            assert p["total"]["loop_iterations"] == {loop["name"]: 2}
            assert p["total"]["cost"]["bytes_accessed_loops"] == 2 * loop["cost"]["bytes_accessed"] > 0
        else:
            assert [u["name"] for u in p["units"]] == ["model"]
    s, u = totals[True], totals[False]
    assert s["weights"] == u["weights"] and s["expert_bytes_read"] == u["expert_bytes_read"]
    assert s["cost"]["flops"] == pytest.approx(u["cost"]["flops"], rel=0.02)
    assert s["cost"]["bytes_accessed_lower"] < u["cost"]["bytes_accessed"] < s["cost"]["bytes_accessed"]
    assert u["cost"]["bytes_accessed_lower"] == u["cost"]["bytes_accessed"]  # no loops: one count


def test_paged_caches_pool_bytes_and_tokens_fit():
    """--cache_tokens (paged DSA caches): the decode step compiles for TPU with one page pool for both streams;
    the pool's bytes per chip are exact (pages split over the 8 chips + a scratch page each; the narrow config's
    latent is float here: kv_lora bf16 per token, pooled keys index_head_dim bf16 per 4 tokens), the per-stream
    cache is the rest, and the tokens that fit follow from the compiled program's free memory."""
    config = _narrow_config()
    settings = Settings(experts="iq4_xs", streams=(2,), prefill=(), context=4096, census=False, compose="full",
                        cache_tokens=8192, page_tokens=64)  # fmt: skip
    r = compile_tpu.run(config, settings, progress=lambda _: None)
    (p,) = r["programs"]
    t = p["total"]
    cfg = model_config_from_dict(config.model)
    pages_per_chip = 8192 // 64 // 8 + 1
    per_token = cfg.kv_lora_rank * 2 + cfg.index_head_dim * 2 // cfg.index_kpool  # one DSA layer, bf16
    assert t["pool"] == pages_per_chip * 64 * per_token
    assert t["pool_tokens"] == 8192 and t["pool_bytes_per_token"] == per_token / 8
    assert t["cache"] - t["pool"] == 2 * t["cache_per_stream"] > 0
    assert t["cache_tokens_fit"] == int((t["hbm"] - (t["total"] - t["pool"])) / (per_token / 8))
