"""Loading GLM-5.3 from llama.cpp GGUF files: a complete GGUF, or the hybrid of an HF checkpoint's non-expert
weights with a GGUF's routed experts.

Complete GGUF (`load_gguf_model`): the config comes from the GGUF metadata (architecture `glm5-next` or
`glm5next`); the model is built abstractly and every parameter is read from its tensor(s) by the name map of
`gguf_rules` (docs/architecture.md §10), transformed into our layout and checked against the abstract
parameter. Tensors of any GGUF type glm53 decodes (F32 / F16 / BF16 / Q8_0 / K- and i-quants) are dequantized
to the parameter dtype on load. Problems (missing / unexpected tensors, wrong shapes, unsupported types,
unreadable bytes) are collected and raised once, as one `CheckpointError` naming every tensor.

Routed experts are decoded to dense [E, in, out] arrays, or -- for a model built with a `QuantConfig` -- kept
as the GGUF blocks (`glm53.quant.qweight.QuantizedExperts`). `expert_tensors` is the seam: per (layer, matrix)
it gives the GGUF tensor's format, shape and a reader of its raw blocks.

Hybrid (`load_hybrid`): everything but the routed experts from an HF folder (bf16 / fp32 / FP8, via
`glm53.checkpoint.hf`; the folder's expert tensors, if any, are not read), the routed experts from a GGUF.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.constants import GGMLQuantizationType

from glm53.checkpoint import gguf_rules as rules
from glm53.checkpoint import scan, slices
from glm53.checkpoint.gguf_rules import Path, Target
from glm53.checkpoint.hf import checkpoint_has_mtp, load_hf_weights, mtp_choice
from glm53.config import ConfigError, ModelConfig, load_hf_config
from glm53.errors import CheckpointError
from glm53.io.gguf import GGUFError, GGUFModel, TensorInfo
from glm53.layers.param import is_routed_expert
from glm53.model import Glm53Model
from glm53.parallel import distributed
from glm53.quant import dequant
from glm53.quant.formats import QuantFormat
from glm53.quant.mixes import MATRICES
from glm53.quant.qweight import QuantizedExperts

_log = logging.getLogger(__name__)

_ORDER = ("file", "metadata", "missing", "unexpected", "shape", "type", "value")
_NUMPY_TYPES = {GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2")}
# Layouts read by block when a parameter spans processes (CONV / SSM_A / KV_B, all small: whole).
_BY_BLOCK = (rules.SAME, rules.LINEAR)
EXPERT_CHUNK_WEIGHTS = 1 << 26  # experts decoded per jnp call: at most this many weights (256 MiB of f32)


@dataclasses.dataclass
class GGUFLoadReport:
    """What a GGUF load did: tensors read (by GGUF type), parameters filled, tensors ignored (by reason)."""

    file: str
    tensors_read: int = 0
    bytes_read: int = 0
    params_loaded: int = 0
    types: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
    ignored: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))

    def summary(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items())) or "none"
        ign = ", ".join(f"{n} {r}" for r, n in sorted(self.ignored.items())) or "none"
        return (f"{self.file}: {self.tensors_read} tensors ({self.bytes_read / 2**20:.1f} MiB; {types}) -> "
                f"{self.params_loaded} params; ignored: {ign}")  # fmt: skip


class _Problems:
    def __init__(self, name: str):
        self.name = name
        self.items: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, kind: str, msg: str) -> None:
        self.items[kind].append(msg)

    def raise_if_any(self) -> None:
        n = sum(len(v) for v in self.items.values())
        if not n:
            return
        lines, flat = [f"GGUF {self.name}: {n} problem{'s' if n != 1 else ''}"], []
        for kind in _ORDER:
            for i, p in enumerate(self.items.get(kind, [])):
                if i == 0:
                    lines.append(f"  {kind} ({len(self.items[kind])}):")
                lines.append(f"    {p}")
                flat.append(f"{kind}: {p}")
        raise CheckpointError("\n".join(lines), flat)


# ------------------------------------------------------------------------------------------------ reading
def open_gguf_model(path: str | os.PathLike) -> GGUFModel:
    """Opens a GGUF file (or the split set it belongs to); unreadable files raise CheckpointError."""
    try:
        return GGUFModel(path)
    except (GGUFError, OSError) as e:
        raise CheckpointError(f"GGUF {os.fspath(path)}: cannot open: {e}") from None


def gguf_config(g: GGUFModel) -> ModelConfig:
    """The ModelConfig of a GGUF from its metadata; raises CheckpointError naming every bad key."""
    embd = g.tensors.get("token_embd.weight")
    n_vocab = embd.shape[0] if embd is not None and len(embd.shape) == 2 else None
    try:
        return rules.config_from_metadata(g.get, name=g.name, n_vocab=n_vocab)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def has_mtp(g: GGUFModel, cfg: ModelConfig) -> bool:
    """Whether the GGUF holds the MTP block (tensors ``blk.{num_hidden_layers}.*``)."""
    prefix = f"blk.{cfg.num_hidden_layers}."
    return cfg.num_nextn_predict_layers > 0 and any(n.startswith(prefix) for n in g.tensors)


def decode_tensor(g: GGUFModel, info: TensorInfo) -> np.ndarray:
    """A whole GGUF tensor as f32, numpy order (F32 / F16 directly, every other type via glm53's dequantizers)."""
    raw = g.read_tensor_bytes(info.name)
    dt = _NUMPY_TYPES.get(GGMLQuantizationType(info.ggml_type))
    if dt is not None:
        return raw.view(dt).reshape(info.shape).astype(np.float32)
    return np.asarray(dequant.dequantize(raw, info.format, info.shape))


@dataclasses.dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert matrix of one layer as stored in a GGUF: format, shape and reader of the raw blocks.

    shape is numpy order [E, out, in] (each row: the `in` weights of one output channel, in blocks of the
    format); our parameter is [E, in, out].
    """

    path: Path  # our parameter, e.g. ("layers", 3, "mlp", "experts", "gate_proj")
    name: str  # GGUF tensor name, e.g. "blk.3.ffn_gate_exps.weight"
    format: QuantFormat
    shape: tuple[int, int, int]
    gguf: GGUFModel = dataclasses.field(compare=False, repr=False)

    @property
    def matrix(self) -> str:
        """The matrix: "gate", "up" or "down"."""
        return str(self.path[-1]).removesuffix("_proj")

    @property
    def layer(self) -> int | str:
        """Trunk layer index, or "mtp"."""
        return self.path[1] if self.path[0] == "layers" else "mtp"

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Raw bytes of experts [start, stop): uint8 [stop - start, out * row bytes]."""
        stop = self.shape[0] if stop is None else stop
        return self.gguf.read_tensor_rows(self.name, start, stop)

    def quantized(self, layout: str = "planes"):
        """The experts kept quantized: a `glm53.quant.qweight.QuantizedExperts` (host planes, no decoding)."""
        return QuantizedExperts.from_gguf_bytes(self.read(), self.format, self.shape, layout, name=self.name)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """All experts decoded into our layout [E, in, out] of `dtype` (host numpy)."""
        e, out, inp = self.shape
        result = np.empty((e, inp, out), np.dtype(dtype))
        step = max(1, EXPERT_CHUNK_WEIGHTS // (out * inp))
        for e0 in range(0, e, step):
            e1 = min(e, e0 + step)
            raw = self.read(e0, e1).reshape(-1)
            dt = _NUMPY_TYPES.get(GGMLQuantizationType(self.format.ggml_type))
            if dt is not None:
                w = raw.view(dt).reshape(e1 - e0, out, inp)
            else:
                w = np.asarray(dequant.dequantize(raw, self.format, (e1 - e0, out, inp)))
            result[e0:e1] = w.transpose(0, 2, 1)
        return result


def _targets(abstract_model: nnx.Module, cfg: ModelConfig, problems: _Problems):
    graphdef, state = nnx.split(abstract_model)
    flat = list(nnx.to_flat_state(state))
    others = [".".join(map(str, p)) for p, v in flat if not isinstance(v, nnx.Param)]
    if others:
        raise CheckpointError(f"model has non-Param variables that a checkpoint cannot fill: {others[:10]}")
    targets: dict[Path, tuple[Target, object]] = {}
    for p, v in flat:
        p, abstract = tuple(p), v.get_value()
        scan.check_path(p, f"GGUF {problems.name}")
        try:
            targets[p] = (rules.target_for(p, tuple(abstract.shape), cfg), abstract)
        except KeyError:
            problems.add("missing", f"model parameter '{'.'.join(map(str, p))}' has no GGUF name")
    return graphdef, state, flat, targets


def _check(g: GGUFModel, t: Target, problems: _Problems) -> list[TensorInfo] | None:
    """The file's tensors for a target, or None after recording why they cannot be used."""
    infos, ok = [], True
    for name, want in zip(t.names, t.shapes):
        info = g.tensors.get(name)
        if info is None:
            problems.add("missing", f"{name} {list(want)} (for '{'.'.join(map(str, t.path))}')")
            ok = False
            continue
        if not rules.shape_ok(t.kind, info.shape, want):
            problems.add("shape", f"{name}: shape {list(info.shape)} ({info.type_name}), expected {list(want)} "
                                  f"for '{'.'.join(map(str, t.path))}'")  # fmt: skip
            ok = False
        if info.format is None:
            problems.add("type", f"{name}: GGUF type {info.type_name} is not supported by glm53")
            ok = False
        infos.append(info)
    return infos if ok else None


def expert_tensors(g: GGUFModel, cfg: ModelConfig, *, with_mtp: bool = True) -> dict[Path, ExpertTensor]:
    """The routed-expert tensors of `g` for the model of `cfg`, keyed by our parameter path.

    Checks names, shapes and formats (raises one CheckpointError naming every problem); reads no tensor bytes.
    with_mtp: include the MTP block's experts (``blk.{num_hidden_layers}``).
    """
    problems = _Problems(g.name)
    pl = scan.per_layer_config(cfg)
    abstract = nnx.eval_shape(lambda: Glm53Model(pl, rngs=nnx.Rngs(0), with_mtp=with_mtp))
    _, _, _, targets = _targets(abstract, cfg, problems)
    out = _expert_tensors(g, targets, problems)
    problems.raise_if_any()
    return out


def _expert_tensors(g: GGUFModel, targets, problems: _Problems) -> dict[Path, ExpertTensor]:
    out = {}
    for path, (t, _) in targets.items():
        if t.is_expert:
            infos = _check(g, t, problems)
            if infos is not None:
                out[path] = ExpertTensor(path, t.names[0], infos[0].format, tuple(infos[0].shape), g)
    return out


def _spans_processes(sharding) -> bool:
    """Whether a placement spans devices of other processes (then each process reads only its own blocks)."""
    return sharding is not None and not sharding.is_fully_addressable


def _expert_value(et: ExpertTensor, abstract, put, problems: _Problems):
    """A routed-expert parameter from its GGUF tensor: a QuantizedExperts when the model keeps experts quantized
    (the file's format must be the one the model was built for), else dense [E, in, out]; None on a problem.
    On a mesh that spans processes every array is placed by its sharding from the blocks of this process's
    devices only (`glm53.checkpoint.slices`: those experts / rows / input blocks are all it reads)."""
    if not isinstance(abstract, QuantizedExperts):
        sharding = getattr(abstract, "sharding", None)
        if _spans_processes(sharding):
            return put(et.path, slices.expert_dense(et, np.dtype(abstract.dtype)), sharding)
        value = et.dequantize(np.dtype(abstract.dtype))
        return put(et.path, value, sharding)
    if et.format.name != abstract.format_name:
        problems.add(
            "type", f"{et.name}: {et.format.name}, but the model keeps this tensor as {abstract.format_name}"
        )
        return None
    if any(_spans_processes(getattr(a, "sharding", None)) for a in jax.tree.leaves(abstract)):
        e, out, inp = et.shape
        if (e, inp, out) != tuple(abstract.shape):
            problems.add("shape", f"{et.name}: got kernel shape {(e, inp, out)}, {et.format.name} ({abstract.layout}); "
                                  f"the model expects kernel shape {tuple(abstract.shape)}, {abstract.format_name} "
                                  f"({abstract.layout})")  # fmt: skip
            return None
        return slices.expert_planes(et, abstract, lambda source, sharding: put(et.path, source, sharding))
    q = et.quantized(abstract.layout)
    try:
        q.check_like(abstract, et.name)
    except ValueError as e:
        problems.add("shape", str(e))
        return None
    return jax.tree.map(lambda a: put(et.path, np.asarray(a), None), q)


def _put(path: Path, value: np.ndarray, sharding) -> jax.Array:
    return distributed.put(value, sharding)  # several processes: each places only its own devices' blocks


def load_gguf_weights(
    g: GGUFModel,
    abstract_model: nnx.Module,
    cfg: ModelConfig,
    *,
    put: Callable[[Path, np.ndarray, object], jax.Array] | None = None,
) -> tuple[nnx.Module, GGUFLoadReport]:
    """Fills every Param of `abstract_model` (from `nnx.eval_shape`) from the GGUF `g`.

    put(path, host_value, sharding): how a host array becomes a device array (default: `jax.device_put` with
    the abstract value's sharding). Returns (model, report) (a scanned abstract model is filled per layer, then
    stacked: `glm53.checkpoint.scan`); raises CheckpointError listing every problem.
    """
    put = put or _put
    abstract_model, scanned = scan.per_layer_model(abstract_model)
    problems = _Problems(g.name)
    report = GGUFLoadReport(g.name)
    graphdef, state, flat, targets = _targets(abstract_model, cfg, problems)
    values: dict[Path, jax.Array] = {}
    used: set[str] = set()
    for path, (t, abstract) in targets.items():
        used.update(t.names)
        infos = _check(g, t, problems)
        if infos is None:
            continue
        try:
            if t.is_expert:
                et = ExpertTensor(path, t.names[0], infos[0].format, tuple(infos[0].shape), g)
                value = _expert_value(et, abstract, put, problems)
                if value is None:
                    continue
            elif t.kind in _BY_BLOCK and _spans_processes(getattr(abstract, "sharding", None)):
                view = slices.gguf_decoded(g, infos[0].name, infos[0].format, infos[0].shape)
                view = view.T if t.kind == rules.LINEAR else view  # read by block: only this process's
                value = put(path, view.astype(np.dtype(abstract.dtype)), abstract.sharding)
            else:
                value = rules.from_gguf(t.kind, [decode_tensor(g, info) for info in infos])
                value = put(
                    path, np.asarray(value, np.dtype(abstract.dtype)), getattr(abstract, "sharding", None)
                )
        except (GGUFError, OSError) as e:
            problems.add("file", f"{', '.join(t.names)}: cannot read: {e}")
            continue
        except ValueError as e:
            problems.add("value", f"{', '.join(t.names)}: {e}")
            continue
        for info in infos:
            report.tensors_read += 1
            report.bytes_read += info.nbytes
            report.types[info.type_name] += 1
        report.params_loaded += 1
        values[path] = value
    mtp_prefix = f"blk.{cfg.num_hidden_layers}."
    loads_mtp = any(p[0] == "mtp" for p in targets)
    for name in g.tensors:
        if name in used:
            continue
        if name.startswith(mtp_prefix) and name[len(mtp_prefix) :] in rules.MTP_IGNORED:
            report.ignored["MTP copies of the trunk embedding / lm_head"] += 1
        elif name.startswith(mtp_prefix) and not loads_mtp:
            report.ignored["MTP block (the model is built without one)"] += 1
        else:
            info = g.tensors[name]
            problems.add(
                "unexpected", f"{name} {list(info.shape)} {info.type_name}: no model parameter uses it"
            )
    problems.raise_if_any()
    for path, var in flat:
        var.set_value(values[tuple(path)])
    _log.info("loaded %s", report.summary())
    return scan.restack(nnx.merge(graphdef, state), scanned), report


def load_gguf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    dtype=jnp.bfloat16,
    kernels=None,
    with_mtp: bool | None = None,
    quant=None,
    put=None,
    abstract_fn=nnx.eval_shape,
) -> tuple[ModelConfig, nnx.Module, GGUFLoadReport]:
    """Builds `Glm53Model` abstractly (config from the GGUF metadata unless `cfg` is given) and loads the GGUF.

    with_mtp: None builds the MTP block when the file has one; True requires it (CheckpointError); False
    ignores it (`glm53.checkpoint.hf.mtp_choice`).
    quant: a `glm53.config.QuantConfig` to keep the routed experts quantized (their GGUF blocks become
    `QuantizedExperts` planes, no decoding; each tensor's type must be the one `quant` gives it); None: dense.
    abstract_fn(build): the abstract model (`glm53.parallel.abstract_sharded_model` on a mesh: every tensor
    goes straight into its shards). Returns (cfg, model, report); cfg.scan_layers: the model is loaded per layer,
    then stacked (`glm53.checkpoint.scan`).
    """
    with open_gguf_model(path) as g:
        cfg = gguf_config(g) if cfg is None else cfg
        with_mtp = mtp_choice(with_mtp, has_mtp(g, cfg), g.name, cfg.num_hidden_layers)
        pl = scan.per_layer_config(cfg)
        abstract = abstract_fn(
            lambda: Glm53Model(
                pl, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels, with_mtp=with_mtp, quant=quant
            )
        )
        model, report = load_gguf_weights(g, abstract, cfg, put=put)
    return cfg, scan.restack(model, cfg.scan_layers), report


def load_gguf_model(path: str | os.PathLike, *, dtype=jnp.bfloat16, **kw) -> tuple[ModelConfig, nnx.Module]:
    """(cfg, model) from a complete GGUF (see `load_gguf_checkpoint`)."""
    cfg, model, _ = load_gguf_checkpoint(path, dtype=dtype, **kw)
    return cfg, model


def load_hybrid(
    hf_dir: str | os.PathLike,
    experts_gguf: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    dtype=jnp.bfloat16,
    kernels=None,
    with_mtp: bool | None = None,
    quant=None,
    put=None,
    abstract_fn=nnx.eval_shape,
    **hf_kw,
) -> tuple[ModelConfig, nnx.Module]:
    """Non-expert weights from the HF folder `hf_dir`, routed experts from `experts_gguf`.

    The config is the HF folder's (unless `cfg` is given); each GGUF expert tensor must have the shape that
    config implies (blk.N for trunk layer N, blk.{num_hidden_layers} for the MTP block when with_mtp; None: when
    the HF folder has the block). quant, abstract_fn: as `load_gguf_checkpoint`. Other keyword arguments go to
    `glm53.checkpoint.hf.load_hf_weights` (e.g. int8). Returns (cfg, model); cfg.scan_layers: the model is loaded
    per layer, then stacked (`glm53.checkpoint.scan`).
    """
    cfg = load_hf_config(hf_dir) if cfg is None else cfg
    present = checkpoint_has_mtp(hf_dir, cfg)
    with_mtp = mtp_choice(with_mtp, present, os.fspath(hf_dir), cfg.num_hidden_layers)
    pl = scan.per_layer_config(cfg)
    abstract = abstract_fn(
        lambda: Glm53Model(pl, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels, with_mtp=with_mtp, quant=quant)
    )
    model, _ = load_hf_weights(hf_dir, abstract, cfg, skip=is_routed_expert, put=put, **hf_kw)
    put = put or _put
    with open_gguf_model(experts_gguf) as g:
        problems = _Problems(g.name)
        arch = g.get("general.architecture")
        if arch is not None and arch not in rules.ARCHITECTURES:
            problems.add(
                "metadata", f"general.architecture is {arch!r}; expected one of {list(rules.ARCHITECTURES)}"
            )
        graphdef, state, flat, targets = _targets(model, cfg, problems)
        targets = {p: v for p, v in targets.items() if v[0].is_expert}
        experts = _expert_tensors(g, targets, problems)
        wanted = {t.names[0] for t, _ in targets.values()}
        suffixes = tuple(f".ffn_{m}_exps.weight" for m in MATRICES)
        for name, info in g.tensors.items():
            if name.endswith(suffixes) and name not in wanted:
                problems.add("unexpected", f"{name} {list(info.shape)}: routed experts of a layer the model "
                                           f"does not have ({cfg.num_hidden_layers} layers, MTP {with_mtp})")  # fmt: skip
        problems.raise_if_any()
        values = {}
        for path, et in experts.items():
            try:
                value = _expert_value(et, targets[path][1], put, problems)
            except (GGUFError, OSError) as e:
                problems.add("file", f"{et.name}: cannot read: {e}")
                continue
            if value is not None:
                values[path] = value
        problems.raise_if_any()
    for path, var in flat:
        if tuple(path) in values:
            var.set_value(values[tuple(path)])
    _log.info("hybrid: non-experts from %s, %d expert tensors from %s", hf_dir, len(values), experts_gguf)
    return cfg, scan.restack(nnx.merge(graphdef, state), cfg.scan_layers)
