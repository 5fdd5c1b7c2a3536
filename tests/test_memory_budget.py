"""Memory budget (glm53/memory/, experiments/memory_budget.py).

References: transformers' Glm5Next modules built on the meta device (inventory paths and shapes, parameter counts,
vision formula), the real Glm53Model module tree built with nnx.eval_shape (cache pytrees), gguf-py's block sizes
(GGUF bytes), hand formulas from the shapes (per-class bytes), and the audit article's printed figures.
"""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

from glm53.checkpoint.hf_rules import Mapped, classify
from glm53.config import ModelConfig, VisionConfig, as_hf_text_config, model_config_from_dict
from glm53.layers.param import path_str
from glm53.memory import budget as memory
from glm53.memory.caches import CacheLayout, context_set_bytes
from glm53.memory.inventory import param_counts, param_inventory, vision_inventory
from glm53.quant.mixes import UD_IQ3_XXS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def _release_cfg() -> ModelConfig:
    spec = importlib.util.spec_from_file_location(
        "glm53_flash_cfg", os.path.join(ROOT, "configs", "glm53_flash.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return model_config_from_dict(mod.get_config().model)


TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=8,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    linear_num_heads=2,
    linear_head_dim=16,
    num_attention_heads=2,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=8,
    indexer_types=("full",) * 7 + ("shared",),
    eos_token_ids=(0,),
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def cfg():
    return _release_cfg()


@pytest.fixture(scope="module")
def budget(cfg):
    """Under the prior art's placement: the layout its audit article measured."""
    return memory.memory_budget(
        cfg, "ud_iq3_xxs", devices=8, hbm_gb=16.9, context=262144, streams=3, ladder=True,
        placement="prior_art",
    )  # fmt: skip


@pytest.fixture(scope="module")
def run_budget(cfg):
    """The default headline: the placement the run uses (the default config's mesh.rules, "tp")."""
    return memory.memory_budget(cfg, "ud_iq3_xxs", devices=8, hbm_gb=16.9, context=262144, streams=3)


def _hf_meta_state(c: ModelConfig) -> dict:
    """transformers' Glm5NextForConditionalGeneration of `c` on the meta device: {name: shape}."""
    text = as_hf_text_config(c)
    text["index_kpool"] = c.index_kpool
    hc = Glm5NextConfig(
        text_config=text,
        vision_config=dataclasses.asdict(c.vision or VisionConfig()),
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(hc)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_state(cfg):
    """transformers' Glm5NextForConditionalGeneration, release config, on the meta device: {name: numel}."""
    return {k: math.prod(s) for k, s in _hf_meta_state(cfg).items()}


# ------------------------------------------------------------------------------------------------ parameters
def test_param_counts_match_the_article(cfg):
    c = param_counts(cfg)
    assert c["total_params"] == 321_323_031_390
    assert c["routed_expert_params"] == 304_405_807_104 == 42 * 288 * 3 * 4096 * 2048
    assert round(100 * c["routed_expert_share"], 1) == 94.7
    assert c["non_expert_params"] == 8_921_004_862  # "8.921B"
    assert c["vision_params"] == 563_627_008  # "0.563B"
    assert (
        c["total_params"]
        == c["text_trunk_params"] + c["lm_head_params"] + c["mtp_params"] + c["vision_params"]
    )
    assert c["non_expert_params"] == c["text_trunk_params"] + c["lm_head_params"] - c["routed_expert_params"]
    assert round(c["active_params_per_token_excl_embedding"] / 1e9, 2) == 16.74  # docs/architecture.md §12


def test_param_counts_match_transformers_meta_model(cfg, hf_state):
    """Trunk, lm_head, vision and routed experts against transformers' state dict (persistent buffers
    included: e_score_correction_bias is a buffer there). transformers has no MTP block: total - MTP must
    match."""
    c = param_counts(cfg)
    lm = sum(n for k, n in hf_state.items() if k.startswith("model.language_model."))
    vis = sum(n for k, n in hf_state.items() if k.startswith("model.visual."))
    experts = sum(n for k, n in hf_state.items() if ".mlp.experts." in k)
    assert lm == c["text_trunk_params"]
    assert hf_state["lm_head.weight"] == c["lm_head_params"]
    assert vis == c["vision_params"]
    assert experts == c["routed_expert_params"]
    assert sum(hf_state.values()) == c["total_params"] - c["mtp_params"]


@pytest.mark.parametrize("which", ["release", "tiny"])
def test_inventory_matches_transformers_tensors(cfg, which):
    """Every path and shape of the nnx.eval_shape'd Glm53Model (MTP aside) equals transformers' text tensors
    brought into our layout by the checkpoint's name map (tiny: with a shared-indexer DSA layer, which holds no
    indexer); every parameter names one logical axis per dimension."""
    c = cfg if which == "release" else TINY
    tree = param_inventory(c, with_mtp=False)
    ours = {}
    for key, shape in _hf_meta_state(c).items():
        m = classify(key, c.num_hidden_layers, 0)
        if not isinstance(m, Mapped):
            continue  # the vision tower
        for p in m.apply(np.broadcast_to(np.float32(0), shape)):
            assert p.expert is None, key  # transformers' in-memory layout stacks the experts
            ours[path_str(p.path)] = tuple(p.value.shape)
    assert {t.path: t.shape for t in tree} == ours
    assert all(len(t.axes) == len(t.shape) for t in param_inventory(c))
    if which == "release":
        assert sum(t.size for t in param_inventory(c)) == 321_323_031_390 - 563_627_008


def _vision_hf(v: VisionConfig) -> dict:
    hv = Glm5NextVisionConfig(**dataclasses.asdict(v))
    with torch.device("meta"):
        model = Glm5NextVisionModel(hv)
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "v",
    [
        VisionConfig(),  # release fixture (out_hidden_size 4096)
        VisionConfig(
            depth=3,
            hidden_size=96,
            num_heads=4,
            intermediate_size=160,
            in_channels=2,
            patch_size=7,
            temporal_patch_size=3,
            spatial_merge_size=3,
            out_hidden_size=48,
            projection_intermediate_size=80,
            attention_bias=False,
        ),
    ],
)
def test_vision_formula_matches_transformers(v):
    ours = {t.path: t.shape for t in vision_inventory(v)}
    assert ours == _vision_hf(v)
    if v == VisionConfig():
        assert sum(math.prod(s) for s in ours.values()) == 563_627_008


# ------------------------------------------------------------------------------------------------ experts
def test_routed_expert_bytes(budget):
    # GGUF bytes from gguf-py's (block size, type size) per format, independent of glm53.quant.
    ref = 0
    for fmt in UD_IQ3_XXS.values():
        bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
        ref += 288 * 4096 * 2048 // bs * ts
    assert budget["routed_gguf_bytes"] == ref
    assert round(budget["routed_gguf_bytes"] / GB, 2) == 109.87
    assert round(budget["routed_planes_bytes"] / GB, 2) == 110.72
    # The only growth: 2-byte fields (IQ3_S d; IQ4_XS d, scales_h) of down, 1 block per device -> 4 bytes.
    fields = 39 * 1 + 3 * 2
    assert budget["routed_planes_growth_bytes"] == fields * 288 * 4096 * 8 * 2
    assert budget["per_device"]["routed_experts"] * 8 == budget["routed_planes_bytes"]


# ------------------------------------------------------------------------------------------------ non-expert
def test_non_expert_per_device(budget):
    assert round(budget["non_expert_int8_flat_bytes_per_device"] / GB, 2) == 1.12
    by = budget["non_expert_per_device_by_class"]
    n, d, v = 8, 4096, 154880
    # Hand formulas from the shapes and STORAGE (int8 + f32 scale; bf16 / f32 replicated).
    assert by["router"]["bytes_per_device"] == 42 * d * 288 * 2
    assert by["router_bias"]["bytes_per_device"] == 42 * 288 * 4
    assert by["mhc_fn"]["bytes_per_device"] == 90 * 4 * d * 24 * 2
    assert by["mhc_vectors"]["bytes_per_device"] == 90 * (24 + 3) * 4
    assert by["embedding"]["bytes_per_device"] == v * d // n + v * 4 // n
    assert by["lm_head"]["bytes_per_device"] == by["embedding"]["bytes_per_device"]
    dense = 3 * (2 * (d * 12288 // n + 12288 * 4 // n) + (12288 * d // n + d * 4))  # down: split by input
    assert by["dense_mlp"]["bytes_per_device"] == dense
    assert by["kda_vectors"]["bytes_per_device"] == 34 * (3 * 4 * 8192 + 8192 + 64) * 4 // n
    assert all(r["replicated_fallbacks"] == 0 for r in by.values())
    assert sum(r["params"] for r in by.values()) == budget["non_expert_params"]
    total = sum(r["bytes_per_device"] for r in by.values())
    assert total == budget["per_device"]["non_expert"]
    assert 1.2 * GB < total < 1.35 * GB  # replicated router + mHC fn add ~0.16 GB to the article's 1.12


def test_vision_per_device(budget):
    assert budget["vision_bytes_per_device"] == 563_627_008 * 2 // 8
    assert round(budget["vision_bytes_per_device"] / GB, 3) == 0.141


# ------------------------------------------------------------------------------------------------ caches
def _cache_bytes(c: ModelConfig, context: int, dtype) -> int:
    from flax import nnx

    from glm53.model import Glm53Model

    def build():
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        return Glm53Model(c, rngs=rngs, dtype=jnp.bfloat16, with_mtp=False)

    model = nnx.eval_shape(build)
    cache = jax.eval_shape(lambda: model.init_cache(1, context, dtype))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache) if x.ndim > 1)


@pytest.mark.parametrize("which,context", [("tiny", 37), ("release", 262144)])
def test_context_set_matches_the_model_cache_pytree(cfg, which, context):
    """On one device, the 'pooled' bf16 layout is exactly the bytes of Glm53Model.init_cache (the length vector
    aside)."""
    c = cfg if which == "release" else TINY
    lat = "int8" if c.latent_cache_dtype == "int8" else "bf16"  # the release config stores the latent int8
    lay = CacheLayout(latent=lat, indexer="pooled", index_dtype="bf16", conv_dtype="bf16")
    ours = sum(context_set_bytes(c, context, 1, lay).values())
    assert ours == _cache_bytes(c, context, jnp.bfloat16)


def test_context_set_per_device_reproduces_prior_art(cfg, budget):
    ctx = budget["context_set_by_component"]
    assert round(budget["context_set_bytes_per_device"] / GB, 2) == 0.23
    assert ctx["kda_state"] == 34 * 64 * 128 * 128 * 4 // 8
    assert ctx["mla_latent"] == 11 * (262144 // 8) * (512 + 4)
    assert ctx["indexer_pooled_keys"] == 11 * (262144 // 4 // 8) * 128 * 2
    # Sharding: one device holds 1/8 of the one-device figure (all dimensions divide evenly here), except
    # the indexer ring's keys/gates that every device keeps: the last 2 * kpool = 8 tokens x (key + gate) x 128 x
    # bf16 x 11 layers (the open pool's members, and the previous pool's for a rolled-back draft).
    one = sum(context_set_bytes(cfg, 262144, 1).values())
    open_pool = 11 * 8 * 2 * 128 * 2
    assert ctx["indexer_keys_gates"] == open_pool
    assert one // 8 + open_pool * 7 // 8 == budget["context_set_bytes_per_device"]
    # Per-token keys and gates at full length would not fit the prior art's 0.23 GB.
    assert budget["context_set_alternatives"]["indexer_full"] > 0.4 * GB


# ------------------------------------------------------------------------------------------------ totals
def test_totals_and_residual(budget):
    pd = budget["per_device"]
    assert budget["per_device_total_bytes"] == sum(pd.values())
    assert budget["headroom_bytes"] == round(16.9 * GB) - budget["per_device_total_bytes"]
    assert pd["caches"] == 3 * budget["context_set_bytes_per_device"]
    art = budget["article_reconstruction"]
    assert round(art["weights_bytes_per_device"] / GB, 1) == 15.1  # "about 15.1 GB per device in all"
    assert abs(art["weights_bytes_per_device"] - (110.72 / 8 + 1.12 + 0.141) * GB) < 0.01 * GB
    # The workspace is what the prior art's printed 15.4 leaves after our itemised weights.
    assert abs(budget["per_device_weights_bytes"] + pd["workspace"] - 15.4 * GB) < 2
    assert 0.1 * GB < pd["workspace"] < 0.3 * GB
    assert budget["fits"] and budget["max_streams"] == 6
    assert 16.0 * GB < budget["per_device_total_bytes"] < 16.2 * GB


def test_headline_is_the_placement_the_run_uses(budget, run_budget):
    r = run_budget
    assert r["headline_placement"] == r["config"]["placement"] == r["config"]["run_placement"] == "tp"
    roles = {name: row["roles"] for name, row in r["placements"].items()}
    assert roles == {"prior_art": ["prior art"], "tp": ["headline", "run"], "ep": []}
    # the headline is the tp row of the table, byte for byte
    tp = r["placements"]["tp"]
    assert tp["total"] == r["per_device_total_bytes"] and tp["fits"] == r["fits"]
    assert tp["max_streams"] == r["max_streams"] == 5 and r["fits"]
    assert tp["non_expert"] == r["per_device"]["non_expert"] and tp["context_set"] == r["context_set_bytes_per_device"]
    # the tp rules replicate the low-rank down-projections (+0.122 GB) and the KDA conv state (+34 x 3/4 of it)
    pa = budget["placements"]["prior_art"]
    assert pa["total"] == budget["per_device_total_bytes"] and pa["max_streams"] == 6
    assert r["per_device"]["routed_experts"] == budget["per_device"]["routed_experts"]
    assert r["per_device"]["workspace"] == budget["per_device"]["workspace"]  # the prior art's residual both
    conv = budget["context_set_by_component"]["kda_conv"]
    assert r["context_set_by_component"]["kda_conv"] == 8 * conv
    assert r["per_device_total_bytes"] - budget["per_device_total_bytes"] == (
        tp["non_expert"] - pa["non_expert"] + 3 * (tp["context_set"] - pa["context_set"])
    )
    assert 16.2 * GB < r["per_device_total_bytes"] < 16.25 * GB
    # the article comparison is made under the prior art's placement whatever the headline
    assert r["comparison_placement"] == budget["comparison_placement"] == "prior_art"
    assert r["comparison"] == budget["comparison"]
    assert "the rule set the config runs" in r["assumptions"][1]
    ep = memory.memory_budget(
        _release_cfg(), devices=8, placement="prior_art", mesh_rules="ep", context=1024, streams=1
    )
    assert ep["headline_placement"] == "prior_art" and ep["config"]["run_placement"] == "ep"
    assert ep["placements"]["ep"]["roles"] == ["run"] and "asked for" in ep["assumptions"][1]


def test_comparison_says_why_figures_differ(budget):
    rows = {r["quantity"]: r for r in budget["comparison"]}
    differ = {q for q, r in rows.items() if not r["agrees"]}
    assert differ == {
        "non-expert per device, per-class rule (STORAGE)",
        "weights per device, article method (planes + 1 B/param + vision)",
        "prior art's printed use minus the article-method weights (residual)",
        "weights per device, per-class rule",
    }
    for q in differ:
        assert "matches" not in rows[q]["why"] and len(rows[q]["why"]) > 30
    assert "0.03 GB" in rows["weights per device, article method (planes + 1 B/param + vision)"]["why"]


def test_ladder(budget):
    rows = {r["name"]: r for r in budget["ladder"]}
    assert "error" not in rows["ud_iq3_xxs"] and rows["ud_iq3_xxs"]["fits"]
    assert rows["ud_iq3_xxs"]["experts_bytes_per_device"] == budget["per_device"]["routed_experts"]
    for name in ("iq3_s", "iq4_xs", "q4_k", "q8_0", "bf16"):
        assert not rows[name]["fits"], name
    assert not rows["bf16"]["experts_alone_fit"]
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
    assert rows["q8_0"]["gguf_bytes"] == 304_405_807_104 // bs * ts
    fits = [r["fits"] for r in budget["ladder"]]  # sorted by bytes: fitting rows come first
    assert fits == sorted(fits, reverse=True)


# ------------------------------------------------------------------------------------------------ errors
def test_errors_name_the_field():
    with pytest.raises(ValueError, match="mlp_layer_types"):
        memory.expert_mix(TINY, "ud_iq3_xxs")
    with pytest.raises(ValueError, match="unknown expert mix"):
        memory.expert_mix(TINY, "iq9_z")
    with pytest.raises(ValueError, match="block size"):
        memory.memory_budget(TINY, "q4_k", devices=2)
    with pytest.raises(ValueError, match="latent"):
        CacheLayout(latent="fp4")


def test_tiny_config_budget_has_no_article_comparison():
    c = TINY.replace(hidden_size=256, intermediate_size=512, moe_intermediate_size=512)  # whole Q4_K blocks
    r = memory.memory_budget(c, "q4_k", devices=2, hbm_gb=1.0, context=64, streams=2)
    assert r["routed_gguf_bytes"] == 5 * 3 * 8 * 256 * 512 // 256 * 144
    assert "comparison" not in r and r["per_device"]["workspace"] == 0
    assert "workspace_gb" in r["workspace_source"]
    assert r["per_device_total_bytes"] == sum(r["per_device"].values())


# ------------------------------------------------------------------------------------------------ entry point
def test_entry_point_writes_json(tmp_path):
    out = tmp_path / "budget.json"
    cmd = [
        sys.executable,
        "-m",
        "experiments.memory_budget",
        "--config=configs/glm53_flash.py",
        "--experts=ud_iq3_xxs",
        "--devices=8",
        "--hbm_gb=16.9",
        "--context=262144",
        "--streams=3",
        "--ladder",
        f"--out={out}",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "why it differs" in p.stdout and "UD-IQ3_XXS" in p.stdout
    # the headline is what the run uses (configs/glm53_flash.py: mesh.rules "tp"); the table says whose is whose
    assert "placement tp (the config's mesh.rules: what the run uses)" in p.stdout
    assert "fits: True, room for 5 context sets" in p.stdout
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith(("  tp ", "  prior_art "))}
    assert "headline, the run's" in rows["tp"] and "the prior art's" in rows["prior_art"]
    assert "compared with the audit article, under the prior art's placement (prior_art" in p.stdout
    r = json.loads(out.read_text())
    assert r["headline_placement"] == "tp" and r["config"]["run_placement"] == "tp"
    assert r["per_device_total_bytes"] == r["placements"]["tp"]["total"]
    for key in (
        "total_params",
        "routed_expert_params",
        "routed_gguf_bytes",
        "routed_planes_bytes",
        "non_expert_params",
        "per_device",
        "per_device_total_bytes",
        "context_set_bytes_per_device",
    ):
        assert key in r, key
    assert r["total_params"] == 321_323_031_390
    assert set(r["per_device"]) == {"routed_experts", "non_expert", "vision", "caches", "workspace"}
    assert not list(tmp_path.glob("*.tmp"))
    bad = subprocess.run(
        cmd[:4] + ["--experts=iq9_z"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
    )
    assert bad.returncode != 0 and "iq9_z" in bad.stderr
