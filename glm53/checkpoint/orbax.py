"""glm53's own checkpoint format: Orbax arrays per conversion unit plus a JSON sidecar, restored straight into a
(sharded) abstract model. `glm53.checkpoint.convert` writes it.

Layout of a checkpoint directory OUT:

    OUT/glm53_checkpoint.json     sidecar: model + quant config, dtype choices, units, manifest of every tensor
    OUT/COMPLETE                  written last (before the final rename): marks the checkpoint complete and
                                  holds the CRC-32 of the sidecar's bytes
    OUT/plan.json                 the conversion's arguments (what a resumed run must repeat)
    OUT/units/<unit>/arrays/      an Orbax PyTree checkpoint of the unit's parameters (nested dict by path)
    OUT/units/<unit>/manifest.json  the unit's tensors: path, kind, leaf shapes / dtypes, expert format / layout

A unit is one group of parameters: "embed", "norm", "lm_head", "layers.<i>" (non-expert), "layers.<i>.experts"
(routed experts), "mtp", "mtp.experts". Paths and units are per layer whatever the layout of the model that is
written or restored (`ModelConfig.scan_layers`: `glm53.checkpoint.scan`; `restore_model(scan_layers=True)`). Parameter kinds: "array" (bf16 / f32 ...), "int8" (`Int8Weight`: int8
values + f32 per-output-channel scale) and "quantized" (`QuantizedExperts`: uint32 planes of the GGUF blocks in
layout "planes" or "reencoded", always saved with block_splits = 1, i.e. independent of any mesh).

Integrity: the manifest records the CRC-32 of every stored leaf's bytes (C order, as written); `restore_model`
checks each restored leaf against it (before any cast or relayout, one tensor at a time: a sharded leaf is
gathered to the host for the check, which `verify=False` skips), and `read_metadata` checks the sidecar against
the CRC in COMPLETE. A flipped, truncated or missing file is a CheckpointError naming the unit and tensor.

Restore (`restore_model`): the model is built abstractly (`nnx.eval_shape`, or `glm53.parallel.
abstract_sharded_model` on a mesh) and every leaf is read by Orbax with the leaf's target sharding
(`ArrayRestoreArgs(sharding=...)`), so each device reads only the chunks of its own shard. Quantized experts
whose input blocks are split over the mesh need the planes in `block_splits = n` layout: their 4-byte-word
planes are identical in both layouts and are read sharded; the small 2-byte-field planes (f16 scales) are read
with the word axis unsplit and re-paired on device.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from glm53 import parallel as S
from glm53.checkpoint import scan
from glm53.checkpoint.hf import mtp_choice
from glm53.config import ModelConfig, model_config_from_dict, quant_config_from_dict
from glm53.errors import CheckpointError
from glm53.layers.param import Path, is_routed_expert, path_str
from glm53.model import Glm53Model
from glm53.parallel import distributed
from glm53.quant import planes as P
from glm53.quant.int8 import Int8Weight
from glm53.quant.layout import layout_format
from glm53.quant.qweight import QuantizedExperts

FORMAT = "glm53-orbax"
VERSION = 1
META = "glm53_checkpoint.json"
COMPLETE = "COMPLETE"
PLAN = "plan.json"
UNITS = "units"
PARTIAL_SUFFIX = ".partial"


def crc32(a) -> int:
    """CRC-32 of an array's bytes in C order (a device array is copied to the host; one spanning several
    processes is gathered to each of them, `glm53.parallel.distributed.to_host`)."""
    a = np.ascontiguousarray(distributed.to_host(a))
    return zlib.crc32(a.reshape(-1).view(np.uint8).data)


# ------------------------------------------------------------------------------------------------ layout
def unit_of(path: Path) -> str:
    """The unit of a (per-layer) parameter path (module docstring)."""
    scan.check_path(path, "glm53 Orbax checkpoint")
    base = f"layers.{path[1]}" if path[0] == "layers" else str(path[0])
    return base + ".experts" if is_routed_expert(path) else base


def describe(path: Path, value) -> tuple[dict[str, Any], Any]:
    """(manifest entry, saved node) of one parameter value (host arrays): the node is an array, or a dict of
    arrays for Int8Weight ("values", "scale") and QuantizedExperts ("planes" -> field -> uint32 plane)."""
    entry: dict[str, Any] = {"path": path_str(path), "unit": unit_of(path)}
    if isinstance(value, Int8Weight):
        node = {"values": np.asarray(value.values), "scale": np.asarray(value.scale)}
        entry.update(kind="int8", dtype=np.dtype(value.dtype).name)
    elif isinstance(value, QuantizedExperts):
        p = value.planes
        node = {"planes": {k: np.asarray(v) for k, v in p.fields.items()}}
        entry.update(kind="quantized", format=value.format_name, layout=value.layout, planes_format=p.fmt.name,
                     matrix_shape=list(p.shape), block_splits=int(p.block_splits))  # fmt: skip
    else:
        node = np.asarray(value)
        entry.update(kind="array", dtype=node.dtype.name)
    entry["leaves"] = {
        "/".join(str(getattr(k, "key", k)) for k in kp): {
            "shape": list(a.shape), "dtype": a.dtype.name, "crc32": crc32(a)
        }
        for kp, a in jax.tree_util.tree_flatten_with_path(node)[0]
    }  # fmt: skip
    return entry, node


def nest(items: dict[Path, Any]) -> dict:
    """{path: node} as the nested dict Orbax saves (keys as strings)."""
    tree: dict = {}
    for path, node in items.items():
        d = tree
        for k in path[:-1]:
            d = d.setdefault(str(k), {})
        d[str(path[-1])] = node
    return tree


def _get(tree: dict, path: Path):
    for k in path:
        tree = tree[str(k)]
    return tree


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` looks like a glm53 Orbax checkpoint (complete or not): a directory with the sidecar,
    the COMPLETE marker or a units/ directory. `read_metadata` says whether it is usable."""
    path = os.fspath(path)
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in (META, COMPLETE, UNITS, PLAN)
    )


