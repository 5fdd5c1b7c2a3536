"""The model's architecture as a frozen dataclass (`ModelConfig`), validated field by field.

Layer kinds use our short names: attention ``"kda"`` / ``"dsa"``, FFN ``"dense"`` / ``"moe"``, indexer
``"full"`` / ``"shared"``. HF spellings are translated in `glm53.config.hf` only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from glm53.config.fields import field_error as _err
from glm53.config.fields import from_dict

ATTN_KINDS = ("kda", "dsa")
MLP_KINDS = ("dense", "moe")
INDEXER_KINDS = ("full", "shared")
LATENT_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")


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
    # How the DSA caches store the MLA latent (not part of the checkpoint): "auto" = the dtype init_cache is
    # given (the exact layouts parity is tested with), "float32" / "bfloat16", or "int8" with one f32 absmax
    # scale per cached token (lossy; the release config's serving layout).
    latent_cache_dtype: str = "auto"
    # Runs of identical layers as one `jax.lax.scan` over stacked parameters (glm53/layers/stack.py; a runtime
    # layout like latent_cache_dtype: checkpoints always name per-layer tensors). False: every layer unrolled.
    scan_layers: bool = False

    # mHC.
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    # Tokens: generation stops at any of `eos_token_ids` (none: only at its limit); pad None: no pad id.
    eos_token_ids: tuple[int, ...] = (154820, 154827, 154829)
    pad_token_id: int | None = 154820

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
        # Lists become tuples and ints in float fields floats; then the types are checked and the per-layer
        # schedules left empty are filled with the release pattern before the full validation.
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list) and f.type.startswith("tuple"):
                object.__setattr__(self, f.name, tuple(v))
            elif f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, f.name, float(v))
        _check_types(self)
        _check_counts(self)
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple("dsa" if i % 4 == 3 else "kda" for i in range(n)))
        if not self.mlp_layer_types:
            k = min(3, n)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * k + ("moe",) * (n - k))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * n)
        validate(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Field annotation -> the values it admits (a float field also takes an int: JSON writes 2.0 as 2 at times).
_TYPE_CHECKS = {
    "int": _is_int,
    "int | None": lambda v: v is None or _is_int(v),
    "float": lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "tuple[int, ...]": lambda v: isinstance(v, tuple) and all(_is_int(x) for x in v),
    "tuple[str, ...]": lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
    "VisionConfig | None": lambda v: v is None or isinstance(v, VisionConfig),
}


def check_type(cls: type, name: str, v: Any, prefix: str = "") -> None:
    """Raises a ConfigError naming the field unless `v` fits the annotation of field `name` of `cls`."""
    t = cls.__dataclass_fields__[name].type
    if not _TYPE_CHECKS[t](v):
        raise _err(
            prefix + name, f"expected {'a finite float' if t == 'float' else t}, got {type(v).__name__} {v!r}"
        )


def _check_types(obj, prefix: str = "") -> None:
    """Every field of a config dataclass holds a value of its annotated type (a bool is not an int)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        check_type(type(obj), f.name, v, prefix)
        if dataclasses.is_dataclass(v):
            _check_types(v, f"{prefix}{f.name}.")


_NON_NEGATIVE = ("num_nextn_predict_layers", "n_shared_experts")
MAX_LAYERS = 10_000  # bounds the per-layer schedules built from num_hidden_layers


def _check_counts(obj, prefix: str = "") -> None:
    """Every int field is positive (a few may be 0), the nested vision config's too."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.type == "int" and v < (0 if f.name in _NON_NEGATIVE else 1):
            kind = "non-negative" if f.name in _NON_NEGATIVE else "positive"
            raise _err(prefix + f.name, f"must be a {kind} integer, got {v!r}")
        if dataclasses.is_dataclass(v):
            _check_counts(v, f"{prefix}{f.name}.")
    if isinstance(obj, ModelConfig) and obj.num_hidden_layers > MAX_LAYERS:
        raise _err("num_hidden_layers", f"{obj.num_hidden_layers} is more than {MAX_LAYERS}")


def validate(c: ModelConfig) -> ModelConfig:
    """Checks every field's type and every cross-field constraint; raises ConfigError naming the field."""
    _check_types(c)
    _check_counts(c)
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
    if c.latent_cache_dtype not in LATENT_CACHE_DTYPES:
        raise _err("latent_cache_dtype", f"{c.latent_cache_dtype!r} is not one of {list(LATENT_CACHE_DTYPES)}")
    if c.tie_word_embeddings:
        raise _err("tie_word_embeddings", "GLM-5.3 has an untied lm_head; tied embeddings are not supported")
    if c.swiglu_limit <= 0:
        raise _err("swiglu_limit", f"must be > 0, got {c.swiglu_limit}")
    if c.linear_lower_bound >= 0:
        raise _err("linear_lower_bound", f"must be negative (a scale on sigmoid), got {c.linear_lower_bound}")
    for f in ("rms_norm_eps", "hc_eps", "index_norm_eps"):
        if not getattr(c, f) > 0:
            raise _err(f, f"must be > 0, got {getattr(c, f)}")
    if c.pad_token_id is not None and not 0 <= c.pad_token_id < c.vocab_size:
        raise _err("pad_token_id", f"{c.pad_token_id} outside vocab of {c.vocab_size}")
    for t in c.eos_token_ids:
        if not 0 <= t < c.vocab_size:
            raise _err("eos_token_ids", f"{t} outside vocab of {c.vocab_size}")
    if c.vision is not None and c.vision.hidden_size % c.vision.num_heads:
        raise _err(
            "vision.hidden_size", f"{c.vision.hidden_size} not divisible by num_heads {c.vision.num_heads}"
        )
    return c


def model_config_from_dict(d: Any) -> ModelConfig:
    """Builds a ModelConfig from a ConfigDict or dict with our field names. Unknown keys are an error."""
    return from_dict(ModelConfig, d, "model config", nested={"vision": VisionConfig})


def model_config_to_dict(c: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(c)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
