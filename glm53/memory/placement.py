"""Where the memory budget puts each tensor: a named placement is a rule set of `glm53.parallel.rules` (and, for
the prior art, a second one for the int8 matrices the first leaves whole), applied on the default mesh
("data" 1 x "model" `devices`, abstract: no device is needed).

  "prior_art"  the layout of the prior art whose measurement the budget is compared with
               (`glm53.memory.prior_art`): MLA latent / indexer caches sequence-sharded by pool, the KDA conv
               state split by channel, the low-rank down-projections split along their output axis.
  "tp", "ep"   what the model runs with `config.mesh.rules` = "tp" | "ep": the MLA latent / pooled indexer
               caches sequence-sharded too (glm53/parallel/dsa.py), the low-rank down-projections and the KDA
               conv state replicated over "model".
"""

from __future__ import annotations

import dataclasses

from jax.sharding import AbstractMesh

from glm53.config.mesh import MeshConfig
from glm53.memory import prior_art
from glm53.parallel.rules import EP_RULES, TP_RULES, Rules

DTYPE_BYTES = {"int8": 1, "bf16": 2, "f32": 4}  # the element dtypes the budget stores tensors in
INT8_SCALE_BYTES = 4  # f32 scale per output channel (glm53/quant/int8.py Int8Weight) or per cached token


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the budget puts each tensor: by `rules`; an int8 matrix `rules` leaves whole by `whole_matrices`
    instead, when given."""

    name: str
    rules: Rules
    whole_matrices: Rules | None
    note: str


PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in (
        Placement(
            "prior_art",
            prior_art.PRIOR_ART_RULES,
            prior_art.PRIOR_ART_LOW_RANK_RULES,
            "the prior art's layout: caches sequence-sharded, low-rank down-projections split by output",
        ),
        Placement("tp", TP_RULES, None, "the model's tp rules: caches sequence-sharded, low-rank projections and conv state replicated"),
        Placement("ep", EP_RULES, None, "the model's ep rules: whole experts per device, otherwise as tp"),
    )
}


def get_placement(placement: str | Placement) -> Placement:
    """A placement by name (a key of `PLACEMENTS`) or as given."""
    if isinstance(placement, Placement):
        return placement
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {sorted(PLACEMENTS)}")
    return PLACEMENTS[placement]


def budget_mesh(devices: int) -> AbstractMesh:
    """The default mesh (`MeshConfig`: "data" 1 x "model" `devices`), abstract."""
    m = MeshConfig()
    return AbstractMesh(m.resolved_shape(devices), m.axes)
