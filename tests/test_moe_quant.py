"""Routed experts with quantized weights: kernels/moe (reference, xla_quant, dispatch) against an f64 numpy
computation on gguf-py-dequantized weights; a count of the experts xla_quant dequantizes; and the model with
QuantizedExperts (UD-like mix) against the same model holding the dequantized experts as dense arrays."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from expert_blocks import f16_scales
from flax import nnx
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from configs import glm53_flash, tiny
from glm53 import build, dims
from glm53.config import ModelConfig, QuantConfig, model_config_from_dict, quant_config_from_dict
from glm53.layers.moe import Experts
from glm53.model import Glm53Model
from glm53.quant import budget
from glm53.quant.formats import get_format
from glm53.quant.mixes import UD_IQ3_XXS
from glm53.quant.qweight import QuantizedExperts
from kernels import dispatch
from kernels.moe import api, xla_cpu, xla_quant

E, D, F, K = 12, 256, 256, 4
LIMIT = 2.0  # small, so the SwiGLU clamps fire
MIX = {"gate": "IQ2_S", "up": "IQ3_S", "down": "IQ4_XS"}
GGUF_SHAPES = {"gate": (E, F, D), "up": (E, F, D), "down": (E, D, F)}  # [E, rows = out, cols = in]


def random_gguf(name: str, shape, rng) -> np.ndarray:
    """Random valid GGUF bytes of `shape` [E, rows, cols]: random bytes with small finite f16 scales (d, dmin) of
    both signs, a quarter of them subnormal (tests/expert_blocks.py); float formats get N(0, 0.05^2) values."""
    f = get_format(name)
    n_blocks = int(np.prod(shape)) // f.block_size
    if name in ("F32", "F16", "BF16"):
        v = (0.05 * rng.standard_normal(n_blocks)).astype(np.float32)
        if name == "F32":
            return v.view(np.uint8)
        if name == "F16":
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, f.type_size), dtype=np.uint8)
    scale = {"Q8_0": 1e-3, "Q4_0": 5e-3}.get(name, 2e-4 if name.startswith("Q") else 2e-3)
    for fd in f.fields:
        if fd.name in ("d", "dmin"):
            d = f16_scales(n_blocks, rng, scale).astype("<f2")
            raw[:, fd.offset : fd.offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def kernel_f64(raw: np.ndarray, name: str, shape) -> np.ndarray:
    """gguf-py's dequantization as the f64 dense kernel [E, in, out]."""
    w = gq.dequantize(raw, GGMLQuantizationType[name]).reshape(shape).astype(np.float64)
    return np.swapaxes(w, 1, 2)


def moe_f64(x, ids, w, kernels, limit=LIMIT) -> np.ndarray:
    """f64 loop over (token, slot): y[t] = sum_k w[t,k] down_e(silu(min(g, L)) * clip(u, -L, L))."""
    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= kernels["gate"].shape[0]:
                continue
            g, u = x[t] @ kernels["gate"][e], x[t] @ kernels["up"][e]
            g = np.minimum(g, limit)
            h = g / (1.0 + np.exp(-g)) * np.clip(u, -limit, limit)
            y[t] += float(w[t, j]) * (h @ kernels["down"][e])
    return y


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def routing(streams: int, rng, pool: int = 6, k: int = K):
    """Top-k ids drawn from the first `pool` experts (so streams overlap heavily), weights and tokens."""
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(streams)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (streams, k)).astype(np.float32)
    x = rng.standard_normal((streams, D)).astype(np.float32)
    return x, ids, w


@pytest.fixture(scope="module")
def mix_weights():
    """{layout: {matrix: QuantizedExperts}} of the MIX formats and their f64 kernels."""
    rng = np.random.default_rng(0)
    raws = {m: random_gguf(MIX[m], GGUF_SHAPES[m], rng) for m in MIX}
    kernels = {m: kernel_f64(raws[m], MIX[m], GGUF_SHAPES[m]) for m in MIX}
    qs = {
        lay: {m: QuantizedExperts.from_gguf_bytes(raws[m], MIX[m], GGUF_SHAPES[m], lay) for m in MIX}
        for lay in ("planes", "reencoded")
    }
    return qs, kernels


# every implementation that takes QuantizedExperts on this host, checked against the f64 computation
IMPLS = ("reference", "xla_quant_decode", "xla_quant_prefill", "xla_cpu_decode", "xla_cpu_prefill")


