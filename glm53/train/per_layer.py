"""Per-layer names of a grouped model's values: what training reports to users when `ModelConfig.scan_layers`
stacks layers.

A model's parameters and modules are named by their paths in `model.layers`, a list of *units*
(`glm53.layers.stack`): a plain DecoderLayer, or a LayerStack holding `period` DecoderLayers whose every value has
a leading axis of `repeats`. Unit u is described by `model.groups[u]`, so

    layers.<u>.<rest>              (plain unit)     ->  layers.<group.first>.<rest>
    layers.<u>.period.<j>.<rest>   (stacked, [R, ...]) ->  layers.<group.layer(r, j)>.<rest>, value[r], r < R

names every value after the trunk layer it belongs to, whatever the grouping (with scan_layers off a unit is a
layer and nothing changes). Paths outside the trunk (embed, norm, lm_head, mtp) are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx

from glm53.layers.stack import LayerGroup, layer_paths

Path = tuple


def layer_name(name: str, groups: Sequence[LayerGroup]) -> list[tuple[str, int | None]]:
    """`layer_paths` of a dotted name ("layers.2.period.1.mlp.router" -> [("layers.5.mlp.router", 0), ...])."""
    return [(".".join(map(str, p)), r) for p, r in layer_paths(name.split("."), groups)]


def sort_key(name: str):
    """Trunk layers in order, then everything else (the MTP block last), numbers compared as numbers."""
    parts = [int(p) if p.isdigit() else p for p in name.split(".")]
    return (name.startswith("mtp"), [(0, p, "") if isinstance(p, int) else (1, 0, p) for p in parts])


def expand_names(values: Mapping[str, Any], groups: Sequence[LayerGroup]) -> dict[str, Any]:
    """{per-layer name: value} of {module name: value} (e.g. a train step's ``loads``): a stacked module's value
    [R, ...] becomes R entries, one per trunk layer; sorted by `sort_key`."""
    out = {}
    for name, v in values.items():
        for n, r in layer_name(name, groups):
            out[n] = v if r is None else v[r]
    return {n: out[n] for n in sorted(out, key=sort_key)}


def expand_state(state: nnx.State, groups: Sequence[LayerGroup]) -> dict[Path, Any]:
    """{per-layer path: value} of a model's (or a gradient's) state: stacked leaves sliced per trunk layer, so
    the result of a scanned model equals the unrolled model's `nnx.to_flat_state` (as a dict of values)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        v = var.get_value() if isinstance(var, nnx.Variable) else var
        for p, r in layer_paths(path, groups):
            out[p] = v if r is None else v[r]
    return out
