"""Expert storage layouts (`glm53.quant.mixes.LAYOUTS`) and the planes of either one.

"planes" stores the GGUF blocks as planes (planes.py); "reencoded" stores IQ2_S / IQ3_S in their gather-free
re-encodings (reencode.py) and every other format as plain planes (there is nothing to re-encode). Re-encoded
formats are `QuantFormat`s with `ggml_type` None, so the block format of a Planes tells which layout holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from glm53.quant import planes as P
from glm53.quant import reencode as R
from glm53.quant.formats import QuantFormat, get_format
from glm53.quant.mixes import LAYOUTS


def layout_format(fmt: str | int | QuantFormat, layout: str) -> QuantFormat:
    """The block format `layout` stores for GGUF format `fmt`: its re-encoding under "reencoded" where one
    exists (IQ2_S, IQ3_S), else `fmt` itself."""
    f = fmt if isinstance(fmt, QuantFormat) else get_format(fmt)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {list(LAYOUTS)}")
    if layout == "reencoded" and f.name in R.REENCODED:
        return R.REENCODED[f.name]
    return f


def layout_of(fmt: QuantFormat) -> str:
    """The layout whose planes hold block format `fmt`."""
    return "planes" if fmt.ggml_type is not None else "reencoded"


def gguf_source(fmt: QuantFormat) -> QuantFormat:
    """The GGUF format whose weights block format `fmt` holds (itself, or a re-encoding's source)."""
    return fmt if fmt.ggml_type is not None else R.source_format(fmt)


def pack(
    raw,
    fmt: str | int | QuantFormat,
    shape: Sequence[int],
    layout: str = "planes",
    *,
    block_splits: int = 1,
    name: str | None = None,
) -> P.Planes:
    """GGUF bytes of a tensor of logical shape [..., rows, cols] -> Planes of `layout` (host)."""
    f = fmt if isinstance(fmt, QuantFormat) else get_format(fmt)
    if layout_format(f, layout).ggml_type is None:
        return R.pack_reencoded(raw, f, shape, block_splits=block_splits, name=name)
    return P.pack_planes(raw, f, shape, block_splits=block_splits, name=name)


def unpack(planes: P.Planes) -> np.ndarray:
    """Planes of either layout -> the GGUF bytes, uint8 [..., rows, n_blocks * type_size] (exact; host)."""
    if planes.fmt.ggml_type is None:
        return R.unpack_reencoded(planes)
    return P.unpack_planes(planes)


def dequantize(planes: P.Planes) -> jnp.ndarray:
    """Planes of either layout -> f32 [..., rows, cols] (jit-able)."""
    if planes.fmt.ggml_type is None:
        return R.dequantize_reencoded(planes)
    return P.dequantize_planes(planes)
