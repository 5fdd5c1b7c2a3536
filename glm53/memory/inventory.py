"""Parameter inventory of GLM-5.3-Flash from the config alone: every tensor's path, shape and logical axes,
the tensor class it belongs to, and the parameter counts the memory budget and the audit article use.

Two independent routes to the same inventory (tests/test_memory_budget.py checks they agree per tensor):
  * `param_inventory(cfg)`       -- arithmetic from the config, names mirroring the `Glm53Model` module tree;
  * `model_param_inventory(cfg)` -- the real module tree built abstractly with `nnx.eval_shape`.
The vision tower (not ported; it only costs memory) is `vision_inventory(vcfg)`, named as transformers'
`Glm5NextVisionModel` so a test can compare it with that module built on the meta device.

What the counts mean (release config):
  text trunk      embedding + layers 0..44 + final norm                              312,692,423,486
  lm_head         the untied output matrix                                               634,388,480
  MTP             layer 45: eh_proj, 5 norms, a DSA attention, a MoE (shares embedding and lm_head)
                                                                                       7,432,592,416
  vision          the 24-block ViT, patch embed, downsample conv and merger              563,627,008
  total           trunk + lm_head + MTP + vision                                     321,323,031,390
  routed experts  gate/up/down of the 288 experts in the 42 MoE layers of the trunk  304,405,807,104
  non-expert      trunk + lm_head - routed experts                                     8,921,004,862
                  (the article's 8.921B: layers 0..44 with the shared experts, routers, mHC and norms,
                  plus embedding, lm_head and final norm; NOT the MTP block and NOT vision)
"""

from __future__ import annotations

import dataclasses
import math

from glm53 import dims
from glm53.config import ModelConfig, VisionConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: dotted module path, shape and logical axis names (one per dim; None = unnamed)."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


# ---------------------------------------------------------------------------------------------- arithmetic
def _t(path: str, shape, axes) -> Tensor:
    return Tensor(path, tuple(int(s) for s in shape), tuple(axes))


def _linear(path: str, n_in: int, n_out: int, ax_in, ax_out) -> list[Tensor]:
    return [_t(f"{path}.kernel", (n_in, n_out), (ax_in, ax_out))]


def _norm(path: str, n: int, bias: bool = False) -> list[Tensor]:
    out = [_t(f"{path}.weight", (n,), (dims.NORM,))]
    if bias:
        out.append(_t(f"{path}.bias", (n,), (dims.NORM,)))
    return out


def _hyper_connection(path: str, cfg: ModelConfig) -> list[Tensor]:
    n, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + n) * n
    return [
        _t(f"{path}.fn", (n * d, mix), (dims.HC_FLAT, dims.HC_MIX)),
        _t(f"{path}.base", (mix,), (dims.HC_MIX,)),
        _t(f"{path}.scale", (3,), (dims.HC_SCALE,)),
    ]


def _kda(path: str, cfg: ModelConfig) -> list[Tensor]:
    d, hd, r, k = cfg.hidden_size, cfg.kda_dim, cfg.kda_gate_rank, cfg.linear_conv_kernel_dim
    out: list[Tensor] = []
    for name in ("q", "k", "v"):
        out += _linear(f"{path}.{name}_proj", d, hd, dims.EMBED, dims.KDA_QKV)
    for name in ("q", "k", "v"):
        out.append(_t(f"{path}.{name}_conv.weight", (k, hd), (dims.CONV, dims.KDA_QKV)))
    out += _linear(f"{path}.f_a_proj", d, r, dims.EMBED, dims.KDA_RANK)
    out += _linear(f"{path}.f_b_proj", r, hd, dims.KDA_RANK, dims.KDA_QKV)
    out.append(_t(f"{path}.dt_bias", (hd,), (dims.KDA_QKV,)))
    out.append(_t(f"{path}.A_log", (cfg.linear_num_heads,), (dims.KDA_HEADS,)))
    out += _linear(f"{path}.b_proj", d, cfg.linear_num_heads, dims.EMBED, dims.KDA_HEADS)
    out += _linear(f"{path}.g_a_proj", d, r, dims.EMBED, dims.KDA_RANK)
    out += _linear(f"{path}.g_b_proj", r, hd, dims.KDA_RANK, dims.KDA_QKV)
    out += _norm(f"{path}.o_norm", cfg.linear_head_dim)
    out += _linear(f"{path}.o_proj", hd, d, dims.KDA_QKV, dims.EMBED)
    return out


