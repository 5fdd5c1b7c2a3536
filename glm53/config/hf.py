"""HF ``config.json`` <-> `ModelConfig`: the only place HF spellings are translated.

A key missing from the file takes transformers' own class default (``Glm5NextTextConfig`` /
``Glm5NextVisionConfig``), as transformers itself would, never the release's values; the keys so defaulted are
logged in one line. ``null`` means "none" where transformers allows it: ``pad_token_id`` null is no pad id;
``eos_token_id`` null takes the ids of ``generation_config.json`` or the tokenizer in the same folder, else
there are none (generation then stops only at its token limit). Two spellings of one schedule
(``linear_attn_config.kda_layers`` beside ``layer_types``, ``first_k_dense_replace`` beside
``mlp_layer_types``) must agree: llama.cpp's converter refuses files where they do not.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from glm53.config.fields import field_error as _err
from glm53.config.fields import to_plain as _to_plain
from glm53.config.model import MAX_LAYERS, ModelConfig, VisionConfig, check_type
from glm53.errors import ConfigError

_log = logging.getLogger(__name__)

# HF spellings -> ours.
_HF_ATTN = {
    "linear_attention": "kda",
    "deepseek_sparse_attention": "dsa",
    "indexed_attention": "dsa",
    "full_attention": "dsa",
}
_HF_MLP = {"dense": "dense", "sparse": "moe"}
_HF_INDEXER = {"full": "full", "shared": "shared"}

# ModelConfig fields spelled the same in the HF text config.
_HF_DIRECT = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "intermediate_size", "moe_intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
    "n_group", "topk_group", "swiglu_limit", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
    "linear_lower_bound", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
    "index_kpool_always_select_tail", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "pad_token_id",
]  # fmt: skip

# transformers' Glm5NextTextConfig class defaults of the keys read here (tests/test_config.py checks them
# against the installed class). Not index_kpool: its class default 16 is not the release's 4 (see
# `model_config_from_hf`); num_nextn_predict_layers is no transformers field: missing, the model has no MTP
# layer (as llama.cpp reads it).
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45, "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 288,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "n_group": 1, "topk_group": 1, "swiglu_limit": 10.0, "linear_num_heads": 64, "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "num_attention_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 256, "v_head_dim": 256, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 2048, "index_kpool_always_select_tail": True, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "pad_token_id": 154820, "num_key_value_heads": 64,
    "qk_rope_head_dim": 0, "hidden_act": "silu", "attention_bias": False,
}  # fmt: skip
# Keys transformers' model reads that have no field of ours: the one value GLM-5.3 supports (their default).
_FIXED = {"qk_rope_head_dim": 0, "hidden_act": "silu", "attention_bias": False}
# transformers' Glm5NextVisionConfig class defaults (the vision tower only sizes the memory budget).
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096, "in_channels": 3,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 1536,
    "projection_intermediate_size": 10240, "attention_bias": True,
}  # fmt: skip
# linear_attn_config keys -> the flat fields they override (as transformers does).
_LINEAR_ATTN = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "linear_lower_bound",
}
_SCHEDULES = {"layer_types": _HF_ATTN, "mlp_layer_types": _HF_MLP, "indexer_types": _HF_INDEXER}
# Keys read only to fill or check the schedules.
_SCHEDULE_HINTS = ("first_k_dense_replace", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")

# Keys of the HF text config accepted and ignored (training-only, derived, or not changing the inference
# model).
_HF_IGNORED = {
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "initializer_range",
    "use_cache", "output_router_logits", "router_aux_loss_coef", "attention_dropout", "head_dim",
    "qk_head_dim", "bos_token_id", "scoring_func", "topk_method", "moe_router_dtype", "mla_use_nope", "mhc",
    "indexer_rope_interleave", "index_kpool_compress", "index_share_for_mtp_iteration", "rope_theta",
    "rope_parameters", "rope_scaling", "quantization_config", "return_dict", "output_hidden_states",
    "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size",
    "finetuning_task", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "base_config_key",
    "experts_implementation", "torchscript", "ep_size", "moe_layer_freq", "use_return_dict", "_name_or_path",
    "_attn_implementation_autoset",
}  # fmt: skip
_KNOWN = {*_HF_DIRECT, *_TEXT_DEFAULTS, *_SCHEDULES, *_SCHEDULE_HINTS, *_HF_IGNORED, "linear_attn_config",
          "eos_token_id"}  # fmt: skip
# Composite (glm5_next) keys that may sit beside flat text fields.
_TOP_LEVEL = {
    "text_config", "vision_config", "image_token_id", "video_token_id", "image_start_token_id",
    "image_end_token_id", "video_start_token_id", "video_end_token_id",
}  # fmt: skip

EosFallback = Callable[[], tuple[tuple[int, ...], str]]


def model_config_from_hf(hf: Mapping[str, Any], *, index_kpool: int | None = None) -> ModelConfig:
    """Converts an HF config dict (composite ``glm5_next`` or ``glm5_next_text``) into a ModelConfig.

    ``index_kpool``: HF class default is 16 while the release uses 4 (docs/architecture.md, open point 1);
    a value in the file wins, otherwise this argument, otherwise 4. A null or missing ``eos_token_id`` means
    no eos ids (`load_hf_config` looks for them in the folder).
    """
    cfg, notes = _convert(hf, index_kpool, None)
    _log_notes("HF config", notes)
    return cfg


def load_hf_config(path: str | os.PathLike, *, index_kpool: int | None = None) -> ModelConfig:
    """Reads ``config.json`` (a file or a folder holding one) into a ModelConfig; eos ids missing from it come
    from ``generation_config.json`` or the tokenizer files in the same folder."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    d = _read_json(path)
    if d is None:
        raise ConfigError(f"{path}: no such config file")
    try:
        cfg, notes = _convert(d, index_kpool, lambda: _folder_eos(os.path.dirname(path)))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    _log_notes(path, notes)
    return cfg


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