def _run(impl, x, ids, w, ws, **kw):
    fn = jax.jit(lambda x, i, w, g, u, d: api.moe_experts(x, i, w, g, u, d, LIMIT, implementation=impl, **kw))
    return np.asarray(fn(x, ids, w, ws["gate"], ws["up"], ws["down"]))


@pytest.mark.parametrize("streams", (1, 3, 8, 32))
@pytest.mark.parametrize("impl", IMPLS)
def test_impl_vs_f64_numpy(mix_weights, impl, streams):
    qs, kernels = mix_weights
    x, ids, w = routing(streams, np.random.default_rng(streams))
    ref = moe_f64(x, ids, w, kernels)
    assert rel_err(_run(impl, x, ids, w, qs["planes"]), ref) < 2e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_reencoded_layout_vs_f64_numpy(mix_weights, impl):
    qs, kernels = mix_weights
    x, ids, w = routing(8, np.random.default_rng(11), pool=E)
    ids[2, 1] = E  # an empty slot contributes nothing
    assert qs["reencoded"]["gate"].layout == "reencoded" and qs["reencoded"]["down"].layout == "planes"
    assert rel_err(_run(impl, x, ids, w, qs["reencoded"]), moe_f64(x, ids, w, kernels)) < 2e-5


@pytest.mark.parametrize(
    "name", ("IQ2_S", "IQ3_S", "IQ4_XS", "IQ3_XXS", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "BF16")
)
def test_every_expert_format_through_xla_quant(name):
    rng = np.random.default_rng(5)
    raws = {m: random_gguf(name, GGUF_SHAPES[m], rng) for m in MIX}
    ws = {m: QuantizedExperts.from_gguf_bytes(raws[m], name, GGUF_SHAPES[m]) for m in MIX}
    kernels = {m: kernel_f64(raws[m], name, GGUF_SHAPES[m]) for m in MIX}
    x, ids, w = routing(3, rng, pool=E)
    for impl in ("xla_quant_decode", "xla_cpu_decode", "xla_cpu_prefill"):
        assert rel_err(_run(impl, x, ids, w, ws), moe_f64(x, ids, w, kernels)) < 2e-5


def test_dense_and_quantized_weights_mix(mix_weights):
    """One matmul path for dense and quantized operands: a dense gate array with quantized up / down."""
    qs, kernels = mix_weights
    ws = dict(qs["planes"], gate=jnp.asarray(kernels["gate"], jnp.float32))
    x, ids, w = routing(5, np.random.default_rng(2), pool=E)
    ref = moe_f64(x, ids, w, kernels)
    for impl in IMPLS:
        assert rel_err(_run(impl, x, ids, w, ws), ref) < 2e-5


# ----------------------------------------------------------------------------------------------- counting
def _count_dequantized(monkeypatch, fn, *args):
    """Runs fn (jitted fresh) and returns the expert ids each `dequantize_experts` execution gathered."""
    seen = []
    orig = xla_quant.dequantize_experts

    def counting(w, ids, dtype):
        assert isinstance(w, QuantizedExperts)
        taken = w.take(ids)
        assert taken.planes.lead_shape == ids.shape  # only these experts' planes are gathered
        jax.debug.callback(lambda i: seen.append(np.asarray(i).copy()), ids)
        return orig(w, ids, dtype)

    monkeypatch.setattr(xla_quant, "dequantize_experts", counting)
    jax.block_until_ready(jax.jit(fn)(*args))
    return seen


