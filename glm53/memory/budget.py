"""Per-device HBM budget of GLM-5.3-Flash served with GGUF routed experts, from shapes and sharding rules only.

`memory_budget(cfg, experts=..., devices=..., hbm_gb=..., context=..., streams=...)` returns, per device: the
routed experts (GGUF blocks as planes) and the non-expert weights (glm53/memory/weights.py), the vision tower,
the caches of `streams` context sets (glm53/memory/caches.py), a workspace, the total and the headroom; plus the
parameter counts (glm53/memory/inventory.py), a comparison with the prior art and its audit article that says
why a figure differs (glm53/memory/prior_art.py), and optionally a ladder of expert quantizations and whether
each fits. Nothing is allocated.

Every tensor is placed as the logical axes of the model's parameters and caches say under a named placement
(glm53/memory/placement.py): the model's own "tp" / "ep" rules or "prior_art" (the layout the prior art
measured). The headline (`placement`, default: `mesh_rules`, the rule set the experiment runs with, config
field ``mesh.rules``) is the one the code runs unless another is asked for; `placements` in the result gives the
per-device totals under every placement, each row's `roles` saying which is the headline, the run's and the
prior art's. The comparison with the article is always made under the prior art's placement.
"""

from __future__ import annotations

import dataclasses
import math

from glm53.config import ModelConfig
from glm53.config.mesh import MeshConfig
from glm53.memory import prior_art
from glm53.memory.caches import CacheLayout, context_set_bytes
from glm53.memory.inventory import param_counts
from glm53.memory.placement import DTYPE_BYTES, PLACEMENTS, Placement, get_placement
from glm53.memory.weights import STORAGE, VISION_STORAGE, expert_bytes, non_expert_by_class
from glm53.quant import budget as qbudget
from glm53.quant.mixes import (
    IQ4_XS_DOWN_LAYERS,
    RELEASE_MOE_LAYERS,
    UD_IQ3_XXS,
    UD_IQ3_XXS_NAME,
    ExpertMix,
    parse_mix,
)

GB = qbudget.GB  # 1e9 bytes: the unit of the article and of sizes on the Hub
PRIOR_ART = "prior_art"  # the placement the article's figures were measured under


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
# layers glm53.quant.mixes.IQ4_XS_DOWN_LAYERS). These are NOT Unsloth's other builds, whose tables we have not
# read.
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


def _ud_like(gate_up: str, down: str, boost: str) -> ExpertMix:
    return ExpertMix(gate_up, gate_up, down, tuple((layer, "down", boost) for layer in IQ4_XS_DOWN_LAYERS))


def expert_mix_names() -> list[str]:
    """Names accepted by `expert_mix` / --experts."""
    return (
        [UD_IQ3_XXS_NAME]
        + [f.lower() for f in LADDER_UNIFORM]
        + [f"udlike_{g}_{d}_{b}".lower() for g, d, b in LADDER_UD_LIKE]
    )


def expert_mix(cfg: ModelConfig, name: str) -> tuple[str, dict]:
    """(label, {(layer, "gate" | "up" | "down"): GGUF format}) for a mix name of `expert_mix_names()` or any
    other spec of `glm53.quant.mixes.parse_mix`."""
    moe = _moe_layers(cfg)
    key = name.strip().lower()
    for g, d, b in LADDER_UD_LIKE:
        if key == f"udlike_{g}_{d}_{b}".lower():
            layers = ",".join(str(x) for x in IQ4_XS_DOWN_LAYERS)
            return f"UD-like {g}/{d} ({b} down in {layers})", _ud_like(g, d, b).formats(moe)
    try:
        mix = parse_mix(name, f"--experts={name!r}")
    except ValueError as e:
        raise ValueError(f"unknown expert mix: {e}; the ladder's mixes are {expert_mix_names()}") from None
    if mix is None:
        raise ValueError(f"--experts={name!r}: unknown expert mix (no quantized experts to count)")
    if mix.ud and moe != RELEASE_MOE_LAYERS:
        raise ValueError(
            f"--experts={name!r}: the UD-IQ3_XXS table covers MoE layers {RELEASE_MOE_LAYERS[0]}.."
            f"{RELEASE_MOE_LAYERS[-1]} but config field mlp_layer_types has MoE layers {list(moe)}"
        )
    if mix.spec == UD_IQ3_XXS_NAME:
        label = "UD-IQ3_XXS (Unsloth mix)"
    elif mix.spec == mix.gate:
        label = f"{mix.gate} uniform"
    else:
        label = mix.spec
    return label, mix.formats(moe)