# ----------------------------------------------------------------------------------------------- conversion
def _convert(
    hf: Any, index_kpool: int | None, eos_fallback: EosFallback | None
) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig of an HF config dict, and one note per value not taken from it (errors repeat them)."""
    text, top, vision = _split(_to_plain(hf))
    unknown = sorted(k for k in text if k not in _KNOWN and k not in _TOP_LEVEL and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"HF config: unknown text_config keys {unknown}")
    defaulted = {k: repr(v) for k, v in _TEXT_DEFAULTS.items() if k not in text}
    kw: dict[str, Any] = {k: text.get(k, _TEXT_DEFAULTS.get(k)) for k in _HF_DIRECT if k != "index_kpool"}
    lac = _object(text, "linear_attn_config")
    for theirs, ours in _LINEAR_ATTN.items():
        if theirs in lac:
            if ours in text and not (ours == "linear_lower_bound" and text[ours] is None):
                check_type(ModelConfig, ours, text[ours])  # overridden, but transformers checks its type
            kw[ours] = lac[theirs]
            defaulted.pop(ours, None)
    safe_gate = text.get("linear_attn_config") is not None and lac.get("safe_gate", True)
    if kw["linear_lower_bound"] is None and safe_gate:
        kw["linear_lower_bound"] = -5.0  # transformers' safe_gate (only with a linear_attn_config)
    kw.update(_schedules(text, lac, kw["num_hidden_layers"], defaulted))
    if vision is not None:
        kw["vision"] = _hf_vision(vision, defaulted)
    notes = (
        [f"transformers' defaults {', '.join(f'{k}={v}' for k, v in defaulted.items())}"] if defaulted else []
    )
    if "index_kpool" in text:
        kw["index_kpool"] = text["index_kpool"]
    else:
        kw["index_kpool"] = 4 if index_kpool is None else index_kpool
        why = "the release's; transformers' class default is 16" if index_kpool is None else "the argument"
        notes.append(f"index_kpool={kw['index_kpool']} ({why})")
    eos = text.get("eos_token_id")
    if eos is None:
        eos = top.get("eos_token_id")
    if eos is None:
        eos, where = eos_fallback() if eos_fallback else ((), "none in the config")
        notes.append(f"eos_token_id={list(eos)} ({where})")
    kw["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    try:
        if kw["linear_lower_bound"] is None:
            raise _err("linear_lower_bound", "null (an unbounded KDA decay gate) is not supported")
        cfg = ModelConfig(**kw)
        _check_fixed(text, cfg.num_attention_heads)
        return cfg, notes
    except ConfigError as e:
        if not notes:
            raise
        raise ConfigError(f"{e} (not in the file: {'; '.join(notes)})") from None


def _check_fixed(text: Mapping, heads: int) -> None:
    """The keys transformers' model reads that have no field of ours hold the one value GLM-5.3 supports."""
    for k, want in _FIXED.items():
        v = text.get(k, want)
        if type(v) is not type(want) or v != want:
            raise _err(k, f"GLM-5.3 supports only {want!r}, got {v!r}")
    kv_heads = text.get("num_key_value_heads", 64)
    if type(kv_heads) is not int or kv_heads != heads:
        raise _err("num_key_value_heads", f"must equal num_attention_heads {heads!r} (MLA), got {kv_heads!r}")


