"""mHC: kernels/mhc (mhc_pre / mhc_post / Sinkhorn) and glm53.layers.hyper_connections.HyperConnection.

References: transformers `Glm5NextTextHyperConnection` (fp32 and bf16 streams), f64 numpy, and the
doubly-stochastic identity of the Sinkhorn projection.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.glm5_next import modeling_glm5_next as hf

from glm53 import dims
from glm53.config import ModelConfig, as_hf_text_config
from glm53.layers.hyper_connections import HyperConnection
from glm53.layers.param import logical_axes
from kernels.mhc import api
from kernels.mhc.reference import sinkhorn

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    pad_token_id=0,
    eos_token_ids=(1,),
)
N, D = CFG.hc_mult, CFG.hidden_size


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def torch_hc(seed: int, fn_std: float) -> hf.Glm5NextTextHyperConnection:
    """transformers' mHC site with randomized fn, base and scale (their defaults are N(0,.02), 0 and 1)."""
    torch.manual_seed(seed)
    hc = hf.Glm5NextTextHyperConnection(transformers.Glm5NextTextConfig(**as_hf_text_config(CFG)))
    with torch.no_grad():
        hc.fn.normal_(0.0, fn_std)
        hc.base.normal_(0.0, 1.0)
        hc.scale.uniform_(0.5, 2.0)
    return hc


IMPLS = ("reference", "xla_cpu")  # every implementation against the same oracles


def ours_from_torch(hc_t, dtype=jnp.float32, impl="reference") -> HyperConnection:
    """Our module with transformers' weights (HF fn [(2+n)n, nD] -> ours [nD, (2+n)n])."""
    m = HyperConnection(CFG, rngs=nnx.Rngs(0), dtype=dtype, implementation=impl)
    m.fn[...] = jnp.asarray(hc_t.fn.detach().float().numpy().T, dtype)
    m.base[...] = jnp.asarray(hc_t.base.detach().float().numpy())
    m.scale[...] = jnp.asarray(hc_t.scale.detach().float().numpy())
    return m


def np_sinkhorn(logits, hc_eps, iters):
    """f64 numpy version of the comb projection of docs/architecture.md §5."""
    z = logits - logits.max(-1, keepdims=True)
    c = np.exp(z) / np.exp(z).sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return c


