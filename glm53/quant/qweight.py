"""Quantized routed-expert weights as data: `QuantizedExperts`, a pytree leaf that stands in for a dense kernel.

A dense expert kernel is [E, in, out] (y = x @ w[e]; gate/up [E, D, F], down [E, F, D]). `QuantizedExperts`
holds the same weights as `glm53.quant.planes.Planes` in GGUF orientation: E matrices of [rows = out, cols = in],
every plane uint32 [E, n_words, rows] (word axis over the input blocks, lane axis over the outputs). So

  * `.shape` is the dense kernel's shape (E, in, out): code that reads only shapes (routing, api checks) is
    unchanged; `.dequantize()` returns the dense kernel [E, in, out];
  * `.planes` is what kernels consume (gate/up [E, F, D], down [E, D, F] as Planes: experts leading);
  * the logical axes of the dense kernel (expert, input, output) name the plane axes too: a plane is
    [expert, words (input blocks), rows (outputs)]. Sharding the word axis n ways needs `block_splits = n`
    (see `planes.block_split_layout`).

Layouts: "planes" keeps the GGUF block bytes (every GGUF format of `glm53.quant.dequant`); "reencoded" stores
IQ2_S / IQ3_S in their gather-free re-encodings (`glm53.quant.reencode`) and every other format as plain planes
(there is nothing to re-encode). The leaf's only static data is the Planes' format, shape and block splits.

Constructors: `from_gguf_bytes` (GGUF tensor bytes, for the GGUF loader), `from_dense` (quantize with ggml, for
tests and ablations), `from_planes`, and `random` (a seeded random init usable under `nnx.eval_shape`).
`expert_formats` turns a `QuantConfig` into the formats of one layer's experts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.quant import budget, ggml
from glm53.quant import layout as L
from glm53.quant import planes as P
from glm53.quant import reencode as R
from glm53.quant.formats import FLOATS, QuantFormat, get_format
from glm53.quant.layout import layout_format
from glm53.quant.mixes import MATRICES


@struct.dataclass
class QuantizedExperts:
    """E quantized expert matrices standing in for a dense kernel [E, in, out] (see the module docstring).

    planes: Planes with leading axis E; planes.shape = (rows, cols) = (out, in) of one expert matrix.
    """

    planes: P.Planes

    # ------------------------------------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense kernel's shape (E, in, out)."""
        return (self.n_experts, self.planes.cols, self.planes.rows)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def n_experts(self) -> int:
        lead = self.planes.lead_shape
        if len(lead) != 1:
            raise ValueError(f"QuantizedExperts: planes need exactly one leading (expert) axis, got {lead}")
        return int(lead[0])

    @property
    def layout(self) -> str:
        """ "reencoded" when the planes hold a gather-free re-encoding, else "planes"."""
        return L.layout_of(self.planes.fmt)

    @property
    def format(self) -> QuantFormat:
        """The GGUF format of the weights (the re-encoding's source for the "reencoded" layout)."""
        return L.gguf_source(self.planes.fmt)

    @property
    def format_name(self) -> str:
        return self.format.name

    @property
    def nbytes(self) -> int:
        """Bytes held by the planes (all experts)."""
        return self.planes.nbytes

    @property
    def nbytes_per_expert(self) -> int:
        return self.nbytes // self.n_experts

    @property
    def gguf_nbytes(self) -> int:
        """Bytes of the same weights as GGUF blocks."""
        return budget.gguf_nbytes((self.n_experts, self.planes.rows, self.planes.cols), self.format)

    def __repr__(self) -> str:
        return f"QuantizedExperts({self.format_name}, {self.layout}, kernel shape {self.shape})"

    # ------------------------------------------------------------------------------------------- compute
    def take(self, ids: jax.Array) -> QuantizedExperts:
        """The experts `ids` [n] (int, clipped to [0, E-1]): planes gathered on the expert axis, lead [n]."""
        ids = jnp.clip(jnp.asarray(ids, jnp.int32), 0, self.n_experts - 1)
        fields = {k: jnp.take(v, ids, axis=0) for k, v in self.planes.fields.items()}
        return QuantizedExperts(
            P.Planes(fields, self.planes.fmt, self.planes.shape, self.planes.block_splits)
        )

    def dequantize_rows(self, dtype=jnp.float32) -> jax.Array:
        """All experts in GGUF orientation [E, out, in] (jit-able)."""
        return L.dequantize(self.planes).astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The dense kernel [E, in, out] (jit-able)."""
        return jnp.swapaxes(self.dequantize_rows(dtype), -1, -2)

    def to_gguf_bytes(self) -> np.ndarray:
        """The GGUF bytes, uint8 [E, out, n_blocks * type_size] (host; exact inverse of `from_gguf_bytes`)."""
        return L.unpack(self.planes)

    def check_like(self, template: QuantizedExperts, name: str = "expert tensor") -> None:
        """Raises ValueError naming `name` when shape, format or layout differ from `template`'s."""
        mine = (self.shape, self.format_name, self.layout)
        want = (template.shape, template.format_name, template.layout)
        if mine != want:
            raise ValueError(
                f"{name}: got kernel shape {mine[0]}, {mine[1]} ({mine[2]}); the model expects kernel shape "
                f"{want[0]}, {want[1]} ({want[2]})"
            )

    # ------------------------------------------------------------------------------------------ constructors
    @classmethod
    def from_planes(cls, planes: P.Planes) -> QuantizedExperts:
        """Wraps Planes [E, words, rows] (checked) as the experts of kernel shape (E, cols, rows)."""
        P.check_planes(planes)
        q = cls(planes)
        _ = q.n_experts  # one leading axis
        return q

    @classmethod
    def from_gguf_bytes(
        cls,
        raw,
        fmt: str | int | QuantFormat,
        shape: Sequence[int],
        layout: str = "planes",
        *,
        name: str | None = None,
        block_splits: int = 1,
    ) -> QuantizedExperts:
        """GGUF bytes of an expert tensor -> QuantizedExperts (host; no dequantization).

        raw: the tensor's bytes (bytes / memoryview / uint8 array of the exact size).
        fmt: its GGUF type (name or GGML type id).
        shape: its logical numpy-order shape [E, rows = out, cols = in] (GGUF `ne` reversed: ffn_gate_exps /
          ffn_up_exps are [E, F, D], ffn_down_exps [E, D, F]); the kernel shape is then [E, cols, rows].
        layout: "planes" | "reencoded" (IQ2_S / IQ3_S re-encoded gather-free; other formats stay planes).
        name: the tensor's name, used in error messages.
        """
        f = fmt if isinstance(fmt, QuantFormat) else get_format(fmt)
        if len(shape) != 3:
            raise ValueError(
                f"{name or 'expert tensor'} ({f.name}): shape must be [E, rows, cols], got {tuple(shape)}"
            )
        return cls(L.pack(raw, f, shape, layout, block_splits=block_splits, name=name))

    @classmethod
    def from_dense(
        cls,
        w_kernel,
        fmt: str | QuantFormat,
        layout: str = "planes",
        *,
        imatrix: np.ndarray | None = None,
        threads: int | None = None,
    ) -> QuantizedExperts:
        """Quantizes a dense kernel [E, in, out] with llama.cpp's quantizer (glm53.quant.ggml; host).

        imatrix: optional per-input importance [in] (types that need one get all ones by default).
        """
        w = np.asarray(w_kernel, dtype=np.float32)
        if w.ndim != 3:
            raise ValueError(f"from_dense: kernel must be [E, in, out], got shape {w.shape}")
        e, n_in, n_out = w.shape
        rows = np.ascontiguousarray(np.swapaxes(w, 1, 2)).reshape(e * n_out, n_in)  # [E*out, in]
        raw = ggml.quantize(rows, fmt, imatrix, threads=threads)
        return cls.from_gguf_bytes(raw, fmt, (e, n_out, n_in), layout)

    @classmethod
    def random(
        cls,
        key: jax.Array,
        kernel_shape: Sequence[int],
        fmt: str | QuantFormat,
        layout: str = "planes",
        std: float = 0.02,
    ) -> QuantizedExperts:
        """Random valid experts of kernel shape [E, in, out] with weights of RMS about `std` (jit-able: works
        under `nnx.eval_shape` / `jax.eval_shape`, where nothing is allocated).

        Quantized formats draw each block from a fixed pool of random valid blocks (scales set for RMS `std`);
        float formats draw N(0, std^2) weights.
        """
        e, n_in, n_out = (int(x) for x in kernel_shape)
        lf = layout_format(fmt, layout)
        src = get_format(fmt) if not isinstance(fmt, QuantFormat) else fmt
        if n_in % lf.block_size:
            raise ValueError(
                f"{src.name} experts of kernel shape {tuple(kernel_shape)}: {n_in} inputs is not a multiple of "
                f"the block size {lf.block_size}"
            )
        nb = n_in // lf.block_size
        fields = {}
        if src.name in FLOATS:
            v = std * jax.random.normal(key, (e, n_out, n_in), jnp.float32)  # [E, rows, cols]
            if src.name == "F32":
                fields["w"] = jnp.swapaxes(jax.lax.bitcast_convert_type(v, jnp.uint32), -1, -2)
            else:
                h = jax.lax.bitcast_convert_type(
                    v.astype(jnp.bfloat16 if src.name == "BF16" else jnp.float16), jnp.uint16
                )
                fields["w"] = P._pair(h.astype(jnp.uint32), 1, jnp)
        else:
            pool = _block_pool(src.name, lf.name, float(std))
            idx = jax.random.randint(key, (e, n_out, nb), 0, _POOL)  # [E, rows, nb]
            for fd in lf.fields:
                w = jnp.take(jnp.asarray(pool[fd.name]), idx, axis=0)  # [E, rows, nb, words per block]
                if fd.nbytes == 2:
                    fields[fd.name] = P._pair(w[..., 0], 1, jnp)
                else:
                    fields[fd.name] = jnp.swapaxes(w.reshape(e, n_out, -1), -1, -2)
        return cls(P.Planes(fields, lf, (n_out, n_in), 1))


