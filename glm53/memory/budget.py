"""Per-device HBM budget of GLM-5.3-Flash served tensor-parallel with GGUF routed experts, from shapes only.

`memory_budget(cfg, experts=..., devices=..., hbm_gb=..., context=..., streams=...)` returns, per device:
the routed experts (GGUF blocks repacked as planes, glm53/quant/budget.py), the non-expert weights under one
per-tensor-class storage rule (`STORAGE`), the vision tower, the caches of `streams` context sets, a
workspace, the total and the headroom; plus parameter counts (glm53/param_inventory.py), a comparison with
the audit article / prior art (../shared/spec/audit-article.txt, prior-art.md) that says why a figure
differs, and optionally a ladder of expert quantizations and whether each fits. Nothing is allocated.

Placement (the prior art's pure tensor parallelism over one axis of `devices`):
  * routed experts: every device holds 1/devices of every expert (gate/up by output rows, down by input
    blocks);
  * int8 matrices: split along their head / vocabulary / FFN-width axis (low-rank down-projections without
    one, q_a, kv_a, f_a, g_a, indexer wk / compress_gate, along their output axis); norms, mHC and routers
    replicated;
  * caches: KDA conv + recurrent state split by head; MLA latent and indexer caches sequence-sharded by pool
    (pool p on device p mod devices).
"""

from __future__ import annotations

import dataclasses
import math

from glm53 import dims
from glm53.config import ModelConfig
from glm53.memory.inventory import Tensor, param_counts, param_inventory, tensor_class, tensor_group
from glm53.quant import budget as qbudget
from glm53.quant.formats import get_format

GB = qbudget.GB  # 1e9 bytes: the unit of the article and of sizes on the Hub
DTYPE_BYTES = {"int8": 1, "bf16": 2, "f32": 4}
INT8_SCALE_BYTES = 4  # f32 scale per output channel (glm53/quant/int8.py Int8Weight)

# Logical axes that tensor parallelism splits (heads, vocabulary, FFN widths).
SPLIT_AXES = (
    dims.VOCAB,
    dims.HEADS,
    dims.KV_HEADS,
    dims.KDA_QKV,
    dims.KDA_HEADS,
    dims.INDEX_QK,
    dims.INDEX_HEADS,
    dims.MLP,
    dims.EXPERT_MLP,
)


@dataclasses.dataclass(frozen=True)
class Storage:
    """How one tensor class is held on device: element dtype and placement ("split" | "replicated")."""

    dtype: str
    placement: str
    note: str


# The one per-tensor-class rule (prior art: "everything else from the FP8 checkpoint at int8 per channel;
# norms, routers, mHC in fp32/bf16"). bf16 where the checkpoint keeps a tensor in bf16; f32 where transformers
# keeps it in f32 (_keep_in_fp32_modules_strict) or where it is a norm weight (tiny).
STORAGE: dict[str, Storage] = {
    "embedding": Storage("int8", "split", "int8 + f32 scale per vocabulary row; split by vocabulary"),
    "lm_head": Storage("int8", "split", "int8 + f32 scale per vocabulary column; split by vocabulary"),
    "attention": Storage(
        "int8", "split", "KDA / MLA projections, int8 + f32 scale per output channel; by heads"
    ),
    "indexer": Storage("int8", "split", "indexer projections, int8 + f32 scale per output channel"),
    "dense_mlp": Storage("int8", "split", "layers 0-2 SwiGLU, int8 + f32 scale; split by FFN width"),
    "shared_experts": Storage("int8", "split", "shared expert, int8 + f32 scale; split by FFN width"),
    "mtp_fusion": Storage("int8", "split", "MTP eh_proj, int8 + f32 scale"),
    "kda_vectors": Storage("f32", "split", "KDA conv weights, dt_bias, A_log (kept f32); split by head"),
    "indexer_ape": Storage("bf16", "replicated", "indexer pool position embedding"),
    "mhc_fn": Storage("bf16", "replicated", "mHC mixing projection (every device mixes all streams)"),
    "mhc_vectors": Storage("f32", "replicated", "mHC base and scale (kept f32)"),
    "router": Storage("bf16", "replicated", "router kernel (every device routes every token)"),
    "router_bias": Storage("f32", "replicated", "e_score_correction_bias (kept f32)"),
    "norms": Storage("f32", "replicated", "RMSNorm / LayerNorm weights and biases"),
}
VISION_STORAGE = Storage("bf16", "split", "vision tower at bf16 split evenly (the article's rule)")

