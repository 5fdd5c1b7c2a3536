"""Pallas TPU routed-expert kernels (kernels.moe.pallas_tpu_decode / _prefill) on quantized planes, in
interpret mode on CPU.

Oracle: the GGUF bytes dequantized by gguf-py (`gguf.quants.dequantize`, independent of glm53's decoders; the
re-encoded layouts are lossless, so their oracle is the source IQ2_S / IQ3_S bytes) and the routed MoE
computed in f64 numpy. Every case, decode and prefill, f32 and bf16 activations, is also compiled for v5e, v5p
and v6e by libtpu (`glm53.testing.tpu`, marker `tpu_compile`), and the Mosaic kernels' op lists are searched for
`tpu.dynamic_gather`.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from glm53.quant import planes as P
from glm53.quant import reencode as R
from glm53.quant import registry
from glm53.quant.formats import get_format
from glm53.quant.qweight import QuantizedExperts
from glm53.testing import tpu
from kernels.moe import api
from kernels.moe import pallas_common as C
from kernels.moe import pallas_tpu as K
from kernels.moe import pallas_tpu_decode as KD
from kernels.moe import pallas_tpu_prefill as KP

LIMIT = 1.0  # SwiGLU clamp: small enough that a good share of gate / up values are clamped
# f16 `d` magnitudes that give weights of about 0.05 (activations stay O(1) through both layers)
_D_SCALE = {
    "IQ4_XS": 1.5e-4,
    "Q4_K": 2e-4,
    "IQ2_S": 1e-3,
    "IQ3_S": 5e-4,
    "BF16": 0.05,
    "F16": 0.05,
    "F32": 0.05,
}


def _gguf_name(fmt: str) -> str:
    return fmt.removesuffix("_R")


def random_gguf(fmt: str, lead: tuple[int, ...], n_blocks: int, rng) -> np.ndarray:
    """Random GGUF bytes uint8 [*lead, n_blocks * type_size]: random codes, finite random-sign f16/bf16 scales
    (one subnormal `d` per matrix), so every code path of the decoder is exercised."""
    name = _gguf_name(fmt)
    f = get_format(name)
    raw = rng.integers(0, 256, size=(*lead, n_blocks, f.type_size), dtype=np.uint8)
    if name == "F32":
        v = (rng.standard_normal(raw.shape[:-1]) * _D_SCALE[name]).astype(np.float32)
        return v.view(np.uint8).reshape(*lead, -1)
    for fd in f.fields:
        if fd.name in ("d", "dmin") or name in ("F16", "BF16"):
            v = (rng.uniform(-1, 1, size=raw.shape[:-1]) * _D_SCALE.get(name, 1e-3)).astype(np.float32)
            v.reshape(-1, v.shape[-1])[:, 0] *= 1e-3 if name != "BF16" else 1.0  # f16 subnormals
            b = v.view(np.uint32) >> 16 if name == "BF16" else v.astype(np.float16).view(np.uint16)
            raw[..., fd.offset : fd.offset + 2] = b.astype("<u2").view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*lead, -1)


def make_matrix(fmt: str, n_experts: int, rows: int, cols: int, rng, block_splits: int = 1):
    """(Planes [E] x (rows, cols) in `fmt`, f64 oracle weights [E, rows, cols] from gguf-py)."""
    name = _gguf_name(fmt)
    f = get_format(name)
    raw = random_gguf(fmt, (n_experts, rows), cols // f.block_size, rng)
    shape = (n_experts, rows, cols)
    if fmt.endswith("_R"):
        planes = R.pack_reencoded(raw, name, shape, block_splits=block_splits)
    else:
        planes = P.pack_planes(raw, name, shape, block_splits=block_splits)
    w = gq.dequantize(raw.reshape(-1, raw.shape[-1]), GGMLQuantizationType[name]).reshape(shape)
    return planes, w.astype(np.float64)


def moe_f64(x, ids, wts, wg, wu, wd, limit=LIMIT):
    """The routed MoE in f64: y[t] = sum_k w[t,k] Wd_e (silu(min(g, L)) clip(u, -L, L)), g = Wg_e x[t], ..."""
    x = np.asarray(x, np.float64)
    n_exp = wg.shape[0]
    y = np.zeros((x.shape[0], wd.shape[1]))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < n_exp:
                continue
            a, b = np.minimum(wg[e] @ x[t], limit), np.clip(wu[e] @ x[t], -limit, limit)
            y[t] += wts[t, k] * (wd[e] @ (a / (1.0 + np.exp(-a)) * b))
    return y


def routing(t: int, k: int, n_experts: int, rng, empty: bool = False):
    """Top-k ids [T, K] from a skewed distribution with forced overlaps between tokens, and weights [T, K]."""
    p = rng.uniform(0.2, 1.0, n_experts) ** 3
    p[rng.integers(n_experts)] = 0.0  # at least one expert nobody routes to
    ids = np.stack([rng.choice(n_experts, k, replace=False, p=p / p.sum()) for _ in range(t)]).astype(
        np.int32
    )
    if t > 1:
        ids[1] = rng.permutation(ids[0])  # token 1 uses exactly token 0's experts
    if t > 2:
        ids[2, : k // 2] = ids[0, : k // 2]
        ids[2] = ids[2, np.argsort(rng.random(k))]
    if empty:
        ids[0, -1] = n_experts  # an empty slot
    return ids, rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)


# (name, T, K, E, D, F, gate fmt, up fmt, down fmt, down block_splits): every format in some layer role,
# streams 1 / 3 / 8 / 32, and a down matrix of two blocks per row stored as two block groups (the TP "blocks"
# split).
CASES = [
    ("ud_mix_T1", 1, 8, 16, 256, 256, "IQ2_S_R", "IQ2_S_R", "IQ3_S_R", 1),  # the UD-IQ3_XXS mix, re-encoded
    ("iq4_q4k_iq2s_T3", 3, 4, 8, 256, 256, "IQ4_XS", "Q4_K", "IQ2_S", 1),
    ("iq3r_bf16_iq4_T8", 8, 4, 8, 256, 512, "IQ3_S_R", "BF16", "IQ4_XS", 2),
    ("f32_f16_iq3s_T32", 32, 4, 16, 256, 256, "F32", "F16", "IQ3_S", 1),
]
# in-register gathers (one per [8, 128] vreg of indices) per 256-weight block and 128 lanes: one per 8 grid
# entries and 128-entry table chunk (4 chunks)
_GATHERS_PER_BLOCK = {"IQ2_S": 32 // 8 * 4, "IQ3_S": 64 // 8 * 4}
_IDS = [c[0] for c in CASES]


@functools.cache
def case_data(name: str):
    return make_case(next(c for c in CASES if c[0] == name), 100 + _IDS.index(name))


def make_case(case, seed: int) -> dict:
    """Random weights (gate / up / down in the case's formats), tokens, routing and the f64 oracle output."""
    _, t, k, e, d, f, fg, fu, fd, splits = case
    rng = np.random.default_rng(seed)
    gate, wg = make_matrix(fg, e, f, d, rng)
    up, wu = make_matrix(fu, e, f, d, rng)
    down, wd = make_matrix(fd, e, d, f, rng, splits)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids, wts = routing(t, k, e, rng, empty=t > 1)
    oracle = (wg, wu, wd)
    return dict(
        x=x, ids=ids, w=wts, gate=gate, up=up, down=down, oracle=oracle, y=moe_f64(x, ids, wts, *oracle)
    )


# TPU interpret mode: simulates the BlockSpec pipeline (a block is copied in only when its index changes, an
# output block is written back only when its index changes, revisiting an output block raises), reads past a
# buffer raise, and uninitialized memory reads as NaN.
_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
_FAST_COMPILE = {"xla_backend_optimization_level": 0}  # the interpreted kernels are big straight-line bodies


@functools.cache
def _jitted(path: str, name: str):
    """The jitted path (lane tile 128, row tile 8, traced) for a case's shapes; reused for other routings."""
    del name  # one compiled program per case (shapes)
    if path == "decode":
        fn = lambda x, i, w, g, u, dn: KD._decode_impl(x, i, w, g, u, dn, LIMIT, 128, _INTERPRET, True)
    else:
        fn = lambda x, i, w, g, u, dn: KP._prefill_impl(x, i, w, g, u, dn, LIMIT, 8, 128, _INTERPRET, True)
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


def _call(path: str, name: str, ids=None, w=None):
    c = case_data(name)
    ids = c["ids"] if ids is None else ids
    w = c["w"] if w is None else w
    y, trace = _jitted(path, name)(c["x"], ids, w, c["gate"], c["up"], c["down"])
    return np.asarray(y), jax.tree.map(np.asarray, trace)


@functools.cache
def _run(path: str, name: str):
    """(y, trace) of the decode / prefill path on the case's routing (one compile per case, shared)."""
    return _call(path, name)


def _assert_close(y, want, rtol=1e-5):
    err = np.abs(np.asarray(y, np.float64) - want).max()
    assert err <= rtol * np.abs(want).max(), (err, np.abs(want).max())


# The kernels' decode math (pallas_common.decode_matrix) against gguf-py, every format, 1 and 2 block groups:
# tests/test_expert_formats.py (TestPallasTpu).


# -------------------------------------------------------------------------------------------- kernels vs f64


@pytest.mark.parametrize("name", _IDS)
def test_decode_matches_f64_reference(name):
    y, _ = _run("decode", name)
    _assert_close(y, case_data(name)["y"])


@pytest.mark.parametrize("name", _IDS)
def test_prefill_matches_f64_reference(name):
    y, _ = _run("prefill", name)
    _assert_close(y, case_data(name)["y"])


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_edge_routings(path):
    """Reusing a compiled case: every slot empty -> exactly 0; all tokens on one expert, a token listing it
    twice (weights add) -> f64 reference."""
    c = case_data("iq4_q4k_iq2s_T3")
    t, k = c["ids"].shape
    y, _ = _call(path, "iq4_q4k_iq2s_T3", ids=np.full((t, k), 8, np.int32))
    assert np.array_equal(y, np.zeros_like(y))
    ids = np.array([[5, 5, 8, 5], [5, 8, 8, 8], [8, 8, 8, 5]], np.int32)
    y, tr = _call(path, "iq4_q4k_iq2s_T3", ids=ids)
    _assert_close(y, moe_f64(c["x"], ids, c["w"], *c["oracle"]))
    if path == "decode":
        assert (
            int(tr["n_valid"][0]) == 1 and (tr["gate_up"][..., 0, 0] >= 0).sum() == 2
        )  # 1 expert x 2 lane blocks


def test_prefill_ragged_groups():
    """Row tile 8 and a skewed routing: an expert with 0 slots, experts spanning 1, 2 and 3+ row tiles."""
    c = case_data("f32_f16_iq3s_T32")
    _, tr = _run("prefill", "f32_f16_iq3s_T32")
    sizes = np.bincount(c["ids"].ravel(), minlength=17)[:16]
    assert (sizes == 0).any() and (sizes > 16).any() and ((sizes > 0) & (sizes <= 8)).any()
    te, nvt = tr["tile_expert"], int(tr["n_tiles"][0])
    np.testing.assert_array_equal(np.bincount(te[:nvt], minlength=16), -(-sizes // 8))
    assert nvt < len(te)  # padding tiles exist and are skipped


def test_prefill_bf16_activations():
    """bf16 activations (weights cast to bf16 in VMEM once per expert tile, row tile 16): bf16 rounding."""
    c = case_data("iq3r_bf16_iq4_T8")
    x = jnp.asarray(c["x"], jnp.bfloat16)
    y = jax.jit(
        lambda x, i, w, g, u, d: KP.moe_prefill(
            x, i, w, g, u, d, LIMIT, row_tile=16, lane_tile=128, interpret=_INTERPRET
        ),
        compiler_options=_FAST_COMPILE,
    )(x, c["ids"], c["w"], c["gate"], c["up"], c["down"])
    assert y.dtype == jnp.bfloat16
    _assert_close(np.asarray(y.astype(jnp.float32)), c["y"], rtol=3e-2)


def test_prefill_down_in_column_windows_is_bit_exact():
    """The down projection computed and combined a window of output columns at a time (`_down_by_columns`, one
    lane block per window here; the release's 2048-token prefill runs 8 windows) gives the one-call result bit
    for bit, and its kernel trace is the one-call trace (every lane block decoded once per expert)."""
    name = "f32_f16_iq3s_T32"
    c = case_data(name)
    fn = lambda x, i, w, g, u, dn: KP._prefill_impl(x, i, w, g, u, dn, LIMIT, 8, 128, _INTERPRET, True, 1)  # noqa: E731
    y, tr = jax.jit(fn, compiler_options=_FAST_COMPILE)(
        c["x"], c["ids"], c["w"], c["gate"], c["up"], c["down"]
    )
    want_y, want_tr = _run("prefill", name)
    assert c["down"].rows // 128 > 1  # several windows
    np.testing.assert_array_equal(np.asarray(y), want_y)
    np.testing.assert_array_equal(np.asarray(tr["down"]), want_tr["down"])


# ---------------------------------------------------------------------------------------------- counting


def _fetches(index_map, grid, *scalars) -> list[tuple]:
    """Block indices Pallas DMAs, in grid order: a step fetches when its block index differs from the last."""
    out, prev = [], None
    for step in np.ndindex(*grid):
        idx = tuple(int(v) for v in index_map(*step, *scalars))
        if idx != prev:
            out.append(idx)
        prev = idx
    return out


@pytest.mark.parametrize("name", _IDS)
def test_decode_fetches_each_distinct_expert_once(name):
    """Per decode step each kernel fetches (DMA schedule of its index maps) and decodes (kernel trace) one
    weight tile per (distinct expert, lane block): weight bytes = distinct experts x expert bytes, not
    tokens x k."""
    c = case_data(name)
    _, tr = _run("decode", name)
    e, f, d = c["gate"].lead_shape[0], c["gate"].rows, c["gate"].cols
    ids = c["ids"]
    distinct = sorted({int(i) for i in ids.ravel() if i < e})
    nv = int(tr["n_valid"][0])
    assert nv == len(distinct) and tr["uids"][:nv].tolist() == distinct
    if ids.shape[0] > 1:
        assert nv < int((ids < e).sum())  # the routing overlaps: a per-slot kernel would fetch more
    u_max = len(tr["uids"])
    gu_map, dn_map = KD._decode_maps(f // 128)[0], KD._decode_maps(d // 128)[2]
    for trace, wmap, grid, n_j in (
        (tr["gate_up"], gu_map, (u_max, f // 128), f // 128),
        (tr["down"], dn_map, (d // 128, u_max), d // 128),
    ):
        decoded = trace[..., 0, 0][trace[..., 0, 0] >= 0]
        assert len(decoded) == nv * n_j and sorted(set(decoded.tolist())) == distinct
        fetched = _fetches(wmap, grid, jnp.asarray(tr["uids"]), jnp.asarray(tr["n_valid"]))
        assert len(fetched) == nv * n_j and len(set(fetched)) == len(fetched)
        assert sorted({i[0] for i in fetched}) == distinct


def test_prefill_decodes_each_expert_tile_once():
    """Prefill: an expert spanning several row tiles is fetched and decoded once per lane block."""
    for name in ("f32_f16_iq3s_T32", "iq3r_bf16_iq4_T8"):
        c = case_data(name)
        _, tr = _run("prefill", name)
        e = c["gate"].lead_shape[0]
        distinct = sorted({int(i) for i in c["ids"].ravel() if i < e})
        for trace in (tr["gate_up"][..., 0, 0], tr["down"][..., 0, 0]):
            for row in trace:  # one lane block
                assert sorted(row[row >= 0].tolist()) == distinct
        nvt = int(tr["n_tiles"][0])
        assert nvt > len(distinct) or name != "f32_f16_iq3s_T32"  # some expert spans several tiles
        w_map, _, _ = KP._prefill_maps()
        nt = len(tr["tile_expert"])
        fetched = _fetches(w_map, (2, nt), jnp.asarray(tr["tile_expert"]), jnp.asarray(tr["n_tiles"]))
        assert len(fetched) == 2 * len(distinct)


# ------------------------------------------------------------------------------------------ TPU compile


def _gather_vregs(kernel_ops: str) -> int:
    """In-register gathers of a Mosaic kernel: each `tpu.dynamic_gather` op counted per 32-bit [8, 128] vreg of
    its result."""
    shapes = re.findall(r"tpu\.dynamic_gather.*-> vector<(\d+)x(\d+)xi32>", kernel_ops)
    return sum(int(r) * int(n) // (8 * 128) for r, n in shapes)


@pytest.mark.tpu_compile
def test_gather_counter_sees_gathers():
    """Positive control: an in-register lane gather lowers to tpu.dynamic_gather and is counted per vreg."""

    def kern(x_ref, i_ref, o_ref):
        o_ref[...] = jnp.take_along_axis(x_ref[...], i_ref[...], axis=1)

    fn = lambda x, i: pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.int32))(x, i)
    ops = tpu.mosaic_ops(tpu.lower_for(fn, np.zeros((16, 128), np.int32), np.zeros((16, 128), np.int32)))
    assert len(ops) == 1 and ops[0].count("tpu.dynamic_gather") == 1 and _gather_vregs(ops[0]) == 2


def _tpu_program(topology: str, path: str, name: str, dtype: str):
    """(Mosaic kernel op texts, compiled program) of a case's path (default tiles) for one chip of `topology`."""
    c = case_data(name)
    if path == "decode":
        fn = lambda x, i, w, g, u, d: KD.moe_decode(x, i, w, g, u, d, LIMIT)
    else:
        fn = lambda x, i, w, g, u, d: KP.moe_prefill(x, i, w, g, u, d, LIMIT, row_tile=128)
    x = np.zeros(c["x"].shape, jnp.dtype(dtype))
    args = (x, c["ids"], c["w"], c["gate"], c["up"], c["down"])
    lowered = tpu.lower_for(fn, *args, devices=tpu.topology_devices(topology))
    return tpu.mosaic_ops(lowered), lowered.compile()


# Every case in bf16 (the serving dtype) on v5e, the target; and each case once more on one other target in
# turn (v5e f32, v5p bf16, v6e bf16, ...), so every target compiles both paths of at least one case (keeps CI short).
_OTHER_TARGETS = [(tpu.TOPOLOGIES[0], "float32")] + [(t, "bfloat16") for t in tpu.TOPOLOGIES[1:]]
_COMPILE_CASES = [
    pytest.param(topology, dtype, name, id=f"{topology}-{name}-{dtype}")
    for i, name in enumerate(_IDS)
    for topology, dtype in ((tpu.TOPOLOGIES[0], "bfloat16"), _OTHER_TARGETS[i % len(_OTHER_TARGETS)])
]


@pytest.mark.tpu_compile
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("topology, dtype, name", _COMPILE_CASES)
def test_compiles_for_tpu_and_counts_gathers(topology, path, name, dtype):
    """Both kernels of each path compile for TPU (Pallas -> Mosaic -> libtpu; a kernel Mosaic rejects fails
    here): 2 Mosaic kernels in the compiled program (gate+up, down), each with its matmuls. Gathers: none for
    every layout but the GGUF codebook ones (IQ2_S, IQ3_S), which have exactly one in-register lane gather
    per 8 grid entries x 128 lanes x table chunk (IQ2_S 0.5, IQ3_S 1 per 1024 weights)."""
    c = case_data(name)
    want = []  # expected gathers of the gate+up kernel, then of the down kernel (default lane tile 256 here)
    for mats in ((c["gate"], c["up"]), (c["down"],)):
        want.append(sum(_GATHERS_PER_BLOCK.get(p.fmt.name, 0) * p.n_blocks * 256 // 128 for p in mats))
    ops, compiled = _tpu_program(topology, path, name, dtype)
    assert tpu.mosaic_kernels(compiled) == 2  # gate+up kernel, down kernel
    assert len(ops) == 2 and all("tpu.matmul" in o for o in ops)
    assert sorted(_gather_vregs(o) for o in ops) == sorted(want)


# ------------------------------------------------------------------------------------------- unsupported


@pytest.mark.parametrize(
    "fmt, rows",
    [(f, 256) for f in registry.gguf_formats() if f not in registry.formats_for("pallas_tpu")] + [("IQ2_S", 64)],
)
def test_unsupported_raise_not_implemented(fmt, rows):
    """Formats without a kernel decoder, or a codebook lookup on under 128 lanes -> NotImplementedError."""
    c = case_data("ud_mix_T1")
    bad, _ = make_matrix(fmt, 16, rows, 256, np.random.default_rng(0))
    if rows == 256:
        with pytest.raises(NotImplementedError, match=f"gate .*{fmt}"):
            KD.moe_decode(c["x"], c["ids"], c["w"], bad, c["up"], c["down"], LIMIT, interpret=True)
    with pytest.raises(NotImplementedError, match=fmt):
        C.check_supported(bad.fmt, bad.shape, 1, "down")


def test_mismatched_shapes_raise():
    c = case_data("iq3r_bf16_iq4_T8")
    with pytest.raises(ValueError, match="down planes"):
        K.check_supported(c["gate"], c["up"], c["gate"])


def test_moe_experts_dispatch(monkeypatch):
    """api.moe_experts with "pallas_tpu": decode kernels up to `decode_max_slots` routed slots, prefill beyond."""
    calls = []
    monkeypatch.setattr(KD, "moe_decode", lambda *a, **kw: calls.append("decode"))
    monkeypatch.setattr(KP, "moe_prefill", lambda *a, **kw: calls.append("prefill"))
    c = case_data("iq4_q4k_iq2s_T3")
    ws = [QuantizedExperts.from_planes(c[m]) for m in ("gate", "up", "down")]
    args = (jnp.asarray(c["x"]), jnp.asarray(c["ids"]), jnp.asarray(c["w"]), *ws, LIMIT)
    slots = c["ids"].size
    api.moe_experts(*args, implementation="pallas_tpu", decode_max_slots=slots)
    api.moe_experts(*args, implementation="pallas_tpu", decode_max_slots=slots - 1)
    assert calls == ["decode", "prefill"]
