"""Typed model configuration.

`ml_collections.ConfigDict` lives at the edge (``configs/*.py``, absl flags); it is converted once, here, into
frozen dataclasses that the library uses everywhere else. Conversion rejects unknown keys and inconsistent
values with a `ConfigError` that names the field.

Three entry points:
  * `model_config_from_dict(d)`  -- a ConfigDict / dict with our field names (``configs/*.py``);
  * `model_config_from_hf(d)`    -- an HF ``config.json`` dict (composite ``glm5_next`` or ``glm5_next_text``);
  * `load_hf_config(path)`       -- the same from a file or a checkpoint folder.

Layer kinds use our short names: attention ``"kda"`` / ``"dsa"``, FFN ``"dense"`` / ``"moe"``, indexer
``"full"`` / ``"shared"``. HF spellings are translated in `model_config_from_hf` only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration field is unknown, missing or inconsistent. The message names the field."""


ATTN_KINDS = ("kda", "dsa")
MLP_KINDS = ("dense", "moe")
INDEXER_KINDS = ("full", "shared")

# HF spellings -> ours.
_HF_ATTN = {
    "linear_attention": "kda",
    "deepseek_sparse_attention": "dsa",
    "indexed_attention": "dsa",
    "full_attention": "dsa",
}
_HF_MLP = {"dense": "dense", "sparse": "moe"}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape (only used for the memory budget; the text port does not run it)."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 4096
    projection_intermediate_size: int = 10240
    attention_bias: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GLM-5.3-Flash text model. Field names follow HF ``Glm5NextTextConfig`` where one exists."""

    # Trunk.
    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    num_nextn_predict_layers: int = 1
    layer_types: tuple[str, ...] = ()  # "kda" | "dsa", len == num_hidden_layers
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "moe"
    indexer_types: tuple[str, ...] = ()  # "full" | "shared" (per layer; only read on dsa layers)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False

    # Dense FFN and experts.
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    swiglu_limit: float = 10.0

    # KDA (linear attention).
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float = -5.0

    # DSA = NoPE MLA.
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256

    # KPool lightning indexer.
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    index_kpool_always_select_tail: bool = True
    index_norm_eps: float = 1e-6  # indexer k_norm LayerNorm eps

    # mHC.
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    # Tokens.
    eos_token_ids: tuple[int, ...] = (154820, 154827, 154829)
    pad_token_id: int = 154820

    vision: VisionConfig | None = None

    # ------------------------------------------------------------------ derived
    @property
    def num_dsa_layers(self) -> int:
        return sum(t == "dsa" for t in self.layer_types)

    @property
    def num_kda_layers(self) -> int:
        return sum(t == "kda" for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(t == "moe" for t in self.mlp_layer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim  # NoPE: no rope part

    @property
    def index_num_pools_selected(self) -> int:
        return self.index_topk // self.index_kpool

    @property
    def kda_gate_rank(self) -> int:
        """Low-rank width of f_a/f_b and g_a/g_b (== linear_head_dim, as in every implementation)."""
        return self.linear_head_dim

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def replace(self, **kw) -> ModelConfig:
        return validate(dataclasses.replace(self, **kw))

    def __post_init__(self):
        # Fill the per-layer schedules when left empty (release defaults), then validate.
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple("dsa" if i % 4 == 3 else "kda" for i in range(n)))
        if not self.mlp_layer_types:
            k = min(3, n)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * k + ("moe",) * (n - k))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * n)
        for name in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        validate(self)


def _err(field: str, msg: str) -> ConfigError:
    return ConfigError(f"config field '{field}': {msg}")


def validate(c: ModelConfig) -> ModelConfig:
    """Checks every cross-field constraint; raises ConfigError naming the field."""
    positive = [
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "linear_num_heads", "linear_head_dim",
        "linear_conv_kernel_dim", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
        "hc_mult", "hc_sinkhorn_iters",
    ]  # fmt: skip
    for f in positive:
        v = getattr(c, f)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise _err(f, f"must be a positive integer, got {v!r}")
    for f in ("num_nextn_predict_layers", "n_shared_experts"):
        v = getattr(c, f)
        if not isinstance(v, int) or v < 0:
            raise _err(f, f"must be a non-negative integer, got {v!r}")
    n = c.num_hidden_layers
    for f, kinds in (
        ("layer_types", ATTN_KINDS),
        ("mlp_layer_types", MLP_KINDS),
        ("indexer_types", INDEXER_KINDS),
    ):
        v = getattr(c, f)
        if len(v) != n:
            raise _err(f, f"has {len(v)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in v if t not in kinds})
        if bad:
            raise _err(f, f"unknown kinds {bad}; expected one of {list(kinds)}")
    # A 'shared' indexer needs an earlier 'full' DSA layer to reuse.
    seen_full = False
    for i, (a, it) in enumerate(zip(c.layer_types, c.indexer_types)):
        if a != "dsa":
            continue
        if it == "full":
            seen_full = True
        elif not seen_full:
            raise _err("indexer_types", f"layer {i} is 'shared' but no earlier DSA layer runs a full indexer")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise _err(
            "num_experts_per_tok", f"top-k {c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}"
        )
    if c.n_routed_experts % c.n_group:
        raise _err(
            "n_group", f"n_routed_experts {c.n_routed_experts} is not divisible by n_group {c.n_group}"
        )
    if not 1 <= c.topk_group <= c.n_group:
        raise _err("topk_group", f"must be in [1, n_group={c.n_group}], got {c.topk_group}")
    if c.index_topk % c.index_kpool:
        raise _err("index_topk", f"{c.index_topk} is not divisible by index_kpool {c.index_kpool}")
    if c.tie_word_embeddings:
        raise _err("tie_word_embeddings", "GLM-5.3 has an untied lm_head; tied embeddings are not supported")
    if c.swiglu_limit <= 0:
        raise _err("swiglu_limit", f"must be > 0, got {c.swiglu_limit}")
    if c.linear_lower_bound >= 0:
        raise _err("linear_lower_bound", f"must be negative (a scale on sigmoid), got {c.linear_lower_bound}")
    for f in ("rms_norm_eps", "hc_eps", "index_norm_eps"):
        if not getattr(c, f) > 0:
            raise _err(f, f"must be > 0, got {getattr(c, f)}")
    if not 0 <= c.pad_token_id < c.vocab_size:
        raise _err("pad_token_id", f"{c.pad_token_id} outside vocab of {c.vocab_size}")
    for t in c.eos_token_ids:
        if not 0 <= t < c.vocab_size:
            raise _err("eos_token_ids", f"{t} outside vocab of {c.vocab_size}")
    if c.vision is not None and c.vision.hidden_size % c.vision.num_heads:
        raise _err(
            "vision.hidden_size", f"{c.vision.hidden_size} not divisible by num_heads {c.vision.num_heads}"
        )
    return c


# ---------------------------------------------------------------------------------------------- conversion
def _to_plain(d: Any) -> Any:
    """ConfigDict / FrozenConfigDict / mapping -> plain python containers."""
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    if isinstance(d, Mapping):
        return {k: _to_plain(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_to_plain(v) for v in d]
    return d


def _build(cls, d: Mapping[str, Any], where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid keys are {sorted(fields)}")
    kw = {}
    for k, v in d.items():
        if k == "vision":
            kw[k] = None if v is None else _build(VisionConfig, v, f"{where}.vision")
        elif isinstance(v, list):
            kw[k] = tuple(v)
        else:
            kw[k] = v
    try:
        return cls(**kw)
    except TypeError as e:  # pragma: no cover - defensive
        raise ConfigError(f"{where}: {e}") from e


def model_config_from_dict(d: Mapping[str, Any] | Any) -> ModelConfig:
    """Builds a ModelConfig from a ConfigDict or dict with our field names. Unknown keys are an error."""
    return _build(ModelConfig, _to_plain(d), "model config")


def model_config_to_dict(c: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(c)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


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


# ---------------------------------------------------------------------------------------------- expert quant
EXPERT_MATRICES = ("gate", "up", "down")
EXPERT_LAYOUTS = ("planes", "reencoded")
EXPERT_MIXES = ("none", "ud_iq3_xxs")
# Implementations of kernels.moe.api.moe_experts (tests check this equals the api's table).
MOE_IMPLEMENTATIONS = (
    "auto", "reference", "dense_einsum", "xla_quant", "xla_quant_decode", "xla_quant_prefill",
    "pallas_tpu", "pallas_tpu_decode", "pallas_tpu_prefill",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Routed-expert storage and the expert kernel (the ``quant`` section of an experiment config).

    experts: "none" (dense experts) | "ud_iq3_xxs" (Unsloth's mix: IQ2_S gate/up, IQ3_S down, IQ4_XS down on
      three layers; `glm53.quant.qweight.ud_iq3_xxs_mix` scales it to other layer counts) | a GGUF format name
      for every expert matrix ("IQ4_XS", "q4_k", "BF16", ...) | a per-matrix mapping {"gate": .., "up": ..,
      "down": ..} (also written "gate=IQ2_S,up=IQ2_S,down=IQ3_S"). Normalized: "none", "ud_iq3_xxs", an upper
      case format name, or a tuple of (matrix, format) pairs in gate/up/down order.
    layout: "planes" (GGUF bytes as planes) | "reencoded" (IQ2_S / IQ3_S gather-free; other formats as planes).
    moe_impl: implementation of kernels.moe.api.moe_experts ("auto" picks by backend and routed slots).
    decode_max_slots: routed slots (tokens x top-k) up to which a step counts as decode, above as prefill.
    """

    experts: Any = "none"
    layout: str = "planes"
    moe_impl: str = "reference"
    decode_max_slots: int = 64

    def __post_init__(self):
        object.__setattr__(self, "experts", _parse_experts(self.experts))
        if self.layout not in EXPERT_LAYOUTS:
            raise _err(
                "quant.layout", f"unknown layout {self.layout!r}; expected one of {list(EXPERT_LAYOUTS)}"
            )
        if self.moe_impl not in MOE_IMPLEMENTATIONS:
            raise _err(
                "quant.moe_impl",
                f"unknown implementation {self.moe_impl!r}; expected one of {list(MOE_IMPLEMENTATIONS)}",
            )
        v = self.decode_max_slots
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _err("quant.decode_max_slots", f"must be a non-negative integer, got {v!r}")

    @property
    def quantized(self) -> bool:
        return self.experts != "none"