# ---------------------------------------------------------------------------------------------- budget
def memory_budget(
    cfg: ModelConfig,
    experts: str = "ud_iq3_xxs",
    devices: int = 8,
    hbm_gb: float = 16.9,
    context: int = 262144,
    streams: int = 3,
    *,
    placement: str | Placement | None = None,
    mesh_rules: str = MeshConfig().rules,
    layout: str = "planes",
    cache: CacheLayout | None = None,
    vision: bool = True,
    workspace_gb: float | None = None,
    ladder: bool = False,
) -> dict:
    """The per-device memory budget (bytes) as a JSON-able dict; see the module docstring. `placement` (None:
    `mesh_rules`) is the headline; `mesh_rules` names the placement the experiment runs (config ``mesh.rules``)."""
    if devices < 1 or streams < 0 or hbm_gb <= 0:
        raise ValueError(f"need devices >= 1, streams >= 0, hbm_gb > 0; got {devices}, {streams}, {hbm_gb}")
    run_place = get_placement(mesh_rules)
    place = run_place if placement is None else get_placement(placement)
    cache = CacheLayout() if cache is None else cache
    counts = param_counts(cfg)
    label, mix = expert_mix(cfg, experts)
    try:
        mb = expert_bytes(cfg, mix, devices, layout, place)
    except ValueError as e:
        raise ValueError(f"--experts={experts} --devices={devices} --layout={layout}: {e}") from None
    by_class = non_expert_by_class(cfg, devices, place)
    non_expert = sum(r["bytes_per_device"] for r in by_class.values())
    # The article's rule: 1 byte per parameter, split evenly.
    flat_int8 = counts["non_expert_params"] / devices
    vision_dev = counts["vision_params"] * DTYPE_BYTES[VISION_STORAGE.dtype] // devices if vision else 0
    ctx = context_set_bytes(cfg, context, devices, cache, place)
    ctx_total = sum(ctx.values())
    weights = mb.per_device + non_expert + vision_dev

    # Workspace: what the prior art's measured 15.4 GB/device leaves after the weights we itemise under its
    # layout (same shapes, UD-IQ3_XXS planes, 8 devices, vision loaded). That measurement cannot include context
    # sets: experts + non-expert int8 alone are ~14.96 GB, and three 0.23 GB sets would already exceed 15.4.
    ref_setup = prior_art.is_release_shape(cfg) and devices == prior_art.PRIOR_ART_DEVICES
    if ref_setup:
        n_ref = prior_art.PRIOR_ART_DEVICES
        ud = expert_bytes(cfg, UD_IQ3_XXS, n_ref).per_device
        vis8 = counts["vision_params"] * DTYPE_BYTES[VISION_STORAGE.dtype] // n_ref
        ne_ref = sum(r["bytes_per_device"] for r in non_expert_by_class(cfg, n_ref).values())
        itemised_ref = ud + ne_ref + vis8
        article_sum = ud + flat_int8 + vis8
        residual = prior_art.REFERENCE["hbm_used_gb"] * GB - itemised_ref
    if workspace_gb is not None:
        workspace, ws_source = round(workspace_gb * GB), "--workspace_gb"
    elif ref_setup:
        workspace = max(0, int(residual))
        ws_source = (
            f"prior-art residual: its measured {prior_art.REFERENCE['hbm_used_gb']} GB/device minus the "
            f"{itemised_ref / GB:.3f} GB of weights itemised here under its layout (XLA's own footprint)"
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
            placement=place.name,
            run_placement=run_place.name,
            layout=layout,
            vision=vision,
            cache=dataclasses.asdict(cache),
        ),
        headline_placement=place.name,
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
            name: sum(context_set_bytes(cfg, context, devices, lay, place).values())
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
        placements=placement_table(
            cfg, mix, devices, layout, cache, context, streams, hbm, vision_dev + workspace,
            headline=place.name, run=run_place.name,
        ),
        storage_rules={k: dataclasses.asdict(v) for k, v in STORAGE.items()}
        | {"vision": dataclasses.asdict(VISION_STORAGE)},
        not_loaded=dict(
            mtp_params=counts["mtp_params"],
            why="the MTP block (layer 45) is not served by the prior art (its cache only with --mtp_cache)",
        ),
        assumptions=_assumptions(place, run_place, cache, ws_source, layout),
    )
    if ref_setup and mix == UD_IQ3_XXS and layout == "planes":
        out["article_reconstruction"] = dict(
            weights_bytes_per_device=article_sum,
            residual_bytes_per_device=prior_art.REFERENCE["hbm_used_gb"] * GB - article_sum,
        )
        out["comparison_placement"] = PRIOR_ART
        if place.name == PRIOR_ART:
            out["comparison"] = prior_art.comparison(out, article_sum, itemised_ref, residual)
        else:  # the article measured the prior art's layout: compare under it, whatever the headline
            out["comparison"] = memory_budget(
                cfg, experts, devices, hbm_gb, context, streams, placement=PRIOR_ART, mesh_rules=mesh_rules,
                layout=layout, cache=cache, vision=vision, workspace_gb=workspace_gb,
            )["comparison"]  # fmt: skip
    if ladder:
        out["ladder"] = ladder_table(cfg, devices, hbm, rest, ctx_total, streams, layout, place)
    return out