@pytest.mark.parametrize("per_step", (1, 4))
def test_decode_dequantizes_only_distinct_experts(mix_weights, monkeypatch, per_step):
    qs, _ = mix_weights
    ws = qs["planes"]
    x, ids, w = routing(8, np.random.default_rng(7), pool=7)  # 32 slots, 7 distinct experts
    distinct = sorted(set(ids.ravel().tolist()))
    u = len(distinct)

    def fn(x, ids, w, g, up, d):
        return xla_quant.moe_experts_decode(x, ids, w, g, up, d, LIMIT, experts_per_step=per_step)

    seen = _count_dequantized(monkeypatch, fn, x, ids, w, ws["gate"], ws["up"], ws["down"])
    steps = -(-u // per_step)
    assert len(seen) == 3 * steps  # gate, up, down once per step
    per_matrix = np.concatenate(seen).reshape(steps, 3, per_step)[:, 0].ravel()
    assert per_matrix.size == per_step * steps  # dequantized experts per matrix: U rounded up to the step
    assert sorted(per_matrix[per_matrix < E].tolist()) == distinct  # each distinct expert once, padding = E
    if per_step == 1:
        assert per_matrix.size == u


def test_prefill_dequantizes_each_routed_expert_once(mix_weights, monkeypatch):
    qs, _ = mix_weights
    ws = qs["planes"]
    x, ids, w = routing(20, np.random.default_rng(8), pool=9)

    def fn(x, ids, w, g, up, d):
        return xla_quant.moe_experts_prefill(x, ids, w, g, up, d, LIMIT, tile_rows=4)

    seen = _count_dequantized(monkeypatch, fn, x, ids, w, ws["gate"], ws["up"], ws["down"])
    got = sorted(int(s[0]) for s in seen)
    assert got == sorted(3 * sorted(set(ids.ravel().tolist())))


def counted_chunks(monkeypatch) -> list:
    """The expert ids of every chunk xla_cpu dequantizes from now on (appended as the program runs), on the XLA
    path (the C++ kernel dequantizes nothing)."""
    seen = []
    orig = xla_cpu.dequantize_chunk

    def counting(q, chunk_ids, dtype):
        jax.debug.callback(lambda i: seen.append(np.asarray(i).copy()), chunk_ids)
        return orig(q, chunk_ids, dtype)

    monkeypatch.setattr(xla_cpu, "dequantize_chunk", counting)
    monkeypatch.setenv("GLM53_MOE_FFI", "0")
    return seen


@pytest.mark.parametrize("form", ("decode", "prefill"))
def test_xla_cpu_dequantizes_each_routed_expert_once(mix_weights, monkeypatch, form):
    """xla_cpu dequantizes the distinct routed experts in chunks of `chunk_experts`: ceil(U / chunk) chunks
    per matrix, holding every distinct expert once (the last chunk padded)."""
    qs, _ = mix_weights
    ws = qs["planes"]
    x, ids, w = routing(20, np.random.default_rng(8), pool=9)  # 80 slots, 9 distinct experts
    distinct = sorted(set(ids.ravel().tolist()))
    seen = counted_chunks(monkeypatch)
    fn = getattr(xla_cpu, f"moe_experts_{form}")
    y = jax.jit(lambda *a: fn(*a, LIMIT, chunk_experts=4))(x, ids, w, ws["gate"], ws["up"], ws["down"])
    jax.block_until_ready(y)
    chunks = -(-len(distinct) // 4)
    assert len(seen) == 3 * chunks  # gate, up, down once per chunk
    per_matrix = np.stack(seen).reshape(chunks, 3, 4)[:, 0].ravel()
    assert per_matrix[: len(distinct)].tolist() == distinct


def test_xla_cpu_prefill_computes_only_the_group_rows(monkeypatch):
    """The prefill form's expert FFN runs on exactly the routed rows: full tiles plus power-of-two remainder
    tiles sum to the non-empty slots, with no padded row (dense weights, groups of odd sizes)."""
    rng = np.random.default_rng(3)
    t, k, e = 23, 3, 5
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    ids[4, 1] = e  # an empty slot
    x = rng.standard_normal((t, D)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    dense = {m: jnp.asarray(0.05 * rng.standard_normal(s), jnp.float32)
             for m, s in (("gate", (e, D, 64)), ("up", (e, D, 64)), ("down", (e, 64, D)))}  # fmt: skip
    rows = []
    orig = xla_cpu._ffn

    def counting(xt, mats, limit):
        jax.debug.callback(lambda: rows.append(xt.shape[0]))
        return orig(xt, mats, limit)

    monkeypatch.setattr(xla_cpu, "_ffn", counting)
    args = (x, ids, w, dense["gate"], dense["up"], dense["down"])
    y = jax.jit(lambda *a: xla_cpu.moe_experts_prefill(*a, LIMIT, tile_rows=8))(*args)
    jax.block_until_ready(y)
    assert sum(rows) == int(np.sum(ids < e)) and max(rows) == 8
    kern = {m: np.asarray(v, np.float64) for m, v in dense.items()}  # [E, in, out]
    assert rel_err(y, moe_f64(x, ids, w, kern)) < 2e-5


# ----------------------------------------------------------------------------------------------- dispatch
def test_dispatch_rule():
    sel = api.select_implementation
    assert sel("auto", 64, 64, "cpu") == "xla_cpu_decode"
    assert sel("auto", 65, 64, "cpu") == "xla_cpu_prefill"
    assert sel("auto", 64, 64, "gpu") == "pallas_gpu_decode"
    assert sel("auto", 65, 64, "gpu") == "pallas_gpu_prefill"
    assert sel("auto", 8, 64, "tpu") == "pallas_tpu_decode"
    assert sel("auto", 4096, 512, "tpu") == "pallas_tpu_prefill"
    assert sel("xla_quant", 3, 2) == "xla_quant_prefill"
    assert sel("xla_cpu", 2, 2, "gpu") == "xla_cpu_decode"
    assert sel("reference", 10**6, 1, "tpu") == "reference"
    with pytest.raises(ValueError, match="unknown implementation"):
        sel("fastest", 8, 64)


def test_auto_and_fallback(mix_weights, monkeypatch, caplog):
    qs, kernels = mix_weights
    x, ids, w = routing(3, np.random.default_rng(9), pool=E)
    # auto == xla_cpu on cpu, xla_quant on gpu (decode form for 12 slots <= 64, prefill form for
    # decode_max_slots=4)
    fast = {"cpu": "xla_cpu", "gpu": "xla_quant"}.get(jax.default_backend(), "xla_quant")
    with monkeypatch.context() as m:
        m.setitem(api._AUTO, jax.default_backend(), fast)
        np.testing.assert_array_equal(
            _run("auto", x, ids, w, qs["planes"]), _run(f"{fast}_decode", x, ids, w, qs["planes"])
        )
        np.testing.assert_array_equal(
            _run("auto", x, ids, w, qs["planes"], decode_max_slots=4),
            _run(f"{fast}_prefill", x, ids, w, qs["planes"]),
        )
    # the Pallas kernels take QuantizedExperts only: named, dense arrays raise; "auto" runs the reference
    dense = {m: jnp.asarray(kernels[m], jnp.float32) for m in MIX}
    with pytest.raises(NotImplementedError, match="'pallas_tpu_decode'.*QuantizedExperts"):
        _run("pallas_tpu_decode", x, ids, w, dense)
    with monkeypatch.context() as m:
        m.setitem(api._AUTO, jax.default_backend(), "pallas_tpu")
        np.testing.assert_array_equal(_run("auto", x, ids, w, dense), _run("reference", x, ids, w, dense))

    # an implementation raising NotImplementedError at trace time: named, the error names it; "auto" falls
    # back to the reference and logs the reason once
    def unsupported(*args):
        raise NotImplementedError("not this shape")

    monkeypatch.setitem(api._AUTO, jax.default_backend(), "xla_quant")
    monkeypatch.setitem(api._IMPLEMENTATIONS, "xla_quant_decode", unsupported)
    with pytest.raises(
        NotImplementedError, match="'xla_quant_decode' cannot run these inputs: not this shape"
    ):
        _run("xla_quant", x, ids, w, qs["planes"])
    dispatch.warn_fallback.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kernels.dispatch"):
        got = [_run("auto", x, ids, w, qs["planes"]) for _ in range(2)]  # traced twice
    for y in got:
        np.testing.assert_array_equal(y, _run("reference", x, ids, w, qs["planes"]))
    warned = [r.getMessage() for r in caplog.records if r.name == "kernels.dispatch"]
    assert len(warned) == 1 and "xla_quant_decode" in warned[0] and "not this shape" in warned[0]


def test_pallas_tpu_is_wired_through_the_api(mix_weights):
    """QuantizedExperts reach the Pallas kernels as Planes (interpret mode off TPU); the result matches the f64
    computation (a named implementation never falls back: formats the kernels do not take would raise)."""
    qs, kernels = mix_weights
    x, ids, w = routing(2, np.random.default_rng(10), pool=E)
    ref = moe_f64(x, ids, w, kernels)
    for impl in ("pallas_tpu_decode", "pallas_tpu_prefill"):
        assert rel_err(_run(impl, x, ids, w, qs["reencoded"]), ref) < 2e-5


# ------------------------------------------------------------------------------------------------- model
def test_experts_params_hold_quantized_experts():
    cfg = model_config_from_dict(tiny.get_config("gguf").model)
    ex = nnx.eval_shape(
        lambda: Experts(cfg, rngs=nnx.Rngs(0), formats={"gate": "IQ2_S", "up": "Q4_K", "down": "IQ3_S"},
                        layout="reencoded")
    )  # fmt: skip
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for name, axes, kernel in (
        ("gate_proj", (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP), (e, d, f)),
        ("up_proj", (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP), (e, d, f)),
        ("down_proj", (dims.EXPERT, dims.EXPERT_MLP, dims.EMBED), (e, f, d)),
    ):
        p = getattr(ex, name)
        q = p.get_value()
        assert isinstance(q, QuantizedExperts) and q.shape == kernel
        assert p.get_metadata()["logical_axes"] == axes
        for a in q.planes.fields.values():  # planes [expert, words over the inputs, output rows]
            assert a.shape[0] == e and a.shape[2] == kernel[2]
    assert ex.gate_proj.get_value().layout == "reencoded" and ex.up_proj.get_value().layout == "planes"


def test_release_model_abstract_experts_match_the_byte_budget():
    """nnx.eval_shape of GLM-5.3-Flash with the UD-IQ3_XXS quant section: the trunk's QuantizedExperts hold
    exactly budget.expert_mix_nbytes of the Unsloth table (109.87 GB as planes); the MTP experts stay dense."""
    cfg = model_config_from_dict(glm53_flash.get_config().model)
    for layout in ("planes", "reencoded"):
        quant = QuantConfig(experts="ud_iq3_xxs", layout=layout)

        def build_model(quant=quant):
            with nnx.var_defaults(ref=True):
                rngs = nnx.Rngs(0)
            return Glm53Model(cfg, rngs=rngs, dtype=jnp.bfloat16, quant=quant)

        model = nnx.eval_shape(build_model)
        total = 0
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            v = var.get_value()
            if isinstance(v, QuantizedExperts):
                assert path[0] == "layers"
                total += v.nbytes
        assert total == budget.expert_mix_nbytes(UD_IQ3_XXS, 1, layout).total
        assert not isinstance(model.mtp.mlp.experts.gate_proj.get_value(), QuantizedExperts)
    assert budget.expert_mix_nbytes(UD_IQ3_XXS, 1, "planes").total == 109_867_696_128


def _tiny_quant_config(experts: str, moe_impl: str):
    c = tiny.get_config("gguf")
    n = 4
    c.model.num_hidden_layers = n
    c.model.num_nextn_predict_layers = 0
    c.model.layer_types = ["dsa" if i % 4 == 3 else "kda" for i in range(n)]
    c.model.mlp_layer_types = ["dense"] + ["moe"] * (n - 1)
    c.model.indexer_types = ["full"] * n
    c.quant.experts = experts  # the format is a config flag
    c.kernels.moe = moe_impl
    c.quant.decode_max_slots = 16
    return c


def _dense_twin(cfg: ModelConfig, qmodel: Glm53Model) -> Glm53Model:
    """The same model with every QuantizedExperts replaced by its dequantized kernel (dense arrays)."""
    dense = Glm53Model(cfg, rngs=nnx.Rngs(1), kernels={"moe": "reference"})
    src = dict(nnx.to_flat_state(nnx.state(qmodel, nnx.Param)))
    state = nnx.state(dense, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        v = src[path].get_value()
        var.set_value(v.dequantize() if isinstance(v, QuantizedExperts) else v)
    nnx.update(dense, state)
    return dense


def test_tiny_model_with_ud_mix_equals_dense_dequantized_model():
    # the UD mix with the release's deviations placed by hand (scaled to 3 layers it is IQ2_S / IQ3_S alone)
    c = _tiny_quant_config("ud_iq3_xxs,1.down=IQ4_XS,3.gate=IQ3_S,3.up=IQ3_S,3.down=IQ4_XS", "xla_quant")
    cfg, qmodel = build.model_from_experiment_config(c)
    formats = {
        i: {m: getattr(layer.mlp.experts, f"{m}_proj").get_value().format_name for m in ("gate", "up", "down")}
        for i, layer in enumerate(qmodel.layers) if layer.mlp_kind == "moe"
    }  # fmt: skip
    # 3 MoE layers: IQ4_XS down on the first and last, IQ3_S gate/up on the last
    assert [formats[i]["down"] for i in (1, 2, 3)] == ["IQ4_XS", "IQ3_S", "IQ4_XS"]
    assert [formats[i]["gate"] for i in (1, 2, 3)] == ["IQ2_S", "IQ2_S", "IQ3_S"]
    dense = _dense_twin(cfg, qmodel)
    fwd = nnx.jit(lambda m, t: m(t)[0])
    rng = np.random.default_rng(0)
    for shape in (
        (1, 12),
        (3, 1),
    ):  # 48 routed slots: prefill form; 12 slots: decode form (decode_max_slots 16)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)
        ref = np.asarray(fwd(dense, tokens))
        err = rel_err(fwd(qmodel, tokens), ref)
        print(f"tiny model {shape}: max |quant - dense| / max |dense| = {err:.2e}")
        assert err < 1e-5
    # switching the format is a config flag: the same config with another format builds Q4_K experts
    q4 = quant_config_from_dict(_tiny_quant_config("q4_k", "reference").quant)
    abstract = nnx.eval_shape(lambda: Glm53Model(cfg, rngs=nnx.Rngs(0), quant=q4))
    assert all(
        getattr(layer.mlp.experts, f"{m}_proj").get_value().format_name == "Q4_K"
        for layer in abstract.layers if layer.mlp_kind == "moe" for m in ("gate", "up", "down")
    )  # fmt: skip


def test_sharded_planes_give_the_same_result(mix_weights):
    """Planes sharded 8 ways on their output-row (lane) axis, as tensor parallelism splits gate/up: xla_quant and
    the reference under jit equal the unsharded results (an identity), and the planes stay sharded."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as PS

    qs, _ = mix_weights
    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",))
    lanes = NamedSharding(mesh, PS(None, None, "tp"))  # [expert, words, rows]
    sharded = {m: jax.device_put(q, lanes) for m, q in qs["planes"].items()}
    assert all(a.sharding == lanes for q in sharded.values() for a in jax.tree.leaves(q))
    x, ids, w = routing(4, np.random.default_rng(12), pool=E)
    for impl in IMPLS:
        assert rel_err(_run(impl, x, ids, w, sharded), _run(impl, x, ids, w, qs["planes"])) < 1e-6


@pytest.mark.parametrize("layout", ("planes", "reencoded"))
def test_xla_quant_lowers_for_nvidia_gpus(mix_weights, layout):
    """The GPU path is plain XLA: decode and prefill export for CUDA (bf16 activations) from this CPU host, with no
    custom call (nothing needs a GPU-only kernel). Running it on a GPU is checked only where one is lent."""
    import re

    from jax import export

    qs, _ = mix_weights
    ws = qs[layout]
    x, ids, w = routing(3, np.random.default_rng(13))
    x = jnp.asarray(x, jnp.bfloat16)
    for impl in ("xla_quant_decode", "xla_quant_prefill"):
        fn = jax.jit(
            lambda x, i, w, g, u, d, impl=impl: api.moe_experts(x, i, w, g, u, d, LIMIT, implementation=impl)
        )
        text = export.export(fn, platforms=["cuda"])(
            x, ids, w, ws["gate"], ws["up"], ws["down"]
        ).mlir_module()
        assert "stablehlo.while" in text and not re.search(r"custom_call", text)


def test_xla_cpu_decode_dequantizes_one_routed_expert_at_a_time(mix_weights, monkeypatch):
    """By default the decode form dequantizes one expert per chunk (each expert's f32 weights still in cache
    when its matmuls read them): U chunks of one per matrix, the distinct experts in order, and the output
    still the reference's."""
    qs, kernels = mix_weights
    ws = qs["reencoded"]
    x, ids, w = routing(3, np.random.default_rng(9), pool=5)
    distinct = sorted(set(ids.ravel().tolist()))
    seen = counted_chunks(monkeypatch)
    args = (x, ids, w, ws["gate"], ws["up"], ws["down"])
    y = jax.block_until_ready(jax.jit(lambda *a: xla_cpu.moe_experts_decode(*a, LIMIT))(*args))
    assert xla_cpu.DEFAULT_DECODE_CHUNK_EXPERTS == 1
    assert len(seen) == 3 * len(distinct) and all(s.shape == (1,) for s in seen)
    assert np.stack(seen).reshape(len(distinct), 3)[:, 0].tolist() == distinct
    assert rel_err(np.asarray(y), moe_f64(x, ids, w, kernels)) < 2e-5