def _split(hf: Any) -> tuple[dict, dict, dict | None]:
    """(text config, top-level dict, vision config or None) of a composite or text-only HF config."""
    if not isinstance(hf, Mapping):
        raise ConfigError(f"HF config: expected a JSON object, got {type(hf).__name__}")
    mt = hf.get("model_type")
    if mt == "glm5_next" or "text_config" in hf:
        if hf.get("text_config") is None:  # flat composite: text fields at the top level (as transformers)
            text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
        else:
            text = dict(_object(hf, "text_config"))
        if "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return text, hf, _object(hf, "vision_config") if hf.get("vision_config") is not None else None
    if mt in ("glm5_next_text", None):
        return dict(hf), hf, None
    raise ConfigError(f"HF config: model_type {mt!r} is not glm5_next / glm5_next_text")


def _object(d: Mapping, key: str) -> Mapping:
    """d[key] when it is a JSON object, {} when missing or null."""
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise _err(key, f"expected a JSON object, got {type(v).__name__}")
    return v


def _names(v: Any, key: str, names: Mapping[str, str]) -> tuple[str, ...]:
    """A list of HF names mapped to ours; anything else is a ConfigError naming `key`."""
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise _err(key, f"expected a list of strings, got {v!r}")
    unknown = sorted({t for t in v if t not in names})
    if unknown:
        raise _err(key, f"unknown HF kinds {unknown}; expected one of {sorted(names)}")
    return tuple(names[t] for t in v)


