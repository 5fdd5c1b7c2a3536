"""HF ``config.json`` <-> `ModelConfig`: the only place HF spellings are translated."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from glm53.config.fields import field_error as _err
from glm53.config.fields import to_plain as _to_plain
from glm53.config.model import ModelConfig, VisionConfig
from glm53.errors import ConfigError

# HF spellings -> ours.
_HF_ATTN = {
    "linear_attention": "kda",
    "deepseek_sparse_attention": "dsa",
    "indexed_attention": "dsa",
    "full_attention": "dsa",
}
_HF_MLP = {"dense": "dense", "sparse": "moe"}

# Keys of the HF text config that we read, and those we accept and ignore (training-only or derived).
_HF_IGNORED = {
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "hidden_act",
    "initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef", "attention_dropout",
    "attention_bias", "head_dim", "qk_head_dim", "qk_rope_head_dim", "num_key_value_heads", "bos_token_id",
    "scoring_func", "topk_method", "moe_router_dtype", "mla_use_nope", "mhc", "indexer_rope_interleave",
    "index_kpool_compress", "index_share_for_mtp_iteration", "first_k_dense_replace", "rope_theta",
    "rope_parameters", "rope_scaling", "quantization_config", "return_dict", "output_hidden_states",
    "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size", "finetuning_task",
    "pruned_heads", "tf_legacy_loss", "use_bfloat16", "base_config_key", "experts_implementation",
    "torchscript", "ep_size", "moe_layer_freq", "index_topk_freq", "index_skip_topk_offset",
    "index_topk_pattern", "use_return_dict", "_name_or_path", "_attn_implementation_autoset",
}  # fmt: skip

_HF_DIRECT = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "intermediate_size", "moe_intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
    "n_group", "topk_group", "swiglu_limit", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
    "linear_lower_bound", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
    "index_kpool_always_select_tail", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "pad_token_id",
]  # fmt: skip


def _hf_vision(v: Mapping[str, Any]) -> VisionConfig:
    def one(x):
        return x[0] if isinstance(x, (list, tuple)) else x

    return VisionConfig(
        depth=v.get("depth", 24),
        hidden_size=v.get("hidden_size", 1024),
        num_heads=v.get("num_heads", 16),
        intermediate_size=v.get("intermediate_size", 4096),
        in_channels=v.get("in_channels", 3),
        patch_size=one(v.get("patch_size", 14)),
        temporal_patch_size=one(v.get("temporal_patch_size", 2)),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        out_hidden_size=v.get("out_hidden_size", 1536),
        projection_intermediate_size=v.get("projection_intermediate_size", 10240),
        attention_bias=v.get("attention_bias", True),
    )


def model_config_from_hf(hf: Mapping[str, Any], *, index_kpool: int | None = None) -> ModelConfig:
    """Converts an HF config dict (composite ``glm5_next`` or ``glm5_next_text``) into a ModelConfig.

    ``index_kpool``: HF class default is 16 while the release uses 4 (architecture.md, open point 1); a value in
    the file wins, otherwise this argument, otherwise 4.
    """
    hf = _to_plain(hf)
    vision = None
    mt = hf.get("model_type")
    if mt == "glm5_next" or "text_config" in hf:
        text = dict(hf.get("text_config") or {})
        if not text:  # flat composite: text fields at the top level
            text = {k: v for k, v in hf.items() if k not in ("vision_config",)}
        if hf.get("vision_config") is not None:
            vision = _hf_vision(hf["vision_config"])
        if "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    elif mt in ("glm5_next_text", None):
        text = dict(hf)
    else:
        raise ConfigError(f"HF config: model_type {mt!r} is not glm5_next / glm5_next_text")
    top_level_ok = {
        "text_config", "vision_config", "image_token_id", "video_token_id", "image_start_token_id",
        "image_end_token_id", "video_start_token_id", "video_end_token_id",
    }  # fmt: skip
    kw: dict[str, Any] = {}
    for k in _HF_DIRECT:
        if k in text and text[k] is not None:
            kw[k] = text[k]
    n = kw.get("num_hidden_layers", 45)
    lac = text.get("linear_attn_config")
    if lac:
        kw["linear_num_heads"] = lac.get("num_heads", kw.get("linear_num_heads", 64))
        kw["linear_head_dim"] = lac.get("head_dim", kw.get("linear_head_dim", 128))
        kw["linear_conv_kernel_dim"] = lac.get("short_conv_kernel_size", kw.get("linear_conv_kernel_dim", 4))
        if lac.get("gate_lower_bound") is not None:
            kw["linear_lower_bound"] = lac["gate_lower_bound"]
    if text.get("layer_types"):
        try:
            kw["layer_types"] = tuple(_HF_ATTN[t] for t in text["layer_types"])
        except KeyError as e:
            raise _err("layer_types", f"unknown HF attention layer type {e.args[0]!r}") from None
    elif lac and lac.get("kda_layers") is not None:
        kda = set(lac["kda_layers"])
        kw["layer_types"] = tuple("kda" if i in kda else "dsa" for i in range(n))
    if text.get("mlp_layer_types"):
        try:
            kw["mlp_layer_types"] = tuple(_HF_MLP[t] for t in text["mlp_layer_types"])
        except KeyError as e:
            raise _err("mlp_layer_types", f"unknown HF mlp layer type {e.args[0]!r}") from None
    elif text.get("first_k_dense_replace") is not None:
        k = text["first_k_dense_replace"]
        kw["mlp_layer_types"] = ("dense",) * k + ("moe",) * (n - k)
    if text.get("indexer_types"):
        kw["indexer_types"] = tuple(text["indexer_types"])
    if "index_kpool" not in text:
        kw["index_kpool"] = 4 if index_kpool is None else index_kpool
    eos = text.get("eos_token_id", hf.get("eos_token_id"))
    if eos is not None:
        kw["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if text.get("qk_rope_head_dim", 0):
        raise _err("qk_rope_head_dim", "GLM-5.3 is NoPE; a rope dim > 0 is not supported")
    if text.get("num_key_value_heads") not in (None, text.get("num_attention_heads", 64)):
        raise _err("num_key_value_heads", "must equal num_attention_heads (MLA)")
    known = (
        set(_HF_DIRECT)
        | _HF_IGNORED
        | {
            "linear_attn_config",
            "layer_types",
            "mlp_layer_types",
            "indexer_types",
            "eos_token_id",
            "vision_config",
            "pad_token_id",
        }
    )
    unknown = sorted(k for k in text if k not in known and k not in top_level_ok and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"HF config: unknown text_config keys {unknown}")
    kw["vision"] = vision
    return ModelConfig(**kw)


def load_hf_config(path: str | os.PathLike, **kw) -> ModelConfig:
    """Reads ``config.json`` (a file or a folder holding one) into a ModelConfig."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    try:
        return model_config_from_hf(d, **kw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def as_hf_text_config(c: ModelConfig) -> dict[str, Any]:
    """Our config as HF ``glm5_next_text`` kwargs (for building the transformers reference in tests)."""
    inv_attn = {"kda": "linear_attention", "dsa": "deepseek_sparse_attention"}
    d = {k: getattr(c, k) for k in _HF_DIRECT}
    d.update(
        model_type="glm5_next_text",
        layer_types=[inv_attn[t] for t in c.layer_types],
        mlp_layer_types=["sparse" if t == "moe" else "dense" for t in c.mlp_layer_types],
        indexer_types=list(c.indexer_types),
        first_k_dense_replace=sum(1 for t in c.mlp_layer_types if t == "dense"),
        eos_token_id=list(c.eos_token_ids),
        qk_rope_head_dim=0,
        num_key_value_heads=c.num_attention_heads,
        linear_attn_config={
            "num_heads": c.linear_num_heads,
            "head_dim": c.linear_head_dim,
            "short_conv_kernel_size": c.linear_conv_kernel_dim,
            "gate_lower_bound": c.linear_lower_bound,
            "kda_layers": [i for i, t in enumerate(c.layer_types) if t == "kda"],
            "full_attn_layers": [i for i, t in enumerate(c.layer_types) if t == "dsa"],
        },
        mla_use_nope=True,
        mhc=True,
    )
    return d
