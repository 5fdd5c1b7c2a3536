"""Byte counts (glm53.quant.budget): the UD-IQ3_XXS expert mix is 109.87 GB of GGUF blocks and 110.72 GB of planes
over 8 devices (the audit article's figures), and plane_nbytes agrees with the sizes of real packed arrays."""

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from glm53.quant import budget
from glm53.quant import planes as P
from glm53.quant import reencode as R
from glm53.quant.formats import get_format
from glm53.quant.mixes import UD_IQ3_XXS

GATE_UP = (288, 2048, 4096)  # [experts, out, in]
DOWN = (288, 4096, 2048)
BLOCKS_PER_TENSOR = 288 * 2048 * 4096 // 256  # 9,437,184


@pytest.mark.parametrize(
    "name", ("IQ2_S", "IQ3_S", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")
)
def test_gguf_nbytes_matches_gguf_py(name):
    for shape in (GATE_UP, DOWN, (3, 512)):
        want = int(np.prod(quant_shape_to_byte_shape(shape, GGMLQuantizationType[name])))
        assert budget.gguf_nbytes(shape, name) == want


def test_ud_iq3_xxs_table():
    mix = UD_IQ3_XXS
    assert len(mix) == 126 and {layer for layer, _ in mix} == set(range(3, 45))
    counts = {}
    for fmt in mix.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    assert counts == {"IQ2_S": 82, "IQ3_S": 41, "IQ4_XS": 3}
    assert sorted(layer for (layer, m), f in mix.items() if f == "IQ4_XS") == [11, 12, 44]
    assert all(mix[(layer, "down")] != "IQ2_S" for layer in range(3, 45))  # down always wider than gate/up
    assert (
        sum(
            mix[(layer, "gate")] != mix[(3, "gate")] or mix[(layer, "down")] != mix[(3, "down")]
            for layer in range(3, 45)
        )
        == 3
    )  # only three layers deviate (audit article)


def test_gguf_total_is_109_87_gb():
    m = budget.expert_mix_nbytes(n_devices=8)
    assert m.gguf == BLOCKS_PER_TENSOR * (82 * 82 + 41 * 110 + 3 * 136) == 109_867_696_128
    assert f"{m.gguf / 1e9:.2f}" == "109.87"
    assert m.counts == {"IQ2_S": 82, "IQ3_S": 41, "IQ4_XS": 3}


def test_planes_total_for_8_devices_is_110_72_gb():
    """+849 MB: each down projection's 2-byte fields (IQ3_S d; IQ4_XS d and scales_h) take a 4-byte word per row
    per expert on each of 8 devices, because each device holds one input block of the down projection."""
    m = budget.expert_mix_nbytes(n_devices=8)
    per_field = 288 * 4096 * 8 * 2  # experts x rows x devices x 2 padding bytes = 18.87 MB
    assert m.growth == (39 * 1 + 3 * 2) * per_field == 849_346_560
    assert m.total == 110_717_042_688 and f"{m.total / 1e9:.2f}" == "110.72"
    assert m.total == 8 * m.per_device and f"{m.per_device / 1e9:.2f}" == "13.84"
    assert f"{m.growth / 8 / 1e6:.0f}" == "106"  # MB per chip
    one = budget.expert_mix_nbytes(n_devices=1)
    assert one.total == one.gguf  # unsplit: 16 / 8 blocks per row, every d pair whole
    # gate/up split by rows never grow; the whole growth is in the down projections
    for shape, split, name in ((GATE_UP, ("rows", 8), "IQ2_S"), (DOWN, ("blocks", 8), "IQ3_S")):
        grow = 8 * budget.plane_nbytes(shape, name, split) - budget.gguf_nbytes(shape, name)
        assert grow == (0 if split[0] == "rows" else per_field)


def test_reencoded_ratios_and_mix():
    for name, ratio, size in (("IQ2_S", 1.29, 106), ("IQ3_S", 1.22, 134)):
        got = budget.plane_nbytes(GATE_UP, name, layout="reencoded") / budget.gguf_nbytes(GATE_UP, name)
        assert got == size / get_format(name).type_size and round(got, 2) == ratio
    m = budget.expert_mix_nbytes(n_devices=1, layout="reencoded")  # IQ4_XS stays in planes
    assert (
        m.total == BLOCKS_PER_TENSOR * (82 * 106 + 41 * 134 + 3 * 136) and f"{m.total / 1e9:.2f}" == "137.73"
    )
    m8 = budget.expert_mix_nbytes(n_devices=8, layout="reencoded")
    assert m8.total - m.total == 849_346_560  # the same d-word padding on the down projections
    assert m8.per_device > 16.9e9  # does not fit a 16.9 GB v5e chip (docs/architecture.md §12)


@pytest.mark.parametrize(
    "name, layout, shape, split",
    [
        ("IQ2_S", "planes", (2, 8, 4096), ("rows", 4)),
        ("IQ3_S", "planes", (2, 8, 2048), ("blocks", 8)),
        ("IQ4_XS", "planes", (2, 4, 768), ("blocks", 3)),
        ("Q4_K", "planes", (3, 4, 1024), ("blocks", 2)),
        ("Q2_K", "planes", (4, 768), None),
        ("IQ2_S", "reencoded", (2, 8, 2048), ("blocks", 8)),
        ("IQ3_S", "reencoded", (2, 8, 1024), ("rows", 2)),
    ],
)
def test_plane_nbytes_matches_packed_arrays(name, layout, shape, split):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=budget.gguf_nbytes(shape, name), dtype=np.uint8)
    pack = R.pack_reencoded if layout == "reencoded" else P.pack_planes
    p = pack(raw, name, shape)
    n = 1 if split is None else split[1]
    sizes = {P.split_planes(p, split, i).nbytes for i in range(n)}
    assert sizes == {budget.plane_nbytes(shape, name, split, layout)}


def test_bad_input():
    with pytest.raises(ValueError, match="2048 rows do not split into 3"):
        budget.plane_nbytes(GATE_UP, "IQ2_S", ("rows", 3))
    with pytest.raises(ValueError, match="8 blocks do not split into 16"):
        budget.plane_nbytes(DOWN, "IQ3_S", ("blocks", 16))
    with pytest.raises(ValueError, match="unknown split"):
        budget.plane_nbytes(DOWN, "IQ3_S", ("cols", 2))
    with pytest.raises(ValueError, match="unknown layout"):
        budget.plane_nbytes(DOWN, "IQ3_S", layout="dense")
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        budget.gguf_nbytes((4, 100), "Q4_K")
    with pytest.raises(ValueError, match="layer 3 down"):
        budget.expert_mix_nbytes({(3, "down"): "IQ3_S"}, n_devices=16)


def test_main_prints_the_table(capsys):
    budget.main()
    out = capsys.readouterr().out
    assert (
        "planes    x8: GGUF  109.87 GB ->  110.72 GB total,  13.84 GB per device, growth     +849.3 MB" in out
    )
    assert "IQ2_S re-encoded / GGUF bytes: 1.2927" in out and "IQ3_S re-encoded / GGUF bytes: 1.2182" in out
