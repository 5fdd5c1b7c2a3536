"""glm53's own checkpoint format: Orbax arrays per conversion unit plus a JSON sidecar; conversion from HF (+ GGUF
experts), restore straight into a (sharded) abstract model.

Layout of a checkpoint directory OUT:

    OUT/glm53_checkpoint.json     sidecar: model + quant config, dtype choices, units, manifest of every tensor
    OUT/COMPLETE                  written last (before the final rename): marks the checkpoint complete
    OUT/plan.json                 the conversion's arguments (what a resumed run must repeat)
    OUT/units/<unit>/arrays/      an Orbax PyTree checkpoint of the unit's parameters (nested dict by path)
    OUT/units/<unit>/manifest.json  the unit's tensors: path, kind, leaf shapes / dtypes, expert format / layout

A unit is one group of parameters: "embed", "norm", "lm_head", "layers.<i>" (non-expert), "layers.<i>.experts"
(routed experts), "mtp", "mtp.experts". Parameter kinds: "array" (bf16 / f32 ...), "int8" (`Int8Weight`: int8
values + f32 per-output-channel scale) and "quantized" (`QuantizedExperts`: uint32 planes of the GGUF blocks in
layout "planes" or "reencoded", always saved with block_splits = 1, i.e. independent of any mesh).

Atomicity and resume (`convert`): everything is written under ``OUT.partial``; a unit is staged in
``units/.<unit>.staging`` and renamed into place when its arrays and manifest are written, so a unit directory
that exists is complete. A rerun with the same arguments skips finished units (different arguments: an error
naming what differs). Only when every unit exists are the sidecar and COMPLETE written and ``OUT.partial``
renamed to OUT: an interrupted run never leaves a directory named OUT.

Restore (`restore_model`): the model is built abstractly (`nnx.eval_shape`, or `glm53.parallel.
abstract_sharded_model` on a mesh) and every leaf is read by Orbax with the leaf's target sharding
(`ArrayRestoreArgs(sharding=...)`), so each device reads only the chunks of its own shard (arrays are stored in
chunks of at most `chunk_bytes`). Quantized experts whose input blocks are split over the mesh need the planes
in `block_splits = n` layout: their 4-byte-word planes are identical in both layouts and are read sharded; the
small 2-byte-field planes (f16 scales) are read with the word axis unsplit and re-paired on device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.config import (
    ModelConfig,
    QuantConfig,
    model_config_from_dict,
    model_config_to_dict,
    quant_config_from_dict,
)
from glm53.errors import CheckpointError
from glm53.layers.param import Path, is_routed_expert, path_str
from glm53.quant.int8 import Int8Weight

_log = logging.getLogger(__name__)

FORMAT = "glm53-orbax"
VERSION = 1
META = "glm53_checkpoint.json"
COMPLETE = "COMPLETE"
PLAN = "plan.json"
UNITS = "units"
PARTIAL_SUFFIX = ".partial"
DEFAULT_CHUNK_BYTES = 8 << 20  # Orbax chunk size: the read granularity of a sharded restore
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "float32": "float32", "f32": "float32"}


class ConversionInterrupted(RuntimeError):
    """Raised by `convert(interrupt_after=k)` after k units were written (a test hook)."""


# ------------------------------------------------------------------------------------------------ paths / units


def unit_of(path: Path) -> str:
    """The conversion unit of a parameter path (module docstring)."""
    base = f"layers.{path[1]}" if path[0] == "layers" else str(path[0])
    return base + ".experts" if is_routed_expert(path) else base


def plan_units(paths: Sequence[Path]) -> dict[str, list[Path]]:
    """unit -> its parameter paths, units in first-appearance order."""
    out: dict[str, list[Path]] = {}
    for p in paths:
        out.setdefault(unit_of(p), []).append(tuple(p))
    return out


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` looks like a glm53 Orbax checkpoint (complete or not): a directory with the sidecar,
    the COMPLETE marker or a units/ directory. `read_metadata` says whether it is usable."""
    path = os.fspath(path)
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in (META, COMPLETE, UNITS, PLAN)
    )


# ------------------------------------------------------------------------------------------------ values <-> leaves
def _quantized_experts_cls():
    from glm53.quant.qweight import QuantizedExperts

    return QuantizedExperts


