"""llama.cpp's importance matrix of the routed experts, computed by glm53, in llama.cpp's GGUF imatrix format.

For every MoE layer and routed-expert matrix, per expert e and input column j: the sum over every routed slot
(token t, choice k with ids[t, k] = e) of the squared input reaching that matrix, and the number of such slots
per expert -- what llama-imatrix's `collect_imatrix` accumulates for a MUL_MAT_ID. gate and up read the layer's
input x[t] (the same sums, two entries), down reads h = clamped_swiglu(x W_gate[e], x W_up[e]).

`capture(model)` swaps each MoE layer's `experts` for a `Capture` that runs them unchanged and records one
forward's sums (glm53.layers.records); `collect` runs chunks through the model and adds them up in float64 per
trunk layer. A model with scanned layers (`ModelConfig.scan_layers`) is captured as it is, without unrolling: a
stacked period position's Capture records once per repeat (a leading repeat axis out of the scan), and `collect`
files repeat r under trunk layer `group.layer(r, j)`; the sums equal the unrolled model's (float rounding aside).

File (`write_imatrix` / `read_imatrix`): the GGUF llama-imatrix writes by default and ``llama-quantize
--imatrix`` reads: general.type "imatrix", imatrix.datasets / chunk_count / chunk_size, and per matrix
``<tensor>.in_sum2`` (F32, ggml [k, n_expert]) and ``<tensor>.counts`` (F32, ggml [1, n_expert]).
`importance` turns an entry into what llama-quantize hands ggml's quantizer: sums / count per expert, all ones
for an expert that saw no token.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGUFType, Keys

from glm53.checkpoint.gguf_rules import DEFAULT_ARCH
from glm53.errors import CheckpointError
from glm53.files import atomic_write
from glm53.layers import records
from glm53.layers.stack import LayerStack
from glm53.model import Glm53Model
from glm53.quant.mixes import MATRICES
from kernels.moe import reference, routing


def tensor_name(layer: int, matrix: str) -> str:
    return f"blk.{layer}.ffn_{matrix}_exps.weight"


class Capture(nnx.Module):
    """Runs `inner` (an `Experts`) unchanged; while a `glm53.layers.records.recording()` block is open, also
    records under `name` {sq_in [E, D] (sum of x² over the slots of each expert), sq_h [E, F] (sum of h²),
    count [E]} of the call (and, with `record`, its x [T, D] and ids [T, K]). Inside a scanned LayerStack the
    values come out of the scan with a leading repeat axis. No state of its own: it can sit in a stacked layer."""

    def __init__(self, inner, name: str, n_experts: int, record: bool = False):
        self.inner = inner
        self.name = name
        self.n_experts = n_experts
        self.record = record

    def __call__(self, x_td, ids_tk, w_tk):
        if records.active() is not None:
            records.record(self.name, self.sums(x_td, ids_tk))
        return self.inner(x_td, ids_tk, w_tk)

    def sums(self, x_td, ids_tk) -> dict:
        e, k = self.n_experts, ids_tk.shape[1]
        flat, order, sizes, _ = routing.sort_by_expert(ids_tk, e)
        # the input of each slot, sorted by expert
        xs = x_td[(order // k).astype(jnp.int32)].astype(jnp.float32)
        g = reference.grouped_matmul(xs, self.inner.gate_proj.get_value(), sizes)
        u = reference.grouped_matmul(xs, self.inner.up_proj.get_value(), sizes)
        h = reference.clamped_swiglu(g, u, self.inner.swiglu_limit)
        eid = flat[order]  # E (empty slot) is out of range: segment_sum drops it
        out = dict(sq_in=jax.ops.segment_sum(xs * xs, eid, num_segments=e),
                   sq_h=jax.ops.segment_sum(h * h, eid, num_segments=e),
                   count=jax.ops.segment_sum(jnp.ones_like(eid, jnp.float32), eid, num_segments=e))  # fmt: skip
        if self.record:
            out.update(x=x_td.astype(jnp.float32), ids=ids_tk.astype(jnp.int32))
        return out


def moe_layers(model: Glm53Model) -> list[int]:
    return [i for i, t in enumerate(model.cfg.mlp_layer_types) if t == "moe"]


def _moe_sites(model: Glm53Model) -> list[tuple[nnx.Module, str, list[tuple[int, int | None]]]]:
    """[(MoE module, its path name, [(trunk layer, repeat or None)] it runs)]: one per plain MoE layer and one per
    MoE position of a scanned LayerStack's period (its layers' values stacked over the repeats)."""
    kinds, out = model.cfg.mlp_layer_types, []
    for u, (unit, g) in enumerate(zip(model.layers, model.groups)):
        if isinstance(unit, LayerStack):
            for j, layer in enumerate(unit.period):
                if kinds[g.layer(0, j)] == "moe":
                    runs = [(g.layer(r, j), r) for r in range(g.repeats)]
                    out.append((layer.mlp, f"layers.{u}.period.{j}.mlp", runs))
        elif kinds[g.first] == "moe":
            out.append((unit.mlp, f"layers.{u}.mlp", [(g.first, None)]))
    return out


@contextlib.contextmanager
def capture(model: Glm53Model, record: bool = False) -> Iterator[dict[int, Capture]]:
    """Every trunk MoE layer's experts wrapped in a `Capture` for the block; {layer: Capture} (the layers of a
    scanned group's period position share one). Restored after."""
    caps, sites = {}, []
    for moe, name, layers in _moe_sites(model):
        cap = Capture(moe.experts, name, model.cfg.n_routed_experts, record)
        moe.experts = cap
        sites.append((moe, cap))
        caps.update({i: cap for i, _ in layers})
    try:
        yield caps
    finally:
        for moe, cap in sites:
            moe.experts = cap.inner


