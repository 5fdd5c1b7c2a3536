"""HF checkpoint key -> glm53 parameter path, and the layout transform for each key.

Accepted spellings (all map onto the module tree of glm53/model.py):
  * the release / ``save_pretrained`` names: ``model.language_model.layers.N.self_attn.q_conv1d.weight``,
    per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``, ``hc_attn_fn``, ``self_attn.f_a_proj`` ...;
  * transformers' in-memory names (``save_pretrained(save_original_format=False)``): fused ``self_attn.conv1d``,
    ``mlp.experts.gate_up_proj`` / ``down_proj``, ``attn_hc.fn``, ``self_attn.forget_gate.f_a_proj`` ...;
  * the prefixes ``model.language_model.``, ``model.``, ``language_model.model.``, ``language_model.`` or none.
Layer index ``num_hidden_layers`` is the MTP block (``mtp``); its ``embed_tokens`` / ``shared_head.head`` copies
of the trunk's embedding and head are ignored. Vision-tower keys are ignored (the text port does not run it).

Transforms (HF layout -> ours): Linear [out, in] -> [in, out]; depthwise conv [C, 1, K] -> [K, C]; mHC fn
[(2+n)n, nD] -> [nD, (2+n)n]; per-expert [F, D] -> slice e of [E, D, F]; fused gate_up [E, 2F, D] (gate rows
first) -> two [E, D, F]; fused down [E, D, F] -> [E, F, D]; fused conv [3C, 1, K] -> q, k, v [K, C] each;
vectors (norm weights, A_log, dt_bias, biases, hc base / scale) and the KPool ape [kpool, c] as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from glm53.layers.param import Path


class ShapeProblem(ValueError):
    """A tensor whose rank / shape cannot be transformed by its rule."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """A transformed value for one parameter (`expert` set: the slice [expert] of a stacked expert param)."""

    path: Path
    value: np.ndarray
    expert: int | None = None


def _need(a: np.ndarray, ndim: int, what: str) -> None:
    if a.ndim != ndim:
        raise ShapeProblem(f"expected a rank-{ndim} {what}, got shape {tuple(a.shape)}")


def t_identity(a, tgt, m):
    return [(tgt, a, None)]


def t_linear(a, tgt, m):
    _need(a, 2, "Linear weight [out, in]")
    return [(tgt, a.T, None)]


def t_conv(a, tgt, m):
    if a.ndim != 3 or a.shape[1] != 1:
        raise ShapeProblem(f"expected a depthwise conv weight [C, 1, K], got shape {tuple(a.shape)}")
    return [(tgt, a[:, 0, :].T, None)]


def t_fused_conv(a, tgt, m):
    if a.ndim != 3 or a.shape[1] != 1 or a.shape[0] % 3:
        raise ShapeProblem(f"expected a fused q|k|v conv weight [3C, 1, K], got shape {tuple(a.shape)}")
    c = a.shape[0] // 3
    return [(tgt.format(x=x), a[i * c : (i + 1) * c, 0, :].T, None) for i, x in enumerate("qkv")]


def t_expert(a, tgt, m):
    _need(a, 2, "per-expert Linear weight [out, in]")
    return [(tgt, a.T, int(m["expert"]))]


def t_fused_gate_up(a, tgt, m):
    if a.ndim != 3 or a.shape[1] % 2:
        raise ShapeProblem(f"expected fused experts gate_up_proj [E, 2F, D], got shape {tuple(a.shape)}")
    f = a.shape[1] // 2
    return [(tgt.format(x="gate"), a[:, :f, :].transpose(0, 2, 1), None),
            (tgt.format(x="up"), a[:, f:, :].transpose(0, 2, 1), None)]  # fmt: skip


def t_fused_down(a, tgt, m):
    _need(a, 3, "fused experts down_proj [E, D, F]")
    return [(tgt, a.transpose(0, 2, 1), None)]


@dataclasses.dataclass(frozen=True)
class Rule:
    """`pattern` is matched (fullmatch) on the key with its prefix (and ``layers.N.``) removed."""

    pattern: re.Pattern
    target: str  # dotted path relative to the layer (or model) base; may use {x} filled by the transform
    transform: Callable
    mtp_only: bool = False


def _r(pattern: str, target: str, transform=t_identity, mtp_only: bool = False) -> Rule:
    return Rule(re.compile(pattern), target, transform, mtp_only)


# Keys outside ``layers.N.`` (after the prefix).
MODEL_RULES: tuple[Rule, ...] = (
    _r(r"embed_tokens\.weight", "embed.embedding"),
    _r(r"norm\.weight", "norm.weight"),
    _r(r"lm_head\.weight", "lm_head.kernel", t_linear),
)

# Keys inside ``layers.N.`` (trunk layer N, or the MTP block when N == num_hidden_layers).
LAYER_RULES: tuple[Rule, ...] = (
    # mHC (release: hc_attn_fn; transformers: attn_hc.fn).
    _r(r"(?:hc_(?P<s>attn|ffn)_fn|(?P<s2>attn|ffn)_hc\.fn)", "{s}_hc.fn", t_linear),
    _r(r"(?:hc_(?P<s>attn|ffn)_(?P<p>base|scale)|(?P<s2>attn|ffn)_hc\.(?P<p2>base|scale))", "{s}_hc.{p}"),
    _r(r"(?P<n>input_layernorm|post_attention_layernorm)\.weight", "{n}.weight"),
    # KDA.
    _r(
        r"self_attn\.(?P<n>q_proj|k_proj|v_proj|o_proj|b_proj|g_a_proj|g_b_proj)\.weight",
        "self_attn.{n}.kernel",
        t_linear,
    ),  # fmt: skip
    _r(r"self_attn\.(?:forget_gate\.)?(?P<n>f_a_proj|f_b_proj)\.weight", "self_attn.{n}.kernel", t_linear),
    _r(r"self_attn\.(?:forget_gate\.)?(?P<n>dt_bias|A_log)", "self_attn.{n}"),
    _r(r"self_attn\.(?P<n>q|k|v)_conv1d\.weight", "self_attn.{n}_conv.weight", t_conv),
    _r(r"self_attn\.conv1d\.weight", "self_attn.{{x}}_conv.weight", t_fused_conv),
    _r(r"self_attn\.o_norm\.weight", "self_attn.o_norm.weight"),
    # DSA (NoPE MLA) and its indexer.
    _r(r"self_attn\.(?P<n>q_a_proj|q_b_proj|kv_b_proj)\.weight", "self_attn.{n}.kernel", t_linear),
    _r(r"self_attn\.kv_a_proj_with_mqa\.weight", "self_attn.kv_a_proj.kernel", t_linear),
    _r(r"self_attn\.(?P<n>q_a_layernorm|kv_a_layernorm)\.weight", "self_attn.{n}.weight"),
    _r(r"self_attn\.indexer\.(?P<n>wq_b|wk|weights_proj)\.weight", "self_attn.indexer.{n}.kernel", t_linear),
    _r(r"self_attn\.indexer\.k_norm\.(?P<p>weight|bias)", "self_attn.indexer.k_norm.{p}"),
    _r(r"self_attn\.indexer\.index_kpool_compress_gate", "self_attn.indexer.compress_gate", t_linear),
    _r(r"self_attn\.indexer\.index_kpool_compress_ape", "self_attn.indexer.compress_ape"),
    # Dense MLP, shared expert, router, routed experts.
    _r(r"mlp\.(?P<n>gate_proj|up_proj|down_proj)\.weight", "mlp.{n}.kernel", t_linear),
    _r(
        r"mlp\.shared_experts\.(?P<n>gate_proj|up_proj|down_proj)\.weight",
        "mlp.shared_experts.{n}.kernel",
        t_linear,
    ),  # fmt: skip
    _r(r"mlp\.gate\.weight", "mlp.router.kernel", t_linear),
    _r(r"mlp\.gate\.e_score_correction_bias", "mlp.router.e_score_correction_bias"),
    _r(
        r"mlp\.experts\.(?P<expert>\d+)\.(?P<n>gate_proj|up_proj|down_proj)\.weight",
        "mlp.experts.{n}",
        t_expert,
    ),
    _r(r"mlp\.experts\.gate_up_proj", "mlp.experts.{{x}}_proj", t_fused_gate_up),
    _r(r"mlp\.experts\.down_proj", "mlp.experts.down_proj", t_fused_down),
    # MTP fusion (layer num_hidden_layers only).
    _r(r"eh_proj\.weight", "eh_proj.kernel", t_linear, mtp_only=True),
    _r(r"(?P<n>enorm|hnorm)\.weight", "{n}.weight", mtp_only=True),
    _r(r"shared_head\.norm\.weight", "shared_head_norm.weight", mtp_only=True),
)

# MTP copies of trunk tensors that the model shares instead of loading.
MTP_IGNORED = re.compile(r"(?:embed_tokens|shared_head\.head)\.weight")

_PREFIX = re.compile(r"(?:model\.language_model\.|language_model\.model\.|language_model\.|model\.)?")
_VISION = re.compile(r"(?:model\.)?(?:visual|vision_tower|vision_model|multi_modal_projector)\.")
_LAYER = re.compile(r"layers\.(?P<layer>\d+)\.(?P<rest>.+)")


@dataclasses.dataclass(frozen=True)
class Mapped:
    """A key with a rule: `base` is the path of the layer (or ()) the rule's target is relative to."""

    key: str
    rule: Rule
    base: Path
    groups: dict

    def apply(self, a: np.ndarray) -> list[Placement]:
        """Transforms the (dequantized) HF tensor into placements; raises ShapeProblem on a bad rank/shape."""
        g = {k.rstrip("2"): v for k, v in self.groups.items() if v is not None}
        tgt = self.rule.target.format(**g)
        return [Placement(self.base + parse_path(t), v, e) for t, v, e in self.rule.transform(a, tgt, g)]

    def target_prefix(self) -> Path:
        """The longest path prefix shared by every parameter this key can fill (known before reading it)."""
        g = {k.rstrip("2"): v for k, v in self.groups.items() if v is not None}
        tgt = self.rule.target.format(**g)
        if "{" in tgt:  # keep only the whole path components before the first placeholder
            tgt = tgt.split("{", 1)[0].rpartition(".")[0]
        return self.base + (parse_path(tgt) if tgt else ())