def describe(path: Path, value) -> tuple[dict[str, Any], Any]:
    """(manifest entry, saved node) of one parameter value (host arrays): the node is an array, or a dict of
    arrays for Int8Weight ("values", "scale") and QuantizedExperts ("planes" -> field -> uint32 plane)."""
    QuantizedExperts = _quantized_experts_cls()
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
        "/".join(str(getattr(k, "key", k)) for k in kp): {"shape": list(a.shape), "dtype": a.dtype.name}
        for kp, a in jax.tree_util.tree_flatten_with_path(node)[0]
    }
    return entry, node


def _nest(items: dict[Path, Any]) -> dict:
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


# ------------------------------------------------------------------------------------------------ writing
@dataclasses.dataclass
class _Writer:
    """Stages and finalizes units under the work directory; counts them for the interrupt hook."""

    work: str
    plan: dict[str, list[Path]]
    chunk_bytes: int
    interrupt_after: int | None = None
    progress: Any = None
    written: int = 0

    def __post_init__(self):
        self.pending: dict[str, dict[Path, Any]] = {}

    def unit_dir(self, unit: str) -> str:
        return os.path.join(self.work, UNITS, unit)

    def done(self, unit: str) -> bool:
        return os.path.isfile(os.path.join(self.unit_dir(unit), "manifest.json"))

    def add(self, path: Path, value) -> None:
        """One finished parameter (host value); writes its unit once every parameter of the unit arrived."""
        unit = unit_of(path)
        got = self.pending.setdefault(unit, {})
        got[tuple(path)] = value
        if len(got) == len(self.plan[unit]):
            self.write(unit, self.pending.pop(unit))

    def write(self, unit: str, values: dict[Path, Any]) -> None:
        import orbax.checkpoint as ocp

        order = {p: i for i, p in enumerate(self.plan[unit])}
        if set(values) != set(order):
            raise CheckpointError(f"unit {unit}: got parameters {sorted(map(path_str, values))}, planned "
                                  f"{sorted(map(path_str, order))}")  # fmt: skip
        staging = os.path.join(self.work, UNITS, f".{unit}.staging")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        entries, nodes = [], {}
        for path in sorted(values, key=order.get):
            entry, node = describe(path, values[path])
            entries.append(entry)
            nodes[path] = node
        tree = _nest(nodes)
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=self.chunk_bytes), tree)
        ocp.PyTreeCheckpointer().save(
            os.path.join(staging, "arrays"), args=ocp.args.PyTreeSave(tree, save_args=save_args)
        )
        _write_json(os.path.join(staging, "manifest.json"), {"unit": unit, "tensors": entries})
        os.rename(staging, self.unit_dir(unit))
        self.written += 1
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(unit)
        _log.info("wrote unit %s (%d tensors)", unit, len(entries))
        if self.interrupt_after is not None and self.written >= self.interrupt_after:
            raise ConversionInterrupted(f"conversion interrupted after {self.written} units (test hook)")


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Collector:
    """The HF loader's `put`: hands finished host values to the writer and returns a placeholder, so nothing
    but the units being filled stays in memory. Int8 kernels arrive as two calls (int8 values, then scale)."""

    def __init__(self, writer: _Writer, targets: dict[Path, Any]):
        self.writer, self.targets = writer, targets
        self.int8_values: dict[Path, np.ndarray] = {}

    def __call__(self, path, value, sharding):
        path = tuple(path)
        value = np.asarray(value)
        target = self.targets[path]
        if path in self.int8_values:
            self.writer.add(path, Int8Weight(self.int8_values.pop(path), value, np.dtype(target.dtype)))
        elif value.dtype == np.int8 and np.dtype(target.dtype) != np.int8:
            self.int8_values[path] = value
        else:
            self.writer.add(path, value)
        return jax.ShapeDtypeStruct(value.shape, value.dtype)


# ------------------------------------------------------------------------------------------------ GGUF experts
def infer_quant(experts: dict, cfg: ModelConfig, layout: str) -> QuantConfig | None:
    """The QuantConfig whose expert formats are those of the GGUF expert tensors (`gguf.expert_tensors`): one
    format, one per matrix, or the scaled UD-IQ3_XXS mix (MTP experts then stay dense). None without experts."""
    from glm53.quant.qweight import expert_formats

    if not experts:
        return None
    fmts = {(et.layer, et.matrix): et.format.name for et in experts.values()}
    per_matrix = {m: {f for (_, mm), f in fmts.items() if mm == m} for m in ("gate", "up", "down")}
    if all(len(s) == 1 for s in per_matrix.values()):
        mapping = {m: next(iter(s)) for m, s in per_matrix.items()}
        spec = mapping["gate"] if len(set(mapping.values())) == 1 else mapping
        return QuantConfig(experts=spec, layout=layout)
    ud = QuantConfig(experts="ud_iq3_xxs", layout=layout)
    trunk = {k: f for k, f in fmts.items() if k[0] != "mtp"}
    if all(expert_formats(ud, cfg, layer)[m] == f for (layer, m), f in trunk.items()):
        return ud
    listing = ", ".join(f"{layer}.{m}={f}" for (layer, m), f in sorted(fmts.items(), key=str))
    raise CheckpointError(f"GGUF expert formats [{listing}] are neither one format per matrix nor the UD-IQ3_XXS mix "
                          "(no QuantConfig describes them)")  # fmt: skip


