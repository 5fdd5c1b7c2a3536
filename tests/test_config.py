"""Config system: ml_collections files -> frozen dataclasses, validation, HF config.json conversion."""

import dataclasses
import json
import logging
import os

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from configs import glm53_flash, tiny
from glm53.config import (
    ConfigError,
    ModelConfig,
    as_hf_text_config,
    load_hf_config,
    model_config_from_dict,
    model_config_from_hf,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_release_config_values():
    c = model_config_from_dict(glm53_flash.get_config().model)
    assert (c.hidden_size, c.vocab_size, c.num_hidden_layers) == (4096, 154880, 45)
    assert c.num_kda_layers == 34 and c.num_dsa_layers == 11 and c.num_moe_layers == 42
    assert [i for i, t in enumerate(c.layer_types) if t == "dsa"] == list(range(3, 45, 4))
    assert c.layer_types[44] == "kda"
    assert c.mlp_layer_types[:3] == ("dense",) * 3
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (288, 8, 1)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim) == (1536, 512, 256, 256)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.index_kpool) == (32, 128, 2048, 4)
    assert c.index_num_pools_selected == 512
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4, 20, 1e-6)
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound) == (64, 128, -5.0)
    assert c.eos_token_ids == (154820, 154827, 154829)
    assert c.routed_scaling_factor == 2.5 and c.swiglu_limit == 10.0
    assert c.vision is not None and c.vision.out_hidden_size == 4096
    # The dataclass is frozen.
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1


@pytest.mark.parametrize("name", sorted(tiny.VARIANTS))
def test_tiny_variants_build(name):
    c = model_config_from_dict(tiny.get_config(name).model)
    assert len(c.layer_types) == c.num_hidden_layers
    assert c.num_dsa_layers >= 1 and c.num_kda_layers >= 1 and c.num_moe_layers >= 1


def test_tiny_unknown_variant():
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        tiny.get_config("nope")


