"""Quantization formats: the one place where format names are parsed and block layouts are defined.

Block layouts are llama.cpp's (ggml-common.h): each block of `block_size` weights is `type_size` bytes, made of
named fields at fixed byte offsets. Type ids and sizes come from gguf-py's constants and are cross-checked here.
"""

from __future__ import annotations

import dataclasses

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


class UnknownFormatError(ValueError):
    """A quantization format name or GGML type id that glm53 does not support."""


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    offset: int  # bytes from the block start
    nbytes: int


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    name: str  # "IQ2_S", "Q4_K", ..., "F32", "FP8_E4M3"
    ggml_type: int | None  # GGMLQuantizationType value; None for formats that are not GGUF types (FP8)
    block_size: int  # weights per block
    type_size: int  # bytes per block
    fields: tuple[Field, ...]

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}; fields: {[f.name for f in self.fields]}")

    def nbytes(self, n_weights: int) -> int:
        """Bytes of `n_weights` weights (a multiple of block_size) in this format."""
        if n_weights % self.block_size:
            raise ValueError(
                f"{self.name}: {n_weights} weights is not a multiple of the block size {self.block_size}"
            )
        return n_weights // self.block_size * self.type_size


def _layout(*spec: tuple[str, int]) -> tuple[Field, ...]:
    out, off = [], 0
    for name, n in spec:
        out.append(Field(name, off, n))
        off += n
    return tuple(out)


_QK = 256  # super-block size of K- and i-quants

_LAYOUTS: dict[str, tuple[int, tuple[tuple[str, int], ...]]] = {
    # name: (block_size, [(field, nbytes), ...]) in memory order
    "F32": (1, (("w", 4),)),
    "F16": (1, (("w", 2),)),
    "BF16": (1, (("w", 2),)),
    "Q4_0": (32, (("d", 2), ("qs", 16))),
    "Q8_0": (32, (("d", 2), ("qs", 32))),
    "IQ4_NL": (32, (("d", 2), ("qs", 16))),
    "Q2_K": (_QK, (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2))),
    "Q3_K": (_QK, (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2))),
    "Q4_K": (_QK, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128))),
    "Q5_K": (_QK, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128))),
    "Q6_K": (_QK, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2))),
    "IQ2_XXS": (_QK, (("d", 2), ("qs", 64))),
    "IQ2_XS": (_QK, (("d", 2), ("qs", 64), ("scales", 8))),
    # IQ2_S: qs holds 32 grid-index low bytes followed by 32 sign bytes.
    "IQ2_S": (_QK, (("d", 2), ("qs", 32), ("signs", 32), ("qh", 8), ("scales", 8))),
    "IQ3_XXS": (_QK, (("d", 2), ("qs", 64), ("scales_signs", 32))),
    "IQ3_S": (_QK, (("d", 2), ("qs", 64), ("qh", 8), ("signs", 32), ("scales", 4))),
    "IQ4_XS": (_QK, (("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128))),
}

FORMATS: dict[str, QuantFormat] = {}
for _name, (_bs, _spec) in _LAYOUTS.items():
    _fields = _layout(*_spec)
    _ts = sum(f.nbytes for f in _fields)
    _gt = int(GGMLQuantizationType[_name])
    if GGML_QUANT_SIZES[GGMLQuantizationType[_name]] != (_bs, _ts):  # pragma: no cover - consistency guard
        raise AssertionError(
            f"{_name}: layout {(_bs, _ts)} != gguf {GGML_QUANT_SIZES[GGMLQuantizationType[_name]]}"
        )
    FORMATS[_name] = QuantFormat(_name, _gt, _bs, _ts, _fields)

# FP8 e4m3 with 128x128 block scales (`weight_scale_inv`), the HF release format; not a GGUF type.
FORMATS["FP8_E4M3"] = QuantFormat("FP8_E4M3", None, 1, 1, (Field("w", 0, 1),))

_BY_TYPE = {f.ggml_type: f for f in FORMATS.values() if f.ggml_type is not None}

I_QUANTS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SIMPLE_QUANTS = ("Q8_0", "Q4_0")
FLOATS = ("F16", "BF16", "F32")
GGUF_FORMATS = I_QUANTS + K_QUANTS + SIMPLE_QUANTS + FLOATS


def get_format(name_or_type: str | int | GGMLQuantizationType) -> QuantFormat:
    """Parses a format from a name ("iq2_s", "IQ2_S") or a GGML type id. Unknown -> UnknownFormatError."""
    if isinstance(name_or_type, str):
        key = name_or_type.strip().upper()
        if key in FORMATS:
            return FORMATS[key]
        raise UnknownFormatError(
            f"unknown quantization format {name_or_type!r}; supported: {sorted(FORMATS)}"
        )
    try:
        return _BY_TYPE[int(name_or_type)]
    except (KeyError, ValueError, TypeError):
        try:
            label = GGMLQuantizationType(int(name_or_type)).name
        except (ValueError, TypeError):
            label = "not a GGML type"
        raise UnknownFormatError(
            f"unsupported GGML type id {name_or_type!r} ({label}); supported: {sorted(_BY_TYPE)}"
        ) from None