def _expert_host_value(et, abstract):
    """A routed-expert parameter from its GGUF tensor, as the hybrid loader builds it: QuantizedExperts planes
    (host numpy) when the model keeps it quantized, else the dense kernel [E, in, out] decoded to its dtype."""
    QuantizedExperts = _quantized_experts_cls()
    if not isinstance(abstract, QuantizedExperts):
        return et.dequantize(np.dtype(abstract.dtype))
    if et.format.name != abstract.format_name:
        raise CheckpointError(
            f"{et.name}: {et.format.name}, but the model keeps this tensor as {abstract.format_name}"
        )
    q = et.quantized(abstract.layout)
    try:
        q.check_like(abstract, et.name)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return jax.tree.map(np.asarray, q)


def _open_experts(gguf_files: Sequence[str], cfg: ModelConfig, with_mtp: bool):
    """(GGUFModel, {path: ExpertTensor}) of the given GGUF file(s) (one file, or the shards of one split set)."""
    from glm53.checkpoint import gguf as G
    from glm53.checkpoint import gguf_rules

    g = G.open_gguf_model(gguf_files[0])
    try:
        names = {os.path.realpath(s.name) for s in g.shards}
        stray = [f for f in gguf_files if os.path.realpath(f) not in names]
        if stray:
            raise CheckpointError(f"GGUF {gguf_files[0]}: {stray} are not shards of its split set "
                                  f"({sorted(names)})")  # fmt: skip
        arch = g.get("general.architecture")
        if arch is not None and arch not in gguf_rules.ARCHITECTURES:
            raise CheckpointError(f"GGUF {g.name}: general.architecture is {arch!r}; expected one of "
                                  f"{list(gguf_rules.ARCHITECTURES)}")  # fmt: skip
        experts = G.expert_tensors(g, cfg, with_mtp=with_mtp)
        wanted = {et.name for et in experts.values()}
        suffixes = tuple(f".ffn_{m}_exps.weight" for m in gguf_rules.EXPERT_MATRICES)
        extra = [n for n in g.tensors if n.endswith(suffixes) and n not in wanted]
        if extra:
            raise CheckpointError(f"GGUF {g.name}: routed experts of layers the model does not have: {extra}")
    except BaseException:
        g.close()
        raise
    return g, experts