def read_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """The sidecar of a complete checkpoint; CheckpointError naming the directory when it is incomplete or
    corrupted (no COMPLETE marker, unreadable sidecar, missing unit directories)."""
    d = os.fspath(ckpt_dir)
    if not os.path.isdir(d):
        raise CheckpointError(f"{d}: not a checkpoint directory")
    if not os.path.exists(os.path.join(d, COMPLETE)):
        hint = " (an unfinished conversion: rerun it to resume)" if d.endswith(PARTIAL_SUFFIX) else ""
        raise CheckpointError(f"{d}: incomplete glm53 checkpoint: no {COMPLETE} marker{hint}")
    try:
        with open(os.path.join(d, COMPLETE)) as f:
            want = json.load(f)["sidecar_crc32"]
        with open(os.path.join(d, META), "rb") as f:
            raw = f.read()
        if zlib.crc32(raw) != want:
            raise ValueError(f"{META} does not match its CRC-32 in {COMPLETE}")
        meta = json.loads(raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{d}: corrupted glm53 checkpoint: cannot read {META} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{d}: {META} is not a {FORMAT} v{VERSION} sidecar")
    missing = [u for u in meta.get("units", []) if not os.path.isdir(os.path.join(d, UNITS, u, "arrays"))]
    if missing:
        raise CheckpointError(f"{d}: corrupted glm53 checkpoint: unit directories missing: {missing}")
    return meta


# ------------------------------------------------------------------------------------------------ restore
def _check_crc(where: str, leaf: str, info: dict, value) -> None:
    if "crc32" not in info:
        raise CheckpointError(f"{where}: no checksum recorded for leaf {leaf or '(array)'}")
    got = crc32(value)
    if got != info["crc32"]:
        raise CheckpointError(f"{where}{'/' + leaf if leaf else ''}: checksum mismatch (CRC-32 {got:#010x}, "
                              f"recorded {int(info['crc32']):#010x}): the stored data is corrupted")  # fmt: skip


def _sds_sharding(abstract, default):
    s = getattr(abstract, "sharding", None)
    return s if isinstance(s, jax.sharding.Sharding) else default


def _replicate_axis(sharding, axis: int):
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * 8
    spec[axis] = None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[: axis + 1]))


