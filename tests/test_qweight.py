"""QuantizedExperts (glm53.quant.qweight): GGUF round trips and dequantization against gguf-py for every format,
quantization with llama.cpp (ggml via ctypes) back to the dense kernel, random init under eval_shape, byte counts
against glm53.quant.budget, the UD-IQ3_XXS rule, and the `quant` config section (glm53.config.QuantConfig)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from configs import glm53_flash, tiny
from glm53.config import (
    ConfigError,
    QuantConfig,
    model_config_from_dict,
    quant_config_from_dict,
)
from glm53.quant import budget, ggml
from glm53.quant import planes as P
from glm53.quant.formats import GGUF_FORMATS
from glm53.quant.layout import layout_format
from glm53.quant.mixes import RELEASE_MOE_LAYERS, UD_BASE, UD_IQ3_XXS, parse_mix, ud_iq3_xxs_mix
from glm53.quant.qweight import QuantizedExperts, expert_formats

REENCODABLE = ("IQ2_S", "IQ3_S")
_deq = jax.jit(lambda q: q.dequantize())
_deq_rows = jax.jit(lambda q: q.dequantize_rows())
# relative Frobenius error of llama.cpp's quantizer on N(0, 1) weights, with ~1.3x headroom
MAX_REL_ERR = {
    "IQ2_XXS": 0.45, "IQ2_XS": 0.4, "IQ2_S": 0.35, "IQ3_XXS": 0.28, "IQ3_S": 0.22, "IQ4_NL": 0.1, "IQ4_XS": 0.1,
    "Q2_K": 0.38, "Q3_K": 0.2, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025, "Q8_0": 0.008, "Q4_0": 0.11,
    "F16": 5e-4, "BF16": 3e-3, "F32": 0.0,
}  # fmt: skip


def gguf_dequant(raw: np.ndarray, name: str, shape) -> np.ndarray:
    """gguf-py's dequantizer (the independent reference), f32 `shape` = [E, rows, cols]."""
    return gq.dequantize(np.ascontiguousarray(raw).reshape(-1), GGMLQuantizationType[name]).reshape(shape)


