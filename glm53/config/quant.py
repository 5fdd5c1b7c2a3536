"""The ``quant`` section of an experiment config: how routed experts are stored (which kernel runs them is the
``kernels`` section: `glm53.config.kernels.KernelConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from glm53.config.fields import field_error as _err
from glm53.config.fields import from_dict, to_plain
from glm53.quant.mixes import LAYOUTS, MATRICES, ExpertMix, parse_mix


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Routed-expert storage (the ``quant`` section of an experiment config; the expert kernel is `kernels.moe`).

    experts: a mix spec of `glm53.quant.mixes.parse_mix`: "none" (dense experts), "ud_iq3_xxs" (Unsloth's
      UD-IQ3_XXS, scaled to the model's MoE layers), a GGUF format for every expert matrix ("IQ4_XS", "q4_k",
      "BF16", ...), one format per matrix ("gate=IQ2_S,up=IQ2_S,down=IQ3_S" or a mapping), and per-layer
      overrides ("ud_iq3_xxs,44.down=Q4_K"). Normalized: "none", "ud_iq3_xxs", an upper case format name, a
      tuple of (matrix, format) pairs in gate/up/down order, or else the mix's spec string.
    layout: "planes" (GGUF bytes as planes) | "reencoded" (IQ2_S / IQ3_S gather-free; other formats as planes).
    decode_max_slots: routed slots (tokens x top-k) up to which a step counts as decode, above as prefill (for the
      expert implementations with both forms, `kernels.moe.api.select_implementation`).
    """

    experts: Any = "none"
    layout: str = "planes"
    decode_max_slots: int = 64

    def __post_init__(self):
        object.__setattr__(self, "experts", _normalized(parse_mix(self.experts, "quant.experts")))
        if self.layout not in LAYOUTS:
            raise _err("quant.layout", f"unknown layout {self.layout!r}; expected one of {list(LAYOUTS)}")
        v = self.decode_max_slots
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _err("quant.decode_max_slots", f"must be a non-negative integer, got {v!r}")

    @property
    def quantized(self) -> bool:
        return self.experts != "none"

    @property
    def mix(self) -> ExpertMix | None:
        """The routed-expert mix (None: dense experts)."""
        return parse_mix(self.experts, "quant.experts")


def _normalized(mix: ExpertMix | None) -> Any:
    """The `experts` value a QuantConfig keeps for `mix` (see QuantConfig)."""
    if mix is None:
        return "none"
    if not mix.ud and not mix.overrides and len(set(mix.base.values())) > 1:
        return tuple((m, mix.base[m]) for m in MATRICES)
    return mix.spec


def quant_config_from_dict(d: Any) -> QuantConfig:
    """Builds a QuantConfig from the ``quant`` ConfigDict / dict; unknown keys are an error (``moe_impl``, the
    expert kernel of older configs, names its new home: ``kernels.moe``)."""
    plain = to_plain(d)
    if isinstance(plain, dict) and "moe_impl" in plain:
        raise _err("quant.moe_impl", f"the expert kernel moved to the kernels section: set kernels.moe="
                   f"{plain['moe_impl']!r} (--config.kernels.moe=...) and drop quant.moe_impl")  # fmt: skip
    return from_dict(QuantConfig, plain, "quant config")
