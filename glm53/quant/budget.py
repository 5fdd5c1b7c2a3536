"""Byte counts of quantized tensors from shapes and types alone: GGUF blocks, planes, re-encoded planes, per device.

`plane_nbytes` applies the field-to-plane rule of planes.py (through `planes.plane_words`, the same function the
packer's shapes obey; tests check it against real arrays): every field of 4k bytes costs exactly its GGUF bytes,
a 2-byte field costs 4 bytes per PAIR of input blocks held by a device. So planes equal the GGUF bytes whenever
every device holds an even number of blocks per row, and grow by 2 bytes per row, per 2-byte field, per device
holding an odd count.

The UD-IQ3_XXS routed experts (`glm53.quant.mixes.UD_IQ3_XXS`, 126 tensors of 288 x 4096 x 2048 weights) are
109.87 GB of GGUF blocks. Repacked for 8 tensor-parallel devices they are 110.72 GB, 13.84 GB per device. Where the +849 MB comes
from: gate/up [2048 out, 4096 in] split by output rows keep all 16 input blocks per row on every device, so their
`d` pairs are whole (no growth). down [4096 out, 2048 in] is split by input: 8 blocks per row over 8 devices is ONE
block per device, so each 2-byte field (`d` of IQ3_S, `d` and `scales_h` of IQ4_XS) takes a whole 4-byte word per
row per expert per device: 288 x 4096 x 8 x 2 B = 18.87 MB per field per tensor, times 39 IQ3_S + 2 x 3 IQ4_XS =
45 fields = 849.3 MB in all, 106.2 MB per device. This is the audit article's "110.72 GB once repacked".

`python -m glm53.quant.budget` prints the table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from glm53.quant.formats import QuantFormat, get_format
from glm53.quant.layout import layout_format
from glm53.quant.mixes import LAYOUTS, MATRICES, UD_IQ3_XXS
from glm53.quant.planes import plane_words

GB = 1e9  # decimal, as the audit article and the sizes on the Hub


def expert_shape(
    matrix: str, n_experts: int = 288, d_model: int = 4096, d_ff: int = 2048
) -> tuple[int, int, int]:
    """[experts, rows (out), cols (in)] of a routed-expert tensor (numpy order; ggml dims reversed)."""
    if matrix in ("gate", "up"):
        return (n_experts, d_ff, d_model)
    if matrix == "down":
        return (n_experts, d_model, d_ff)
    raise ValueError(f"unknown expert matrix {matrix!r}; expected one of {MATRICES}")


def tp_split(matrix: str, n_devices: int) -> tuple[str, int] | None:
    """The tensor-parallel split of an expert matrix: gate/up by output rows, down by input blocks."""
    if n_devices == 1:
        return None
    return ("blocks", n_devices) if matrix == "down" else ("rows", n_devices)


def _fmt(fmt: str | int | QuantFormat) -> QuantFormat:
    return fmt if isinstance(fmt, QuantFormat) else get_format(fmt)


def _shape(shape: Sequence[int], f: QuantFormat) -> tuple[int, int, int]:
    """-> (lead, rows, n_blocks), checking the shape."""
    if len(shape) < 2:
        raise ValueError(f"{f.name}: shape {tuple(shape)} needs [..., rows, cols]")
    *lead, rows, cols = (int(x) for x in shape)
    if cols % f.block_size:
        raise ValueError(f"{f.name}: {cols} inputs is not a multiple of the block size {f.block_size}")
    return math.prod(lead), rows, cols // f.block_size


def gguf_nbytes(shape: Sequence[int], fmt: str | int | QuantFormat) -> int:
    """Bytes of a tensor of logical shape [..., rows, cols] (cols = inputs) as GGUF blocks."""
    f = _fmt(fmt)
    lead, rows, nb = _shape(shape, f)
    return lead * rows * nb * f.type_size


def plane_nbytes(
    shape: Sequence[int],
    fmt: str | int | QuantFormat,
    split: tuple[str, int] | None = None,
    layout: str = "planes",
) -> int:
    """Bytes ONE device holds of a tensor [..., rows, cols] stored as planes, under `split`.

    split: None (whole tensor), ("rows", n) (output rows / n each) or ("blocks", n) (input blocks / n each; whole
    blocks per device). layout: "planes" (GGUF bytes, planes.py) or "reencoded" (reencode.py for IQ2_S / IQ3_S,
    other formats as planes; `glm53.quant.layout.layout_format`).
    """
    f = layout_format(fmt, layout)
    lead, rows, nb = _shape(shape, f)
    if split is not None:
        kind, n = split
        if kind not in ("rows", "blocks") or int(n) < 1:
            raise ValueError(f"unknown split {split!r}; expected None, ('rows', n) or ('blocks', n)")
        total = rows if kind == "rows" else nb
        if total % n:
            raise ValueError(f"{f.name} {tuple(shape)}: {total} {kind} do not split into {n} equal parts")
        rows, nb = (rows // n, nb) if kind == "rows" else (rows, nb // n)
    words = sum(plane_words(f, fd, nb) for fd in f.fields)
    return lead * rows * 4 * words


@dataclasses.dataclass(frozen=True)
class MixBytes:
    """Byte totals of an expert mix (all in bytes)."""

    gguf: int  # GGUF blocks
    per_device: int  # planes on one device (every device holds the same)
    total: int  # planes over all devices
    n_devices: int
    layout: str
    by_format: dict[str, int]  # layout bytes over all devices, per GGUF format
    counts: dict[str, int]  # tensors per GGUF format

    @property
    def growth(self) -> int:
        """Planes bytes minus GGUF bytes over all devices."""
        return self.total - self.gguf


def expert_mix_nbytes(
    mix: Mapping[tuple[int, str], str] = UD_IQ3_XXS,
    n_devices: int = 8,
    layout: str = "planes",
    *,
    n_experts: int = 288,
    d_model: int = 4096,
    d_ff: int = 2048,
) -> MixBytes:
    """Byte totals of a routed-expert mix {(layer, matrix): format} under the model's tensor-parallel splits.

    layout "reencoded" re-encodes the formats that have a gather-free layout (IQ2_S, IQ3_S) and keeps the others
    (IQ4_XS) as planes.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {list(LAYOUTS)}")
    gguf = per_dev = 0
    by_format: dict[str, int] = {}
    counts: dict[str, int] = {}
    for (layer, matrix), name in sorted(mix.items()):
        f = _fmt(name)
        shape = expert_shape(matrix, n_experts, d_model, d_ff)
        try:
            dev = plane_nbytes(shape, f, tp_split(matrix, n_devices), layout)
        except ValueError as e:
            raise ValueError(f"layer {layer} {matrix} ({f.name}): {e}") from None
        gguf += gguf_nbytes(shape, f)
        per_dev += dev
        by_format[f.name] = by_format.get(f.name, 0) + dev * n_devices
        counts[f.name] = counts.get(f.name, 0) + 1
    return MixBytes(gguf, per_dev, per_dev * n_devices, n_devices, layout, by_format, counts)


def main() -> None:
    print(
        f"UD-IQ3_XXS routed experts: {sum(1 for _ in UD_IQ3_XXS)} tensors, formats "
        f"{expert_mix_nbytes(n_devices=1).counts}"
    )
    for layout in LAYOUTS:
        for n in (1, 8):
            m = expert_mix_nbytes(n_devices=n, layout=layout)
            print(
                f"  {layout:9s} x{n}: GGUF {m.gguf / GB:7.2f} GB -> {m.total / GB:7.2f} GB total, "
                f"{m.per_device / GB:6.2f} GB per device, growth {m.growth / 1e6:+10.1f} MB "
                f"({m.growth / n / 1e6:+.1f} MB per device), x{m.total / m.gguf:.4f}"
            )
    for name in ("IQ2_S", "IQ3_S"):
        shape = expert_shape("gate")
        print(
            f"  {name} re-encoded / GGUF bytes: {plane_nbytes(shape, name, layout='reencoded') / gguf_nbytes(shape, name):.4f}"
        )


if __name__ == "__main__":  # pragma: no cover
    main()