def _expert_format(name: Any, where: str) -> str:
    from glm53.quant.formats import GGUF_FORMATS, UnknownFormatError, get_format

    try:
        f = get_format(str(name))
    except UnknownFormatError:
        f = None
    if f is None or f.name not in GGUF_FORMATS:
        raise _err(where, f"unknown expert format {name!r}; expected one of {list(EXPERT_MIXES)}, a GGUF format "
                          f"{list(GGUF_FORMATS)} or a mapping gate/up/down -> format")  # fmt: skip
    return f.name


def _parse_experts(spec: Any) -> Any:
    """-> "none" | "ud_iq3_xxs" | format name | ((matrix, format), ...) in gate/up/down order."""
    if spec is None:
        return "none"
    if isinstance(spec, str):
        key = spec.strip()
        if key.lower() in ("none", ""):
            return "none"
        if key.lower().replace("-", "_") == "ud_iq3_xxs":
            return "ud_iq3_xxs"
        if "=" not in key:
            return _expert_format(key, "quant.experts")
        pairs = {}
        for item in key.split(","):
            if item.count("=") != 1:
                raise _err(
                    "quant.experts", f"cannot parse {item!r} in {spec!r}; write gate=FMT,up=FMT,down=FMT"
                )
            m, f = (x.strip() for x in item.split("="))
            if m in pairs:
                raise _err("quant.experts", f"matrix {m!r} given twice in {spec!r}")
            pairs[m] = f
        spec = pairs
    if isinstance(spec, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in spec):
        spec = dict(spec)
    if not isinstance(spec, Mapping):
        raise _err("quant.experts", f"expected a string or a mapping, got {spec!r}")
    keys = set(spec)
    if keys != set(EXPERT_MATRICES):
        raise _err(
            "quant.experts", f"per-matrix mapping needs exactly {list(EXPERT_MATRICES)}, got {sorted(keys)}"
        )
    return tuple((m, _expert_format(spec[m], f"quant.experts.{m}")) for m in EXPERT_MATRICES)


def quant_config_from_dict(d: Mapping[str, Any] | Any) -> QuantConfig:
    """Builds a QuantConfig from the ``quant`` ConfigDict / dict; unknown keys are an error."""
    d = _to_plain(d)
    if not isinstance(d, Mapping):
        raise ConfigError(f"quant config: expected a mapping, got {d!r}")
    fields = {f.name for f in dataclasses.fields(QuantConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"quant config: unknown keys {unknown}; valid keys are {sorted(fields)}")
    return QuantConfig(**d)