# Figures the audit article (../shared/spec/audit-article.txt) and the prior-art notes (prior-art.md)
# print. Used ONLY as the comparison column and, for `hbm_used_gb`, as the measurement the workspace residual
# is taken from; every "ours" figure is computed from the config, the shapes and the format definitions.
REFERENCE = {
    "total_params": 321_323_031_390,
    "routed_expert_params": 304_405_807_104,
    "routed_expert_share_pct": 94.7,
    "routed_gguf_gb": 109.87,
    "routed_planes_gb": 110.72,
    "planes_growth_mb_per_device": 106,
    "non_expert_params_b": 8.921,
    "non_expert_gb_per_device": 1.12,
    "vision_params_b": 0.563,
    "vision_gb_per_device": 0.141,
    "weights_gb_per_device": 15.13,
    "hbm_used_gb": 15.4,
    "residual_gb": 0.28,
    "context_set_gb_per_device": 0.23,
}
PRIOR_ART_DEVICES = 8


# ---------------------------------------------------------------------------------------------- non-expert
def _split_axis(t: Tensor, n: int) -> int | None:
    """The axis `t` is split along over n devices (None: replicated because no axis divides)."""
    if n == 1:
        return None
    named = [i for i, a in enumerate(t.axes) if a in SPLIT_AXES and t.shape[i] % n == 0]
    if named:
        return named[0]
    for i in reversed(range(len(t.shape))):  # no TP axis: the output (last) axis first
        if t.shape[i] % n == 0:
            return i
    return None


