"""KDA: kernels vs fla-core's naive torch KDA, the layer vs transformers' Glm5NextTextLinearAttention (fp32).

Errors are reported as rel = max|ours - ref| / max|ref| (printed with -s).
"""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.cache_utils import DynamicCache
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

from configs.tiny import model_config
from glm53.config import as_hf_text_config, model_config_from_dict
from glm53.layers.conv import ShortConv
from glm53.layers.kda import KDA, KDACache, init_cache
from kernels import dispatch
from kernels.kda import api, xla_cpu
from kernels.kda import cpu_ffi as kda_ffi

TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def naive():
    """fla-core's fla/ops/kda/naive.py, loaded by path (importing the fla package pulls in triton)."""
    loc = importlib.util.find_spec("fla").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        "fla_kda_naive", os.path.join(loc, "ops", "kda", "naive.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------ kernels
B, H, DK, DV = 2, 2, 32, 16
SCALE = DK**-0.5


def kda_inputs(seed: int, T: int, g_mode: str = "random"):
    """Random f32 KDA inputs: unit-norm q, k; g in (-5, 0) (or a fixed value); beta in (0, 1); a state."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = unit(rng.standard_normal((B, T, H, DK)))
    k = unit(rng.standard_normal((B, T, H, DK)))
    v = rng.standard_normal((B, T, H, DV))
    if g_mode == "random":  # the checkpoint's gate: -5 * sigmoid(.), spread over (-5, 0)
        g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((B, T, H, DK))))
    else:
        g = np.full((B, T, H, DK), float(g_mode))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, DK, DV))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, s0)]


IMPLS = ("reference", "xla_cpu")  # every named implementation runs the kernel tests


@functools.partial(jax.jit, static_argnames=("impl", "chunk_size"))
def _chunk(q, k, v, g, beta, s0, impl="reference", chunk_size=64):
    kw = dict(scale=SCALE, initial_state=s0, implementation=impl, chunk_size=chunk_size)
    return api.chunk_kda(q, k, v, g, beta, **kw)


@functools.partial(jax.jit, static_argnames=("impl",))
def _recurrent(q, k, v, g, beta, s0, impl="reference"):
    return api.recurrent_kda(q, k, v, g, beta, scale=SCALE, initial_state=s0, implementation=impl)


def fla_recurrent(naive, q, k, v, g, beta, s0):
    t = [None if x is None else torch.from_numpy(x) for x in (q, k, v, g, beta, s0)]
    o, s = naive.naive_recurrent_kda(*t[:5], scale=SCALE, initial_state=t[5], output_final_state=True)
    return o.numpy(), s.numpy()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T, with_state", [(1, True), (37, True), (64, True), (150, True), (150, False)])
def test_kernels_match_fla_naive_recurrent(naive, T, with_state, impl):
    q, k, v, g, beta, s0 = kda_inputs(T, T)
    s0 = s0 if with_state else None
    o_ref, s_ref = fla_recurrent(naive, q, k, v, g, beta, s0)
    o_c, s_c = _chunk(q, k, v, g, beta, s0, impl=impl)
    o_r, s_r = _recurrent(q, k, v, g, beta, s0, impl=impl)
    assert o_c.shape == (B, T, H, DV) and s_c.shape == (B, H, DK, DV) and s_c.dtype == jnp.float32
    errs = dict(
        chunk_o=rel_err(o_c, o_ref),
        chunk_s=rel_err(s_c, s_ref),
        rec_o=rel_err(o_r, o_ref),
        rec_s=rel_err(s_r, s_ref),
        chunk_vs_rec=rel_err(o_c, o_r),
    )
    print(f"{impl} T={T} state={with_state}", {k_: f"{e:.1e}" for k_, e in errs.items()})
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_matches_fla_naive_chunk(naive, impl):
    """Against fla's own chunked form (T a multiple of 64 there). Its f32 error is ~5e-6 (prefix-sum
    cancellation, see kernels/kda/reference.py), so this bound is looser than against the recurrence."""
    q, k, v, g, beta, s0 = kda_inputs(7, 128)
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta, s0)]
    o_ref, s_ref = naive.naive_chunk_kda(*t[:5], scale=SCALE, initial_state=t[5], output_final_state=True)
    o, s = _chunk(q, k, v, g, beta, s0, impl=impl)
    errs = rel_err(o, o_ref.numpy()), rel_err(s, s_ref.numpy())
    print("vs naive_chunk_kda", errs)
    assert max(errs) < 5e-5, errs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g_value", [-5.0, -30.0, 0.0])
def test_chunk_extreme_decay(naive, g_value, impl):
    """Saturated gate (-5 every token: cumulative -320 in a chunk, exp(320) = inf in f32), a decay far beyond
    the bound, and no decay at all: the chunked form stays finite and equal to the recurrence."""
    q, k, v, g, beta, s0 = kda_inputs(3, 150, g_mode=g_value)
    o_ref, s_ref = fla_recurrent(naive, q, k, v, g, beta, s0)
    o, s = _chunk(q, k, v, g, beta, s0, impl=impl)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    errs = rel_err(o, o_ref), rel_err(s, s_ref)
    print(f"g={g_value}", errs)
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk_size", [24, 64])
def test_chunk_size_and_padding(chunk_size, impl):
    """Other chunk sizes (24: sub-chunks / xla_cpu chunks of 8; 64: xla_cpu chunks of 16) with a padded tail
    give the same result as the recurrence."""
    q, k, v, g, beta, s0 = kda_inputs(11, 50)
    o, s = _chunk(q, k, v, g, beta, s0, impl=impl, chunk_size=chunk_size)
    o_r, s_r = _recurrent(q, k, v, g, beta, s0)
    assert max(rel_err(o, o_r), rel_err(s, s_r)) < TOL


@pytest.mark.parametrize("max_chunk", [1, 2, 64])
def test_xla_cpu_chunk_choices(max_chunk):
    """xla_cpu with chunks of 1 (a scan per token), 2 and 64 tokens (the whole block merge tree) agrees with
    the reference recurrence; a max_chunk that is not a power of two is refused."""
    q, k, v, g, beta, s0 = kda_inputs(13, 70)
    o, s = xla_cpu.chunk_kda(q, k, v, g, beta, scale=SCALE, initial_state=s0, max_chunk=max_chunk)
    o_r, s_r = _recurrent(q, k, v, g, beta, s0)
    assert max(rel_err(o, o_r), rel_err(s, s_r)) < TOL
    with pytest.raises(ValueError, match="max_chunk"):
        xla_cpu.chunk_kda(q, k, v, g, beta, scale=SCALE, max_chunk=12)


def test_auto_is_xla_cpu_without_lapack():
    """On CPU "auto" runs xla_cpu, whose compiled prefill has no custom call (the reference's triangular_solve
    is a LAPACK call per matrix there: the cost this implementation removes)."""
    assert dispatch.resolve("chunk_kda", "auto", api.IMPLEMENTATIONS, api._AUTO, "cpu") == "xla_cpu"
    q, k, v, g, beta, s0 = kda_inputs(5, 40)
    hlo = {
        impl: _chunk.lower(q, k, v, g, beta, s0, impl=impl).compile().as_text()
        for impl in ("reference", "auto")
    }
    assert "lapack" in hlo["reference"] and "custom-call" not in hlo["auto"]


def test_api_errors():
    q, k, v, g, beta, s0 = kda_inputs(0, 4)
    with pytest.raises(ValueError, match="unknown implementation"):
        api.chunk_kda(q, k, v, g, beta, scale=SCALE, implementation="nope")
    with pytest.raises(ValueError, match="beta"):
        api.recurrent_kda(q, k, v, g, beta[..., :1], scale=SCALE)
    with pytest.raises(ValueError, match="g \\(log-decay"):
        api.chunk_kda(q, k, v, g[..., :4], beta, scale=SCALE)
    with pytest.raises(ValueError, match="initial_state"):
        api.chunk_kda(q, k, v, g, beta, scale=SCALE, initial_state=s0[:, :, :4])


# ------------------------------------------------------------------------------------------------ short conv
@pytest.mark.parametrize("activation", ["silu", None])
def test_short_conv_matches_torch_conv1d(activation):
    """ShortConv == F.conv1d(padding=K-1)[..., :T] (+ SiLU), one shot and in pieces carrying the state."""
    rng = np.random.default_rng(0)
    Bc, T, C, K = 2, 20, 8, 4
    x = rng.standard_normal((Bc, T, C)).astype(np.float32)
    w = rng.standard_normal((C, 1, K)).astype(np.float32)  # HF layout [C, 1, K]
    ref = torch.nn.functional.conv1d(
        torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), padding=K - 1, groups=C
    )
    ref = ref[..., :T].transpose(1, 2)
    ref = (torch.nn.functional.silu(ref) if activation == "silu" else ref).numpy()
    conv = ShortConv(C, K, rngs=nnx.Rngs(0), activation=activation)
    conv.weight.set_value(jnp.asarray(w[:, 0, :].T))
    y, state = conv(jnp.asarray(x))
    assert rel_err(y, ref) < 1e-6
    np.testing.assert_array_equal(np.asarray(state), x[:, -(K - 1) :])
    pieces, st = [], None
    for a, b in ((0, 7), (7, 8), (8, 9), (9, 20)):
        yp, st = conv(jnp.asarray(x[:, a:b]), st)
        pieces.append(np.asarray(yp))
    assert rel_err(np.concatenate(pieces, 1), ref) < 1e-6


# ------------------------------------------------------------------------------------------------ layer
@pytest.fixture(scope="module")
def layer_pair():
    """(cfg, hf_config, torch layer with every parameter randomized, our layer holding the same weights)."""
    cfg = model_config_from_dict(model_config("default"))
    hf_cfg = transformers.Glm5NextTextConfig(**as_hf_text_config(cfg))
    assert hf_cfg.layer_types[0] == "linear_attention"
    torch.manual_seed(0)
    tm = Glm5NextTextLinearAttention(hf_cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in tm.named_parameters():
            if name.endswith("A_log"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name == "o_norm.weight":
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name == "conv1d.weight":
                p.copy_(0.4 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    ours = nnx.eval_shape(lambda: KDA(cfg, rngs=nnx.Rngs(0)))  # abstract; every value comes from torch
    copy_kda_from_torch(ours, tm)
    left = [
        p
        for p, v in nnx.to_flat_state(nnx.state(ours, nnx.Param))
        if not isinstance(v.get_value(), jax.Array)
    ]
    assert not left, f"parameters not copied from torch: {left}"
    return cfg, hf_cfg, tm, ours


def copy_kda_from_torch(ours: KDA, tm) -> None:
    """Test helper: HF Glm5NextTextLinearAttention weights -> our KDA (Linear [out, in] -> [in, out])."""

    def t(p):
        return jnp.asarray(p.detach().float().numpy())

    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        getattr(ours, name).kernel.set_value(t(getattr(tm, name).weight).T)
    ours.f_a_proj.kernel.set_value(t(tm.forget_gate.f_a_proj.weight).T)
    ours.f_b_proj.kernel.set_value(t(tm.forget_gate.f_b_proj.weight).T)
    ours.dt_bias.set_value(t(tm.forget_gate.dt_bias))
    ours.A_log.set_value(t(tm.forget_gate.A_log))
    ours.o_norm.weight.set_value(t(tm.o_norm.weight))
    w = t(tm.conv1d.weight)[:, 0, :]  # [3*HD, K]: channels q | k | v
    hd = w.shape[0] // 3
    for i, conv in enumerate((ours.q_conv, ours.k_conv, ours.v_conv)):
        conv.weight.set_value(w[i * hd : (i + 1) * hd].T)


@nnx.jit
def _layer(m, x, cache, start_b):
    return m(x, cache=cache, start_b=start_b)


@nnx.jit
def _layer_nocache(m, x):
    return m(x)


def _x(seed, b, T, D=64):
    return np.random.default_rng(seed).standard_normal((b, T, D)).astype(np.float32)


def _torch(tm, x, cache=None):
    with torch.no_grad():
        return tm(torch.from_numpy(x), cache_params=cache).numpy()


def _check_cache_vs_torch(cache: KDACache, tcache, K):
    """Our conv_state [B, K-1, 3HD] vs torch's [B, 3HD, K] (last K-1 entries); recurrent states."""
    layer = tcache.layers[0]
    conv_t = layer.conv_states[0].numpy()[..., 1:].transpose(0, 2, 1)
    assert conv_t.shape[1] == K - 1
    e_conv = rel_err(cache.conv_state, conv_t)
    e_state = rel_err(cache.state, layer.recurrent_states[0].numpy())
    return e_conv, e_state