def test_params_shapes_and_axes():
    m = HyperConnection(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    mix = (2 + N) * N
    assert m.fn.shape == (N * D, mix) and m.fn.dtype == jnp.bfloat16
    assert m.base.shape == (mix,) and m.base.dtype == jnp.float32
    assert m.scale.shape == (3,) and m.scale.dtype == jnp.float32
    assert logical_axes(m.fn) == (dims.HC_FLAT, dims.HC_MIX)
    assert logical_axes(m.base) == (dims.HC_MIX,)
    assert logical_axes(m.scale) == (dims.HC_SCALE,)


# fn_std 0.05: comb logits of O(1) (Sinkhorn converges in 20 steps); 0.2: peaked logits (it does not).
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn_std", [0.05, 0.2])
def test_mhc_pre_matches_transformers_fp32(fn_std, impl):
    hc_t = torch_hc(0, fn_std)
    x = torch.randn(2, 7, N, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        post_t, comb_t, u_t = hc_t(x)
    m = ours_from_torch(hc_t, impl=impl)
    u, post, comb = nnx.jit(lambda m, x: m(x))(m, jnp.asarray(x.numpy()))
    assert u.dtype == jnp.float32 and post.dtype == jnp.float32 and comb.dtype == jnp.float32
    errs = (rel(u, u_t.numpy()), rel(post, post_t.numpy()), rel(comb, comb_t.numpy()))
    print(f"fn_std={fn_std}: rel err u {errs[0]:.2e} post {errs[1]:.2e} comb {errs[2]:.2e}")
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("impl", IMPLS)
def test_mhc_pre_matches_transformers_bf16_streams(impl):
    """bf16 streams and fn: weights still computed in f32; u is the f32 sum cast to bf16."""
    hc_t = torch_hc(1, 0.05)
    hc_t.fn.data = hc_t.fn.data.to(torch.bfloat16)  # base / scale stay f32, as transformers keeps them
    x = torch.randn(2, 5, N, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        post_t, comb_t, u_t = hc_t(x)
    m = ours_from_torch(hc_t, dtype=jnp.bfloat16, impl=impl)
    u, post, comb = m(jnp.asarray(x.float().numpy(), jnp.bfloat16))
    assert u.dtype == jnp.bfloat16
    assert rel(post, post_t.numpy()) <= 1e-5 and rel(comb, comb_t.numpy()) <= 1e-5
    # u: one bf16 rounding of (nearly) the same f32 value -> at most one bf16 ulp apart.
    ulp = 2.0**-7 * np.abs(u_t.float().numpy())
    diff = np.abs(np.asarray(u, np.float32) - u_t.float().numpy())
    print(f"bf16 u: {np.mean(diff == 0):.4f} exact, max diff/ulp {np.max(diff / np.maximum(ulp, 1e-30)):.2f}")
    assert np.all(diff <= ulp + 1e-30)


def test_sinkhorn_matches_f64_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, N, N)) * 3.0
    got = sinkhorn(jnp.asarray(logits, jnp.float32), hc_eps=CFG.hc_eps, iters=CFG.hc_sinkhorn_iters)
    want = np_sinkhorn(logits, CFG.hc_eps, CFG.hc_sinkhorn_iters)
    print(f"sinkhorn vs f64: rel {rel(got, want):.2e}")
    assert rel(got, want) <= 1e-5


@pytest.mark.parametrize("logit_std,iters", [(1.0, 20), (3.0, 1000)])
def test_sinkhorn_doubly_stochastic(logit_std, iters):
    """Rows and columns sum to 1 (up to the hc_eps floors, ~1e-6) once Sinkhorn has converged."""
    logits = np.random.default_rng(1).normal(size=(64, N, N)) * logit_std
    c = np.asarray(sinkhorn(jnp.asarray(logits, jnp.float32), hc_eps=CFG.hc_eps, iters=iters), np.float64)
    row, col = np.abs(c.sum(-1) - 1).max(), np.abs(c.sum(-2) - 1).max()
    print(f"logit std {logit_std}, {iters} iters: max |row sum - 1| {row:.2e}, |col sum - 1| {col:.2e}")
    assert np.all(c > 0)
    assert row <= 1e-5 and col <= 1e-5


def test_sinkhorn_20_iters_on_peaked_logits_is_not_converged():
    """Documents a property of the model (shared with transformers): 20 iterations leave peaked comb
    matrices only column-stochastic; rows can be off by a few percent."""
    logits = np.random.default_rng(1).normal(size=(64, N, N)) * 3.0
    c = np.asarray(sinkhorn(jnp.asarray(logits, jnp.float32), hc_eps=CFG.hc_eps, iters=20), np.float64)
    row, col = np.abs(c.sum(-1) - 1).max(), np.abs(c.sum(-2) - 1).max()
    print(f"logit std 3, 20 iters: max |row sum - 1| {row:.2e}, |col sum - 1| {col:.2e}")
    assert col <= 1e-5 and row > 1e-3


def _np_post(x, y, post, comb):
    return post[..., None] * y[..., None, :] + np.einsum("btij,btid->btjd", comb, x)


@pytest.mark.parametrize("impl", IMPLS)
def test_mhc_post_matches_f64_numpy(impl):
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(2, 6, N, D)), rng.normal(size=(2, 6, D))
    post = 2.0 / (1.0 + np.exp(-rng.normal(size=(2, 6, N))))
    comb = np_sinkhorn(rng.normal(size=(2, 6, N, N)), 1e-6, 20)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    got = jax.jit(functools.partial(api.mhc_post, implementation=impl))(f32(x), f32(y), f32(post), f32(comb))
    want = _np_post(x, y, post, comb)
    print(f"mhc_post f32 vs f64: rel {rel(got, want):.2e}")
    assert got.dtype == jnp.float32 and rel(got, want) <= 1e-6
    # bf16 streams: post / comb are rounded to bf16 before use; the result is within bf16 rounding of f64.
    bf = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    xb, yb = bf(x), bf(y)
    got_b = api.mhc_post(xb, yb, f32(post), f32(comb), implementation=impl)
    r = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
    want_b = _np_post(r(xb), r(yb), r(post), r(comb))
    # error scale: the magnitudes of the summed terms (three bf16 roundings of at most 2^-9 relative each).
    mag = _np_post(np.abs(r(xb)), np.abs(r(yb)), np.abs(r(post)), np.abs(r(comb)))
    err = np.max(np.abs(np.asarray(got_b, np.float64) - want_b) / mag)
    print(f"mhc_post bf16 vs f64 (bf16-rounded post/comb): max err / term magnitude {err:.2e}")
    assert got_b.dtype == jnp.bfloat16 and err <= 2.0**-7