# ------------------------------------------------------------------------------------------------ convert
def convert(
    hf_dir: str,
    out: str,
    *,
    gguf: Sequence[str] = (),
    dtype: str = "bfloat16",
    int8: bool = False,
    int8_min_size: int = 1 << 20,
    layout: str = "planes",
    with_mtp: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = True,
    interrupt_after: int | None = None,
) -> str:
    """Converts an HF folder (non-experts; experts too without `gguf`) and optionally a GGUF's routed experts
    into a glm53 Orbax checkpoint at `out` (module docstring: units, atomicity, resume). Returns `out`.

    dtype: "bfloat16" | "float32" for the floating parameters. int8: non-expert Linear kernels with at least
    `int8_min_size` weights (not the router) stored as per-channel Int8Weight. layout: "planes" | "reencoded"
    for the quantized experts (formats as in the GGUF). interrupt_after: raise ConversionInterrupted after that
    many units were written in this run (test hook). Raises CheckpointError for bad input, naming it.
    """
    from glm53.checkpoint import hf as H
    from glm53.config import load_hf_config
    from glm53.model import Glm53Model

    out = os.path.abspath(os.fspath(out))
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_NAMES)}")
    dtype = DTYPE_NAMES[dtype]
    if os.path.exists(out):
        raise CheckpointError(f"{out}: already exists; remove it or choose another --out")
    cfg = load_hf_config(hf_dir)
    gguf = [os.fspath(f) for f in gguf]
    g, experts = _open_experts(gguf, cfg, with_mtp) if gguf else (None, {})
    try:
        quant = infer_quant(experts, cfg, layout)
        abstract = nnx.eval_shape(lambda: Glm53Model(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), with_mtp=with_mtp,
                                                     quant=quant))  # fmt: skip
        flat = [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(nnx.state(abstract))]
        targets = dict(flat)
        plan = plan_units([p for p, _ in flat])
        fingerprint = {
            "hf": os.path.abspath(hf_dir), "gguf": [os.path.abspath(f) for f in gguf], "dtype": dtype,
            "int8": bool(int8), "int8_min_size": int(int8_min_size) if int8 else None, "layout": layout,
            "with_mtp": bool(with_mtp), "config": model_config_to_dict(cfg), "quant": _quant_dict(quant),
        }  # fmt: skip
        fingerprint = json.loads(json.dumps(fingerprint))  # as plan.json reads back (lists, not tuples)
        work = out + PARTIAL_SUFFIX
        _prepare_work(work, fingerprint)
        if os.path.exists(os.path.join(work, COMPLETE)):  # finished, but stopped before the final rename
            os.rename(work, out)
            return out
        bar = _progress(len(plan), out) if progress else None
        writer = _Writer(work, plan, chunk_bytes, interrupt_after, bar)
        todo = [u for u in plan if not writer.done(u)]
        if bar is not None:
            bar.update(len(plan) - len(todo))
        try:
            # Routed experts from the GGUF: one unit per layer, read tensor by tensor.
            for unit in todo:
                if experts and unit.endswith(".experts"):
                    writer.write(unit, {p: _expert_host_value(experts[p], targets[p]) for p in plan[unit]})
            rest = [u for u in todo if not (experts and u.endswith(".experts"))]
            if rest:
                skip_units = set(plan) - set(rest)
                H.load_hf_weights(
                    hf_dir, abstract, cfg, int8=int8, int8_min_size=int8_min_size,
                    put=_Collector(writer, targets), skip=lambda p: unit_of(tuple(p)) in skip_units,
                )  # fmt: skip
                if writer.pending:
                    raise CheckpointError(f"HF {hf_dir}: units left incomplete: {sorted(writer.pending)}")
        finally:
            if bar is not None:
                bar.close()
    finally:
        if g is not None:
            g.close()
    _finalize(work, out, plan, fingerprint, cfg, quant)
    return out


def _quant_dict(quant: QuantConfig | None) -> dict | None:
    if quant is None:
        return None
    d = dataclasses.asdict(quant)
    if isinstance(d["experts"], (tuple, list)):
        d["experts"] = dict(d["experts"])
    return d


def _progress(total: int, out: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"convert -> {os.path.basename(out)}", unit="unit")


def _prepare_work(work: str, fingerprint: dict) -> None:
    """Creates the work directory, or checks that an existing one was started with the same arguments."""
    plan_file = os.path.join(work, PLAN)
    if os.path.isdir(work):
        try:
            with open(plan_file) as f:
                old = json.load(f)["fingerprint"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{work}: an unfinished conversion without a readable {PLAN} ({e}); "
                                  "remove the directory to start over") from None  # fmt: skip
        diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        if diff:
            raise CheckpointError(f"{work}: an unfinished conversion with different arguments ({', '.join(diff)}); "
                                  "rerun with the same arguments to resume, or remove the directory")  # fmt: skip
        units = os.path.join(work, UNITS)
        for name in os.listdir(units):
            if name.endswith(".staging"):
                shutil.rmtree(os.path.join(units, name))
        _log.info("resuming %s", work)
        return
    os.makedirs(os.path.join(work, UNITS))
    _write_json(plan_file, {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint})


def _finalize(work: str, out: str, plan, fingerprint, cfg, quant) -> None:
    manifest = []
    for unit in plan:
        with open(os.path.join(work, UNITS, unit, "manifest.json")) as f:
            manifest.extend(json.load(f)["tensors"])
    meta = {
        "format": FORMAT, "version": VERSION, "config": model_config_to_dict(cfg), "quant": _quant_dict(quant),
        "dtype": fingerprint["dtype"], "int8": fingerprint["int8"], "with_mtp": fingerprint["with_mtp"],
        "layout": fingerprint["layout"], "sources": {"hf": fingerprint["hf"], "gguf": fingerprint["gguf"]},
        "units": list(plan), "manifest": manifest,
    }  # fmt: skip
    _write_json(os.path.join(work, META), meta)
    _write_json(os.path.join(work, COMPLETE), {"units": len(plan), "tensors": len(manifest)})
    os.rename(work, out)
    _log.info("wrote %s: %d units, %d tensors", out, len(plan), len(manifest))


