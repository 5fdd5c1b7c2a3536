"""Checkpoints of scanned models (`ModelConfig.scan_layers`, glm53/layers/stack.py; docs/scan.md, "Checkpoints").

Every checkpoint glm53 reads or writes names per-layer tensors (HF, GGUF and Orbax alike), whatever the layout the
model runs in. A scanned model holds each group of identical layers as one `LayerStack` whose values have a leading
[repeats] axis, at paths ``layers.<u>.period.<j>.<rest>`` (unit u is described by `model.groups[u]`). Its
*per-layer view* names every value after the trunk layer it belongs to:

    layers.<u>.<rest>              (plain unit)          ->  layers.<group.first>.<rest>
    layers.<u>.period.<j>.<rest>   (stacked, [R, ...])   ->  layers.<group.layer(r, j)>.<rest>, value[r], r < R

(paths outside the trunk -- embed, norm, lm_head, mtp -- unchanged). So:

* writers save `per_layer_items` / `per_layer_values`: the unrolled model's paths, in its order, each stacked value
  sliced one layer at a time when it is read (no unrolled copy of the model is made): a scanned model writes the
  files the unrolled one writes;
* loaders build their abstract model from `per_layer_config(cfg)` (scan_layers False), fill it per layer, and
  `restack` the result into the asked layout at the end (`Glm53Model.set_scan_layers`, on device); a scanned
  abstract model handed to a loader is regrouped first (`per_layer_model`). No loader ever sees a stacked path;
* `check_path` turns a stacked path that reaches per-layer code into a CheckpointError naming scan_layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx

from glm53.config import ModelConfig
from glm53.errors import CheckpointError
from glm53.layers import stack
from glm53.layers.param import Path, path_str
from glm53.layers.stack import LayerGroup


def is_scanned(model) -> bool:
    """Whether `model` holds a stacked group (a LayerStack) of layers."""
    return any(g.scanned for g in getattr(model, "groups", ()))


def is_stacked_path(path: Sequence) -> bool:
    """Whether a parameter path lies inside a LayerStack (``layers.<u>.period.<j>...``)."""
    return len(path) > 3 and path[0] == "layers" and path[2] == "period"


def check_path(path: Sequence, where: str) -> None:
    """CheckpointError when `path` is a stacked path: `where` needs per-layer paths."""
    if is_stacked_path(path):
        raise CheckpointError(
            f"{where}: '{path_str(tuple(path))}' is a path of a scanned model (ModelConfig.scan_layers=True), but "
            "checkpoints name per-layer tensors: pass the model's per-layer view (glm53.checkpoint.scan."
            "per_layer_values) or unroll it first with model.set_scan_layers(False)"
        )


def per_layer_config(cfg: ModelConfig) -> ModelConfig:
    """The config loaders build with: `cfg` with scan_layers False (a runtime layout, not part of the weights)."""
    return cfg.replace(scan_layers=False) if cfg.scan_layers else cfg


def layer_paths(path: Sequence, groups: Sequence[LayerGroup]) -> list[tuple[Path, int | None]]:
    """`glm53.layers.stack.layer_paths`, a path into a LayerStack off its period a CheckpointError."""
    try:
        return stack.layer_paths(path, groups)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _slice(x, r: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[r]


def _getter(var: nnx.Variable, r: int) -> Callable[[], Any]:
    return lambda: jax.tree.map(lambda x: _slice(x, r), var.get_value())


def per_layer_items(model: nnx.Module, *filters) -> list[tuple[Path, Callable[[], Any]]]:
    """[(per-layer path, get)] of the variables of `model` (those `filters` select, as `nnx.state`): the unrolled
    model's paths in its order; get() returns the value (a stacked value's slice r, made only when called)."""
    state = nnx.state(model, *filters) if filters else nnx.state(model)
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(state)]
    if not is_scanned(model):
        return [(p, v.get_value) for p, v in flat]
    out: list = []
    layers: dict[int, list] = {}
    at = None
    for p, var in flat:
        if p[0] != "layers":
            out.append((p, var.get_value))
            continue
        if at is None:
            at = len(out)
        for q, r in layer_paths(p, model.groups):
            layers.setdefault(q[1], []).append((q, var.get_value if r is None else _getter(var, r)))
    out[at:at] = [item for i in sorted(layers) for item in layers[i]]
    return out


def per_layer_values(model: nnx.Module, *filters) -> Iterator[tuple[Path, Any]]:
    """(per-layer path, value) of every variable `filters` select, in the unrolled model's order (`per_layer_items`;
    a stacked value is sliced as it is reached)."""
    for p, get in per_layer_items(model, *filters):
        yield p, get()


def per_layer_model(model: nnx.Module) -> tuple[nnx.Module, bool]:
    """(`model` in the per-layer layout, whether it was scanned). A scanned (e.g. abstract) model is regrouped in a
    copy sharing its values; the model passed in is left as it is."""
    if not is_scanned(model):
        return model, False
    copy = nnx.merge(*nnx.split(model))
    copy.set_scan_layers(False)
    return copy, True


def restack(model: nnx.Module, scan: bool) -> nnx.Module:
    """`model` (loaded per layer) in the asked layout: scan True stacks its groups in place."""
    if scan:
        model.set_scan_layers(True)
    return model