T_FULL = 150  # 3 chunks of 64 (the last one padded)


def test_layer_full_sequence_matches_transformers(layer_pair):
    cfg, _, tm, ours = layer_pair
    x = _x(1, 2, T_FULL)
    y_ref = _torch(tm, x)
    y, c = _layer_nocache(ours, jnp.asarray(x))
    assert c is None
    e = rel_err(y, y_ref)
    print(f"full T={T_FULL}: rel {e:.2e}")
    assert e < TOL


def test_layer_decode_matches_transformers(layer_pair):
    """prefill(T-1) + one decode step == prefill(T), and == transformers' own cached path, caches included."""
    cfg, hf_cfg, tm, ours = layer_pair
    x = _x(1, 2, T_FULL)
    y_full = _torch(tm, x)
    tcache = DynamicCache(config=hf_cfg)
    y_tp = _torch(tm, x[:, :-1], tcache)
    y_td = _torch(tm, x[:, -1:], tcache)
    cache = init_cache(cfg, 2, T_FULL)
    y_p, cache = _layer(ours, jnp.asarray(x[:, :-1]), cache, jnp.zeros((2,), jnp.int32))
    y_d, cache = _layer(ours, jnp.asarray(x[:, -1:]), cache, jnp.full((2,), T_FULL - 1, jnp.int32))
    errs = dict(
        prefill_vs_torch=rel_err(y_p, y_tp),
        decode_vs_torch_cached=rel_err(y_d, y_td),
        decode_vs_torch_full=rel_err(y_d, y_full[:, -1:]),
        prefill_vs_torch_full=rel_err(y_p, y_full[:, :-1]),
    )
    errs["conv_state"], errs["state"] = _check_cache_vs_torch(cache, tcache, cfg.linear_conv_kernel_dim)
    print({k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) < TOL, errs


def test_layer_piecewise_prefill_matches_transformers(layer_pair):
    """37 + 112 + 1 tokens through the cache == one shot, and == transformers' cached pieces."""
    cfg, hf_cfg, tm, ours = layer_pair
    x = _x(1, 2, T_FULL)
    y_full = _torch(tm, x)
    tcache = DynamicCache(config=hf_cfg)
    cache = init_cache(cfg, 2, T_FULL)
    errs, outs, pos = {}, [], 0
    for n in (37, 112, 1):
        xs = x[:, pos : pos + n]
        y_t = _torch(tm, xs, tcache)
        y, cache = _layer(ours, jnp.asarray(xs), cache, jnp.full((2,), pos, jnp.int32))
        errs[f"piece{n}_vs_torch_cached"] = rel_err(y, y_t)
        outs.append(np.asarray(y))
        pos += n
    errs["pieces_vs_torch_full"] = rel_err(np.concatenate(outs, 1), y_full)
    errs["conv_state"], errs["state"] = _check_cache_vs_torch(cache, tcache, cfg.linear_conv_kernel_dim)
    print({k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) < TOL, errs


def test_layer_streams_at_different_positions(layer_pair):
    """Streams with different histories (37 and 149 tokens) batched == each stream alone; a stream at start 0
    ignores the stale contents of its cache slot (== a fresh sequence)."""
    cfg, _, _, ours = layer_pair
    x = _x(1, 2, T_FULL)
    zero2 = jnp.zeros((2,), jnp.int32)
    _, c37 = _layer(ours, jnp.asarray(x[:, :37]), init_cache(cfg, 2, 0), zero2)
    _, c149 = _layer(ours, jnp.asarray(x[:, 37:149]), c37, jnp.full((2,), 37, jnp.int32))
    new = jnp.asarray(_x(4, 2, 5))

    def row(c, b):
        return jax.tree.map(lambda a: a[b : b + 1], c)

    def stack(c0, c1):
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], 0), c0, c1)

    y0, _ = _layer(ours, new[:1], row(c37, 0), jnp.asarray([37], jnp.int32))
    y1, _ = _layer(ours, new[1:], row(c149, 1), jnp.asarray([149], jnp.int32))
    y1_fresh, _ = _layer_nocache(ours, new[1:])
    mixed = stack(row(c37, 0), row(c149, 1))
    y, _ = _layer(ours, new, mixed, jnp.asarray([37, 149], jnp.int32))
    y_reset, _ = _layer(ours, new, mixed, jnp.asarray([37, 0], jnp.int32))
    errs = (
        rel_err(y, np.concatenate([y0, y1], 0)),
        rel_err(y_reset, np.concatenate([y0, y1_fresh], 0)),
    )
    print(f"batched streams vs alone: {errs}")
    assert max(errs) < 1e-6, errs
    assert rel_err(y1, y1_fresh) > 1e-2  # the history matters, so the reset check can fail


