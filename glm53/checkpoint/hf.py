"""Loading an HF GLM-5.3 safetensors checkpoint (bf16 / fp32, or the released FP8 form) into a glm53 model.

The model is built abstractly (`nnx.eval_shape`); shards are read one at a time, each tensor is mapped by the
rule table in `hf_rules`, transformed into our layout, checked against the abstract parameter and placed on
device. Routed experts stored per expert (possibly spread over several shards) are accumulated per parameter
until every expert has arrived. Nothing is raised until the last shard has been read: then every problem found
(missing parameters, unexpected keys, wrong shapes, unsupported dtypes, FP8 weights without scales, unreadable
files) is reported in one `CheckpointError`.

FP8 (``quantization_config.quant_method == "fp8"``): weights and their block scales are paired and dequantized
on the host by `glm53.checkpoint.hf_fp8`. Optionally (``int8=True``) the large non-expert Linear kernels are
stored as `Int8Weight` (int8 + one f32 scale per output channel).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.checkpoint import hf_fp8, scan, slices
from glm53.checkpoint.hf_fp8 import FP8_DTYPE, SCALE_DTYPES, QuantInfo, read_quant_info
from glm53.checkpoint.hf_rules import Ignored, Mapped, Path, ShapeProblem, classify
from glm53.config import load_hf_config
from glm53.errors import CheckpointError
from glm53.io.safetensors import DTYPES, SafetensorsFile
from glm53.layers.param import path_str
from glm53.model import Glm53Model
from glm53.parallel import distributed
from glm53.quant.int8 import Int8Weight, quantize_int8

_log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass
class LoadReport:
    """What a load did: files and tensors read, parameters filled, keys ignored (by reason)."""

    files: list[str] = dataclasses.field(default_factory=list)
    tensors_read: int = 0
    bytes_read: int = 0
    params_loaded: int = 0
    fp8_dequantized: int = 0
    int8_params: int = 0
    ignored: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))

    def summary(self) -> str:
        ign = ", ".join(f"{n} {r}" for r, n in sorted(self.ignored.items())) or "none"
        return (f"{len(self.files)} files, {self.tensors_read} tensors ({self.bytes_read / 2**20:.1f} MiB) -> "
                f"{self.params_loaded} params ({self.fp8_dequantized} dequantized from FP8, {self.int8_params} "
                f"stored int8); ignored: {ign}")  # fmt: skip


def shard_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder, in index order (``model.safetensors.index.json``) or sorted."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise CheckpointError(
                f"{index}: lists shard files that do not exist: {missing}",
                [f"file: {os.path.join(folder, n)}: listed in the index but missing" for n in missing],
            )
        return [os.path.join(folder, n) for n in names]
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return [os.path.join(folder, f) for f in files]


def checkpoint_has_mtp(folder: str | os.PathLike, cfg) -> bool:
    """Whether the folder stores the MTP block (keys ``...layers.{num_hidden_layers}.*``); a folder written by
    transformers' ``save_pretrained`` has none. Read from the index or the shard headers."""
    folder = os.fspath(folder)

    def is_mtp(key: str) -> bool:
        c = classify(key, cfg.num_hidden_layers, 1)
        return isinstance(c, Mapped) and c.target_prefix()[:1] == ("mtp",)

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                return any(is_mtp(k) for k in json.load(f)["weight_map"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return True  # unreadable: the loader reports it
    for path in shard_files(folder):
        try:
            if any(is_mtp(k) for k in SafetensorsFile(path).keys()):
                return True
        except CheckpointError:
            return True  # unreadable: the loader reports it
    return False


def mtp_choice(with_mtp: bool | None, present: bool, where: str, layer: int) -> bool:
    """Whether to build the MTP block: `with_mtp` None ("auto") follows the checkpoint (logged when it has
    none); True requires it (CheckpointError naming `where` when absent); False leaves it out."""
    if with_mtp is None:
        if not present:
            _log.warning("%s has no MTP block (layer %d): loading the model without it", where, layer)
        return present
    if with_mtp and not present:
        raise CheckpointError(f"{where}: no MTP block (layer {layer}) in the checkpoint, but the MTP block was "
                              "required (--mtp=on); load it with --mtp=auto or --mtp=off")  # fmt: skip
    return bool(with_mtp)


def default_int8_filter(path: Path, shape: tuple[int, ...], min_size: int) -> bool:
    """Large non-expert Linear kernels: 2-D ``kernel`` params of >= min_size weights, except the router."""
    return (
        path[-1] == "kernel" and len(shape) == 2 and int(np.prod(shape)) >= min_size and "router" not in path
    )


class _Loader:
    """State of one load: abstract targets, finished values, expert buffers, FP8 pairs, problems."""

    def __init__(self, targets, cfg, quant: QuantInfo, int8_select, put, report: LoadReport,
                 skipped: frozenset = frozenset(), lazy: bool = False):  # fmt: skip
        self.targets: dict[Path, jax.ShapeDtypeStruct] = targets
        self.skipped = (
            skipped  # params filled elsewhere (load_hf_weights(skip=...)): neither read nor required
        )
        self._prefixes: tuple[set, set] | None = None
        self.cfg, self.quant, self.int8_select, self.put, self.report = cfg, quant, int8_select, put, report
        self.values: dict[Path, object] = {}
        self.sources: dict[Path, str] = {}
        # Stacked expert params being filled: path -> (buffer [E, ...], filled [E], first key).
        self.experts: dict[Path, tuple[np.ndarray, np.ndarray, str]] = {}
        # FP8 weights waiting for their scale, and scales waiting for their weight (keyed by the weight's key).
        self.fp8_weights: dict[str, tuple[Mapped, np.ndarray, str]] = {}
        self.scales: dict[str, tuple[np.ndarray, str]] = {}
        self.rejected: set[str] = set()  # FP8 weights already reported (their scales are dropped silently)
        self.problems: dict[str, list[str]] = collections.defaultdict(list)
        self.num_mtp = 1 if any(p[0] == "mtp" for p in targets) else 0
        # Several processes: bf16 / fp32 tensors become views (`glm53.checkpoint.slices.LazyArray`) read when
        # placed, each process only the blocks of its own devices when the parameter spans processes.
        self.lazy = lazy

    # ------------------------------------------------------------------ reading
    def read_file(self, path: str) -> None:
        try:
            sf = SafetensorsFile(path)
        except CheckpointError as e:
            self.problems["file"].append(str(e))
            return
        fname = os.path.basename(path)
        for key in sf.keys():
            try:
                self._read_key(sf, key, fname)
            except CheckpointError as e:
                self.problems["file"].append(str(e))

    def _read_key(self, sf: SafetensorsFile, key: str, fname: str) -> None:
        dt = sf.dtype(key)
        partner = hf_fp8.scale_partner(key)
        if partner is not None:
            if dt not in SCALE_DTYPES:
                self.problems["dtype"].append(
                    f"{key} ({fname}): scale dtype {dt} is not one of {SCALE_DTYPES}"
                )
                return
            pc = classify(partner, self.cfg.num_hidden_layers, self.num_mtp)
            if isinstance(pc, Ignored):
                self.report.ignored[pc.reason] += 1
                return
            if not isinstance(pc, Mapped):
                self.problems["unexpected"].append(f"{key} ({fname}): scale of '{partner}', {pc.reason}")
                return
            if self._skipped(pc):
                self.report.ignored[_SKIPPED] += 1
                return
            if partner in self.rejected:
                return
            scale = self._read(sf, key)
            if partner in self.fp8_weights:
                mapped, w, wfile = self.fp8_weights.pop(partner)
                self._dequantize_and_place(mapped, w, scale, wfile)
            else:
                self.scales[partner] = (scale, fname)
            return
        if hf_fp8.is_activation_scale(key):
            self.report.ignored["activation scales (weights are dequantized)"] += 1
            return
        c = classify(key, self.cfg.num_hidden_layers, self.num_mtp)
        if isinstance(c, Ignored):
            self.report.ignored[c.reason] += 1
            return
        if not isinstance(c, Mapped):
            self.problems["unexpected"].append(f"{key} ({fname}): {c.reason}")
            return
        if self._skipped(c):
            self.report.ignored[_SKIPPED] += 1
            return
        if dt == FP8_DTYPE:
            if self.quant.excluded(hf_fp8.module_name(key)):
                self.rejected.add(key)  # its scale is not reported again
                self.scales.pop(key, None)
                self.problems["dtype"].append(f"{key} ({fname}): stored as {dt} but its module is listed in "
                                              "quantization_config.modules_to_not_convert")  # fmt: skip
                return
            w = self._read(sf, key)
            if key in self.scales:
                scale, _ = self.scales.pop(key)
                self._dequantize_and_place(c, w, scale, fname)
            else:
                self.fp8_weights[key] = (c, w, fname)
            return
        if dt not in FLOAT_DTYPES:
            self.problems["dtype"].append(f"{key} ({fname}): unsupported dtype {dt} (expected one of "
                                          f"{FLOAT_DTYPES + (FP8_DTYPE,)})")  # fmt: skip
            return
        self.place(c, self._view(sf, key) if self.lazy else self._read(sf, key), fname)

    def _skipped(self, mapped: Mapped) -> bool:
        """Whether every parameter the key can map onto is skipped (then its bytes are not even read)."""
        if not self.skipped:
            return False
        if self._prefixes is None:  # (prefixes of skipped params, prefixes of loaded params)
            self._prefixes = tuple(
                {p[:i] for p in ps for i in range(len(p) + 1)} for ps in (self.skipped, self.targets)
            )
        prefix = mapped.target_prefix()
        return prefix in self._prefixes[0] and prefix not in self._prefixes[1]

    def _read(self, sf: SafetensorsFile, key: str) -> np.ndarray:
        a = sf.read(key)
        self.report.tensors_read += 1
        self.report.bytes_read += a.nbytes
        return a

    def _view(self, sf: SafetensorsFile, key: str) -> slices.LazyArray:
        """The tensor as a view read by box when placed (bytes_read counts what is read)."""
        self.report.tensors_read += 1

        def read(box):
            a = sf.read_box(key, box)
            self.report.bytes_read += a.nbytes
            return a

        return slices.LazyArray(read, sf.shape(key), DTYPES[sf.dtype(key)], f"{sf.path}, tensor '{key}'")

    def _dequantize_and_place(self, mapped: Mapped, w: np.ndarray, scale: np.ndarray, fname: str) -> None:
        try:
            value = hf_fp8.dequantize(w, scale, self.quant.block, mapped.key)
        except ShapeProblem as e:
            self.problems["shape"].append(f"{mapped.key} ({fname}): {e}")
            return
        self.report.fp8_dequantized += 1
        self.place(mapped, value, fname)

    # ------------------------------------------------------------------ placing
    def place(self, mapped: Mapped, a: np.ndarray, fname: str) -> None:
        """Transforms one HF tensor and stores (or accumulates) its placements after checking them."""
        where = f"{mapped.key} ({fname})"
        try:
            placements = mapped.apply(a)
        except ShapeProblem as e:
            self.problems["shape"].append(f"{where}: {e}")
            return
        for p in placements:
            if p.path in self.skipped:
                continue
            target = self.targets.get(p.path)
            name = path_str(p.path)
            if target is None:
                self.problems["unexpected"].append(
                    f"{where}: maps to '{name}', which the model does not have"
                )
                continue
            shape = tuple(target.shape)
            if p.expert is None:
                if tuple(p.value.shape) != shape:
                    self.problems["shape"].append(
                        f"{where}: shape {tuple(a.shape)} -> '{name}' {tuple(p.value.shape)}, model expects {shape}"
                    )
                    continue
                if p.path in self.sources or p.path in self.experts:
                    self.problems["duplicate"].append(
                        f"{where}: '{name}' was already loaded from "
                        f"{self.sources.get(p.path) or self.experts[p.path][2]}"
                    )
                    continue
                self.sources[p.path] = mapped.key
                self.values[p.path] = self.finish(p.path, target, p.value)
                continue
            # One expert's slice of a stacked [E, ...] parameter.
            if not 0 <= p.expert < shape[0] or tuple(p.value.shape) != shape[1:]:
                self.problems["shape"].append(
                    f"{where}: expert {p.expert} {tuple(a.shape)} -> '{name}'[{p.expert}] {tuple(p.value.shape)}, "
                    f"model expects {shape[0]} experts of {shape[1:]}"
                )
                continue
            if p.path in self.sources:
                self.problems["duplicate"].append(
                    f"{where}: '{name}' was already loaded from {self.sources[p.path]}"
                )
                continue
            if p.path not in self.experts:
                buf = [None] * shape[0] if self.lazy else np.empty(shape, np.dtype(target.dtype))
                self.experts[p.path] = (buf, np.zeros(shape[0], bool), mapped.key)
            buf, filled, _ = self.experts[p.path]
            if filled[p.expert]:
                self.problems["duplicate"].append(
                    f"{where}: expert {p.expert} of '{name}' was already loaded"
                )
                continue
            buf[p.expert] = p.value if self.lazy else p.value.astype(buf.dtype)
            filled[p.expert] = True
            if filled.all():
                del self.experts[p.path]
                self.sources[p.path] = f"{shape[0]} per-expert tensors"
                if self.lazy:
                    buf = slices.Stacked(buf, np.dtype(target.dtype), name)
                self.values[p.path] = self.finish(p.path, target, buf)

    def finish(self, path: Path, target, value: np.ndarray):
        """Casts to the parameter dtype (or int8) and puts the value on device (a view spanning processes: read
        by `put` block by block, else read whole here)."""
        self.report.params_loaded += 1
        dtype = np.dtype(target.dtype)
        sharding = getattr(target, "sharding", None)
        int8 = self.int8_select(path, tuple(target.shape))
        if isinstance(value, (slices.LazyArray, slices.Stacked)):
            if not int8 and sharding is not None and not sharding.is_fully_addressable:
                return self.put(path, value.astype(dtype), sharding)
            value = np.asarray(value)
        if int8:
            self.report.int8_params += 1
            q = quantize_int8(value, dtype=dtype)
            sharding = getattr(target, "sharding", None)
            return Int8Weight(self.put(path, q.values, sharding), self.put(path, q.scale, _vector_sharding(sharding)),
                              q.dtype)  # fmt: skip
        return self.put(path, np.asarray(value, dtype), getattr(target, "sharding", None))

    # ------------------------------------------------------------------ end
    def check_complete(self) -> None:
        for key, (_, _, fname) in self.fp8_weights.items():
            self.problems["fp8"].append(f"{key} ({fname}): FP8 weight without a weight_scale_inv")
        for key, (_, fname) in self.scales.items():
            self.problems["fp8"].append(f"{key}_scale_inv / weight_scale_inv ({fname}): scale without an FP8 weight "
                                        f"'{key}'")  # fmt: skip
        for path, (_, filled, first) in self.experts.items():
            miss = np.flatnonzero(~filled).tolist()
            self.problems["missing"].append(f"{path_str(path)}: experts {_ranges(miss)} missing (others loaded "
                                            f"from keys like {first})")  # fmt: skip
        has_mtp = any(k in self.sources for k in self.targets if k[0] == "mtp")
        for path, t in self.targets.items():
            if path not in self.values and path not in self.experts:
                hint = ""
                if path[0] == "mtp" and not has_mtp:
                    hint = (f" (the checkpoint has no MTP block, layer {self.cfg.num_hidden_layers}: load it with "
                            "--mtp=auto / with_mtp=None)")  # fmt: skip
                self.problems["missing"].append(
                    f"{path_str(path)} {list(t.shape)} {np.dtype(t.dtype).name}{hint}"
                )


def _ranges(ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _vector_sharding(sharding):
    """The sharding of a per-output-channel vector for a matrix sharded as `sharding` (last axis kept)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * 2
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[1]))
    return sharding


def _default_put(path: Path, value: np.ndarray, sharding) -> jax.Array:
    return distributed.put(value, sharding)  # several processes: each places only its own devices' blocks


_SKIPPED = "parameters filled from elsewhere (skip)"
_ORDER = ("file", "missing", "unexpected", "shape", "dtype", "fp8", "duplicate")


def _raise(folder: str, problems: dict[str, list[str]]) -> None:
    n = sum(len(v) for v in problems.values())
    lines = [f"HF checkpoint {folder}: {n} problem{'s' if n != 1 else ''}"]
    flat = []
    for kind in _ORDER:
        items = problems.get(kind, [])
        if items:
            lines.append(f"  {kind} ({len(items)}):")
            lines.extend(f"    {p}" for p in items)
            flat.extend(f"{kind}: {p}" for p in items)
    raise CheckpointError("\n".join(lines), flat)


def load_hf_weights(
    folder: str | os.PathLike,
    abstract_model: nnx.Module,
    cfg,
    *,
    int8: bool = False,
    int8_min_size: int = 1 << 20,
    int8_filter: Callable[[Path, tuple[int, ...]], bool] | None = None,
    put: Callable[[Path, np.ndarray, object], jax.Array] | None = None,
    skip: Callable[[Path], bool] | None = None,
) -> tuple[nnx.Module, LoadReport]:
    """Fills the Params of `abstract_model` (from `nnx.eval_shape`) from the safetensors files in `folder`.

    cfg: the ModelConfig (layer count, MTP). int8: store the kernels chosen by `int8_filter` (default: 2-D Linear
    kernels with >= int8_min_size weights, not the router) as `Int8Weight`. put(path, host_value, sharding):
    how a host array becomes a device array (default: `jax.device_put` with the abstract value's sharding).
    skip(path): parameters filled from elsewhere (e.g. routed experts from a GGUF): not required, keys that map
    only onto them are not read, and they stay abstract in the returned model.
    Returns (model, report) (a scanned abstract model is filled per layer, then stacked); raises `CheckpointError`
    listing every problem.
    """
    folder = os.fspath(folder)
    abstract_model, scanned = scan.per_layer_model(abstract_model)
    graphdef, state = nnx.split(abstract_model)
    flat = list(nnx.to_flat_state(state))
    targets = {tuple(p): v.get_value() for p, v in flat if isinstance(v, nnx.Param)}
    skipped = frozenset(p for p in targets if skip is not None and skip(p))
    targets = {p: v for p, v in targets.items() if p not in skipped}
    others = [path_str(p) for p, v in flat if not isinstance(v, nnx.Param)]
    if others:
        raise CheckpointError(f"model has non-Param variables that a checkpoint cannot fill: {others[:10]}")
    if int8_filter is None:
        select = (
            (lambda path, shape: default_int8_filter(path, shape, int8_min_size))
            if int8
            else (lambda *a: False)
        )
    else:
        select = int8_filter if int8 else (lambda *a: False)
    report = LoadReport()
    loader = _Loader(targets, cfg, read_quant_info(folder), select, put or _default_put, report, skipped,
                     lazy=distributed.process_count() > 1)  # fmt: skip
    for f in shard_files(folder):
        _log.info("reading %s", f)
        report.files.append(f)
        loader.read_file(f)
    loader.check_complete()
    if loader.problems:
        _raise(folder, loader.problems)
    for path, var in flat:
        if tuple(path) not in skipped:
            var.set_value(loader.values[tuple(path)])
    _log.info("loaded %s: %s", folder, report.summary())
    return scan.restack(nnx.merge(graphdef, state), scanned), report


def load_hf_checkpoint(folder: str | os.PathLike, cfg=None, *, dtype=jnp.bfloat16, kernels=None,
                       with_mtp: bool | None = None, abstract_fn=nnx.eval_shape, **kw):  # fmt: skip
    """Builds `Glm53Model` abstractly from `cfg` (default: the folder's config.json) and loads the folder.

    dtype / kernels: as `Glm53Model`. with_mtp: see `mtp_choice` (None: when the folder has the block; without
    it, checkpoint layer num_hidden_layers is ignored). abstract_fn(build): the abstract model (default
    `nnx.eval_shape`; `glm53.parallel.abstract_sharded_model` on a mesh puts every tensor straight into its
    shards). Returns (model, report), the model stacked when cfg.scan_layers; other keyword arguments as
    `load_hf_weights`.
    """
    folder = os.fspath(folder)
    cfg = load_hf_config(folder) if cfg is None else cfg
    with_mtp = mtp_choice(with_mtp, checkpoint_has_mtp(folder, cfg), folder, cfg.num_hidden_layers)
    pl = scan.per_layer_config(cfg)  # loaded per layer (`glm53.checkpoint.scan`), stacked at the end
    abstract = abstract_fn(
        lambda: Glm53Model(pl, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels, with_mtp=with_mtp)
    )
    model, report = load_hf_weights(folder, abstract, cfg, **kw)
    return scan.restack(model, cfg.scan_layers), report


def load_hf_model(folder: str | os.PathLike, *, dtype=jnp.bfloat16, **kw):
    """(cfg, model) from an HF folder: its config.json and weights (see `load_hf_checkpoint`)."""
    cfg = load_hf_config(folder)
    model, report = load_hf_checkpoint(folder, cfg, dtype=dtype, **kw)
    return cfg, model