def test_config_flags_variant_syntax():
    argv = ["prog", f"--config={ROOT}/configs/tiny.py:parity", "--config.model.index_topk=12"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    c = model_config_from_dict(fv.config.model)
    assert c.num_hidden_layers == 8 and c.index_topk == 12 and c.swiglu_limit == 2.0


def _tiny(**kw):
    d = tiny.get_config().model.to_dict()
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "override, field",
    [
        (dict(bogus_key=1), "bogus_key"),
        (dict(layer_types=["kda"] * 5), "layer_types"),
        (dict(mlp_layer_types=["dense"] * 3 + ["moe"] * 2 + ["sparse"]), "mlp_layer_types"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(index_topk=10), "index_topk"),
        (dict(n_group=3), "n_group"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(linear_lower_bound=1.0), "linear_lower_bound"),
        (dict(indexer_types=["full"] * 3 + ["shared"] + ["full"] * 2), "indexer_types"),
        (dict(eos_token_ids=[1000]), "eos_token_ids"),
        (dict(vision=dict(depth=1, bad=2)), "bad"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
        (dict(hidden_size=64.0), "hidden_size"),
        (dict(hidden_size=True), "hidden_size"),
        (dict(index_topk=[8]), "index_topk"),
        (dict(norm_topk_prob=1), "norm_topk_prob"),
        (dict(eos_token_ids=[0, True]), "eos_token_ids"),
        (dict(pad_token_id=128), "pad_token_id"),
        (dict(n_group=0), "n_group"),
        (dict(swiglu_limit=float("inf")), "swiglu_limit"),
        (dict(layer_types="kdakda"), "layer_types"),
        (dict(vision=dict(depth=1.5)), "vision.depth"),
    ],
)
def test_rejects_bad_values(override, field):
    with pytest.raises(ConfigError, match=field):
        model_config_from_dict(_tiny(**override))


def test_no_pad_no_eos_and_int_floats():
    c = model_config_from_dict(_tiny(pad_token_id=None, eos_token_ids=[], swiglu_limit=2))
    assert c.pad_token_id is None and c.eos_token_ids == () and c.swiglu_limit == 2.0
    assert isinstance(c.swiglu_limit, float)


def test_replace_revalidates():
    c = model_config_from_dict(tiny.get_config().model)
    assert c.replace(index_topk=16).index_topk == 16
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        c.replace(num_experts_per_tok=100)


def test_locked_configdict_rejects_unknown_override():
    cfg = ml_collections.ConfigDict(tiny.get_config().to_dict())
    cfg.lock()
    with pytest.raises(AttributeError):
        cfg.model.not_a_field = 1


# --------------------------------------------------------------------------------- HF config conversion
def _hf_text_config(c: ModelConfig):
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(**as_hf_text_config(c))


def test_hf_text_config_written_by_transformers(tmp_path):
    ours = model_config_from_dict(tiny.get_config("parity").model)
    hf = _hf_text_config(ours)
    hf.save_pretrained(tmp_path)
    back = load_hf_config(tmp_path)
    for f in dataclasses.fields(ModelConfig):
        if f.name == "vision":
            continue
        assert getattr(back, f.name) == getattr(ours, f.name), f.name


def test_hf_composite_config_written_by_transformers(tmp_path):
    from transformers import Glm5NextConfig

    ours = model_config_from_dict(tiny.get_config("default").model)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    hf = Glm5NextConfig(text_config=as_hf_text_config(ours), vision_config=vision)
    hf.save_pretrained(tmp_path)
    raw = json.load(open(tmp_path / "config.json"))
    assert raw["model_type"] == "glm5_next" and "text_config" in raw
    back = load_hf_config(tmp_path)
    assert back.layer_types == ours.layer_types and back.index_kpool == 4
    assert back.hidden_size == ours.hidden_size and back.n_routed_experts == ours.n_routed_experts
    assert back.vision.depth == 1 and back.vision.out_hidden_size == 64


def test_release_like_hf_json():
    """The released config.json spelling: linear_attn_config with 0-based kda_layers, deepseek_sparse_attention."""
    n = 45
    text = dict(
        model_type="glm5_next_text",
        num_hidden_layers=n,
        layer_types=["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        mlp_layer_types=["dense"] * 3 + ["sparse"] * 42,
        linear_attn_config=dict(num_heads=64, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                kda_layers=[i for i in range(n) if i % 4 != 3]),
        index_kpool=4, index_topk=2048, eos_token_id=[154820, 154827, 154829], head_dim=0, qk_rope_head_dim=0,
        mla_use_nope=True, mhc=True, indexer_types=["full"] * n, scoring_func="sigmoid", topk_method="noaux_tc",
    )  # fmt: skip
    hf = dict(model_type="glm5_next", text_config=text, tie_word_embeddings=False, image_token_id=154854)
    c = model_config_from_hf(hf)
    ref = model_config_from_dict(glm53_flash.get_config().model)
    assert c.layer_types == ref.layer_types and c.mlp_layer_types == ref.mlp_layer_types
    assert c.eos_token_ids == ref.eos_token_ids and c.index_kpool == 4


def test_hf_kpool_default_is_four_not_sixteen():
    text = dict(model_type="glm5_next_text", num_hidden_layers=4)
    assert model_config_from_hf(text).index_kpool == 4


@pytest.mark.parametrize(
    "text, field",
    [
        (dict(model_type="glm5_next_text", qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(model_type="glm5_next_text", layer_types=["mamba"] * 45), "layer_types"),
        (dict(model_type="glm5_next_text", something_new=3), "something_new"),
        (dict(model_type="llama"), "model_type"),
    ],
)
def test_hf_rejects(text, field):
    with pytest.raises(ConfigError, match=field):
        model_config_from_hf(text)


def test_load_hf_config_errors_name_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="no such config file"):
        load_hf_config(tmp_path / "missing")


# ---------------------------------------------------------------------- HF config: nulls, defaults, types
def _tiny_hf(**kw) -> dict:
    """The text config.json transformers writes for the tiny parity model, with `kw` set (None = null)."""
    d = _hf_text_config(model_config_from_dict(tiny.get_config("parity").model)).to_dict()
    d.update(kw)
    return d


def _hf_records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "glm53.config.hf"]


def test_hf_null_pad_and_eos_mean_none(tmp_path, caplog):
    """transformers writes null pad / eos for a model built without token ids, and loads that folder."""
    from transformers import AutoConfig

    _hf_text_config(model_config_from_dict(_tiny(pad_token_id=None, eos_token_ids=[]))).save_pretrained(
        tmp_path
    )
    raw = json.load(open(tmp_path / "config.json"))
    raw["eos_token_id"] = None
    json.dump(raw, open(tmp_path / "config.json", "w"))
    assert raw["pad_token_id"] is None and AutoConfig.from_pretrained(tmp_path).pad_token_id is None
    with caplog.at_level(logging.INFO, logger="glm53.config.hf"):
        c = load_hf_config(tmp_path)
    assert c.pad_token_id is None and c.eos_token_ids == () and c.vocab_size == 128
    assert any("eos_token_id=[]" in m and "generation stops at its limit" in m for m in _hf_records(caplog))
    # eos ids come from generation_config.json, else from the tokenizer's eos_token.
    tok = {"added_tokens": [{"id": 5, "content": "<|endoftext|>"}], "model": {"vocab": {"a": 7}}}
    json.dump(tok, open(tmp_path / "tokenizer.json", "w"))
    json.dump({"eos_token": {"content": "<|endoftext|>"}}, open(tmp_path / "tokenizer_config.json", "w"))
    assert load_hf_config(tmp_path).eos_token_ids == (5,)
    json.dump({"eos_token_id": [3, 4]}, open(tmp_path / "generation_config.json", "w"))
    assert load_hf_config(tmp_path).eos_token_ids == (3, 4)
    # The file's own ids win.
    json.dump({**raw, "eos_token_id": 2}, open(tmp_path / "config.json", "w"))
    assert load_hf_config(tmp_path).eos_token_ids == (2,)


@pytest.mark.parametrize("key", ["index_topk", "hidden_size", "rms_norm_eps", "n_routed_experts"])
def test_hf_missing_key_takes_transformers_default_and_says_so(key, caplog):
    from transformers import Glm5NextTextConfig

    d = _tiny_hf()
    del d[key]
    want = getattr(Glm5NextTextConfig(), key)
    with caplog.at_level(logging.INFO, logger="glm53.config.hf"):
        try:
            got = getattr(model_config_from_hf(d), key)
        except ConfigError as e:  # the default does not fit the tiny model: the error says it was defaulted
            assert f"{key}={want!r}" in str(e)
            return
    assert got == want
    (line,) = _hf_records(caplog)
    assert f"{key}={want!r}" in line and "transformers' defaults" in line


def test_hf_defaults_are_transformers_class_defaults():
    from transformers import Glm5NextTextConfig, Glm5NextVisionConfig

    from glm53.config.hf import _TEXT_DEFAULTS, _VISION_DEFAULTS

    text, vision = Glm5NextTextConfig(), Glm5NextVisionConfig()
    assert {k: getattr(text, k) for k in _TEXT_DEFAULTS if k != "num_nextn_predict_layers"} == {
        k: v for k, v in _TEXT_DEFAULTS.items() if k != "num_nextn_predict_layers"
    }
    assert not hasattr(text, "num_nextn_predict_layers") and _TEXT_DEFAULTS["num_nextn_predict_layers"] == 0
    assert {k: getattr(vision, k) for k in _VISION_DEFAULTS} == _VISION_DEFAULTS
    assert text.index_kpool == 16  # and ours stays 4 (test_hf_kpool_default_is_four_not_sixteen)


def test_hf_missing_schedules_follow_transformers(caplog):
    from transformers import Glm5NextTextConfig

    d = _tiny_hf()
    for k in (
        "layer_types",
        "mlp_layer_types",
        "indexer_types",
        "linear_attn_config",
        "first_k_dense_replace",
    ):
        del d[k]
    d.update(num_hidden_layers=10, index_topk_freq=3, index_skip_topk_offset=4)
    ref = Glm5NextTextConfig(**d)
    with caplog.at_level(logging.INFO, logger="glm53.config.hf"):
        c = model_config_from_hf(d)
    assert c.layer_types == tuple("dsa" if t == "indexed_attention" else "kda" for t in ref.layer_types)
    assert c.mlp_layer_types == tuple("moe" if t == "sparse" else "dense" for t in ref.mlp_layer_types)
    assert c.indexer_types == tuple(ref.indexer_types) and "shared" in c.indexer_types
    (line,) = _hf_records(caplog)
    assert all(
        f"{k}=<its schedule for 10 layers>" in line
        for k in ("layer_types", "mlp_layer_types", "indexer_types")
    )


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
        (dict(hidden_size=64.0), "hidden_size"),
        (dict(num_attention_heads=True), "num_attention_heads"),
        (dict(index_topk=[8]), "index_topk"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(pad_token_id=True), "pad_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(eos_token_id=[0, True]), "eos_token_ids"),
        (dict(eos_token_id="0"), "eos_token_ids"),
        (dict(layer_types="linear_attention"), "layer_types"),
        (dict(layer_types=[["linear_attention"]] * 8), "layer_types"),
        (dict(linear_attn_config=[1]), "linear_attn_config"),
        (dict(linear_lower_bound=None, linear_attn_config=None), "linear_lower_bound"),
        (dict(num_key_value_heads=4), "num_key_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(qk_rope_head_dim=False), "qk_rope_head_dim"),
        (dict(first_k_dense_replace=1), "first_k_dense_replace"),
        (dict(first_k_dense_replace=2**40), "first_k_dense_replace"),
        (dict(num_hidden_layers=2**40), "num_hidden_layers"),
        (dict(linear_attn_config=dict(kda_layers=[0, 1, 2])), "linear_attn_config.kda_layers"),
        (dict(text_config=7, model_type="glm5_next"), "text_config"),
    ],
)
def test_hf_wrong_values_name_the_key(kw, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        model_config_from_hf(_tiny_hf(**kw))


def test_hf_kpool_rule_is_logged(caplog):
    d = _tiny_hf()
    del d["index_kpool"]
    with caplog.at_level(logging.INFO, logger="glm53.config.hf"):
        assert model_config_from_hf(d).index_kpool == 4
        assert model_config_from_hf(d, index_kpool=2).index_kpool == 2
    first, second = _hf_records(caplog)
    assert "index_kpool=4 (the release's; transformers' class default is 16)" in first
    assert "index_kpool=2 (the argument)" in second