_POOL = 64  # random blocks per format in `QuantizedExperts.random`'s pool


@functools.cache
def _block_pool(src_name: str, layout_name: str, std: float) -> dict[str, np.ndarray]:
    """Per-block words of `_POOL` random valid blocks of `src_name` (re-encoded when `layout_name` differs):
    field -> uint32 [_POOL, words per block] (a 2-byte field: [_POOL, 1], value in the low half).

    Random bytes decode to valid weights in every GGUF block format once the f16 scales are finite; `d` (and
    `dmin`) get random values in a 1:3 range, scaled so the pool's weights have RMS `std` (every weight is linear
    in (d, dmin)).
    """
    f = get_format(src_name)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(_POOL, f.type_size), dtype=np.uint8)
    scaled = [fd for fd in f.fields if fd.name in ("d", "dmin")]

    spread = rng.uniform(0.5, 1.5, size=_POOL)  # blocks of different scales

    def set_scales(value: float) -> None:
        b = (value * spread).astype(np.float16).view(np.uint8).reshape(_POOL, 2)
        for fd in scaled:
            raw[:, fd.offset : fd.offset + 2] = b

    set_scales(1.0)
    w = gq.dequantize(raw.reshape(-1), GGMLQuantizationType[f.name]).astype(np.float64)
    set_scales(std / max(float(np.sqrt(np.mean(w * w))), 1e-30))
    lf = f
    if layout_name != src_name:
        lf = R.reencoded_format(f)
        raw = R.reencode(raw, f)  # [_POOL, re-encoded type_size]
    out = {}
    for fd in lf.fields:
        b = np.ascontiguousarray(raw[:, fd.offset : fd.offset + fd.nbytes])
        out[fd.name] = (b.view("<u2") if fd.nbytes == 2 else b.view("<u4")).astype(np.uint32)
    return out


def expert_formats(quant, cfg, layer_idx: int | None) -> dict[str, str] | None:
    """{"gate", "up", "down"} -> GGUF format of the routed experts of MoE layer `layer_idx` under `quant`
    (a `glm53.config.QuantConfig` or None), or None for dense experts.

    layer_idx None is the MTP block (GGUF block `num_hidden_layers`): it gets the mix's per-matrix formats and
    its overrides; the UD-IQ3_XXS table covers the trunk only, so under a UD mix the MTP experts stay dense.
    """
    mix = None if quant is None else quant.mix
    if mix is None:
        return None
    moe = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
    if layer_idx is None:
        if mix.ud:
            return None
        layer_idx = cfg.num_hidden_layers
    elif layer_idx not in moe:
        raise ValueError(f"layer {layer_idx} is not a MoE layer of this config (MoE layers {moe})")
    mix = mix.resolve(moe)
    return {m: mix.format(layer_idx, m) for m in MATRICES}