def placement_table(
    cfg: ModelConfig,
    mix: dict,
    devices: int,
    layout: str,
    cache: CacheLayout,
    context: int,
    streams: int,
    hbm: int,
    fixed: int,
    *,
    headline: str | None = None,
    run: str | None = None,
) -> dict:
    """{placement: per-device bytes (experts, non-expert, one context set, total), fits, max streams, roles} for
    every placement of `PLACEMENTS`; `fixed` (vision + workspace) is the same for all. `roles` lists "headline"
    (the placement `headline`), "run" (`run`: the config's mesh rules) and "prior art" as they apply."""
    rows = {}
    for name, p in PLACEMENTS.items():
        roles = [r for r, n in (("headline", headline), ("run", run), ("prior art", PRIOR_ART)) if n == name]
        try:
            experts = expert_bytes(cfg, mix, devices, layout, p).per_device
            non_expert = sum(r["bytes_per_device"] for r in non_expert_by_class(cfg, devices, p).values())
            ctx = sum(context_set_bytes(cfg, context, devices, cache, p).values())
        except ValueError as e:
            rows[name] = dict(note=p.note, roles=roles, error=str(e))
            continue
        total = experts + non_expert + fixed + streams * ctx
        rows[name] = dict(
            note=p.note,
            roles=roles,
            routed_experts=experts,
            non_expert=non_expert,
            context_set=ctx,
            total=total,
            fits=total <= hbm,
            max_streams=max(0, (hbm - experts - non_expert - fixed) // ctx) if ctx else None,
        )
    return rows


def _assumptions(
    place: Placement, run: Placement, cache: CacheLayout, workspace_source: str, layout: str
) -> list[str]:
    whose = (
        "the rule set the config runs (mesh.rules)"
        if place.name == run.name
        else f"asked for; the config runs {run.name!r}"
    )
    return [
        "GB = 1e9 bytes.",
        f"Placement {place.name!r}, {whose} (glm53/memory/placement.py: {place.note}): every tensor split as its logical "
        f"axes say under rule set {place.rules.name!r}"
        + (
            f", int8 matrices it leaves whole under {place.whole_matrices.name!r}"
            if place.whole_matrices
            else ""
        )
        + "; `placements` gives the totals under the other placements.",
        f"Routed experts: {layout} (glm53/quant/planes.py, reencode.py); a kernel's output axis splits plane "
        "rows, its input axis whole blocks, its expert axis whole experts.",
        "Non-expert weights: the STORAGE table (int8 + f32 per-channel scales for matrices; router, mHC fn in "
        "bf16; norms, mHC base+scale, router bias, KDA conv / dt_bias / A_log in f32).",
        "Vision tower: bf16, split evenly over devices (as the article computes 0.141 GB/device).",
        f"Caches per context set: the model's cache pytree placed by the rules; KDA state "
        f"{cache.kda_state_dtype}, conv {cache.conv_dtype}, MLA latent {cache.latent}"
        f"{' + f32 per-token scale' if cache.latent == 'int8' else ''}, indexer {cache.indexer} "
        f"({cache.index_dtype}).",
        "MTP block weights not loaded (the prior art does not serve it); its DSA cache "
        f"{'included' if cache.include_mtp else 'excluded'}.",
        f"Workspace: {workspace_source}. The prior art's measured 15.4 GB/device holds weights and XLA's "
        "footprint, not context sets: experts and non-expert int8 alone are ~14.96 GB.",
    ]


def ladder_table(
    cfg: ModelConfig,
    devices: int,
    hbm: int,
    rest: int,
    ctx: int,
    streams: int,
    layout: str,
    placement: str | Placement = "prior_art",
) -> list:
    """One row per expert mix: GGUF GB, bits/weight, experts per device, total per device, fits, max
    streams."""
    rows = []
    for name in expert_mix_names():
        try:
            label, mix = expert_mix(cfg, name)
            mb = expert_bytes(cfg, mix, devices, layout, placement)
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
