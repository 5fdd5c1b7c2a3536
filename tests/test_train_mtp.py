"""The MTP loss against an independent float64 numpy computation of the MTP block and its loss from our own forward's
hidden states (transformers has no MTP block), and its gradient against central finite differences of that numpy
loss on a few parameters. The indexer keeps every pool here (index_topk > T), so the block's attention is dense
causal MLA, which the numpy code implements directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from glm53.config import model_config_from_dict
from glm53.model import Glm53Model
from glm53.train import loss as L
from glm53.train import step as S

d = tiny.get_config("default").model
d.num_hidden_layers, d.layer_types, d.mlp_layer_types, d.indexer_types = 4, ["kda"] * 3 + ["dsa"], ["dense"] * 3 + ["moe"], ["full"] * 4  # fmt: skip
d.index_topk = 64
CFG = model_config_from_dict(d)
B, T = 2, 12


def randomize(model: nnx.Module, seed: int) -> None:
    """Every parameter random (norm weights around 1, vectors small, matrices N(0, min(0.08, 1.5/sqrt(fan_in))^2))."""
    rng = np.random.default_rng(seed)
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = np.asarray(v.get_value())
        r = rng.standard_normal(x.shape)
        if x.ndim >= 2:
            val = r * min(0.08, 1.5 / np.sqrt(x.shape[-2]))
        elif path[-1] == "weight":
            val = 1.0 + 0.2 * r
        else:
            val = 0.3 * r
        v.set_value(jnp.asarray(val, jnp.float32))


def rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def swiglu(g, u, lim):
    g = np.minimum(g, lim)
    return g / (1 + np.exp(-g)) * np.clip(u, -lim, lim)


def np_mtp_loss(p: dict, h, tokens, mask, cfg=CFG) -> float:
    """Float64 MTP loss from trunk hidden states h [B, T, D] (p: dotted parameter name -> float64 array)."""
    eps, lim = cfg.rms_norm_eps, cfg.swiglu_limit
    e = p["embed.embedding"][tokens[:, 1:]]
    x = np.concatenate([rms(e, p["mtp.enorm.weight"], eps), rms(h[:, :-1], p["mtp.hnorm.weight"], eps)], -1)
    x = x @ p["mtp.eh_proj.kernel"]
    # dense causal NoPE MLA
    u = rms(x, p["mtp.input_layernorm.weight"], eps)
    a = "mtp.self_attn."
    hq, nope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = rms(u @ p[a + "q_a_proj.kernel"], p[a + "q_a_layernorm.weight"], eps) @ p[a + "q_b_proj.kernel"]
    q = q.reshape(*q.shape[:2], hq, nope)
    c = rms(u @ p[a + "kv_a_proj.kernel"], p[a + "kv_a_layernorm.weight"], eps)
    kv = (c @ p[a + "kv_b_proj.kernel"]).reshape(*c.shape[:2], hq, nope + vd)
    k, v = kv[..., :nope], kv[..., nope:]
    s = np.einsum("bthc,bshc->bhts", q, k) / np.sqrt(nope)
    n = s.shape[-1]
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshe->bthe", pr, v).reshape(*u.shape[:2], hq * vd)
    x = x + o @ p[a + "o_proj.kernel"]
    # MoE: sigmoid router with selection bias, normalized top-k weights, clamped SwiGLU experts, shared expert
    u = rms(x, p["mtp.post_attention_layernorm.weight"], eps)
    m = "mtp.mlp."
    sc = 1 / (1 + np.exp(-(u @ p[m + "router.kernel"])))
    ids = np.argsort(-(sc + p[m + "router.e_score_correction_bias"]), -1)[..., : cfg.num_experts_per_tok]
    w = np.take_along_axis(sc, ids, -1)
    w = w / w.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    y = np.zeros_like(u)
    for j in range(ids.shape[-1]):
        gk, uk, dk = (
            p[m + f"experts.{n}_proj"][ids[..., j]] for n in ("gate", "up", "down")
        )  # [B, T, in, out]
        hj = swiglu(np.einsum("btd,btdf->btf", u, gk), np.einsum("btd,btdf->btf", u, uk), lim)
        y += w[..., j : j + 1] * np.einsum("btf,btfd->btd", hj, dk)
    sh = m + "shared_experts."
    y += (
        swiglu(u @ p[sh + "gate_proj.kernel"], u @ p[sh + "up_proj.kernel"], lim) @ p[sh + "down_proj.kernel"]
    )
    x = x + y
    logits = rms(x, p["mtp.shared_head_norm.weight"], eps) @ p["lm_head.kernel"]
    lg = logits[:, :-1]
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    nll = lse - np.take_along_axis(lg, tokens[:, 2:, None], -1)[..., 0]
    return float((nll * mask[:, 2:]).sum() / mask[:, 2:].sum())


@pytest.fixture(scope="module")
def setup():
    model = Glm53Model(CFG, rngs=nnx.Rngs(0), kernels={"moe": "reference"})
    randomize(model, 1)
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, CFG.vocab_size, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), np.float32)
    mask[1, 9:] = 0.0
    h = np.asarray(jax.jit(lambda m, t: m.hidden(t)[0])(model, jnp.asarray(tokens)))
    graphdef, params = nnx.split(model, nnx.Param)

    def f(params):
        m = nnx.merge(graphdef, params)
        return L.mtp_loss(m, jnp.asarray(h), jnp.asarray(tokens), jnp.asarray(mask))[0]

    loss, grads = jax.jit(jax.value_and_grad(f), compiler_options=S.compiler_options(True))(params)
    flat = {
        ".".join(map(str, k)): np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(params)
    }
    gflat = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
    return dict(p=flat, g=gflat, loss=float(loss), h=h.astype(np.float64), tokens=tokens, mask=mask)


def test_mtp_loss_equals_float64_numpy(setup):
    ref = np_mtp_loss(setup["p"], setup["h"], setup["tokens"], setup["mask"])
    print(f"MTP loss ours {setup['loss']:.7f} numpy f64 {ref:.7f}")
    assert abs(setup["loss"] - ref) <= 2e-5 * abs(ref)
    # a wrong shift (predicting token p+1 instead of p+2) is far off: the test can tell
    shifted = setup["tokens"].copy()
    shifted[:, 2:] = setup["tokens"][:, 1:-1]
    assert abs(np_mtp_loss(setup["p"], setup["h"], shifted, setup["mask"]) - ref) > 1e-2


@pytest.mark.parametrize(
    "name, index",
    [
        ("mtp.eh_proj.kernel", (3, 5)),
        ("mtp.self_attn.kv_b_proj.kernel", (1, 2)),
        ("mtp.enorm.weight", (7,)),
        ("mtp.mlp.shared_experts.down_proj.kernel", (4, 9)),
        ("mtp.shared_head_norm.weight", (11,)),
        ("lm_head.kernel", (5, 17)),
        ("mtp.mlp.router.kernel", (2, None)),  # None: the expert whose column matters most
    ],  # fmt: skip
)
def test_mtp_gradient_matches_finite_differences(setup, name, index):
    p, eps = dict(setup["p"]), 1e-5
    if None in index:
        index = (index[0], int(np.abs(setup["g"][name][index[0]]).argmax()))
    vals = []
    for sign in (1, -1):
        q = setup["p"][name].copy()
        q[index] += sign * eps
        p[name] = q
        vals.append(np_mtp_loss(p, setup["h"], setup["tokens"], setup["mask"]))
    fd = (vals[0] - vals[1]) / (2 * eps)
    ours = float(setup["g"][name][index])
    print(f"{name}{list(index)}: ours {ours:.6e} finite differences {fd:.6e}")
    assert abs(fd) > 1e-5, "pick a parameter the loss depends on"
    assert abs(ours - fd) <= 1e-3 * abs(fd) + 1e-7