def _indexer(path: str, cfg: ModelConfig) -> list[Tensor]:
    d, ih, c = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return [
        _t(f"{path}.compress_ape", (cfg.index_kpool, c), (dims.KPOOL, dims.INDEX_HEAD_DIM)),
        _t(f"{path}.compress_gate", (d, c), (dims.EMBED, dims.INDEX_HEAD_DIM)),
        *_norm(f"{path}.k_norm", c, bias=True),
        *_linear(f"{path}.weights_proj", d, ih, dims.EMBED, dims.INDEX_HEADS),
        *_linear(f"{path}.wk", d, c, dims.EMBED, dims.INDEX_HEAD_DIM),
        *_linear(f"{path}.wq_b", cfg.q_lora_rank, ih * c, dims.Q_LORA, dims.INDEX_QK),
    ]


def _dsa(path: str, cfg: ModelConfig, with_indexer: bool) -> list[Tensor]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    out = [
        *_linear(f"{path}.q_a_proj", d, cfg.q_lora_rank, dims.EMBED, dims.Q_LORA),
        *_norm(f"{path}.q_a_layernorm", cfg.q_lora_rank),
        *_linear(f"{path}.q_b_proj", cfg.q_lora_rank, h * cfg.qk_nope_head_dim, dims.Q_LORA, dims.HEADS),
        *_linear(f"{path}.kv_a_proj", d, cfg.kv_lora_rank, dims.EMBED, dims.KV_LORA),
        *_norm(f"{path}.kv_a_layernorm", cfg.kv_lora_rank),
        *_linear(
            f"{path}.kv_b_proj",
            cfg.kv_lora_rank,
            h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            dims.KV_LORA,
            dims.HEADS,
        ),
        *_linear(f"{path}.o_proj", h * cfg.v_head_dim, d, dims.HEADS, dims.EMBED),
    ]
    if with_indexer:
        out += _indexer(f"{path}.indexer", cfg)
    return out


def _mlp(path: str, d: int, f: int, axis: str) -> list[Tensor]:
    return [
        *_linear(f"{path}.gate_proj", d, f, dims.EMBED, axis),
        *_linear(f"{path}.up_proj", d, f, dims.EMBED, axis),
        *_linear(f"{path}.down_proj", f, d, axis, dims.EMBED),
    ]


def _moe(path: str, cfg: ModelConfig) -> list[Tensor]:
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    out = [
        _t(f"{path}.router.kernel", (d, e), (dims.EMBED, dims.EXPERT)),
        _t(f"{path}.router.e_score_correction_bias", (e,), (dims.EXPERT,)),
        _t(f"{path}.experts.gate_proj", (e, d, f), (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP)),
        _t(f"{path}.experts.up_proj", (e, d, f), (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP)),
        _t(f"{path}.experts.down_proj", (e, f, d), (dims.EXPERT, dims.EXPERT_MLP, dims.EMBED)),
    ]
    if cfg.n_shared_experts:
        out += _mlp(f"{path}.shared_experts", d, f * cfg.n_shared_experts, dims.EXPERT_MLP)
    return out


def _shared_indexer(cfg: ModelConfig, layer_idx: int) -> bool:
    return cfg.indexer_types[layer_idx] == "shared"