def test_layer_bf16_activations(layer_pair):
    """bf16 activations: output and conv cache in bf16, recurrent state f32, close to the f32 run."""
    cfg, _, _, ours = layer_pair
    x = jnp.asarray(_x(1, 2, 38))
    outs = {}
    for dt in (jnp.float32, jnp.bfloat16):
        xd = x.astype(dt)
        y_p, c = _layer(ours, xd[:, :37], init_cache(cfg, 2, 0, dt), jnp.zeros((2,), jnp.int32))
        y_d, c = _layer(ours, xd[:, 37:], c, jnp.full((2,), 37, jnp.int32))
        assert y_p.dtype == y_d.dtype == c.conv_state.dtype == dt and c.state.dtype == jnp.float32
        outs[dt] = (np.asarray(y_p.astype(jnp.float32)), np.asarray(y_d.astype(jnp.float32)), c.state)
    errs = [rel_err(a, b) for a, b in zip(outs[jnp.bfloat16], outs[jnp.float32])]
    print("bf16 vs f32", errs)
    assert max(errs) < 5e-2, errs


def test_layer_rejects_bad_cache(layer_pair):
    cfg, _, _, ours = layer_pair
    with pytest.raises(ValueError, match="cache shapes"):
        ours(jnp.zeros((2, 3, 64)), cache=init_cache(cfg, 3, 0), start_b=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="start_b"):
        ours(jnp.zeros((2, 3, 64)), cache=init_cache(cfg, 2, 0), start_b=jnp.zeros((3,), jnp.int32))


