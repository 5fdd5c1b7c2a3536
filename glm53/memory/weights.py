"""Per-device bytes of the weights: every parameter of the abstract model (`param_inventory`: shape and logical
axes) stored as its tensor class says (`STORAGE`) and split as a placement's rules say (`glm53.memory.placement`);
the routed experts as GGUF planes (`glm53.quant.budget`). A dimension its mesh axes do not divide is counted
whole."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from glm53 import dims
from glm53.config import ModelConfig
from glm53.memory.inventory import Tensor, param_inventory, tensor_class
from glm53.memory.placement import (
    DTYPE_BYTES,
    INT8_SCALE_BYTES,
    Placement,
    budget_mesh,
    get_placement,
)
from glm53.parallel.rules import Rules, axis_size, logical_to_spec
from glm53.quant import budget as qbudget
from glm53.quant.formats import get_format
from glm53.quant.int8 import Int8Rows, Int8Weight
from glm53.quant.qweight import QuantizedExperts
from glm53.quant.reencode import REENCODED


@dataclasses.dataclass(frozen=True)
class Storage:
    """How one tensor class is held on device: element dtype (where it goes is the placement's)."""

    dtype: str
    note: str


# The one per-tensor-class rule (prior art: "everything else from the FP8 checkpoint at int8 per channel;
# norms, routers, mHC in fp32/bf16"). bf16 where the checkpoint keeps a tensor in bf16; f32 where transformers
# keeps it in f32 (_keep_in_fp32_modules_strict) or where it is a norm weight (tiny).
STORAGE: dict[str, Storage] = {
    "embedding": Storage("int8", "int8 + f32 scale per vocabulary row"),
    "lm_head": Storage("int8", "int8 + f32 scale per vocabulary column"),
    "attention": Storage("int8", "KDA / MLA projections, int8 + f32 scale per output channel"),
    "indexer": Storage("int8", "indexer projections, int8 + f32 scale per output channel"),
    "dense_mlp": Storage("int8", "layers 0-2 SwiGLU, int8 + f32 scale per output channel"),
    "shared_experts": Storage("int8", "shared expert, int8 + f32 scale per output channel"),
    "mtp_fusion": Storage("int8", "MTP eh_proj, int8 + f32 scale per output channel"),
    "kda_vectors": Storage("f32", "KDA conv weights, dt_bias, A_log (kept f32)"),
    "indexer_ape": Storage("bf16", "indexer pool position embedding"),
    "mhc_fn": Storage("bf16", "mHC mixing projection"),
    "mhc_vectors": Storage("f32", "mHC base and scale (kept f32)"),
    "router": Storage("bf16", "router kernel"),
    "router_bias": Storage("f32", "e_score_correction_bias (kept f32)"),
    "norms": Storage("f32", "RMSNorm / LayerNorm weights and biases"),
}
# The vision tower is not ported (no module tree, no logical axes): bf16 split evenly, the article's rule.
VISION_STORAGE = Storage("bf16", "vision tower at bf16 split evenly (the article's rule)")


_JNP_DTYPES = {"int8": jnp.int8, "bf16": jnp.bfloat16, "f32": jnp.float32}


def storage_value(path: str, value, dtype=jnp.bfloat16):
    """Parameter `path`'s abstract value (a ShapeDtypeStruct) as STORAGE holds it: a matrix of an int8 class as
    `Int8Weight` (f32 scale per output channel), the embedding as `Int8Rows` (f32 scale per vocabulary row), both
    dequantizing to `dtype`; any other class in its dtype. Routed experts (no STORAGE class) come back as they
    are. What glm53/benchmarks/compile_tpu.py compiles, so that its bytes are the budget's."""
    cls = tensor_class(path)
    if isinstance(value, QuantizedExperts) or cls not in STORAGE:
        return value
    kind = STORAGE[cls].dtype
    if kind != "int8":
        return jax.ShapeDtypeStruct(value.shape, _JNP_DTYPES[kind])
    values = jax.ShapeDtypeStruct(value.shape, jnp.int8)
    if cls == "embedding" and len(value.shape) == 2:  # a lookup table: one scale per row (vocabulary entry)
        return Int8Rows(values, jax.ShapeDtypeStruct(value.shape[:1], jnp.float32), np.dtype(dtype))
    if len(value.shape) < 2:
        raise ValueError(f"{path}: tensor class {cls!r} is stored int8 but {value.shape} is not a matrix")
    return Int8Weight(
        values, jax.ShapeDtypeStruct((*value.shape[:-2], value.shape[-1]), jnp.float32), np.dtype(dtype)
    )


def _held(shape, axes, rules: Rules, mesh: AbstractMesh) -> tuple[int, bool]:
    """(elements one device holds of a tensor with logical `axes` under `rules`, whether a dimension was kept
    whole because its mesh axes do not divide it)."""
    logical_to_spec(axes, rules)  # ShardingError on a collision
    n = [axis_size(mesh, rules.mesh_axes(a)) for a in axes]
    indivisible = any(s % k for s, k in zip(shape, n))
    return math.prod(s // k if s % k == 0 else s for s, k in zip(shape, n)), indivisible


def tensor_rules(axes, dtype: str, placement: str | Placement) -> Rules:
    """The rule set a tensor with logical `axes` stored as `dtype` ("int8" | "bf16" | "f32") is split by under
    `placement`: its `rules`, or `whole_matrices` for an int8 tensor that `rules` leaves whole (the prior art's
    low-rank split). The compiled model places its parameters with this too (glm53/benchmarks/compile_tpu.py)."""
    placement = get_placement(placement)
    whole = not any(placement.rules.mesh_axes(a) for a in axes)
    if whole and dtype == "int8" and placement.whole_matrices is not None:
        return placement.whole_matrices
    return placement.rules


def _rules_for(t: Tensor, storage: Storage, placement: Placement) -> Rules:
    return tensor_rules(t.axes, storage.dtype, placement)


def tensor_device_bytes(
    t: Tensor, storage: Storage, placement: Placement, mesh: AbstractMesh
) -> tuple[int, bool]:
    """(bytes one device holds of `t` stored as `storage`, whether a dimension stayed whole as indivisible)."""
    rules = _rules_for(t, storage, placement)
    n, indivisible = _held(t.shape, t.axes, rules, mesh)
    nbytes = n * DTYPE_BYTES[storage.dtype]
    if storage.dtype == "int8":  # scales per output channel, per row for the embedding (a lookup table)
        keep = [0] if t.axes[:1] == (dims.VOCAB,) else [*range(len(t.shape) - 2), len(t.shape) - 1]
        n_scales, _ = _held([t.shape[i] for i in keep], [t.axes[i] for i in keep], rules, mesh)
        nbytes += n_scales * INT8_SCALE_BYTES
    return nbytes, indivisible


def non_expert_by_class(cfg: ModelConfig, devices: int, placement: str | Placement = "prior_art") -> dict:
    """{class: {params, dtype, placement, bytes_per_device, replicated_fallbacks}} over trunk + lm_head,
    routed experts and the MTP block excluded. placement: "split" (every tensor of the class), "replicated"
    (none) or "partly split"; replicated_fallbacks: tensors with a dimension kept whole as indivisible."""
    p, mesh = get_placement(placement), budget_mesh(devices)
    out: dict[str, dict] = {}
    for t in param_inventory(cfg, with_mtp=False):
        cls = tensor_class(t.path)
        if cls == "routed_experts":
            continue
        st = STORAGE[cls]
        nbytes, indivisible = tensor_device_bytes(t, st, p, mesh)
        split = _held(t.shape, t.axes, _rules_for(t, st, p), mesh)[0] < t.size
        row = out.setdefault(cls, dict(params=0, dtype=st.dtype, bytes_per_device=0, replicated_fallbacks=0,
                                       n_split=0, n_whole=0))  # fmt: skip
        row["params"] += t.size
        row["bytes_per_device"] += nbytes
        row["replicated_fallbacks"] += int(indivisible)
        row["n_split" if split else "n_whole"] += 1
    for row in out.values():
        split, whole = row.pop("n_split"), row.pop("n_whole")
        row["placement"] = "replicated" if not split else "split" if not whole else "partly split"
    return dict(sorted(out.items()))


def expert_bytes(
    cfg: ModelConfig,
    mix: dict,
    devices: int,
    layout: str = "planes",
    placement: str | Placement = "prior_art",
) -> qbudget.MixBytes:
    """GGUF and per-device plane bytes of a routed-expert mix {(layer, matrix): format}, each matrix split as
    its logical axes say under the placement's rules: a kernel [E, in, out] is held as planes [E, words (input
    blocks), rows (outputs)] (glm53/quant/budget.py), so its output axis splits rows, its input axis blocks."""
    if layout not in qbudget.LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {qbudget.LAYOUTS}")
    rules, mesh = get_placement(placement).rules, budget_mesh(devices)
    axes = {t.path: t.axes for t in param_inventory(cfg)}
    gguf = per_dev = 0
    by_format: dict[str, int] = {}
    counts: dict[str, int] = {}
    for (layer, matrix), name in sorted(mix.items()):
        f = get_format(name)
        path = f"layers.{layer}.mlp.experts.{matrix}_proj"
        if path not in axes:
            raise ValueError(
                f"expert mix: layer {layer} has no routed experts (config field mlp_layer_types)"
            )
        n_e, n_in, n_out = (axis_size(mesh, rules.mesh_axes(a)) for a in axes[path])
        e, rows, cols = qbudget.expert_shape(
            matrix, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        )
        split = ("rows", n_out) if n_out > 1 else ("blocks", n_in) if n_in > 1 else None
        lay = "reencoded" if layout == "reencoded" and f.name in REENCODED else "planes"
        try:
            if e % n_e:
                raise ValueError(f"{e} experts do not split into {n_e} equal parts")
            dev = qbudget.plane_nbytes((e // n_e, rows, cols), f, split, lay)
        except ValueError as err:
            raise ValueError(f"layer {layer} {matrix} ({f.name}): {err}") from None
        gguf += qbudget.gguf_nbytes((e, rows, cols), f)
        per_dev += dev
        by_format[f.name] = by_format.get(f.name, 0) + dev * devices
        counts[f.name] = counts.get(f.name, 0) + 1
    return qbudget.MixBytes(gguf, per_dev, per_dev * devices, devices, layout, by_format, counts)