def tensor_device_bytes(t: Tensor, storage: Storage, n: int) -> tuple[int, bool]:
    """(bytes one device holds of `t` under `storage` over n devices, whether it fell back to replication)."""
    axis = _split_axis(t, n) if storage.placement == "split" else None
    fallback = storage.placement == "split" and axis is None and n > 1
    per_dev = t.size // n if axis is not None else t.size
    nbytes = per_dev * DTYPE_BYTES[storage.dtype]
    if storage.dtype == "int8":
        scale_axis = 0 if t.axes[:1] == (dims.VOCAB,) else len(t.shape) - 1  # per output channel / vocab row
        n_scales = t.shape[scale_axis] * math.prod(t.shape[:-2])
        nbytes += (n_scales // n if axis == scale_axis else n_scales) * INT8_SCALE_BYTES
    return nbytes, fallback


def non_expert_by_class(cfg: ModelConfig, devices: int, inventory: list[Tensor] | None = None) -> dict:
    """{class: {params, dtype, placement, bytes_per_device, replicated_fallbacks}} over trunk + lm_head,
    routed experts and the MTP block excluded."""
    inv = param_inventory(cfg, with_mtp=False) if inventory is None else inventory
    out: dict[str, dict] = {}
    for t in inv:
        cls = tensor_class(t.path)
        if cls == "routed_experts" or tensor_group(t.path) == "mtp":
            continue
        st = STORAGE[cls]
        nbytes, fallback = tensor_device_bytes(t, st, devices)
        row = out.setdefault(
            cls,
            dict(
                params=0, dtype=st.dtype, placement=st.placement, bytes_per_device=0, replicated_fallbacks=0
            ),
        )
        row["params"] += t.size
        row["bytes_per_device"] += nbytes
        row["replicated_fallbacks"] += int(fallback)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------- experts
LADDER_UNIFORM = (
    "IQ2_XXS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ4_XS",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_0",
    "BF16",
)
# UD-like mixes defined here after the pattern of Unsloth's UD-IQ3_XXS: (gate/up, down, down in the boosted
# layers budget.IQ4_XS_DOWN_LAYERS). These are NOT Unsloth's other builds, whose tables we have not read.
LADDER_UD_LIKE = (
    ("IQ2_XXS", "IQ2_S", "IQ3_S"),
    ("IQ3_XXS", "IQ3_S", "IQ4_XS"),
    ("Q2_K", "Q3_K", "Q4_K"),
    ("IQ3_S", "IQ4_XS", "Q5_K"),
    ("Q3_K", "Q4_K", "Q5_K"),
    ("IQ4_XS", "Q5_K", "Q6_K"),
    ("Q4_K", "Q5_K", "Q6_K"),
    ("Q5_K", "Q6_K", "Q8_0"),
)


def _moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe")


def _uniform(cfg: ModelConfig, fmt: str) -> dict:
    return {(layer, m): fmt for layer in _moe_layers(cfg) for m in qbudget.MATRICES}


def _ud_like(cfg: ModelConfig, gate_up: str, down: str, boost: str) -> dict:
    mix = {}
    for layer in _moe_layers(cfg):
        mix[(layer, "gate")] = mix[(layer, "up")] = gate_up
        mix[(layer, "down")] = boost if layer in qbudget.IQ4_XS_DOWN_LAYERS else down
    return mix


def expert_mix_names() -> list[str]:
    """Names accepted by `expert_mix` / --experts."""
    return (
        ["ud_iq3_xxs"]
        + [f.lower() for f in LADDER_UNIFORM]
        + [f"udlike_{g}_{d}_{b}".lower() for g, d, b in LADDER_UD_LIKE]
    )


def expert_mix(cfg: ModelConfig, name: str) -> tuple[str, dict]:
    """(label, {(layer, "gate" | "up" | "down"): GGUF format}) for a mix name of `expert_mix_names()`."""
    key = name.strip().lower()
    if key == "ud_iq3_xxs":
        table_layers = tuple(sorted({layer for layer, _ in qbudget.UD_IQ3_XXS}))
        if table_layers != _moe_layers(cfg):
            raise ValueError(
                f"--experts=ud_iq3_xxs: the UD-IQ3_XXS table covers MoE layers "
                f"{table_layers[0]}..{table_layers[-1]} "
                f"but config field mlp_layer_types has MoE layers {list(_moe_layers(cfg))}"
            )
        return "UD-IQ3_XXS (Unsloth mix)", dict(qbudget.UD_IQ3_XXS)
    for f in LADDER_UNIFORM:
        if key == f.lower():
            return f"{f} uniform", _uniform(cfg, f)
    for g, d, b in LADDER_UD_LIKE:
        if key == f"udlike_{g}_{d}_{b}".lower():
            layers = ",".join(str(x) for x in qbudget.IQ4_XS_DOWN_LAYERS)
            return f"UD-like {g}/{d} ({b} down in {layers})", _ud_like(cfg, g, d, b)
    try:  # any other known GGUF format name, uniform
        return f"{get_format(key).name} uniform", _uniform(cfg, get_format(key).name)
    except ValueError:
        raise ValueError(
            f"--experts={name!r}: unknown expert mix; choose one of {expert_mix_names()}"
        ) from None


def expert_bytes(cfg: ModelConfig, mix: dict, devices: int, layout: str = "planes") -> qbudget.MixBytes:
    """GGUF and per-device plane bytes of a routed-expert mix under the TP split (glm53/quant/budget.py)."""
    return qbudget.expert_mix_nbytes(
        mix,
        devices,
        layout,
        n_experts=cfg.n_routed_experts,
        d_model=cfg.hidden_size,
        d_ff=cfg.moe_intermediate_size,
    )


# ---------------------------------------------------------------------------------------------- caches
@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Cache storage of one context set (one stream).

    latent: "int8" (512 int8 + one f32 absmax scale per token, the prior art) or "bf16".
    indexer: "pooled" (one pooled key per completed pool + the per-token key/gate of the open pool only:
      what a 262k set of 0.23 GB/device implies) or "full" (per-token key and gate for every position as
      well, the layout of glm53/layers/dsa.py DSACache).
    """

    latent: str = "int8"
    indexer: str = "pooled"
    index_dtype: str = "bf16"
    kda_state_dtype: str = "f32"
    conv_dtype: str = "bf16"
    include_mtp: bool = False

    def __post_init__(self):
        if self.latent not in ("int8", "bf16"):
            raise ValueError(f"cache latent must be 'int8' or 'bf16', got {self.latent!r}")
        if self.indexer not in ("pooled", "full"):
            raise ValueError(f"cache indexer must be 'pooled' or 'full', got {self.indexer!r}")
        for f in ("index_dtype", "kda_state_dtype", "conv_dtype"):
            if getattr(self, f) not in DTYPE_BYTES:
                raise ValueError(f"cache {f} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, f)!r}")


def context_set_bytes(
    cfg: ModelConfig, context: int, devices: int, layout: CacheLayout = CacheLayout()
) -> dict:
    """Bytes ONE device holds for one stream of `context` tokens, per cache component (the worst-loaded
    device)."""
    if context < 1 or devices < 1:
        raise ValueError(f"context and devices must be >= 1, got {context}, {devices}")
    n_kda = cfg.num_kda_layers
    dsa = [i for i, t in enumerate(cfg.layer_types) if t == "dsa"]
    mtp = int(layout.include_mtp and cfg.num_nextn_predict_layers > 0)
    n_dsa = len(dsa) + mtp
    n_idx = sum(cfg.indexer_types[i] == "full" for i in dsa) + mtp  # "shared" layers keep no indexer cache
    kp, c, d = cfg.index_kpool, cfg.index_head_dim, cfg.linear_head_dim
    pools = -(-context // kp)
    pools_dev = -(-pools // devices)  # pool p on device p mod devices
    tokens_dev = pools_dev * kp
    heads_dev = -(-cfg.linear_num_heads // devices)
    ib = DTYPE_BYTES[layout.index_dtype]
    latent_row = cfg.kv_lora_rank + INT8_SCALE_BYTES if layout.latent == "int8" else 2 * cfg.kv_lora_rank
    keys_gates_rows = tokens_dev if layout.indexer == "full" else kp  # "pooled": the open pool's members only
    conv_rows = cfg.linear_conv_kernel_dim - 1  # last K-1 pre-conv inputs of q | k | v
    return dict(
        kda_state=n_kda * heads_dev * d * d * DTYPE_BYTES[layout.kda_state_dtype],
        kda_conv=n_kda * conv_rows * 3 * heads_dev * d * DTYPE_BYTES[layout.conv_dtype],
        mla_latent=n_dsa * tokens_dev * latent_row,
        indexer_pooled_keys=n_idx * pools_dev * c * ib,
        indexer_keys_gates=n_idx * keys_gates_rows * 2 * c * ib,
    )


# ---------------------------------------------------------------------------------------------- budget
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "layer_types",
    "mlp_layer_types",
    "indexer_types",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "linear_num_heads",
    "linear_head_dim",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_kpool",
    "hc_mult",
)


def is_release_shape(cfg: ModelConfig) -> bool:
    """True when every shape field equals the release model's (ModelConfig defaults) and a vision tower is
    set."""
    ref = ModelConfig()
    return cfg.vision is not None and all(getattr(cfg, f) == getattr(ref, f) for f in _SHAPE_FIELDS)


def _gb(x: float) -> float:
    return x / GB


def _row(name: str, ours, ref, decimals: int | None, why_differs: str, unit: str = "") -> dict:
    if ref is None:
        agrees = None
    elif decimals is None:
        agrees = ours == ref
    else:  # within one unit of the reference's last printed digit (it may be rounded or truncated)
        agrees = abs(ours - ref) < 10.0**-decimals
    why = "matches at the printed precision" if agrees else why_differs
    return dict(quantity=name, ours=ours, reference=ref, unit=unit, decimals=decimals, agrees=agrees, why=why)


def memory_budget(
    cfg: ModelConfig,
    experts: str = "ud_iq3_xxs",
    devices: int = 8,
    hbm_gb: float = 16.9,
    context: int = 262144,
    streams: int = 3,
    *,
    layout: str = "planes",
    cache: CacheLayout = CacheLayout(),
    vision: bool = True,
    workspace_gb: float | None = None,
    ladder: bool = False,
) -> dict:
    """The per-device memory budget (bytes) as a JSON-able dict; see the module docstring."""
    if devices < 1 or streams < 0 or hbm_gb <= 0:
        raise ValueError(f"need devices >= 1, streams >= 0, hbm_gb > 0; got {devices}, {streams}, {hbm_gb}")
    counts = param_counts(cfg)
    label, mix = expert_mix(cfg, experts)
    try:
        mb = expert_bytes(cfg, mix, devices, layout)
    except ValueError as e:
        raise ValueError(f"--experts={experts} --devices={devices} --layout={layout}: {e}") from None
    by_class = non_expert_by_class(cfg, devices)
    non_expert = sum(r["bytes_per_device"] for r in by_class.values())
    # The article's rule: 1 byte per parameter, split evenly.
    flat_int8 = counts["non_expert_params"] / devices
    vision_dev = counts["vision_params"] * DTYPE_BYTES[VISION_STORAGE.dtype] // devices if vision else 0
    ctx = context_set_bytes(cfg, context, devices, cache)
    ctx_total = sum(ctx.values())
    weights = mb.per_device + non_expert + vision_dev

    # Workspace: what the prior art's measured 15.4 GB/device leaves after the weights we itemise (same
    # shapes, UD-IQ3_XXS planes, 8 devices, vision loaded). That measurement cannot include context sets:
    # experts + non-expert int8 alone are ~14.96 GB, and three 0.23 GB sets would already exceed 15.4.
    ref_setup = is_release_shape(cfg) and devices == PRIOR_ART_DEVICES
    if ref_setup:
        ud = expert_bytes(cfg, dict(qbudget.UD_IQ3_XXS), PRIOR_ART_DEVICES).per_device
        vis8 = counts["vision_params"] * DTYPE_BYTES[VISION_STORAGE.dtype] // PRIOR_ART_DEVICES
        itemised_ref = ud + non_expert + vis8
        article_sum = ud + flat_int8 + vis8
        residual = REFERENCE["hbm_used_gb"] * GB - itemised_ref
    if workspace_gb is not None:
        workspace, ws_source = round(workspace_gb * GB), "--workspace_gb"
    elif ref_setup:
        workspace = max(0, int(residual))
        ws_source = (
            f"prior-art residual: its measured {REFERENCE['hbm_used_gb']} GB/device minus the "
            f"{_gb(itemised_ref):.3f} GB of weights itemised here (XLA's own footprint)"
        )
    else:
        workspace, ws_source = 0, "no prior-art measurement for these shapes / devices: pass --workspace_gb"

    hbm = round(hbm_gb * GB)
    rest = non_expert + vision_dev + workspace
    total = mb.per_device + rest + streams * ctx_total
    free_for_ctx = hbm - (mb.per_device + rest)
    max_streams = max(0, free_for_ctx // ctx_total) if ctx_total else None
    out = dict(
        config=dict(
            devices=devices,
            hbm_gb=hbm_gb,
            context=context,
            streams=streams,
            experts=experts,
            experts_label=label,
            layout=layout,
            vision=vision,
            cache=dataclasses.asdict(cache),
        ),
        **counts,
        routed_gguf_bytes=mb.gguf,
        routed_planes_bytes=mb.total,
        routed_gguf_bytes_per_device=mb.gguf // devices,
        routed_planes_bytes_per_device=mb.per_device,
        routed_planes_growth_bytes=mb.growth,
        routed_formats=mb.counts,
        routed_bits_per_weight=8 * mb.gguf / counts["routed_expert_params"],
        non_expert_bytes_per_device=non_expert,
        non_expert_int8_flat_bytes_per_device=flat_int8,
        non_expert_per_device_by_class=by_class,
        vision_bytes_per_device=vision_dev,
        context_set_bytes_per_device=ctx_total,
        context_set_by_component=ctx,
        context_set_alternatives={
            name: sum(context_set_bytes(cfg, context, devices, lay).values())
            for name, lay in (
                ("latent_bf16", dataclasses.replace(cache, latent="bf16")),
                ("indexer_full", dataclasses.replace(cache, indexer="full")),
                ("glm53_dsacache_bf16", CacheLayout(latent="bf16", indexer="full", index_dtype="bf16")),
            )
        },
        workspace_bytes_per_device=workspace,
        workspace_source=ws_source,
        per_device=dict(
            routed_experts=mb.per_device,
            non_expert=non_expert,
            vision=vision_dev,
            caches=streams * ctx_total,
            workspace=workspace,
        ),
        per_device_weights_bytes=weights,
        per_device_total_bytes=total,
        hbm_bytes_per_device=hbm,
        headroom_bytes=hbm - total,
        fits=total <= hbm,
        max_streams=max_streams,
        storage_rules={k: dataclasses.asdict(v) for k, v in STORAGE.items()}
        | {"vision": dataclasses.asdict(VISION_STORAGE)},
        not_loaded=dict(
            mtp_params=counts["mtp_params"],
            why="the MTP block (layer 45) is not served by the prior art (its cache only with --mtp_cache)",
        ),
        assumptions=_assumptions(cache, ws_source, layout),
    )
    if ref_setup and experts == "ud_iq3_xxs" and layout == "planes":
        out["article_reconstruction"] = dict(
            weights_bytes_per_device=article_sum,
            residual_bytes_per_device=REFERENCE["hbm_used_gb"] * GB - article_sum,
        )
        out["comparison"] = _comparison(out, article_sum, itemised_ref, residual)
    if ladder:
        out["ladder"] = ladder_table(cfg, devices, hbm, rest, ctx_total, streams, layout)
    return out


def _assumptions(cache: CacheLayout, workspace_source: str, layout: str) -> list[str]:
    return [
        "GB = 1e9 bytes.",
        f"Routed experts: {layout} (glm53/quant/planes.py, reencode.py); gate/up split by output rows, "
        "down by input blocks.",
        "Non-expert weights: the STORAGE table (int8 + f32 per-channel scales for matrices, split over "
        "devices; router, mHC fn in bf16 and norms / mHC base+scale / router bias in f32, replicated; KDA "
        "conv / dt_bias / A_log f32 split by head).",
        "Vision tower: bf16, split evenly over devices (as the article computes 0.141 GB/device).",
        f"Caches per context set: KDA state {cache.kda_state_dtype} + conv {cache.conv_dtype} split by "
        f"head; MLA latent {cache.latent}{' + f32 per-token scale' if cache.latent == 'int8' else ''}, "
        f"indexer {cache.indexer} ({cache.index_dtype}), sequence-sharded by pool (pool p on device p mod "
        "devices).",
        "MTP block weights not loaded (the prior art does not serve it); its DSA cache "
        f"{'included' if cache.include_mtp else 'excluded'}.",
        f"Workspace: {workspace_source}. The prior art's measured 15.4 GB/device holds weights and XLA's "
        "footprint, not context sets: experts and non-expert int8 alone are ~14.96 GB.",
    ]


def _comparison(out: dict, article_sum: float, itemised: int, residual: float) -> list[dict]:
    """Rows (quantity, ours, reference, agrees, why) against the article's / prior art's printed figures."""
    r, c = REFERENCE, out
    n = c["config"]["devices"]
    by = c["non_expert_per_device_by_class"]
    replicated_extra = sum(
        v["bytes_per_device"] - v["params"] / n for v in by.values() if v["placement"] == "replicated"
    )
    detail_extra = c["non_expert_bytes_per_device"] - c["non_expert_int8_flat_bytes_per_device"]
    router, mhc_fn = (_gb(by.get(k, {}).get("bytes_per_device", 0)) for k in ("router", "mhc_fn"))
    items = r["routed_planes_gb"] / 8 + r["non_expert_gb_per_device"] + r["vision_gb_per_device"]
    ctx, alt = c["context_set_by_component"], c["context_set_alternatives"]
    shapes = "different config shapes than the release"
    why_non_expert = (
        f"+{_gb(detail_extra):.3f} GB over the article's rule: {_gb(replicated_extra):.3f} GB because the "
        f"router ({router:.3f} GB) and mHC fn ({mhc_fn:.3f} GB) are held whole in bf16 on every device "
        f"(norms, biases in f32) instead of 1/{n} at 1 byte; {_gb(detail_extra - replicated_extra):.3f} GB "
        "for the f32 per-channel int8 scales and the f32 KDA vectors"
    )
    why_sum = (
        f"the article's three itemised figures ({r['routed_planes_gb']}/8 + {r['non_expert_gb_per_device']} "
        f"+ {r['vision_gb_per_device']}) add up to {items:.2f}, as ours do; its {r['weights_gb_per_device']} "
        f"holds {r['weights_gb_per_device'] - _gb(article_sum):.2f} GB it does not itemise"
    )
    why_residual = (
        f"follows from the line above: {r['hbm_used_gb']} - {_gb(article_sum):.2f} (the article subtracts "
        f"its {r['weights_gb_per_device']})"
    )
    why_printed = (
        f"the remaining {_gb(residual):.3f} GB of the printed figure is taken as workspace (XLA's footprint)"
    )
    detail_ctx = (
        f"KDA state {_gb(ctx['kda_state']):.4f} + conv {_gb(ctx['kda_conv']):.4f} + MLA latent "
        f"{_gb(ctx['mla_latent']):.4f} + pooled keys {_gb(ctx['indexer_pooled_keys']):.4f} + open-pool "
        f"keys/gates {_gb(ctx['indexer_keys_gates']):.6f} GB; per-token keys and gates at full length would "
        f"make it {_gb(alt['indexer_full']):.3f} GB, a bf16 latent {_gb(alt['latent_bf16']):.3f} GB"
    )
    rows = [  # (quantity, ours, reference, decimals, why it would differ, unit)
        ("total parameters", c["total_params"], r["total_params"], None, shapes, "params"),
        ("routed-expert parameters", c["routed_expert_params"], r["routed_expert_params"], None, shapes,
         "params"),
        ("routed-expert share", 100 * c["routed_expert_share"], r["routed_expert_share_pct"], 1, shapes, "%"),
        ("routed experts as GGUF blocks", _gb(c["routed_gguf_bytes"]), r["routed_gguf_gb"], 2,
         "the expert table differs from UD-IQ3_XXS", "GB"),
        ("routed experts as planes (all devices)", _gb(c["routed_planes_bytes"]), r["routed_planes_gb"], 2,
         "different plane padding", "GB"),
        ("plane growth per device", c["routed_planes_growth_bytes"] / n / 1e6,
         r["planes_growth_mb_per_device"], 0, "different plane padding", "MB"),
        ("non-expert parameters", c["non_expert_params"] / 1e9, r["non_expert_params_b"], 3, shapes, "B"),
        ("non-expert per device, 1 byte/param split evenly (article rule)",
         _gb(c["non_expert_int8_flat_bytes_per_device"]), r["non_expert_gb_per_device"], 2, shapes, "GB"),
        ("non-expert per device, per-class rule (STORAGE)", _gb(c["non_expert_bytes_per_device"]),
         r["non_expert_gb_per_device"], 2, why_non_expert, "GB"),
        ("vision parameters", c["vision_params"] / 1e9, r["vision_params_b"], 3, "different vision config",
         "B"),
        ("vision per device (bf16)", _gb(c["vision_bytes_per_device"]), r["vision_gb_per_device"], 3,
         "vision tower not loaded (--novision)", "GB"),
        ("weights per device, article method (planes + 1 B/param + vision)", _gb(article_sum),
         r["weights_gb_per_device"], 2, why_sum, "GB"),
        ("prior art's printed use minus the article-method weights (residual)",
         r["hbm_used_gb"] - _gb(article_sum), r["residual_gb"], 2, why_residual, "GB"),
        ("weights per device, per-class rule", _gb(itemised), r["hbm_used_gb"], 1, why_printed, "GB"),
        ("one 262k-token context set per device", _gb(c["context_set_bytes_per_device"]),
         r["context_set_gb_per_device"], 2, "cache layout differs from the prior art's", "GB"),
    ]  # fmt: skip
    out_rows = [_row(*row) for row in rows]
    out_rows[-1]["detail"] = detail_ctx
    return out_rows


def ladder_table(
    cfg: ModelConfig, devices: int, hbm: int, rest: int, ctx: int, streams: int, layout: str
) -> list:
    """One row per expert mix: GGUF GB, bits/weight, experts per device, total per device, fits, max
    streams."""
    rows = []
    for name in expert_mix_names():
        try:
            label, mix = expert_mix(cfg, name)
            mb = expert_bytes(cfg, mix, devices, layout)
        except ValueError as e:
            rows.append(dict(name=name, error=str(e)))
            continue
        n_weights = sum(
            math.prod(
                qbudget.expert_shape(m, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
            )
            for (_, m) in mix
        )
        total = mb.per_device + rest + streams * ctx
        rows.append(
            dict(
                name=name,
                label=label,
                gguf_bytes=mb.gguf,
                bits_per_weight=8 * mb.gguf / n_weights,
                experts_bytes_per_device=mb.per_device,
                total_bytes_per_device=total,
                fits=total <= hbm,
                experts_alone_fit=mb.per_device <= hbm,
                max_streams=max(0, (hbm - mb.per_device - rest) // ctx) if ctx else None,
            )
        )
    return sorted(rows, key=lambda r: r.get("experts_bytes_per_device", math.inf))