def test_decode_step_kernel_live_streams_and_switch(naive, monkeypatch):
    """A T = 1 step of the xla_cpu form runs the C++ step (kernels/kda/cpu_ffi.py): one custom call, fla's values;
    a stream that is not `live` starts from zeros whatever its state holds (NaN here); each stream's result is the
    same alone as in the batch (bit for bit); GLM53_KDA_FFI=0 gives the XLA form (no custom call), same values."""
    assert kda_ffi.available()
    q, k, v, g, beta, s0 = kda_inputs(5, 1)
    live = np.array([True, False] + [True] * (B - 2))
    s_in = s0.copy()
    s_in[1] = np.nan
    s_ref_in = s0.copy()
    s_ref_in[1] = 0.0
    o_ref, s_ref = fla_recurrent(naive, q, k, v, g, beta, s_ref_in)

    def step(*a):
        return api.recurrent_kda(*a[:5], scale=SCALE, initial_state=a[5], live=a[6], implementation="xla_cpu")

    args = [jnp.asarray(a) for a in (q, k, v, g, beta, s_in, live)]
    hlo = jax.jit(lambda *a: step(*a)).lower(*args).compile().as_text()
    assert hlo.count('custom_call_target="glm53_kda_step"') == 1
    o, s = jax.jit(step)(*args)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
    for i in (0, 1):
        oi, si = jax.jit(step)(*(a[i : i + 1] for a in args))
        assert np.array_equal(np.asarray(oi)[0], np.asarray(o)[i]) and np.array_equal(np.asarray(si)[0], np.asarray(s)[i])
    monkeypatch.setenv(kda_ffi.ENV, "0")
    off = jax.jit(lambda *a: step(*a))
    assert off.lower(*args).compile().as_text().count("glm53_kda_step") == 0
    o2, s2 = off(*args)
    assert rel_err(o2, o) < 1e-6 and rel_err(s2, s) < 1e-6
