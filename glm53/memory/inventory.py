"""What GLM-5.3-Flash holds, from the real module tree built abstractly (`nnx.eval_shape`, nothing allocated):
every parameter's path, shape and logical axes, the tensor class it belongs to, the parameter counts the memory
budget and the audit article use, and the cache pytree of one context set.

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
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.config import ModelConfig, VisionConfig
from glm53.layers.param import path_str
from glm53.model import Cache, Glm53Model
from glm53.parallel.rules import param_axes


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: dotted module path, shape and logical axis names (one per dim; None = unnamed)."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


# ---------------------------------------------------------------------------------------------- text model
@functools.lru_cache(maxsize=4)
def _abstract_model(cfg: ModelConfig) -> Glm53Model:
    """`Glm53Model(cfg)` with the MTP block, built by `nnx.eval_shape` (~5 s for the release config); always
    unrolled (per-layer paths and caches, the names checkpoints and budgets use; a scanned model holds the same
    bytes)."""
    cfg = cfg.replace(scan_layers=False)

    def build():
        # The RNG counter is held as a Ref: with a plain Variable every `rngs.params()` under tracing makes
        # flax compare the tracer's `.sharding`, which walks the whole jaxpr so far (quadratic: ~20-50 s for
        # the release model instead of ~5 s).
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        return Glm53Model(cfg, rngs=rngs, dtype=jnp.bfloat16, with_mtp=True)

    return nnx.eval_shape(build)


@functools.lru_cache(maxsize=4)
def _inventory(cfg: ModelConfig) -> tuple[Tensor, ...]:
    out = []
    for path, var in nnx.to_flat_state(nnx.state(_abstract_model(cfg), nnx.Param)):
        what = f"parameter {path_str(path)}"
        out.append(Tensor(path_str(path), tuple(var.get_value().shape), param_axes(var, what)))
    return tuple(sorted(out, key=lambda t: t.path))


def param_inventory(cfg: ModelConfig, *, with_mtp: bool = True) -> tuple[Tensor, ...]:
    """Every parameter of `Glm53Model(cfg)` (sorted by path), read from the module tree built abstractly."""
    inv = _inventory(cfg)
    return inv if with_mtp else tuple(t for t in inv if tensor_group(t.path) != "mtp")


@functools.lru_cache(maxsize=16)
def abstract_cache(cfg: ModelConfig, context: int, *, with_mtp: bool = False) -> Cache:
    """`Glm53Model.init_cache(1, context)` as ShapeDtypeStructs (bf16 activations): one context set."""
    cache = jax.eval_shape(lambda: _abstract_model(cfg).init_cache(1, context, jnp.bfloat16))
    return cache if with_mtp else cache.replace(mtp=None)


# ---------------------------------------------------------------------------------------------- vision
def vision_inventory(v: VisionConfig) -> list[Tensor]:
    """Parameters of the vision tower (transformers `Glm5NextVisionModel` names and [out, in] shapes).

    Built from the config by hand: the text port does not run the vision tower, so it has no module tree (and
    no logical axes) of its own; tests check the result against transformers' module on the meta device."""
    h, i, o, p = v.hidden_size, v.intermediate_size, v.out_hidden_size, v.projection_intermediate_size
    if h % v.num_heads:
        raise ValueError(f"vision.hidden_size {h} is not divisible by vision.num_heads {v.num_heads}")
    head = h // v.num_heads
    bias = v.attention_bias

    def t(path, shape):
        return Tensor(path, tuple(int(s) for s in shape), (None,) * len(shape))

    def lin(path, n_out, n_in, b):
        return [t(f"{path}.weight", (n_out, n_in))] + ([t(f"{path}.bias", (n_out,))] if b else [])

    out = [
        t("patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)),
        t("patch_embed.proj.bias", (h,)),
    ]
    for b in range(v.depth):
        q = f"blocks.{b}"
        out += [t(f"{q}.norm1.weight", (h,)), t(f"{q}.norm2.weight", (h,))]
        out += lin(f"{q}.attn.qkv", 3 * h, h, bias) + lin(f"{q}.attn.proj", h, h, bias)
        out += [t(f"{q}.attn.q_norm.weight", (head,)), t(f"{q}.attn.k_norm.weight", (head,))]
        out += lin(f"{q}.mlp.gate_proj", i, h, bias) + lin(f"{q}.mlp.up_proj", i, h, bias)
        out += lin(f"{q}.mlp.down_proj", h, i, bias)
    out += lin("merger.proj", o, o, False)
    out += [t("merger.post_projection_norm.weight", (o,)), t("merger.post_projection_norm.bias", (o,))]
    out += lin("merger.gate_proj", p, o, False) + lin("merger.up_proj", p, o, False)
    out += lin("merger.down_proj", o, p, False)
    m = v.spatial_merge_size
    out += [t("downsample.weight", (o, h, m, m)), t("downsample.bias", (o,))]
    out.append(t("post_layernorm.weight", (h,)))
    return sorted(out, key=lambda x: x.path)


def vision_params(v: VisionConfig | None) -> int:
    """Parameter count of the vision tower (0 without one)."""
    return 0 if v is None else sum(t.size for t in vision_inventory(v))


# ---------------------------------------------------------------------------------------------- classes
# Tensor classes of the text model, matched on the path (first match wins). The memory budget's storage table
# (glm53/memory/budget.py `STORAGE`) is keyed by these names.
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
def param_counts(cfg: ModelConfig) -> dict:
    """Parameter counts: totals per group, routed experts, non-expert (the article's definition), per class."""
    group = {"trunk": 0, "lm_head": 0, "mtp": 0}
    routed = {"trunk": 0, "lm_head": 0, "mtp": 0}
    by_class: dict[str, int] = {}
    mtp_by_class: dict[str, int] = {}
    for t in param_inventory(cfg):
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
