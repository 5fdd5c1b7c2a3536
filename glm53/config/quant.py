"""The ``quant`` section of an experiment config: how routed experts are stored and which kernel runs them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from glm53.config.fields import field_error as _err
from glm53.config.fields import from_dict

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


def quant_config_from_dict(d: Any) -> QuantConfig:
    """Builds a QuantConfig from the ``quant`` ConfigDict / dict; unknown keys are an error."""
    return from_dict(QuantConfig, d, "quant config")