def param_inventory(cfg: ModelConfig, *, with_mtp: bool = True) -> list[Tensor]:
    """Every parameter of `Glm53Model(cfg)` computed from the config (sorted by path)."""
    d = cfg.hidden_size
    out = [_t("embed.embedding", (cfg.vocab_size, d), (dims.VOCAB, dims.EMBED))]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        out += _hyper_connection(f"{p}.attn_hc", cfg)
        out += _norm(f"{p}.input_layernorm", d)
        if cfg.layer_types[i] == "kda":
            out += _kda(f"{p}.self_attn", cfg)
        else:
            out += _dsa(f"{p}.self_attn", cfg, with_indexer=not _shared_indexer(cfg, i))
        out += _hyper_connection(f"{p}.ffn_hc", cfg)
        out += _norm(f"{p}.post_attention_layernorm", d)
        if cfg.mlp_layer_types[i] == "dense":
            out += _mlp(f"{p}.mlp", d, cfg.intermediate_size, dims.MLP)
        else:
            out += _moe(f"{p}.mlp", cfg)
    out += _norm("norm", d)
    out += _linear("lm_head", d, cfg.vocab_size, dims.EMBED, dims.VOCAB)
    if with_mtp and cfg.num_nextn_predict_layers > 0:
        out += _norm("mtp.enorm", d) + _norm("mtp.hnorm", d)
        out += _linear("mtp.eh_proj", 2 * d, d, None, dims.EMBED)
        out += _norm("mtp.input_layernorm", d)
        out += _dsa("mtp.self_attn", cfg, with_indexer=True)
        out += _norm("mtp.post_attention_layernorm", d)
        out += _moe("mtp.mlp", cfg)
        out += _norm("mtp.shared_head_norm", d)
    return sorted(out, key=lambda t: t.path)


def model_param_inventory(cfg: ModelConfig, *, with_mtp: bool = True) -> list[Tensor]:
    """Every parameter of the real `Glm53Model(cfg)` module tree, built with `nnx.eval_shape` (nothing is
    allocated; ~3 s for the release config)."""
    import jax.numpy as jnp
    from flax import nnx

    from glm53.layers.param import logical_axes
    from glm53.model import Glm53Model

    def build():
        # The RNG counter is held as a Ref: with a plain Variable every `rngs.params()` under tracing makes
        # flax compare the tracer's `.sharding`, which walks the whole jaxpr so far (quadratic: ~20-50 s for
        # the release model instead of ~3 s).
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        return Glm53Model(cfg, rngs=rngs, dtype=jnp.bfloat16, with_mtp=with_mtp)

    model = nnx.eval_shape(build)
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        axes = logical_axes(var) or (None,) * len(value.shape)
        out.append(_t(".".join(str(p) for p in path), value.shape, axes))
    return sorted(out, key=lambda t: t.path)


