"""Converting an HF folder (+ a GGUF's routed experts) into a glm53 Orbax checkpoint (`glm53.checkpoint.orbax`).

Atomicity and resume (`convert`): everything is written under ``OUT.partial``; a unit is staged in
``units/.<unit>.staging`` and renamed into place when its arrays and manifest are written, so a unit directory
that exists is complete. A rerun with the same arguments skips finished units (different arguments: an error
naming what differs, or naming the source files that changed since the conversion started: their sizes and
modification times are part of the fingerprint, so a resume never mixes two models; delete ``OUT.partial`` to
convert the new files). Only when every unit exists are the sidecar and COMPLETE written and ``OUT.partial``
renamed to OUT: an interrupted run never leaves a directory named OUT. Arrays are stored in Orbax chunks of at
most `chunk_bytes`: the read granularity of a sharded restore.

`save_model` writes a model (any `ModelConfig.scan_layers`) in the same format, per layer.

Several processes (`glm53.parallel.distributed`, e.g. one per host of a slice): process 0 alone reads the sources
and writes every unit (with an Orbax writer of its own: Orbax writes host arrays from process 0 only) and the
sidecar; the others wait for it. The result is the checkpoint one process writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from glm53.checkpoint import gguf as G
from glm53.checkpoint import gguf_rules, scan
from glm53.checkpoint.hf import checkpoint_has_mtp, load_hf_weights, mtp_choice, shard_files
from glm53.checkpoint.orbax import (
    COMPLETE,
    FORMAT,
    META,
    PARTIAL_SUFFIX,
    PLAN,
    UNITS,
    VERSION,
    describe,
    nest,
    read_metadata,
    unit_of,
)
from glm53.config import ModelConfig, QuantConfig, load_hf_config, model_config_to_dict
from glm53.errors import CheckpointError
from glm53.files import write_json
from glm53.layers.param import Path, path_str
from glm53.model import Glm53Model
from glm53.parallel import distributed
from glm53.progress import Progress
from glm53.quant.int8 import Int8Weight
from glm53.quant.mixes import MATRICES
from glm53.quant.qweight import QuantizedExperts, expert_formats

_log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "float32": "float32", "f32": "float32"}


class ConversionInterrupted(RuntimeError):
    """Raised by `convert(interrupt_after=k)` after k units were written (a test hook)."""


def plan_units(paths: Sequence[Path]) -> dict[str, list[Path]]:
    """unit -> its parameter paths, units in first-appearance order."""
    out: dict[str, list[Path]] = {}
    for p in paths:
        out.setdefault(unit_of(p), []).append(tuple(p))
    return out


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
        tree = nest(nodes)
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=self.chunk_bytes), tree)
        _unit_checkpointer().save(
            os.path.join(staging, "arrays"), args=ocp.args.PyTreeSave(tree, save_args=save_args)
        )
        write_json(os.path.join(staging, "manifest.json"), {"unit": unit, "tensors": entries})
        os.rename(staging, self.unit_dir(unit))
        self.written += 1
        if self.progress is not None:
            self.progress.update(1, postfix=unit)
        _log.info("wrote unit %s (%d tensors)", unit, len(entries))
        if self.interrupt_after is not None and self.written >= self.interrupt_after:
            raise ConversionInterrupted(f"conversion interrupted after {self.written} units (test hook)")


def _unit_checkpointer() -> ocp.Checkpointer:
    """Orbax's PyTree checkpointer; with several processes, one of this process (0) alone: no collective."""
    if distributed.process_count() == 1:
        return ocp.PyTreeCheckpointer()
    me = jax.process_index()
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=mp), multiprocessing_options=mp)


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
    if not experts:
        return None
    fmts = {(et.layer, et.matrix): et.format.name for et in experts.values()}
    per_matrix = {m: {f for (_, mm), f in fmts.items() if mm == m} for m in MATRICES}
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
        suffixes = tuple(f".ffn_{m}_exps.weight" for m in MATRICES)
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
    with_mtp: bool | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = True,
    interrupt_after: int | None = None,
) -> str:
    """Converts an HF folder (non-experts; experts too without `gguf`) and optionally a GGUF's routed experts
    into a glm53 Orbax checkpoint at `out` (module docstring: atomicity, resume). Returns `out`.

    dtype: "bfloat16" | "float32" for the floating parameters. int8: non-expert Linear kernels with at least
    `int8_min_size` weights (not the router) stored as per-channel Int8Weight. layout: "planes" | "reencoded"
    for the quantized experts (formats as in the GGUF). with_mtp: None converts the MTP block when the HF
    folder has one (`glm53.checkpoint.hf.mtp_choice`). interrupt_after: raise ConversionInterrupted after that
    many units were written in this run (test hook). Raises CheckpointError for bad input, naming it.
    """
    out = os.path.abspath(os.fspath(out))
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_NAMES)}")
    dtype = DTYPE_NAMES[dtype]
    if os.path.exists(out):
        raise CheckpointError(f"{out}: already exists; remove it or choose another --out")
    cfg = load_hf_config(hf_dir)
    with_mtp = mtp_choice(with_mtp, checkpoint_has_mtp(hf_dir, cfg), os.fspath(hf_dir), cfg.num_hidden_layers)
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
            "files": source_files(hf_dir, gguf),
        }  # fmt: skip
        fingerprint = json.loads(json.dumps(fingerprint))  # as plan.json reads back (lists, not tuples)
        work = out + PARTIAL_SUFFIX
        main = distributed.is_main_process()  # several processes: process 0 prepares and finalizes
        if main:
            _prepare_work(work, fingerprint)
        distributed.barrier("glm53 convert: work directory ready")
        if os.path.exists(os.path.join(work, COMPLETE)):  # finished, but stopped before the final rename
            if main:
                os.rename(work, out)
            distributed.barrier("glm53 convert: renamed")
            return out
        mine = list(plan) if main else []
        # a tqdm bar on a terminal, a plain line now and then otherwise (glm53.progress)
        bar = Progress(len(mine), desc=f"convert -> {os.path.basename(out)}", unit="unit") if progress and main else None
        writer = _Writer(work, plan, chunk_bytes, interrupt_after, bar)
        todo = [u for u in mine if not writer.done(u)]
        if bar is not None:
            bar.update(len(mine) - len(todo))
        try:
            # Routed experts from the GGUF: one unit per layer, read tensor by tensor.
            for unit in todo:
                if experts and unit.endswith(".experts"):
                    writer.write(unit, {p: _expert_host_value(experts[p], targets[p]) for p in plan[unit]})
            rest = [u for u in todo if not (experts and u.endswith(".experts"))]
            if rest:
                skip_units = set(plan) - set(rest)
                load_hf_weights(
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
    distributed.barrier("glm53 convert: units written")
    if main:
        _finalize(work, out, plan, fingerprint, cfg, quant)
    distributed.barrier("glm53 convert: finalized")
    return out


def save_model(model: Glm53Model, out: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """Writes a concrete `Glm53Model` (of one process) as a glm53 Orbax checkpoint at `out`, the format `convert`
    writes: per layer whatever the model's `scan_layers` (a stacked value is sliced one layer at a time,
    `glm53.checkpoint.scan`), so a scanned model and its unrolled twin write the same checkpoint. Values are stored
    as they are (floats in their dtype, Int8Weight, QuantizedExperts); the sidecar names no sources. Written under
    ``OUT.partial`` and renamed; an existing `out` or ``OUT.partial`` is a CheckpointError. Returns `out`."""
    out = os.path.abspath(os.fspath(out))
    work = out + PARTIAL_SUFFIX
    for p in (out, work):
        if os.path.exists(p):
            raise CheckpointError(f"{p}: already exists; remove it or choose another path")
    items = scan.per_layer_items(model)
    plan = plan_units([p for p, _ in items])
    quant = model.quant
    info = dict(hf=None, gguf=[], dtype=jnp.dtype(model.dtype).name, int8=False, with_mtp=model.mtp is not None,
                layout=quant.layout if quant is not None else "planes")  # fmt: skip
    os.makedirs(os.path.join(work, UNITS))
    writer = _Writer(work, plan, chunk_bytes)
    for path, get in items:
        value = get()
        if isinstance(value, QuantizedExperts) and value.planes.block_splits != 1:
            raise CheckpointError(f"save_model: {path_str(path)} is laid out for a mesh (block_splits "
                                  f"{value.planes.block_splits}); save the model before sharding it")  # fmt: skip
        info["int8"] = info["int8"] or isinstance(value, Int8Weight)
        writer.add(path, value)
    _finalize(work, out, plan, info, scan.per_layer_config(model.cfg), quant)
    return out


def source_files(hf_dir: str, gguf: Sequence[str]) -> dict[str, list[int]]:
    """{path: [size, mtime_ns]} of every file a conversion reads (config.json, safetensors index and shards,
    GGUF files): the identity of the sources a resumed conversion must find unchanged."""
    paths = [os.path.join(hf_dir, "config.json"), *shard_files(hf_dir), *gguf]
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        paths.append(index)
    out = {}
    for p in paths:
        st = os.stat(p)
        out[os.path.abspath(p)] = [st.st_size, st.st_mtime_ns]
    return out


def _quant_dict(quant: QuantConfig | None) -> dict | None:
    if quant is None:
        return None
    d = dataclasses.asdict(quant)
    if isinstance(d["experts"], (tuple, list)):
        d["experts"] = dict(d["experts"])
    return d


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
        if diff == ["files"]:
            was, now = old.get("files") or {}, fingerprint["files"]
            changed = sorted(p for p in set(was) | set(now) if was.get(p) != now.get(p))
            raise CheckpointError(
                f"{work}: the source files changed since this conversion started ({', '.join(changed[:5])}"
                f"{', ...' if len(changed) > 5 else ''}); resuming would mix two models: delete {work} to convert "
                "the current files",
                [f"changed since the conversion started (size, mtime): {p}" for p in changed],
            )
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
    write_json(plan_file, {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint})


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
    write_json(os.path.join(work, META), meta)
    with open(os.path.join(work, META), "rb") as f:
        sidecar_crc = zlib.crc32(f.read())
    write_json(os.path.join(work, COMPLETE), {"units": len(plan), "tensors": len(manifest),
                                              "sidecar_crc32": sidecar_crc})  # fmt: skip
    os.rename(work, out)
    _log.info("wrote %s: %d units, %d tensors", out, len(plan), len(manifest))


def convert_cli_summary(out: str) -> str:
    """One line describing a complete checkpoint (what `experiments.convert` prints)."""
    meta = read_metadata(out)
    kinds: dict[str, int] = {}
    nbytes = 0
    for e in meta["manifest"]:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        for leaf in e["leaves"].values():
            nbytes += int(np.prod(leaf["shape"])) * _np_dtype(leaf["dtype"]).itemsize
    q = meta["quant"]["experts"] if meta.get("quant") else "dense"
    parts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return (f"{out}: {len(meta['units'])} units, {len(meta['manifest'])} tensors ({parts}), {nbytes / 2**20:.1f} MiB; "
            f"dtype {meta['dtype']}, int8 {meta['int8']}, experts {q} ({meta['layout']})")  # fmt: skip


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