# ------------------------------------------------------------------------------------------------ restore
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
        with open(os.path.join(d, META)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d}: corrupted glm53 checkpoint: cannot read {META} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{d}: {META} is not a {FORMAT} v{VERSION} sidecar")
    missing = [u for u in meta.get("units", []) if not os.path.isdir(os.path.join(d, UNITS, u, "arrays"))]
    if missing:
        raise CheckpointError(f"{d}: corrupted glm53 checkpoint: unit directories missing: {missing}")
    return meta


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
    from glm53 import parallel as S

    QuantizedExperts = _quantized_experts_cls()
    target = var.get_value()
    leaves = entry["leaves"]
    kind = entry.get("kind")
    if kind == "array":
        if isinstance(target, (QuantizedExperts, Int8Weight)) or list(target.shape) != leaves[""]["shape"]:
            raise CheckpointError(
                f"{where}: stored {kind} {leaves['']['shape']}, the model expects {target!r}"
            )
        return {"": (target.shape, target.dtype, _sds_sharding(target, default))}, lambda r: r[""]
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
    from glm53 import parallel as S
    from glm53.quant import planes as P
    from glm53.quant.qweight import layout_format

    QuantizedExperts = _quantized_experts_cls()
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


def restore_model(
    ckpt_dir: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    rules="tp",
    *,
    dtype=None,
    kernels: dict[str, str] | None = None,
    moe_dispatch: bool = True,
) -> nnx.Module:
    """The `Glm53Model` of a glm53 Orbax checkpoint, every leaf read straight into its place.

    mesh: None puts everything on the default device; a mesh builds the model with
    `glm53.parallel.abstract_sharded_model(..., rules)` and reads each leaf with its NamedSharding (each device
    reads its shard only). dtype: parameter dtype (default: the one converted to; floats are cast on read).
    kernels: implementation per kernel op (overrides the stored quant.moe_impl for "moe").
    Raises CheckpointError naming the directory for incomplete / corrupted checkpoints and mismatches.
    """
    import orbax.checkpoint as ocp

    from glm53 import parallel as S
    from glm53.model import Glm53Model

    d = os.path.abspath(os.fspath(ckpt_dir))
    meta = read_metadata(d)
    try:
        cfg = model_config_from_dict(meta["config"])
        quant = None if meta.get("quant") is None else quant_config_from_dict(meta["quant"])
        dtype = jnp.dtype(dtype if dtype is not None else meta["dtype"])
        with_mtp = bool(meta["with_mtp"])
        manifest = {e["path"]: e for e in meta["manifest"]}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d}: corrupted {META}: {e!r}") from None

    def build():
        return Glm53Model(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels, with_mtp=with_mtp, quant=quant)

    abstract = (
        nnx.eval_shape(build)
        if mesh is None
        else S.abstract_sharded_model(build, mesh, rules, moe_dispatch=moe_dispatch)
    )
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
                udir, args=ocp.args.PyTreeRestore(item=_nest(item), restore_args=_nest(args))
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
            flat[name].set_value(builders[name](r))
    return nnx.merge(graphdef, state)


def load_checkpoint(ckpt_dir: str | os.PathLike, **kw) -> tuple[ModelConfig, nnx.Module]:
    """(cfg, model) of a glm53 Orbax checkpoint (see `restore_model`)."""
    model = restore_model(ckpt_dir, **kw)
    return model.cfg, model


def convert_cli_summary(out: str) -> str:
    """One line describing a complete checkpoint (what `experiments.convert` prints)."""
    meta = read_metadata(out)
    kinds: dict[str, int] = {}
    nbytes = 0
    for e in meta["manifest"]:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        for leaf in e["leaves"].values():
            nbytes += int(np.prod(leaf["shape"])) * np.dtype(_np_dtype(leaf["dtype"])).itemsize
    q = meta["quant"]["experts"] if meta.get("quant") else "dense"
    parts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return (f"{out}: {len(meta['units'])} units, {len(meta['manifest'])} tensors ({parts}), {nbytes / 2**20:.1f} MiB; "
            f"dtype {meta['dtype']}, int8 {meta['int8']}, experts {q} ({meta['layout']})")  # fmt: skip


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


__all__ = [
    "COMPLETE", "META", "CheckpointError", "ConversionInterrupted", "convert", "is_checkpoint", "load_checkpoint",
    "read_metadata", "restore_model",
]  # fmt: skip