def ggml_bytes(name: str, shape, rng) -> np.ndarray:
    """llama.cpp-quantized bytes of N(0, 1) weights of GGUF shape [E, rows, cols]."""
    x = rng.standard_normal((int(np.prod(shape[:-1])), shape[-1])).astype(np.float32)
    return np.frombuffer(ggml.quantize(x, name, threads=1), np.uint8)


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_gguf_round_trip_and_dequantize_vs_gguf_py(name):
    """Every expert format: bytes round-trip exactly; dequantize() is gguf-py's values, transposed to [E, in, out]."""
    rng = np.random.default_rng(0)
    shape = (3, 8, 512)  # [E, rows = out, cols = in]
    raw = ggml_bytes(name, shape, rng)
    layouts = ("planes", "reencoded") if name in REENCODABLE else ("planes",)
    ref = gguf_dequant(raw, name, shape)  # [E, out, in]
    for layout in layouts:
        q = QuantizedExperts.from_gguf_bytes(raw.tobytes(), name, shape, layout, name="blk.3.ffn_gate_exps")
        assert q.shape == (3, 512, 8) and q.format_name == name and q.layout == layout
        np.testing.assert_array_equal(q.to_gguf_bytes().reshape(-1), raw)
        np.testing.assert_array_equal(np.asarray(_deq(q)), np.swapaxes(ref, 1, 2))
        np.testing.assert_array_equal(np.asarray(_deq_rows(q)), ref)


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_from_dense_quantizes_the_kernel(name):
    """from_dense(w [E, in, out]) comes back as w within the format's error (so the orientation is right)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 512, 16)).astype(np.float32)
    q = QuantizedExperts.from_dense(w, name, threads=1)
    deq = np.asarray(_deq(q))
    assert deq.shape == w.shape
    err = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert err <= MAX_REL_ERR[name], err
    # and the stored bytes are exactly what ggml's quantizer writes for the transposed rows
    rows = np.swapaxes(w, 1, 2).reshape(-1, 512)
    np.testing.assert_array_equal(
        q.to_gguf_bytes().reshape(-1), np.frombuffer(ggml.quantize(rows, name, threads=1), np.uint8)
    )


def test_bytes_and_layout_formats():
    kernel = (288, 4096, 2048)  # gate: [E, D, F] -> GGUF [E, F, D]
    for name in ("IQ2_S", "IQ3_S", "IQ4_XS", "Q4_K", "BF16"):
        for layout in ("planes", "reencoded"):
            q = jax.eval_shape(
                lambda k, n=name, lay=layout: QuantizedExperts.random(k, kernel, n, lay), jax.random.key(0)
            )
            lay = "reencoded" if layout == "reencoded" and name in REENCODABLE else "planes"
            assert q.layout == lay and q.format_name == name and q.shape == kernel
            assert q.nbytes == budget.plane_nbytes((288, 2048, 4096), name, None, lay)
            assert q.gguf_nbytes == budget.gguf_nbytes((288, 2048, 4096), name)
            assert q.planes.fmt == layout_format(name, layout)
    with pytest.raises(ValueError, match="layout"):
        layout_format("IQ2_S", "packed")


@pytest.mark.parametrize(
    "name", ("IQ2_S", "IQ3_S", "IQ3_XXS", "IQ4_XS", "Q3_K", "Q4_K", "Q8_0", "BF16", "F32")
)
def test_random_init_is_valid_and_scaled(name):
    """Random experts are valid GGUF blocks (gguf-py decodes their bytes to our values) with RMS near std."""
    for layout in ("planes", "reencoded"):
        q = jax.jit(lambda k, lay=layout: QuantizedExperts.random(k, (4, 256, 32), name, lay, 0.05))(
            jax.random.key(3)
        )
        P.check_planes(q.planes)
        deq = np.asarray(_deq(q))
        ref = gguf_dequant(q.to_gguf_bytes(), name, (4, 32, 256))
        np.testing.assert_array_equal(deq, np.swapaxes(ref, 1, 2))
        assert 0.035 < np.sqrt(np.mean(deq.astype(np.float64) ** 2)) < 0.065
        assert len(np.unique(deq)) > 200  # varied values (random scales per block)


def test_take_gathers_experts_and_pytree():
    q = QuantizedExperts.random(jax.random.key(0), (6, 256, 16), "IQ3_S", "reencoded")
    full = np.asarray(_deq(q))
    ids = jnp.asarray([4, 1, 4], jnp.int32)
    sub = jax.jit(lambda q, i: q.take(i).dequantize())(q, ids)
    np.testing.assert_array_equal(np.asarray(sub), full[[4, 1, 4]])
    leaves = jax.tree.leaves(q)
    assert leaves and all(a.dtype == jnp.uint32 and a.shape[0] == 6 for a in leaves)
    assert jax.tree.structure(q) == jax.tree.structure(jax.tree.map(jnp.zeros_like, q))


def test_errors_name_the_tensor():
    raw = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="blk.7.ffn_down_exps"):
        QuantizedExperts.from_gguf_bytes(raw, "IQ3_S", (2, 8, 256), name="blk.7.ffn_down_exps")
    with pytest.raises(ValueError, match="multiple of the block size"):
        QuantizedExperts.random(jax.random.key(0), (2, 100, 8), "Q4_K")
    a = QuantizedExperts.random(jax.random.key(0), (2, 256, 8), "Q4_K")
    b = QuantizedExperts.random(jax.random.key(0), (2, 256, 8), "IQ4_XS")
    a.check_like(a)
    with pytest.raises(ValueError, match=r"blk.3.ffn_up_exps: got .*Q4_K.*expects .*IQ4_XS"):
        a.check_like(b, "blk.3.ffn_up_exps")


# --------------------------------------------------------------------------------------------- format mixes
def test_ud_mix_is_the_release_table_and_scales():
    release = ud_iq3_xxs_mix(RELEASE_MOE_LAYERS)
    assert release == UD_IQ3_XXS
    counts = {}
    for f in release.values():
        counts[f] = counts.get(f, 0) + 1
    assert counts == {"IQ2_S": 82, "IQ3_S": 41, "IQ4_XS": 3}  # the GGUF's tensor-type census
    # the rule is the identity on 42 layers wherever they sit
    shifted = ud_iq3_xxs_mix(range(42))
    assert {(i + 3, m): f for (i, m), f in shifted.items()} == UD_IQ3_XXS
    # fewer layers: each takes the majority of the release layers its share of the depth stands for
    small = ud_iq3_xxs_mix([3, 4, 5, 6, 7])  # 5 layers: 8-9 release layers each, at most one deviating
    assert all(small[(i, m)] == UD_BASE[m] for i in range(3, 8) for m in UD_BASE)
    # 21 layers: two release layers each; 8 + 9 (11 and 12: IQ4_XS down) -> 4; 40 + 41 (43, 44) -> 20, a tie
    # that the larger format wins
    mid = ud_iq3_xxs_mix(range(21))
    assert [i for i in range(21) if mid[(i, "down")] == "IQ4_XS"] == [4, 20]
    assert [i for i in range(21) if mid[(i, "gate")] == "IQ3_S"] == [20]
    # more layers than the release: each takes its nearest release ordinal
    big = ud_iq3_xxs_mix(range(84))
    assert [i for i in range(84) if big[(i, "down")] == "IQ4_XS"] == [16, 17, 18, 19, 82, 83]


def test_expert_formats_per_layer():
    cfg = model_config_from_dict(tiny.get_config("gguf").model)  # MoE layers 3..7
    assert expert_formats(None, cfg, 3) is None
    assert expert_formats(QuantConfig(), cfg, 3) is None
    assert expert_formats(QuantConfig(experts="q4_k"), cfg, None) == {
        "gate": "Q4_K",
        "up": "Q4_K",
        "down": "Q4_K",
    }
    mixed = QuantConfig(experts="gate=IQ4_XS,up=Q8_0,down=BF16")
    assert expert_formats(mixed, cfg, 5) == {"gate": "IQ4_XS", "up": "Q8_0", "down": "BF16"}
    ud = QuantConfig(experts="ud_iq3_xxs")
    assert expert_formats(ud, cfg, 7) == {"gate": "IQ2_S", "up": "IQ2_S", "down": "IQ3_S"}  # 5 layers: no deviation
    assert expert_formats(ud, cfg, 5) == {"gate": "IQ2_S", "up": "IQ2_S", "down": "IQ3_S"}
    assert expert_formats(ud, cfg, None) is None  # MTP: not in the UD table
    with pytest.raises(ValueError, match="not a MoE layer"):
        expert_formats(ud, cfg, 0)
    # block 8 is the MTP block of this 8-layer config
    over = QuantConfig(experts="Q4_K,5.down=Q8_0,8.gate=IQ4_XS")
    assert expert_formats(over, cfg, 5) == {"gate": "Q4_K", "up": "Q4_K", "down": "Q8_0"}
    assert expert_formats(over, cfg, None) == {"gate": "IQ4_XS", "up": "Q4_K", "down": "Q4_K"}
    ud_over = QuantConfig(experts="ud_iq3_xxs,7.down=Q8_0")
    assert expert_formats(ud_over, cfg, 7) == {"gate": "IQ2_S", "up": "IQ2_S", "down": "Q8_0"}


def test_mix_spellings_parse_to_one_value():
    """Every spelling of a mix parses to one ExpertMix, and its spec reads back to it."""
    pairs = {"gate": "IQ2_S", "up": "IQ2_S", "down": "Q4_K"}
    same = [
        parse_mix(s)
        for s in ("gate=iq2_s,up=IQ2_S,down=q4_k", pairs, tuple(pairs.items()), "IQ2_S,down=Q4_K")
    ]
    assert all(m == same[0] for m in same) and same[0].base == pairs
    assert parse_mix("none") is None and parse_mix(" ") is None and parse_mix(None) is None
    ud = parse_mix("UD-IQ3_XXS,44.down=Q4_K,45.gate=Q8_0")
    assert ud.ud and ud == parse_mix("ud_iq3_xxs,45.gate=q8_0,44.down=q4_k")
    for m in (*same, ud, parse_mix("Q4_K"), parse_mix("ud_iq3_xxs,gate=Q4_K")):
        assert parse_mix(m.spec) == m
    assert ud.formats(RELEASE_MOE_LAYERS) == {**UD_IQ3_XXS, (44, "down"): "Q4_K"}  # 45 is no MoE layer
    r = ud.resolve(RELEASE_MOE_LAYERS)  # the UD deviations written out: every block answers
    assert not r.ud and r.format(45, "gate") == "Q8_0" and r.format(45, "up") == "IQ2_S"
    assert r.format(12, "down") == "IQ4_XS" and r.format(13, "down") == "IQ3_S"
    with pytest.raises(ValueError, match="resolve"):
        ud.format(3, "gate")
    for spec, match in [
        ("Q4_K,x.down=Q4_K", "experts: cannot parse 'x.down'"),
        ("Q4_K,3.down=Q9", "experts.3.down: unknown quantization format 'Q9'"),
        ("Q4_K,3.up=Q8_0,3.up=Q6_K", "'3.up' given twice"),
        ("none,3.down=Q4_K", "'none' .* takes no formats"),
        ("gate=Q4_K,up=Q4_K", r"experts: no type for \['down'\]"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_mix(spec, "experts")


# ---------------------------------------------------------------------------------------------- config
def test_quant_config_parsing_and_errors():
    assert QuantConfig().experts == "none" and not QuantConfig().quantized
    assert QuantConfig(experts="UD-IQ3_XXS").experts == "ud_iq3_xxs"
    assert QuantConfig(experts="iq4_xs").experts == "IQ4_XS"
    pairs = (("gate", "IQ2_S"), ("up", "IQ2_S"), ("down", "Q4_K"))
    assert QuantConfig(experts=" gate=iq2_s, up=IQ2_S ,down=q4_k").experts == pairs
    assert QuantConfig(experts="ud-iq3_xxs,44.down=q4_k").experts == "ud_iq3_xxs,44.down=Q4_K"
    assert QuantConfig(experts=pairs).mix == parse_mix(pairs)
    assert (
        quant_config_from_dict({"experts": {"down": "q4_k", "up": "iq2_s", "gate": "IQ2_S"}}).experts == pairs
    )
    bad = [
        ({"experts": "iq9"}, "quant.experts"),
        ({"experts": "FP8_E4M3"}, "quant.experts"),
        ({"experts": {"gate": "IQ2_S"}}, "needs exactly"),
        ({"experts": "gate=IQ2_S,gate=IQ3_S,up=Q4_K,down=Q4_K"}, "twice"),
        ({"experts": "gate=IQ2_S,up=Q4_K,down=nope"}, "quant.experts.down"),
        ({"layout": "packed"}, "quant.layout"),
        ({"moe_impl": "reference"}, "quant.moe_impl': the expert kernel moved .* kernels.moe='reference'"),
        ({"decode_max_slots": -1}, "quant.decode_max_slots"),
        ({"experts": "none", "bits": 3}, "unknown keys"),
    ]
    for d, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            quant_config_from_dict(d)


def test_config_files_have_a_quant_section():
    t = quant_config_from_dict(tiny.get_config("gguf").quant)
    assert t == QuantConfig(experts="none", layout="planes", decode_max_slots=64)
    r = quant_config_from_dict(glm53_flash.get_config().quant)
    assert r.experts == "ud_iq3_xxs" and r.decode_max_slots == 512
    # a locked ConfigDict takes the format as a flag-style override
    c = ml_collections.ConfigDict(tiny.get_config("gguf").to_dict())
    c.lock()
    c.quant.experts = "gate=IQ4_XS,up=IQ4_XS,down=Q6_K"
    assert quant_config_from_dict(c.quant).experts[2] == ("down", "Q6_K")
    with pytest.raises(AttributeError):
        c.quant.bits = 3
