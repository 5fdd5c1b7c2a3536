"""Tensors on disk read by slice: what the HF and GGUF loaders hand to `glm53.parallel.distributed.put` when a
parameter's sharding spans several processes, so that each process reads only the blocks of its own devices.

`LazyArray` stands in for a host array: `shape`, `dtype`, numpy-style basic indexing, `transpose` / `.T` and
`astype` build views without reading; `np.asarray(view)` reads exactly the view's box of the stored tensor (its
`read(box)`: HF safetensors by byte ranges, GGUF by rows). So the loaders' layout transforms
(`glm53.checkpoint.hf_rules`: transposes, slices of fused tensors) run unchanged on views, and `put` reads
``view[device index]`` per device. `Stacked` stacks per-expert views along a new leading axis.

GGUF routed experts (`expert_dense`, `expert_planes`): a device's box [experts, in, out] of the dense kernel
reads experts x output rows of the GGUF tensor [E, out, in] (whole rows: the blocks run along `in`); kept
quantized, a device's box of a plane [experts, words, rows] reads the same rows and packs only its input blocks
(`glm53.quant.planes.split_blocks`: a word-axis shard i of n is blocks [i nb/n, (i+1) nb/n)).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import numpy as np
from gguf.constants import GGMLQuantizationType

from glm53.quant import dequant
from glm53.quant import layout as L
from glm53.quant import planes as P
from glm53.quant.qweight import QuantizedExperts

Box = tuple[tuple[int, int], ...]
_NUMPY_TYPES = {GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2")}


def _ranges(index, shape: Sequence[int], what: str) -> list[int | tuple[int, int]]:
    """Basic numpy index (ints, step-1 slices, one Ellipsis) -> per axis an int or (lo, hi)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"{what}: {len(index)} indices for shape {tuple(shape)}")
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for i, n in zip(index, shape):
        if isinstance(i, slice):
            lo, hi, step = i.indices(n)
            if step != 1:
                raise IndexError(f"{what}: only step-1 slices are read by range, got {i}")
            out.append((lo, max(lo, hi)))
        else:
            i = operator.index(i)
            if not -n <= i < n:
                raise IndexError(f"{what}: index {i} out of range for an axis of {n}")
            out.append(i % n)
    return out


class LazyArray:
    """A view of a stored tensor (module docstring). read(box) returns the box [lo, hi) per axis of the stored
    tensor as a numpy array; the view keeps, per stored axis, a range or a fixed index, and the order of the
    remaining axes."""

    def __init__(self, read: Callable[[Box], np.ndarray], shape: Sequence[int], dtype, what: str = "tensor",
                 *, _box=None, _axes=None, _cast=None):  # fmt: skip
        self._read, self._stored, self.what = read, tuple(shape), what
        self._box = list(_box) if _box is not None else [(0, n) for n in self._stored]
        self._axes = list(_axes) if _axes is not None else list(range(len(self._stored)))
        self._dtype = np.dtype(dtype)
        self._cast = _cast

    def _view(self, box=None, axes=None, cast=None) -> LazyArray:
        return LazyArray(self._read, self._stored, self._dtype, self.what, _box=self._box if box is None else box,
                         _axes=self._axes if axes is None else axes, _cast=cast or self._cast)  # fmt: skip

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._cast or self._dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._box[a][1] - self._box[a][0] for a in self._axes)

    @property
    def ndim(self) -> int:
        return len(self._axes)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def transpose(self, *perm) -> LazyArray:
        perm = perm[0] if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm
        perm = tuple(perm) or tuple(reversed(range(self.ndim)))
        if sorted(perm) != list(range(self.ndim)):
            raise ValueError(f"{self.what}: axes {perm} are no permutation of {self.ndim} axes")
        return self._view(axes=[self._axes[p] for p in perm])

    @property
    def T(self) -> LazyArray:  # noqa: N802 (numpy's name)
        return self.transpose()

    def astype(self, dtype) -> LazyArray:
        return self._view(cast=np.dtype(dtype))

    def __getitem__(self, index) -> LazyArray:
        box, axes = list(self._box), []
        for a, r in zip(self._axes, _ranges(index, self.shape, self.what)):
            lo = box[a][0]
            if isinstance(r, int):
                box[a] = (lo + r, lo + r + 1, "fixed")
            else:
                box[a] = (lo + r[0], lo + r[1])
                axes.append(a)
        return self._view(box=box, axes=axes)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = np.asarray(self._read(tuple((b[0], b[1]) for b in self._box)))
        a = a[tuple(0 if len(b) == 3 else slice(None) for b in self._box)]  # drop the fixed axes
        kept = [k for k, b in enumerate(self._box) if len(b) == 2]
        a = np.asarray(a).transpose([kept.index(k) for k in self._axes])
        out_dtype = dtype or self._cast
        return np.asarray(a.astype(out_dtype) if out_dtype is not None else a)

    def __repr__(self) -> str:
        return f"LazyArray({self.what}, shape {self.shape}, {self.dtype})"


class Stacked:
    """Host arrays or views of equal shape stacked along a new leading axis, read per index like `LazyArray`."""

    def __init__(self, items: Sequence, dtype, what: str = "tensor"):
        self.items, self.what, self.dtype = list(items), what, np.dtype(dtype)
        self.shape = (len(self.items), *tuple(self.items[0].shape))
        self.ndim = len(self.shape)

    def astype(self, dtype) -> Stacked:
        return Stacked(self.items, dtype, self.what)

    def __getitem__(self, index) -> np.ndarray:
        r = _ranges(index, self.shape, self.what)
        rest = tuple(x if isinstance(x, int) else slice(*x) for x in r[1:])
        lead = [r[0]] if isinstance(r[0], int) else range(*r[0])
        parts = [np.asarray(self.items[e][rest], self.dtype) for e in lead]
        return parts[0] if isinstance(r[0], int) else np.stack(parts) if parts else np.empty((0,), self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[:], dtype or self.dtype)