def _int_list(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(type(i) is int for i in v):
        raise _err(key, f"expected a list of integers, got {v!r}")
    return v


def _schedules(text: Mapping, lac: Mapping, n: Any, defaulted: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The per-layer schedules: the file's, else transformers' defaults for n layers (noted in `defaulted`),
    checked against the other spellings in the file."""
    if type(n) is not int or not 0 < n <= MAX_LAYERS:
        return {}  # ModelConfig names the bad num_hidden_layers
    out = {}
    for key, names in _SCHEDULES.items():
        if text.get(key) is not None:
            out[key] = _names(text[key], key, names)
            if len(out[key]) != n:  # (an empty schedule would otherwise be filled by ModelConfig)
                raise _err(key, f"has {len(out[key])} entries but num_hidden_layers is {n}")
            continue
        if key == "layer_types":
            out[key] = tuple("dsa" if i % 4 == 3 else "kda" for i in range(n))
        elif key == "mlp_layer_types":
            out[key] = ("dense",) * min(3, n) + ("moe",) * (n - 3)
        else:
            out[key] = _default_indexer_types(text, n)
        defaulted[key] = f"<its schedule for {n} layers>"
    for hint, kind in (("kda_layers", "kda"), ("full_attn_layers", "dsa")):
        if lac.get(hint) is not None:
            want = [i for i, t in enumerate(out["layer_types"]) if t == kind]
            if sorted(_int_list(lac[hint], f"linear_attn_config.{hint}")) != want:
                raise _err(f"linear_attn_config.{hint}", f"{lac[hint]} disagrees with layer_types ({want})")
    k = text.get("first_k_dense_replace")
    mlp = out["mlp_layer_types"]
    if k is not None and (
        type(k) is not int or not 0 <= k <= n or mlp != ("dense",) * k + ("moe",) * (n - k)
    ):
        raise _err("first_k_dense_replace", f"{k!r} disagrees with mlp_layer_types {list(mlp)}")
    return out


def _default_indexer_types(text: Mapping, n: int) -> tuple[str, ...]:
    """transformers' indexer schedule: ``index_topk_pattern`` ("FS..." or a list), else every
    ``index_topk_freq``-th layer from ``index_skip_topk_offset`` on runs a full indexer."""
    pattern = text.get("index_topk_pattern")
    if isinstance(pattern, str):
        return _names(list(pattern), "index_topk_pattern", {"F": "full", "S": "shared"})
    if pattern is not None:
        return _names(pattern, "index_topk_pattern", _HF_INDEXER)
    freq, offset = text.get("index_topk_freq", 1), text.get("index_skip_topk_offset", 2)
    for key, v in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if type(v) is not int:
            raise _err(key, f"expected an integer, got {v!r}")
    return tuple("full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(n))


def _hf_vision(v: Mapping[str, Any], defaulted: dict[str, str]) -> VisionConfig:
    kw = {}
    for k, default in _VISION_DEFAULTS.items():
        if k not in v:
            defaulted[f"vision_config.{k}"] = repr(default)
        x = v.get(k, default)
        kw[k] = x[0] if k in ("patch_size", "temporal_patch_size") and isinstance(x, list) and x else x
    return VisionConfig(**kw)


# ------------------------------------------------------------------------------------------ folder and log
def _read_json(path: str) -> Any:
    """The JSON in `path`, or None when there is no such file; unreadable or invalid JSON is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read as JSON ({e})") from None


def _folder_eos(folder: str) -> tuple[tuple[int, ...], str]:
    """(eos ids, where from): those of ``generation_config.json``, else the tokenizer's ``eos_token``."""
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    if isinstance(gen, Mapping) and gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        return (tuple(eos) if isinstance(eos, list) else (eos,)), "from generation_config.json"
    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    name = tok_cfg.get("eos_token") if isinstance(tok_cfg, Mapping) else None
    if isinstance(name, Mapping):
        name = name.get("content")
    tok = _read_json(os.path.join(folder, "tokenizer.json")) if isinstance(name, str) else None
    if isinstance(tok, Mapping):
        model, added = tok.get("model"), tok.get("added_tokens")
        ids = (
            dict(model["vocab"])
            if isinstance(model, Mapping) and isinstance(model.get("vocab"), Mapping)
            else {}
        )
        for t in added if isinstance(added, list) else []:
            if isinstance(t, Mapping) and isinstance(t.get("content"), str):
                ids[t["content"]] = t.get("id")
        if name in ids:
            return (ids[name],), f"the tokenizer's eos_token {name!r}"
    return (), "none in config.json, generation_config.json or the tokenizer: generation stops at its limit"


def _log_notes(source: str, notes: list[str]) -> None:
    """One line for the values not read from the file; a warning when a key that shapes the model is one."""
    if notes:
        level = logging.INFO if all(n.startswith("eos_token_id=") for n in notes) else logging.WARNING
        _log.log(level, "%s: not in the file: %s", source, "; ".join(notes))
