"""llama.cpp's importance matrix of the routed experts, computed by glm53, in llama.cpp's GGUF imatrix format.

For every MoE layer and routed-expert matrix, per expert e and input column j: the sum over every routed slot
(token t, choice k with ids[t, k] = e) of the squared input reaching that matrix, and the number of such slots
per expert -- what llama-imatrix's `collect_imatrix` accumulates for a MUL_MAT_ID. gate and up read the layer's
input x[t] (the same sums, two entries), down reads h = clamped_swiglu(x W_gate[e], x W_up[e]).

`capture(model)` swaps each MoE layer's `experts` for a `Capture` that runs them unchanged and stores one
forward's sums in `ImatrixStat` variables; `collect` runs chunks through the model and adds them up in float64.

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
from glm53.model import Glm53Model
from glm53.quant.mixes import MATRICES
from kernels.moe import reference, routing


class ImatrixStat(nnx.Variable):
    """One forward's imatrix sums of a `Capture` (not a parameter)."""


def tensor_name(layer: int, matrix: str) -> str:
    return f"blk.{layer}.ffn_{matrix}_exps.weight"


class Capture(nnx.Module):
    """Runs `inner` (an `Experts`) unchanged; stores sq_in [E, D] (sum of x² over the slots of each expert), sq_h
    [E, F] (sum of h²) and count [E] of the call (and, with `record`, its x [T, D] and ids [T, K])."""

    def __init__(self, inner, n_experts: int, hidden: int, width: int, record: bool = False):
        self.inner = inner
        self.n_experts = n_experts
        self.record = record
        self.sq_in = ImatrixStat(jnp.zeros((n_experts, hidden), jnp.float32))
        self.sq_h = ImatrixStat(jnp.zeros((n_experts, width), jnp.float32))
        self.count = ImatrixStat(jnp.zeros((n_experts,), jnp.float32))
        self.x = ImatrixStat(jnp.zeros((0, hidden), jnp.float32))
        self.ids = ImatrixStat(jnp.zeros((0, 1), jnp.int32))

    def __call__(self, x_td, ids_tk, w_tk):
        e, k = self.n_experts, ids_tk.shape[1]
        flat, order, sizes, _ = routing.sort_by_expert(ids_tk, e)
        # the input of each slot, sorted by expert
        xs = x_td[(order // k).astype(jnp.int32)].astype(jnp.float32)
        g = reference.grouped_matmul(xs, self.inner.gate_proj.get_value(), sizes)
        u = reference.grouped_matmul(xs, self.inner.up_proj.get_value(), sizes)
        h = reference.clamped_swiglu(g, u, self.inner.swiglu_limit)
        eid = flat[order]  # E (empty slot) is out of range: segment_sum drops it
        self.sq_in.set_value(jax.ops.segment_sum(xs * xs, eid, num_segments=e))
        self.sq_h.set_value(jax.ops.segment_sum(h * h, eid, num_segments=e))
        self.count.set_value(jax.ops.segment_sum(jnp.ones_like(eid, jnp.float32), eid, num_segments=e))
        if self.record:
            self.x.set_value(x_td.astype(jnp.float32))
            self.ids.set_value(ids_tk.astype(jnp.int32))
        return self.inner(x_td, ids_tk, w_tk)


def moe_layers(model: Glm53Model) -> list[int]:
    return [i for i, t in enumerate(model.cfg.mlp_layer_types) if t == "moe"]


@contextlib.contextmanager
def capture(model: Glm53Model, record: bool = False) -> Iterator[dict[int, Capture]]:
    """Every trunk MoE layer's experts wrapped in a `Capture` for the block; {layer: Capture}. Restored after."""
    cfg, caps = model.cfg, {}
    for i in moe_layers(model):
        moe = model.layers[i].mlp
        caps[i] = Capture(
            moe.experts, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, record
        )
        moe.experts = caps[i]
    try:
        yield caps
    finally:
        for i, c in caps.items():
            model.layers[i].mlp.experts = c.inner


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
    with capture(model, record) as caps:
        graphdef, state = nnx.split(model)

        @jax.jit
        def fwd(state, tokens):
            m = nnx.merge(graphdef, state)
            m(tokens)
            return nnx.state(m, ImatrixStat)

        for chunk in chunks:
            stats = fwd(state, jnp.asarray(chunk[None]))
            for i in caps:
                s = stats["layers"][i]["mlp"]["experts"]
                im.add(i, s["sq_in"].get_value(), s["sq_h"].get_value(), s["count"].get_value())
                if record:
                    seen.append((i, np.asarray(s["x"].get_value()), np.asarray(s["ids"].get_value())))
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