# ------------------------------------------------------------------------------------------------ GGUF
def gguf_decoded(g, name: str, fmt, shape: Sequence[int]) -> LazyArray:
    """GGUF tensor `name` of `g` (a `glm53.io.gguf.GGUFModel`, numpy-order `shape`, format `fmt`) decoded to f32,
    read by box: the box's leading-axis rows whole (a quantized row is whole blocks), the last axis sliced after
    decoding. Each row decodes as in a whole-tensor decode (the blocks are independent): the same values. Boxes
    that differ in the last axis only (devices splitting the rows' columns) share one read."""
    shape = tuple(shape)
    rows: dict[Box, np.ndarray] = {}

    def read(box: Box) -> np.ndarray:
        if box[:-1] not in rows:
            raw = g.read_tensor_region(name, tuple(slice(lo, hi) for lo, hi in box[:-1]))
            lead = tuple(hi - lo for lo, hi in box[:-1])
            dt = _NUMPY_TYPES.get(GGMLQuantizationType(fmt.ggml_type))
            if dt is not None:
                w = raw.reshape(-1).view(dt).reshape(*lead, shape[-1])
            else:
                w = np.asarray(dequant.dequantize(raw.reshape(-1), fmt, (*lead, shape[-1])))
            rows[box[:-1]] = w.astype(np.float32, copy=False)
        return rows[box[:-1]][..., box[-1][0] : box[-1][1]]

    return LazyArray(read, shape, np.float32, name)


def expert_dense(et, dtype) -> LazyArray:
    """The routed experts of GGUF tensor `et` (`glm53.checkpoint.gguf.ExpertTensor`, [E, out, in]) decoded into
    our kernel [E, in, out] of `dtype`, read by box: experts x output rows of whole input rows."""
    return gguf_decoded(et.gguf, et.name, et.format, et.shape).transpose(0, 2, 1).astype(dtype)


class _PlaneField:
    """One plane of GGUF experts kept quantized, [E, words, rows], read by box (see `expert_planes`)."""

    def __init__(self, packer: _Packer, field: str, shape: tuple[int, ...]):
        self.packer, self.field, self.shape, self.dtype = packer, field, shape, np.dtype(np.uint32)
        self.ndim = len(shape)

    def __getitem__(self, index) -> np.ndarray:
        r = _ranges(index, self.shape, self.packer.et.name)
        if any(isinstance(x, int) for x in r):
            raise IndexError(f"{self.packer.et.name}: planes are read by ranges, got {index}")
        return self.packer.field(self.field, r[0], r[1], r[2], self.shape[1])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[:], dtype)


class _Packer:
    """Reads and packs boxes of one GGUF expert tensor for its planes; the fields of one box share one pack."""

    def __init__(self, et, like: P.Planes, layout: str):
        self.et, self.like, self.layout = et, like, layout
        self.cache: dict[tuple, P.Planes] = {}
        self.raw: dict[tuple, np.ndarray] = {}  # rows read, shared by the input-block shards of one box

    def field(self, name: str, experts, words, rows, n_words: int) -> np.ndarray:
        nb, s = self.like.n_blocks, self.like.block_splits
        width = words[1] - words[0]
        if width == n_words:
            blocks, splits = (0, nb), s
        else:  # word-axis shard i of n: input blocks [i nb / n, (i + 1) nb / n) (planes.split_blocks)
            n, i = n_words // width, words[0] // width
            if width * n != n_words or words[0] % width or s % n or nb % n:
                raise ValueError(
                    f"{self.et.name}: words {words} of {n_words} are no block shard of {s} splits"
                )
            blocks, splits = (i * nb // n, (i + 1) * nb // n), s // n
        key = (experts, rows, blocks, splits)
        if key not in self.cache:
            if (experts, rows) not in self.raw:
                self.raw[experts, rows] = self.et.gguf.read_tensor_region(
                    self.et.name, (slice(*experts), slice(*rows))
                )
            raw = self.raw[experts, rows]
            ts, bs = self.et.format.type_size, self.et.format.block_size
            raw = np.ascontiguousarray(raw[..., blocks[0] * ts : blocks[1] * ts])
            shape = (experts[1] - experts[0], rows[1] - rows[0], (blocks[1] - blocks[0]) * bs)
            self.cache[key] = L.pack(
                raw, self.et.format, shape, self.layout, block_splits=splits, name=self.et.name
            )
        return np.asarray(self.cache[key].fields[name])


def expert_planes(
    et, like: QuantizedExperts, put: Callable[[np.ndarray, object], object]
) -> QuantizedExperts:
    """The routed experts of GGUF tensor `et` kept quantized in the layout and block splits of `like` (the
    abstract parameter, whose plane leaves carry their shardings): every plane goes through put(source, sharding),
    each device's box packed from its own rows and blocks only."""
    planes = like.planes
    packer = _Packer(et, planes, like.layout)
    fields = {}
    for name, a in planes.fields.items():
        fields[name] = put(_PlaneField(packer, name, tuple(a.shape)), getattr(a, "sharding", None))
    return QuantizedExperts(P.Planes(fields, planes.fmt, planes.shape, planes.block_splits))