class Imatrix:
    """Accumulated sums: {tensor name: (in_sum2 float64 [E, k], counts int64 [E])}, chunk count and size."""

    def __init__(self, chunk_size: int, datasets: Iterable[str] = ()):
        self.entries: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.chunk_size, self.chunks, self.datasets = chunk_size, 0, list(datasets)

    def add(self, layer: int, sq_in, sq_h, count) -> None:
        c = np.rint(np.asarray(count, np.float64)).astype(np.int64)
        for m in MATRICES:
            s = np.asarray(sq_h if m == "down" else sq_in, np.float64)
            name = tensor_name(layer, m)
            old = self.entries.get(name)
            self.entries[name] = (s, c) if old is None else (old[0] + s, old[1] + c)

    def importance(self) -> dict[str, np.ndarray]:
        return {n: importance(s, c) for n, (s, c) in self.entries.items()}


def collect(model: Glm53Model, chunks: Iterable[Iterable[int]], *, dataset: str = "", record: bool = False):
    """Runs each chunk (token ids) through `model` with the experts captured; returns the `Imatrix` (and with
    `record`, also [(layer, x [T, D], ids [T, K]) per chunk and layer] for checking)."""
    chunks = [np.asarray(c, np.int32) for c in chunks]
    if not chunks:
        raise ValueError("imatrix: no calibration chunks")
    im, seen = Imatrix(len(chunks[0]), [dataset] if dataset else []), []
    sites = {name: layers for _, name, layers in _moe_sites(model)}
    order = sorted((i, name, r) for name, layers in sites.items() for i, r in layers)  # trunk layer order
    with capture(model, record):
        graphdef, state = nnx.split(model)

        @jax.jit
        def fwd(state, tokens):
            with records.recording() as rec:
                nnx.merge(graphdef, state)(tokens)
            return {name: rec[name] for name in sites}

        for chunk in chunks:
            out = fwd(state, jnp.asarray(chunk[None]))
            for i, name, r in order:
                s = out[name] if r is None else jax.tree.map(lambda x, r=r: x[r], out[name])
                im.add(i, s["sq_in"], s["sq_h"], s["count"])
                if record:
                    seen.append((i, np.asarray(s["x"]), np.asarray(s["ids"])))
            im.chunks += 1
    return (im, seen) if record else im


def importance(in_sum2: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """What llama-quantize passes the quantizer: in_sum2 / count per expert; ones for an expert with no data."""
    s, c = np.asarray(in_sum2, np.float64), np.asarray(counts, np.float64).reshape(-1)
    out = np.ones_like(s)
    seen = c > 0
    out[seen] = s[seen] / c[seen, None]
    return out.astype(np.float32)


def write_imatrix(path: str | os.PathLike, im: Imatrix) -> None:
    """`im` as llama.cpp's GGUF imatrix file at `path` (built in a temporary file, then written atomically)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.TemporaryDirectory(dir=folder if os.path.isdir(folder) else None) as tmpdir:
        tmp = os.path.join(tmpdir, "imatrix.gguf")
        w = GGUFWriter(tmp, DEFAULT_ARCH)
        w.add_type(GGUFType.IMATRIX)
        w.add_array(Keys.IMatrix.DATASETS, im.datasets or ["glm53"])
        w.add_uint32(Keys.IMatrix.CHUNK_COUNT, im.chunks)
        w.add_uint32(Keys.IMatrix.CHUNK_SIZE, im.chunk_size)
        for name in sorted(im.entries):
            s, c = im.entries[name]
            w.add_tensor(f"{name}.in_sum2", np.asarray(s, np.float32))
            w.add_tensor(f"{name}.counts", np.asarray(c, np.float32).reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb") as src, atomic_write(path, "wb") as dst:
            dst.write(src.read())


def read_imatrix(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """{tensor name: importance [E, k]} (`importance`) of a GGUF imatrix file; CheckpointError naming the file."""
    path = os.fspath(path)
    try:
        r = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a GGUF imatrix file ({e})") from None
    field = r.fields.get("general.type")
    if field is None or bytes(field.parts[field.data[0]]).decode() != "imatrix":
        raise CheckpointError(f"{path}: not an imatrix file (general.type is not 'imatrix')")
    sums, counts = {}, {}
    for t in r.tensors:
        a = np.asarray(t.data, np.float64).reshape([int(x) for x in reversed(t.shape)])
        if t.name.endswith(".in_sum2"):
            sums[t.name[: -len(".in_sum2")]] = a
        elif t.name.endswith(".counts"):
            counts[t.name[: -len(".counts")]] = a.reshape(-1)
    bad = sorted(set(sums) ^ set(counts))
    if bad:
        raise CheckpointError(f"{path}: sums without counts or counts without sums: {bad[:4]}")
    return {n: importance(sums[n], counts[n]) for n in sums}