@dataclasses.dataclass(frozen=True)
class Ignored:
    key: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Unknown:
    key: str
    reason: str


def parse_path(dotted: str) -> Path:
    return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def classify(key: str, num_hidden_layers: int, num_mtp_layers: int) -> Mapped | Ignored | Unknown:
    """Finds the rule for one HF key (``.weight_scale_inv`` keys are handled by the loader, not here)."""
    if _VISION.match(key):
        return Ignored(key, "vision tower (not part of the text port)")
    rest = key[_PREFIX.match(key).end() :]
    m = _LAYER.fullmatch(rest)
    if m is None:
        for rule in MODEL_RULES:
            g = rule.pattern.fullmatch(rest)
            if g:
                return Mapped(key, rule, (), g.groupdict())
        return Unknown(key, "no rule maps this key")
    layer, rest = int(m["layer"]), m["rest"]
    is_mtp = layer >= num_hidden_layers
    if is_mtp:
        if layer != num_hidden_layers:
            return Unknown(
                key,
                f"layer {layer} is neither a trunk layer (< {num_hidden_layers}) nor the MTP block "
                f"(layer {num_hidden_layers})",
            )
        if num_mtp_layers == 0:
            return Ignored(key, "MTP block (the model is built without one)")
        if MTP_IGNORED.fullmatch(rest):
            return Ignored(key, "MTP copy of the trunk embedding / lm_head (the trunk's are used)")
    base: Path = ("mtp",) if is_mtp else ("layers", layer)
    for rule in LAYER_RULES:
        if rule.mtp_only and not is_mtp:
            continue
        g = rule.pattern.fullmatch(rest)
        if g:
            return Mapped(key, rule, base, g.groupdict())
    return Unknown(key, "no rule maps this key")
