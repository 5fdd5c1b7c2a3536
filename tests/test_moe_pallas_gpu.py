"""Pallas GPU routed-expert kernels (kernels.moe.pallas_gpu*): interpreted on CPU against the f64 oracle, and
lowered for CUDA on this host.

The shared kernel test body of tests/test_moe_pallas.py (random GGUF bytes, gguf-py's dequantize as the
independent oracle, the routed MoE in f64 numpy, skewed routings with overlapping experts and empty slots) is
reused with the formats the GPU kernels decode: IQ4_XS, Q4_K, Q8_0, the gather-free IQ2_S_R / IQ3_S_R (the UD
mix), BF16, F16, F32; streams 1 / 3 / 8 / 32. The CUDA-core kernels run in Pallas' interpreter here
(`interpret=True`), the tensor-core prefill (pallas_gpu_wgmma) in the Mosaic GPU interpreter;
`jax.export(..., platforms=["cuda"])` runs the whole Pallas -> Mosaic GPU lowering without a GPU (what a GPU
adds: PTX compilation and the run itself, `experiments/gpu_check.sh`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_pallas import _FAST_COMPILE, LIMIT, _assert_close, make_case, make_matrix, moe_f64, routing

from glm53.quant import registry
from glm53.quant.qweight import QuantizedExperts
from kernels.moe import api
from kernels.moe import pallas_gpu as G
from kernels.moe import pallas_gpu_decode as KD
from kernels.moe import pallas_gpu_prefill as KP
from kernels.moe import routing as moe_routing

# (name, T, K, E, D, F, gate fmt, up fmt, down fmt, down block_splits): every GPU format in some layer role,
# 1 / 3 / 8 / 32 streams, and a down matrix of two blocks per row stored as two block groups.
CASES = [
    ("ud_mix_T1", 1, 8, 16, 256, 256, "IQ2_S_R", "IQ2_S_R", "IQ3_S_R", 1),  # the UD-IQ3_XXS mix, re-encoded
    ("iq4_q4k_q80_T3", 3, 4, 8, 256, 256, "IQ4_XS", "Q4_K", "Q8_0", 1),
    ("bf16_iq3r_iq4_T8", 8, 4, 8, 256, 512, "BF16", "IQ3_S_R", "IQ4_XS", 2),
    ("f16_f32_q4k_T32", 32, 4, 16, 256, 256, "F16", "F32", "Q4_K", 1),
]
_IDS = [c[0] for c in CASES]
# Interpreted here with small programs (compile time grows with rows x decoded weights per loop step): prefill row
# tiles of 4 slots (several tiles per expert), decode token groups of 4 tokens (T=8 and T=32: several groups);
# the CUDA lowering tests use the defaults (row tile 16, token group 8).
ROW_TILE = 4
TOKEN_GROUP = 4


@functools.cache
def case_data(name: str):
    return make_case(next(c for c in CASES if c[0] == name), 200 + _IDS.index(name))


def _fn(path: str, interpret: bool):
    kw = dict(row_tile=ROW_TILE, token_group=TOKEN_GROUP) if interpret else {}
    if path == "decode":
        kw.pop("row_tile", None)
        return lambda x, i, w, g, u, d: KD.moe_decode(x, i, w, g, u, d, LIMIT, interpret=interpret, **kw)
    kw.pop("token_group", None)
    return lambda x, i, w, g, u, d: KP.moe_prefill(x, i, w, g, u, d, LIMIT, interpret=interpret, **kw)


@functools.cache
def _jitted(path: str, name: str):
    del name  # one compiled program per case (shapes, formats); reused for other routings
    return jax.jit(_fn(path, True), compiler_options=_FAST_COMPILE)


def _call(path: str, name: str, ids=None, w=None, x=None):
    c = case_data(name)
    args = (c["x"] if x is None else x, c["ids"] if ids is None else ids, c["w"] if w is None else w)
    return np.asarray(_jitted(path, name)(*args, c["gate"], c["up"], c["down"]))


# ------------------------------------------------------------------------------- interpreted vs f64 oracle


@pytest.mark.parametrize("name", _IDS)
def test_decode_matches_f64_reference(name):
    _assert_close(_call("decode", name), case_data(name)["y"])


@pytest.mark.parametrize("name", ["bf16_iq3r_iq4_T8", "f16_f32_q4k_T32"])
def test_prefill_matches_f64_reference(name):
    _assert_close(_call("prefill", name), case_data(name)["y"])


def test_prefill_ragged_groups():
    """The T=32 case is ragged at row tile 4: an expert with 0 slots, experts of 1, 2 and 3+ row tiles, and
    padding tiles past the real ones (skipped by the kernel); its result is checked above."""
    c = case_data("f16_f32_q4k_T32")
    e = c["gate"].lead_shape[0]
    sizes = np.bincount(c["ids"].ravel(), minlength=e + 1)[:e]
    assert (sizes == 0).any() and (sizes > 2 * ROW_TILE).any() and ((sizes > 0) & (sizes <= ROW_TILE)).any()
    meta = jax.jit(moe_routing.prefill_tiles, static_argnums=(1, 2))(jnp.asarray(c["ids"]), e, ROW_TILE)
    nvt = int(meta["n_tiles"][0])
    np.testing.assert_array_equal(
        np.bincount(np.asarray(meta["tile_expert"])[:nvt], minlength=e), -(-sizes // ROW_TILE)
    )
    assert nvt < len(meta["tile_expert"])


@pytest.mark.parametrize("path, name", [("decode", "iq4_q4k_q80_T3"), ("prefill", "bf16_iq3r_iq4_T8")])
def test_edge_routings(path, name):
    """Reusing a compiled case: every slot empty -> exactly 0; every token on one expert (or none), tokens
    listing it twice (weights add) -> f64 reference."""
    c = case_data(name)
    t, k = c["ids"].shape
    e = c["gate"].lead_shape[0]
    y = _call(path, name, ids=np.full((t, k), e, np.int32))
    assert np.array_equal(y, np.zeros_like(y))
    ids = np.full((t, k), e, np.int32)
    ids[:, 0] = 5
    ids[1, 1:] = 5
    ids[-1, 0] = e
    _assert_close(_call(path, name, ids=ids), moe_f64(c["x"], ids, c["w"], *c["oracle"]))


def test_decode_bf16_activations():
    """bf16 activations (h rounded to bf16 between the matmuls, as the reference): bf16 rounding."""
    c = case_data("ud_mix_T1")
    y = jax.jit(_fn("decode", True), compiler_options=_FAST_COMPILE)(
        jnp.asarray(c["x"], jnp.bfloat16), c["ids"], c["w"], c["gate"], c["up"], c["down"]
    )
    assert y.dtype == jnp.bfloat16
    _assert_close(np.asarray(y.astype(jnp.float32)), c["y"], rtol=3e-2)


# ---------------------------------------------------------------------------------------------- counting


def test_split_k_choice():
    """The cases above run both kernel forms: the T=32 dense gate/up (16 units of 16 inputs) with K split 8
    ways (partial sums and the SwiGLU in XLA), the block formats (one unit here) unsplit (SwiGLU in the kernel)."""
    c = case_data("f16_f32_q4k_T32")
    programs = 16 * 8 * 2  # 16 distinct experts x 8 token groups x 2 lane blocks
    assert G.pick_split([c["gate"], c["up"]], programs) == 8  # 2048 / 256
    assert G.pick_split([c["down"]], programs) == 1
    c = case_data("ud_mix_T1")
    assert G.pick_split([c["gate"], c["up"]], 8 * 1 * 2) == 1


@pytest.mark.parametrize("name", ["iq4_q4k_q80_T3", "f16_f32_q4k_T32"])
def test_decode_programs_cover_each_distinct_expert_once(name):
    """The decode grid: programs g < n_valid run each distinct expert once per token group (weight words read
    = distinct experts x token groups x expert bytes, not tokens x k); the rest do nothing."""
    c = case_data(name)
    e = c["gate"].lead_shape[0]
    n_groups = -(-c["ids"].shape[0] // TOKEN_GROUP)

    @jax.jit
    def schedule(ids, w):
        uids, nv, _ = moe_routing.expert_combine(ids, w, e)
        return KD.decode_schedule(uids, nv, n_groups)

    eid, xid, n_valid = (np.asarray(a) for a in schedule(c["ids"], c["w"]))
    distinct = sorted({int(i) for i in c["ids"].ravel() if i < e})
    run = int(n_valid[0])
    assert run == len(distinct) * n_groups and len(eid) >= run
    assert sorted(zip(eid[:run].tolist(), xid[:run].tolist())) == [
        (u, g) for u in distinct for g in range(n_groups)
    ]
    assert len(distinct) < int((c["ids"] < e).sum())  # overlapping routing: a per-slot kernel would read more


# ------------------------------------------------------------------------------------------ CUDA lowering


def _cuda_module(fn, *args) -> str:
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("name, dtype", [(n, ("bfloat16", "float32")[i % 2]) for i, n in enumerate(_IDS)])
def test_lowers_for_cuda(name, path, dtype):
    """Both kernels of each path lower through Pallas -> Mosaic GPU on this CPU host: two mosaic_gpu_v2 custom
    calls in the exported CUDA module (the gate+up kernel, the down kernel) and no interpreter."""
    c = case_data(name)
    x = np.zeros(c["x"].shape, jnp.dtype(dtype))
    mod = _cuda_module(_fn(path, False), x, c["ids"], c["w"], c["gate"], c["up"], c["down"])
    assert mod.count("@mosaic_gpu_v2(") == 2


def test_api_lowers_pallas_gpu_for_cuda_and_interprets_elsewhere():
    """api.moe_experts("pallas_gpu"): the CUDA lowering holds the Mosaic GPU kernels, the CPU lowering none."""
    c = case_data("ud_mix_T1")
    ws = [QuantizedExperts.from_planes(c[m]) for m in ("gate", "up", "down")]

    def f(x, ids, w, g, u, d):
        return api.moe_experts(x, ids, w, g, u, d, LIMIT, implementation="pallas_gpu")

    args = (jnp.asarray(c["x"]), jnp.asarray(c["ids"]), jnp.asarray(c["w"]), *ws)
    assert _cuda_module(f, *args).count("@mosaic_gpu_v2(") == 2
    assert "mosaic_gpu" not in jax.jit(f).lower(*args).as_text()


# ------------------------------------------------------------------------------------------- unsupported


@pytest.mark.parametrize("fmt", [f for f in registry.gguf_formats() if f not in registry.formats_for("pallas_gpu")])
def test_unsupported_raise_not_implemented(fmt):
    """Formats without a GPU decoder (the GGUF codebook layouts need a gather) -> NotImplementedError naming
    them; "auto" on a GPU backend falls back to the reference."""
    c = case_data("iq4_q4k_q80_T3")
    bad, _ = make_matrix(fmt, 8, 256, 256, np.random.default_rng(0))
    with pytest.raises(NotImplementedError, match=f"gate: no GPU decoder for {fmt}"):
        KD.moe_decode(c["x"], c["ids"], c["w"], bad, c["up"], c["down"], LIMIT, interpret=True)
    ws = [QuantizedExperts.from_planes(p) for p in (bad, c["up"], c["down"])]
    args = (jnp.asarray(c["x"]), jnp.asarray(c["ids"]), jnp.asarray(c["w"]), *ws, LIMIT)
    with pytest.raises(NotImplementedError, match="pallas_gpu_decode"):
        api.moe_experts(*args, implementation="pallas_gpu")
    assert api.select_implementation("auto", 12, backend="gpu") == "pallas_gpu_decode"


def test_auto_falls_back_on_gpu(monkeypatch):
    c = case_data("iq4_q4k_q80_T3")
    bad, _ = make_matrix("IQ2_S", 8, 256, 256, np.random.default_rng(0))
    ws = [QuantizedExperts.from_planes(p) for p in (bad, c["up"], c["down"])]
    args = (jnp.asarray(c["x"]), jnp.asarray(c["ids"]), jnp.asarray(c["w"]), *ws, LIMIT)
    monkeypatch.setitem(api._AUTO, jax.default_backend(), "pallas_gpu")  # this backend behaves as a GPU one

    def run(impl):
        return jax.jit(lambda *a: api.moe_experts(*a, LIMIT, implementation=impl))(*args[:-1])

    np.testing.assert_array_equal(np.asarray(run("auto")), np.asarray(run("reference")))


def test_mismatched_shapes_and_tiles_raise():
    c = case_data("bf16_iq3r_iq4_T8")
    with pytest.raises(ValueError, match="down planes"):
        G.check_supported(c["gate"], c["up"], c["gate"])
    with pytest.raises(NotImplementedError, match="multiple of 128"):
        G.check_supported(c["gate"], c["up"], c["down"], tile=64)


def test_moe_experts_dispatch(monkeypatch):
    """api.moe_experts with "pallas_gpu": decode kernels up to `decode_max_slots` routed slots, prefill beyond."""
    calls = []
    monkeypatch.setattr(KD, "moe_decode", lambda *a, **kw: calls.append("decode") or a[0])
    monkeypatch.setattr(KP, "moe_prefill", lambda *a, **kw: calls.append("prefill") or a[0])
    c = case_data("iq4_q4k_q80_T3")
    ws = [QuantizedExperts.from_planes(c[m]) for m in ("gate", "up", "down")]
    args = (jnp.asarray(c["x"]), jnp.asarray(c["ids"]), jnp.asarray(c["w"]), *ws, LIMIT)
    slots = c["ids"].size
    api.moe_experts(*args, implementation="pallas_gpu", decode_max_slots=slots)
    api.moe_experts(*args, implementation="pallas_gpu", decode_max_slots=slots - 1)
    assert calls == ["decode", "prefill"]


# ------------------------------------------------------------------------------ tensor-core prefill (wgmma)
# (name, T, K, E, D, F, gate/up fmt, down fmt): bf16 activations take pallas_gpu_wgmma when the formats allow.
# The first: 3 experts, one never routed, two of about 70 slots (two 64-row tiles each; a token may list one
# twice). Every case runs interpreted against the f64 oracle (rel err 4e-3 .. 5e-3; the UD mix 14 s) and lowers for
# CUDA; tests/test_expert_formats.py checks each tensor-core decoder (`decode_chunk`) bit for bit against gguf-py.
WGMMA_CASES = [
    ("wg_bf16_q80", 70, 2, 3, 128, 256, "BF16", "Q8_0"),
    ("wg_iq4_q80", 4, 2, 4, 512, 256, "IQ4_XS", "Q8_0"),
    ("wg_q4k_bf16", 4, 2, 4, 512, 256, "Q4_K", "BF16"),
    ("wg_iq3r_iq4", 4, 2, 4, 512, 512, "IQ3_S_R", "IQ4_XS"),
    ("wg_ud_mix", 4, 2, 4, 1024, 512, "IQ2_S_R", "IQ3_S_R"),
]


@functools.cache
def wgmma_case(name: str):
    _, t, k, e, d, f, fgu, fd = next(c for c in WGMMA_CASES if c[0] == name)
    rng = np.random.default_rng(300 + [c[0] for c in WGMMA_CASES].index(name))
    gate, wg = make_matrix(fgu, e, f, d, rng)
    up, wu = make_matrix(fgu, e, f, d, rng)
    down, wd = make_matrix(fd, e, d, f, rng)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    ids, wts = routing(t, k, e, rng)
    y = moe_f64(np.asarray(x.astype(jnp.float32)), ids, wts, wg, wu, wd)
    return dict(x=x, ids=ids, w=wts, gate=gate, up=up, down=down, y=y)


@pytest.mark.parametrize("name", [c[0] for c in WGMMA_CASES])
def test_prefill_tensor_cores_match_f64_reference(name):
    """Interpreted by the Mosaic GPU interpreter (TMA copies, barriers, wgmma simulated): bf16 rounding of the
    activations, the decoded weights and h."""
    c = wgmma_case(name)
    assert KP.W.supports(c["gate"], c["up"], c["down"]) is None
    if name == "wg_bf16_q80":  # ragged: an empty expert and two of two row tiles
        sizes = sorted(np.bincount(c["ids"].ravel(), minlength=3).tolist())
        assert sizes[0] == 0 and sizes[1] > 64
    y = jax.jit(_fn("prefill", True))(c["x"], c["ids"], c["w"], c["gate"], c["up"], c["down"])
    _assert_close(np.asarray(y.astype(jnp.float32)), c["y"], rtol=3e-2)


@pytest.mark.parametrize("name", [c[0] for c in WGMMA_CASES])
def test_prefill_tensor_cores_lower_for_cuda(name):
    c = wgmma_case(name)
    assert KP.W.supports(c["gate"], c["up"], c["down"]) is None
    mod = _cuda_module(_fn("prefill", False), c["x"], c["ids"], c["w"], c["gate"], c["up"], c["down"])
    assert mod.count("@mosaic_gpu_v2(") == 2


def test_tensor_cores_for_bf16_and_supported_formats(monkeypatch):
    calls = []
    real_w, real_g = KP.W.grouped_matmul, KP.G.grouped_matvec
    monkeypatch.setattr(KP.W, "grouped_matmul", lambda *a, **k: calls.append("wgmma") or real_w(*a, **k))
    monkeypatch.setattr(KP.G, "grouped_matvec", lambda *a, **k: calls.append("cuda_cores") or real_g(*a, **k))
    c = wgmma_case("wg_q4k_bf16")
    args = (c["ids"], c["w"], c["gate"], c["up"], c["down"])
    for path in ("prefill", "decode"):  # decode: from 4 tokens on (here 4)
        for x in (c["x"], c["x"].astype(jnp.float32)):
            jax.eval_shape(_fn(path, False), x, *args)
    assert calls == ["wgmma", "wgmma", "cuda_cores", "cuda_cores"] * 2  # bf16, then f32 activations
    calls.clear()
    jax.eval_shape(_fn("decode", False), c["x"][:3], c["ids"][:3], c["w"][:3], *args[2:])
    assert calls == ["cuda_cores", "cuda_cores"]  # 3 tokens: CUDA cores
    mixed = case_data("iq4_q4k_q80_T3")  # gate IQ4_XS, up Q4_K: no shared activation tile
    assert "differ" in KP.W.supports(mixed["gate"], mixed["up"], mixed["down"])
    assert "IQ2_S" in KP.W.supports(*(make_matrix("IQ2_S", 4, 256, 256, np.random.default_rng(1))[0],) * 3)
    one_block, _ = make_matrix("IQ4_XS", 4, 256, 256, np.random.default_rng(2))  # 256 inputs < a 512 chunk
    assert "does not tile" in KP.W.supports(c["gate"], c["up"], one_block)