def test_bad_inputs_raise():
    x = jnp.zeros((1, 2, N, D))
    fn, base, scale = jnp.zeros((N * D, (2 + N) * N)), jnp.zeros(((2 + N) * N,)), jnp.ones(3)
    kw = dict(eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
    with pytest.raises(ValueError, match="fn must be"):
        api.mhc_pre(x, fn.T, base, scale, **kw)
    with pytest.raises(ValueError, match="base must be"):
        api.mhc_pre(x, fn, base[:-1], scale, **kw)
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        api.mhc_pre(x, fn, base, scale, implementation="nope", **kw)
    with pytest.raises(ValueError, match="comb_btnn"):
        api.mhc_post(x, jnp.zeros((1, 2, D)), jnp.zeros((1, 2, N)), jnp.zeros((1, 2, N, N + 1)))
    with pytest.raises(ValueError, match="HyperConnection"):
        HyperConnection(CFG, rngs=nnx.Rngs(0))(jnp.zeros((1, 2, N + 1, D)))


class _Fixed(torch.nn.Module):
    """Stand-in sublayer returning a fixed output (so only the decoder's mHC plumbing is exercised)."""

    def __init__(self, y):
        super().__init__()
        self.y = y

    def forward(self, hidden_states, *args, **kwargs):
        return self.y


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_update_matches_transformers_decoder_bf16(impl):
    """Both mHC sites of a transformers decoder layer (its sublayers replaced by fixed outputs) in bf16:
    exercises the casts of post / comb to the hidden dtype in the stream update."""
    torch.manual_seed(4)
    hf_cfg = transformers.Glm5NextTextConfig(**as_hf_text_config(CFG))
    layer = hf.Glm5NextTextDecoderLayer(hf_cfg, 0)
    g = torch.Generator().manual_seed(5)
    y1, y2 = (torch.randn(2, 5, D, generator=g).to(torch.bfloat16) for _ in range(2))
    layer.self_attn, layer.mlp = _Fixed(y1), _Fixed(y2)
    layer.to(torch.bfloat16)
    ours = {}
    for name in ("attn_hc", "ffn_hc"):
        hc_t = getattr(layer, name)
        with torch.no_grad():
            hc_t.fn.normal_(0.0, 0.05)
            hc_t.base.data = torch.randn(hc_t.base.shape, generator=g)  # f32, as transformers keeps it
            hc_t.scale.data = torch.rand(3, generator=g) * 1.5 + 0.5
        ours[name] = ours_from_torch(hc_t, dtype=jnp.bfloat16, impl=impl)
    x = torch.randn(2, 5, N, D, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want = layer(x)[0].float().numpy()
    xj = jnp.asarray(x.float().numpy(), jnp.bfloat16)
    for name, y in (("attn_hc", y1), ("ffn_hc", y2)):
        _, post, comb = ours[name](xj)
        xj = ours[name].expand(xj, jnp.asarray(y.float().numpy(), jnp.bfloat16), post, comb)
    got = np.asarray(xj, np.float32)
    ulp = 2.0**-7 * np.abs(want)
    diff = np.abs(got - want)
    print(
        f"decoder mHC bf16: {np.mean(diff == 0):.4f} bit-exact, max diff {diff.max():.3e}, "
        f"max diff/ulp {np.max(diff / np.maximum(ulp, 1e-30)):.2f}"
    )
    assert xj.dtype == jnp.bfloat16
    assert np.all(diff <= ulp + 1e-30)