def _leaf_plan(entry: dict, var: nnx.Variable, mesh, rules, default, where: str):
    """For one manifest entry and its model variable: {leaf name: (shape, restore dtype, sharding)} and a
    function building the parameter value from the restored leaves."""
    target = var.get_value()
    leaves = entry["leaves"]
    kind = entry.get("kind")
    if kind == "array":
        if isinstance(target, (QuantizedExperts, Int8Weight)) or list(target.shape) != leaves[""]["shape"]:
            raise CheckpointError(
                f"{where}: stored {kind} {leaves['']['shape']}, the model expects {target!r}"
            )
        stored = jnp.dtype(leaves[""]["dtype"])  # read as stored (checked bytes), then cast
        cast = (lambda r: r[""]) if stored == target.dtype else (lambda r: r[""].astype(target.dtype))
        return {"": (target.shape, stored, _sds_sharding(target, default))}, cast
    if kind == "int8":
        shape = tuple(leaves["values"]["shape"])
        if isinstance(target, QuantizedExperts) or tuple(target.shape) != shape:
            raise CheckpointError(f"{where}: stored int8 {list(shape)}, the model expects {target!r}")
        vs = ss = default
        if mesh is not None:
            axes = S.param_axes(var, where)
            vs = S.logical_to_sharding(axes, mesh, rules, shape, where)
            ss = S.logical_to_sharding(axes[:-2] + axes[-1:], mesh, rules, leaves["scale"]["shape"], where)
        dt = np.dtype(target.dtype)
        return ({"values": (shape, np.int8, vs), "scale": (tuple(leaves["scale"]["shape"]), np.float32, ss)},
                lambda r: Int8Weight(r["values"], r["scale"], dt))  # fmt: skip
    if kind == "quantized":
        return _quantized_plan(entry, var, target, mesh, rules, default, where)
    raise CheckpointError(f"{where}: unknown tensor kind {kind!r}")


def _quantized_plan(entry, var, target, mesh, rules, default, where):
    if not isinstance(target, QuantizedExperts):
        raise CheckpointError(
            f"{where}: stored quantized experts ({entry['format']}), the model expects {target!r}"
        )
    if (entry["format"], entry["layout"]) != (target.format_name, target.layout):
        raise CheckpointError(f"{where}: stored {entry['format']} ({entry['layout']}), the model expects "
                              f"{target.format_name} ({target.layout})")  # fmt: skip
    fmt = layout_format(entry["format"], entry["layout"])
    shape, splits = tuple(entry["matrix_shape"]), int(entry["block_splits"])
    if fmt.name != entry["planes_format"] or shape != tuple(target.planes.shape):
        raise CheckpointError(f"{where}: stored planes {entry['planes_format']} {list(shape)}, the model expects "
                              f"{fmt.name} {list(target.planes.shape)}")  # fmt: skip
    relayout = splits != target.planes.block_splits
    if relayout and (mesh is None or splits != 1):
        raise CheckpointError(f"{where}: stored with block_splits={splits}, cannot lay out as "
                              f"{target.planes.block_splits}")  # fmt: skip
    plan = {}
    for name, t in target.planes.fields.items():
        key = f"planes/{name}"
        if key not in entry["leaves"]:
            raise CheckpointError(f"{where}: plane {name!r} missing from the checkpoint")
        stored = tuple(entry["leaves"][key]["shape"])
        sh = _sds_sharding(t, default)
        if relayout and fmt.field(name).nbytes == 2:  # re-paired per block group: read the word axis whole
            sh = _replicate_axis(sh, len(stored) - 2)
        elif stored != tuple(t.shape):
            raise CheckpointError(
                f"{where}: plane {name!r} stored {list(stored)}, the model expects {list(t.shape)}"
            )
        plan[key] = (stored, np.uint32, sh)

    def build(r):
        fields = {k.split("/", 1)[1]: v for k, v in r.items()}
        q = QuantizedExperts(P.Planes(fields, fmt, shape, splits))
        if not relayout:
            return q
        axes = S.param_axes(var, where)
        out = jax.tree.map(lambda a: _sds_sharding(a, default), target)
        return jax.jit(lambda v: S.prepare_planes(v, axes, mesh, rules, where), out_shardings=out)(q)

    return plan, build


def _stored_quant(d: dict) -> dict:
    """A sidecar's quant section without the expert kernel that checkpoints written before the ``kernels``
    section stored in it (``moe_impl``): a run choice, not part of the weights."""
    return {k: v for k, v in d.items() if k != "moe_impl"}