# ---------------------------------------------------------------------------------------------- vision
def vision_inventory(v: VisionConfig) -> list[Tensor]:
    """Parameters of the vision tower (transformers `Glm5NextVisionModel` names and [out, in] shapes)."""
    h, i, o, p = v.hidden_size, v.intermediate_size, v.out_hidden_size, v.projection_intermediate_size
    if h % v.num_heads:
        raise ValueError(f"vision.hidden_size {h} is not divisible by vision.num_heads {v.num_heads}")
    head = h // v.num_heads
    bias = v.attention_bias
    out = [
        _t(
            "patch_embed.proj.weight",
            (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
            (),
        ),
        _t("patch_embed.proj.bias", (h,), ()),
    ]

    def lin(path, n_out, n_in, b):
        return [_t(f"{path}.weight", (n_out, n_in), ())] + ([_t(f"{path}.bias", (n_out,), ())] if b else [])

    for b in range(v.depth):
        q = f"blocks.{b}"
        out += [_t(f"{q}.norm1.weight", (h,), ()), _t(f"{q}.norm2.weight", (h,), ())]
        out += lin(f"{q}.attn.qkv", 3 * h, h, bias) + lin(f"{q}.attn.proj", h, h, bias)
        out += [_t(f"{q}.attn.q_norm.weight", (head,), ()), _t(f"{q}.attn.k_norm.weight", (head,), ())]
        out += lin(f"{q}.mlp.gate_proj", i, h, bias) + lin(f"{q}.mlp.up_proj", i, h, bias)
        out += lin(f"{q}.mlp.down_proj", h, i, bias)
    out += lin("merger.proj", o, o, False)
    out += [
        _t("merger.post_projection_norm.weight", (o,), ()),
        _t("merger.post_projection_norm.bias", (o,), ()),
    ]
    out += (
        lin("merger.gate_proj", p, o, False)
        + lin("merger.up_proj", p, o, False)
        + lin("merger.down_proj", o, p, False)
    )
    m = v.spatial_merge_size
    out += [_t("downsample.weight", (o, h, m, m), ()), _t("downsample.bias", (o,), ())]
    out.append(_t("post_layernorm.weight", (h,), ()))
    return sorted(out, key=lambda t: t.path)


def vision_params(v: VisionConfig | None) -> int:
    """Parameter count of the vision tower (0 without one)."""
    return 0 if v is None else sum(t.size for t in vision_inventory(v))


# ---------------------------------------------------------------------------------------------- classes
# Tensor classes of the text model, matched on the path (first match wins). The memory budget's storage table
# (glm53/memory.py) is keyed by these names.
_CLASS_RULES: tuple[tuple[str, object], ...] = (
    ("routed_experts", lambda p: ".mlp.experts." in p),
    ("embedding", lambda p: p.startswith("embed.")),
    ("lm_head", lambda p: p.startswith("lm_head.")),
    ("router", lambda p: p.endswith(".router.kernel")),
    ("router_bias", lambda p: p.endswith(".router.e_score_correction_bias")),
    ("mhc_fn", lambda p: p.endswith("_hc.fn")),
    ("mhc_vectors", lambda p: p.endswith("_hc.base") or p.endswith("_hc.scale")),
    (
        "norms",
        lambda p: any(p.endswith(f"{s}.{w}") for s in ("norm", "layernorm") for w in ("weight", "bias")),
    ),
    ("kda_vectors", lambda p: p.endswith((".dt_bias", ".A_log", "_conv.weight"))),
    ("indexer_ape", lambda p: p.endswith(".indexer.compress_ape")),
    ("indexer", lambda p: ".indexer." in p),
    ("shared_experts", lambda p: ".mlp.shared_experts." in p),
    ("mtp_fusion", lambda p: p.startswith("mtp.eh_proj")),
    ("dense_mlp", lambda p: ".mlp." in p),
    ("attention", lambda p: ".self_attn." in p),
)
TENSOR_CLASSES = tuple(name for name, _ in _CLASS_RULES)


def tensor_class(path: str) -> str:
    """The tensor class of a text-model parameter path (see `TENSOR_CLASSES`)."""
    for name, match in _CLASS_RULES:
        if match(path):
            return name
    raise ValueError(f"parameter {path!r} matches no tensor class of {TENSOR_CLASSES}")


def tensor_group(path: str) -> str:
    """'trunk' (embedding, layers 0..N-1, final norm), 'lm_head' or 'mtp'."""
    if path.startswith("mtp."):
        return "mtp"
    if path.startswith("lm_head."):
        return "lm_head"
    return "trunk"


# ---------------------------------------------------------------------------------------------- counts
def param_counts(cfg: ModelConfig, inventory: list[Tensor] | None = None) -> dict:
    """Parameter counts: totals per group, routed experts, non-expert (the article's definition), per class.

    `inventory` defaults to `param_inventory(cfg)`; pass `model_param_inventory(cfg)` to count the module
    tree.
    """
    inv = param_inventory(cfg) if inventory is None else inventory
    group = {"trunk": 0, "lm_head": 0, "mtp": 0}
    routed = {"trunk": 0, "lm_head": 0, "mtp": 0}
    by_class: dict[str, int] = {}
    mtp_by_class: dict[str, int] = {}
    for t in inv:
        g, c = tensor_group(t.path), tensor_class(t.path)
        group[g] += t.size
        if c == "routed_experts":
            routed[g] += t.size
        target = mtp_by_class if g == "mtp" else by_class
        target[c] = target.get(c, 0) + t.size
    vision = vision_params(cfg.vision)
    total = group["trunk"] + group["lm_head"] + group["mtp"] + vision
    non_expert = group["trunk"] + group["lm_head"] - routed["trunk"]
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active = non_expert + cfg.num_moe_layers * cfg.num_experts_per_tok * per_expert
    return dict(
        total_params=total,
        text_trunk_params=group["trunk"],
        lm_head_params=group["lm_head"],
        mtp_params=group["mtp"],
        mtp_routed_expert_params=routed["mtp"],
        vision_params=vision,
        routed_expert_params=routed["trunk"],
        routed_expert_share=routed["trunk"] / total,
        non_expert_params=non_expert,
        non_expert_params_by_class={k: v for k, v in sorted(by_class.items()) if k != "routed_experts"},
        mtp_params_by_class=dict(sorted(mtp_by_class.items())),
        active_params_per_token=active,
        active_params_per_token_excl_embedding=active - by_class.get("embedding", 0),
    )
