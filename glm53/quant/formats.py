"""Quantization formats: the one place where format names are parsed and block layouts are defined.

Block layouts are llama.cpp's (ggml-common.h): each block of `block_size` weights is `type_size` bytes, made of
named fields at fixed byte offsets. The layouts themselves are entries of `glm53.quant.registry` (one per format,
cross-checked there against gguf-py's type sizes); this module turns them into `QuantFormat`s and parses names.
"""

from __future__ import annotations

import dataclasses

from gguf.constants import GGMLQuantizationType

from glm53.quant import registry


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


FORMATS: dict[str, QuantFormat] = {}  # the GGUF types (and FP8 below); parsed by get_format
REENCODED_FORMATS: dict[str, QuantFormat] = {}  # the re-encoded gather-free layouts (glm53.quant.reencode)
for _e in registry.ENTRIES:
    _f = QuantFormat(_e.name, _e.ggml_type, _e.block_size, _e.type_size, _layout(*_e.fields))
    (FORMATS if _e.gguf else REENCODED_FORMATS)[_e.name] = _f

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