def restore_model(
    ckpt_dir: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    rules="tp",
    *,
    dtype=None,
    kernels=None,
    moe_dispatch: bool = True,
    with_mtp: bool | None = None,
    verify: bool = True,
    scan_layers: bool | None = None,
) -> nnx.Module:
    """The `Glm53Model` of a glm53 Orbax checkpoint, every leaf read straight into its place.

    mesh: None puts everything on the default device; a mesh builds the model with
    `glm53.parallel.abstract_sharded_model(..., rules)` and reads each leaf with its NamedSharding (each device
    reads its shard only). dtype: parameter dtype (default: the one converted to; floats are cast on read).
    kernels: the implementation of each kernel op (`Glm53Model`; not stored with the weights). with_mtp: None
    restores the MTP block when the checkpoint has one, True requires it, False leaves it out. verify: check
    every leaf's CRC-32 (module docstring; False skips the host copy). scan_layers: the layout of the model
    returned (`ModelConfig.scan_layers`; None: the stored config's, False for every checkpoint glm53 writes): the
    checkpoint is per layer either way, and True reads each layer's tensors straight into repeat r of its group's
    stacked parameters (`_Stacked`). Raises CheckpointError naming the directory (and unit, tensor) for
    incomplete / corrupted checkpoints and mismatches.
    """
    d = os.path.abspath(os.fspath(ckpt_dir))
    meta = read_metadata(d)
    try:
        cfg = model_config_from_dict(meta["config"])
        quant = None if meta.get("quant") is None else quant_config_from_dict(_stored_quant(meta["quant"]))
        dtype = jnp.dtype(dtype if dtype is not None else meta["dtype"])
        stored_mtp = bool(meta["with_mtp"])
        manifest = {e["path"]: e for e in meta["manifest"]}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d}: corrupted {META}: {e!r}") from None
    with_mtp = mtp_choice(with_mtp, stored_mtp, d, cfg.num_hidden_layers)
    if not with_mtp:
        manifest = {k: e for k, e in manifest.items() if not k.startswith("mtp.")}
    scan_layers = cfg.scan_layers if scan_layers is None else bool(scan_layers)
    cfg = scan.per_layer_config(cfg)

    def abstract_model(c: ModelConfig):
        def build():
            return Glm53Model(
                c, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels, with_mtp=with_mtp, quant=quant
            )

        if mesh is None:
            return nnx.eval_shape(build)
        return S.abstract_sharded_model(build, mesh, rules, moe_dispatch=moe_dispatch)

    abstract = abstract_model(cfg)  # the per-layer targets, what the manifest names
    stacked = _Stacked(abstract_model(cfg.replace(scan_layers=True))) if scan_layers else None
    graphdef, state = nnx.split(abstract)
    flat = {path_str(p): v for p, v in nnx.to_flat_state(state)}
    missing, extra = sorted(set(flat) - set(manifest)), sorted(set(manifest) - set(flat))
    if missing or extra:
        raise CheckpointError(f"{d}: checkpoint does not match the model it describes: missing {missing[:10]}, "
                              f"unexpected {extra[:10]}")  # fmt: skip
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    by_unit: dict[str, list[str]] = {}
    for name, e in manifest.items():
        by_unit.setdefault(e["unit"], []).append(name)
    ckptr = ocp.PyTreeCheckpointer()
    for unit, names in by_unit.items():
        udir = os.path.join(d, UNITS, unit, "arrays")
        plans, builders, item, args = {}, {}, {}, {}
        for name in names:
            path = tuple(int(k) if k.isdigit() else k for k in name.split("."))
            plans[name], builders[name] = _leaf_plan(
                manifest[name], flat[name], mesh, rules, default, f"{d}: {name}"
            )
            for leaf, (shape, dt, sh) in plans[name].items():
                key = path + tuple(leaf.split("/")) if leaf else path
                item[key] = jax.ShapeDtypeStruct(tuple(shape), dt, sharding=sh)
                args[key] = ocp.ArrayRestoreArgs(sharding=sh, global_shape=tuple(shape), dtype=dt)
        try:
            restored = ckptr.restore(
                udir, args=ocp.args.PyTreeRestore(item=nest(item), restore_args=nest(args))
            )
        except Exception as e:  # noqa: BLE001 -- Orbax / tensorstore raise many types
            raise CheckpointError(f"{d}: corrupted glm53 checkpoint: cannot read unit {unit} ({udir}): "
                                  f"{type(e).__name__}: {e}") from None  # fmt: skip
        for name in names:
            path = tuple(int(k) if k.isdigit() else k for k in name.split("."))
            node = _get(restored, path)
            r = {leaf: (_get(node, tuple(leaf.split("/"))) if leaf else node) for leaf in plans[name]}
            for leaf, (shape, _, _) in plans[name].items():
                if tuple(r[leaf].shape) != tuple(shape):
                    raise CheckpointError(
                        f"{d}: {name}/{leaf}: restored shape {r[leaf].shape}, expected {shape}"
                    )
                if verify:
                    _check_crc(f"{d}: unit {unit}: {name}", leaf, manifest[name]["leaves"][leaf], r[leaf])
            if stacked is None:
                flat[name].set_value(builders[name](r))
            else:
                stacked.put(name, builders[name](r), f"{d}: {name}")
        if stacked is not None:
            stacked.flush()
    return nnx.merge(graphdef, state) if stacked is None else stacked.model()


class _Stacked:
    """The scanned abstract model a restore fills: a per-layer value goes to its variable, or into repeat r of its
    group's stacked variable (`glm53.checkpoint.scan.layer_paths`). A stacked value is allocated whole when its
    first layer arrives, in that layer's structure (e.g. an Int8Weight), each leaf with a leading unsharded axis
    (as `glm53.layers.stack` stacks), and updated in place (donated); one program places a unit's values (`flush`).
    The restore never holds a per-layer copy of more than the unit being read."""

    def __init__(self, abstract: nnx.Module):
        self.graphdef, self.state = nnx.split(abstract)
        self.slots, self.started, self.pending = {}, set(), []
        for path, var in nnx.to_flat_state(self.state):
            for p, r in scan.layer_paths(path, abstract.groups):
                self.slots[path_str(p)] = (var, r, None if r is None else abstract.groups[path[1]].repeats)

    def put(self, name: str, value, where: str) -> None:
        var, r, repeats = self.slots[name]
        if r is None:
            var.set_value(value)
            return
        fresh = id(var) not in self.started
        self.started.add(id(var))
        if not fresh and jax.tree.structure(var.get_value()) != jax.tree.structure(value):
            raise CheckpointError(f"{where}: a layer's value {jax.tree.structure(value)} does not fit the other "
                                  f"layers' of its group {jax.tree.structure(var.get_value())}")  # fmt: skip
        self.pending.append((var, r, repeats if fresh else None, value))

    def flush(self) -> None:
        """Places the pending values (one unit's) with one program."""
        if not self.pending:
            return
        variables, rs, fresh, values = zip(*self.pending)
        self.pending = []
        bufs = [None if n else v.get_value() for v, n in zip(variables, fresh)]
        out = [jax.tree.map(lambda x: _stacked_sharding(x.sharding), v) if n else jax.tree.map(lambda x: x.sharding, b)
               for b, n, v in zip(bufs, fresh, values)]  # fmt: skip
        leaves, tree = jax.tree.flatten(out)
        placed = _place(fresh, tree, tuple(leaves))(bufs, list(values), jnp.asarray(rs, jnp.int32))
        for var, value in zip(variables, placed):
            var.set_value(value)

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state)


def _stacked_sharding(sharding):
    """A leaf's sharding with a new unsharded leading axis."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
    return sharding


_FAST_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _place(fresh: tuple, tree, shardings: tuple):
    """(bufs, values, rs) -> bufs with bufs[i][rs[i]] = values[i]; a None buf (fresh[i] = its repeats) starts from
    zeros. The bufs are donated: updated in place."""

    def place(bufs, values, rs):
        out = []
        for i, (b, v) in enumerate(zip(bufs, values)):
            if fresh[i] is not None:
                b = jax.tree.map(lambda x, n=fresh[i]: jnp.zeros((n, *x.shape), x.dtype), v)
            out.append(
                jax.tree.map(lambda x, y, i=i: jax.lax.dynamic_update_index_in_dim(x, y, rs[i], 0), b, v)
            )
        return out

    opts = _FAST_CPU if jax.default_backend() == "cpu" else None  # copies: nothing for XLA to optimize
    return jax.jit(
        place, donate_argnums=0, out_shardings=jax.tree.unflatten(tree, shardings), compiler_options=opts
    )


def load_checkpoint(ckpt_dir: str | os.PathLike, **kw) -> tuple[ModelConfig, nnx.Module]:
    """(cfg, model) of a glm53 Orbax checkpoint (see `restore_model`, e.g. scan_layers=True)."""
    model = restore_model(ckpt_dir, **kw)
    return model.cfg, model
