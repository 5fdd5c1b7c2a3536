"""DSA layer (NoPE MLA + KPool indexer) and the sparse_mla kernel vs transformers 5.23 (fp32) and identities.

Tiny config: hidden 64, 4 heads, q_lora 48, kv_lora 32, nope = v = 16, indexer 32 heads x 16, kpool 4, topk 16
(= 4 pools), T = 80 (20 pools), so most pools are dropped. Layer 0 runs its own indexer, layer 1 is "shared".
rel = max|ours - ref| / max|ref|.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from glm53.config import ModelConfig, as_hf_text_config
from glm53.layers import indexer as idx
from glm53.layers.dsa import DSA, DSACache, init_cache
from kernels.sparse_mla import api

B, T = 2, 80
TOL = 1e-5

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, layer_types=("dsa", "dsa"),
    mlp_layer_types=("dense", "dense"), indexer_types=("full", "shared"), intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4, q_lora_rank=48,
    kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=32, index_head_dim=16, index_topk=16,
    index_kpool=4, linear_num_heads=2, linear_head_dim=16, eos_token_ids=(1,), pad_token_id=0,
)  # fmt: skip


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _hf_attention(cfg, layer_idx):
    import transformers
    from transformers.models.glm5_next import modeling_glm5_next as hf

    hc = transformers.Glm5NextTextConfig(**as_hf_text_config(cfg), attn_implementation="eager")
    return hf.Glm5NextTextAttention(hc, layer_idx).eval()


def _randomize(mod, gen):
    """Random values for every parameter, incl. the constant-init ones (norms, k_norm bias, ape, gate)."""
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("compress_ape"):
                p.copy_(0.7 * torch.randn(p.shape, generator=gen))
            else:  # [out, in] matrices (incl. compress_gate [C, D]): unit-scale outputs, sharpened a bit
                p.copy_(1.5 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _copy_into(ours: DSA, theirs):
    """torch Glm5NextTextAttention weights -> our DSA (Linear weights transposed to [in, out])."""
    t = {k: jnp.asarray(v.detach().numpy()) for k, v in theirs.state_dict().items()}
    ours.q_a_proj.kernel[...] = t["q_a_proj.weight"].T
    ours.q_a_layernorm.weight[...] = t["q_a_layernorm.weight"]
    ours.q_b_proj.kernel[...] = t["q_b_proj.weight"].T
    ours.kv_a_proj.kernel[...] = t["kv_a_proj_with_mqa.weight"].T
    ours.kv_a_layernorm.weight[...] = t["kv_a_layernorm.weight"]
    ours.kv_b_proj.kernel[...] = t["kv_b_proj.weight"].T
    ours.o_proj.kernel[...] = t["o_proj.weight"].T
    if ours.indexer is None:
        assert not any(k.startswith("indexer.") for k in t)
        return
    ix = ours.indexer
    ix.wq_b.kernel[...] = t["indexer.wq_b.weight"].T
    ix.wk.kernel[...] = t["indexer.wk.weight"].T
    ix.k_norm.weight[...] = t["indexer.k_norm.weight"]
    ix.k_norm.bias[...] = t["indexer.k_norm.bias"]
    ix.weights_proj.kernel[...] = t["indexer.weights_proj.weight"].T
    ix.compress_gate[...] = t["indexer.index_kpool_compress_gate"].T
    ix.compress_ape[...] = t["indexer.index_kpool_compress_ape"]


def _jit(mod):
    """A jitted functional call of `mod`: f(x, cache, start_b, selection) -> (y, cache, pool_ids)."""
    graphdef, state = nnx.split(mod)

    @jax.jit
    def f(state, x, cache, start_b, selection):
        return nnx.merge(graphdef, state)(x, cache=cache, start_b=start_b, selection=selection)

    return lambda x, cache=None, start_b=None, selection=None: f(state, x, cache, start_b, selection)


def _torch_call(mod, x, prev=None):
    xt = torch.from_numpy(np.asarray(x))
    mask = torch.ones(xt.shape[:2], dtype=torch.bool)
    with torch.no_grad():
        out, _, topk = mod(
            hidden_states=xt, attention_mask=mask, past_key_values=None, prev_topk_indices=prev
        )
    return out.numpy(), topk


@pytest.fixture(scope="module")
def env():
    gen = torch.Generator().manual_seed(0)
    t0, t1 = _hf_attention(CFG, 0), _hf_attention(CFG, 1)
    _randomize(t0, gen)
    _randomize(t1, gen)
    m0 = DSA(CFG, rngs=nnx.Rngs(0), layer_idx=0)
    m1 = DSA(CFG, rngs=nnx.Rngs(1), layer_idx=1)
    _copy_into(m0, t0)
    _copy_into(m1, t1)
    rs = np.random.RandomState(0)
    x = rs.randn(B, T, CFG.hidden_size).astype(np.float32)
    x1 = rs.randn(B, T, CFG.hidden_size).astype(np.float32)
    ref0, topk0 = _torch_call(t0, x)
    f0 = _jit(m0)
    y0, none_cache, sel0 = f0(jnp.asarray(x))
    assert none_cache is None
    return dict(t0=t0, t1=t1, m0=m0, m1=m1, f0=f0, x=x, x1=x1, ref0=ref0, topk0=topk0, y0=y0, sel0=sel0)


# ------------------------------------------------------------------------------------------------ parity
def test_full_sequence_matches_torch(env):
    r = rel(env["y0"], env["ref0"])
    print(f"one-shot T={T} vs torch: rel {r:.2e}")
    assert r <= TOL


def test_dense_attention_does_not_match(env):
    """With index_topk >= T every pool is selected (dense causal); that output must differ from the sparse one."""
    dense_cfg = CFG.replace(index_topk=128)
    td = _hf_attention(dense_cfg, 0)
    td.load_state_dict(env["t0"].state_dict())
    ref_dense, _ = _torch_call(td, env["x"])
    md = DSA(dense_cfg, rngs=nnx.Rngs(0), layer_idx=0)
    _copy_into(md, td)
    y_dense, _, sel = _jit(md)(jnp.asarray(env["x"]))
    r_dense = rel(y_dense, ref_dense)
    gap = rel(env["ref0"], ref_dense)
    print(f"dense: ours vs torch rel {r_dense:.2e}; sparse vs dense (torch) rel {gap:.3f}")
    assert r_dense <= TOL
    assert gap > 0.05
    # Ours dense == the causal mask exactly.
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = api.selection_mask(sel, q_pos, kpool=4, num_keys=T)
    np.testing.assert_array_equal(
        np.asarray(mask), np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
    )


def _our_scores(m: DSA, x):
    """Our indexer scores [B, T, P] for a fresh sequence (to find tie-free rows)."""
    ix = m.indexer
    x = jnp.asarray(x)
    b, t, _ = x.shape
    q_res = m.q_a_layernorm(m.q_a_proj(x))
    k, g = ix.token_state(x)
    pooled = idx.pool_keys(k.reshape(b, t // 4, 4, -1), g.reshape(b, t // 4, 4, -1), ix.compress_ape[...])
    iq = ix.wq_b(q_res).reshape(b, t, ix.n_heads, ix.head_dim)
    w = ix.weights_proj(x) * ix.n_heads**-0.5
    return np.asarray(idx.pool_scores(iq, w, pooled))


def test_selection_matches_torch_topk(env):
    """Token sets (selected pools + tail) vs torch's top-k indices, on rows whose k-th/k+1-th gap is clear."""
    sel, topk = np.asarray(env["sel0"]), env["topk0"].numpy()
    assert sel.shape == (B, T, 4) and topk.shape == (B, T, 16 + 3)
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ours = np.asarray(api.selection_mask(jnp.asarray(sel), q_pos, kpool=4, num_keys=T))
    theirs = np.zeros((B, T, T), bool)
    for b in range(B):
        for t in range(T):
            v = topk[b, t][topk[b, t] >= 0]
            theirs[b, t, v] = True
    scores = _our_scores(env["m0"], env["x"])
    tie_free = np.ones((B, T), bool)
    for b in range(B):
        for t in range(T):
            n_cand = (t + 1) // 4
            if n_cand > 4:
                s = np.sort(scores[b, t, :n_cand])[::-1]
                tie_free[b, t] = s[3] - s[4] > 1e-5 * np.abs(s).max()
    n_dropped = int(sum(max(0, (t + 1) // 4 - 4) for t in range(T))) * B
    print(f"tie-free rows {tie_free.sum()}/{B * T}; pools dropped over all queries: {n_dropped}")
    assert tie_free.mean() >= 0.9
    np.testing.assert_array_equal(ours[tie_free], theirs[tie_free])
    # Every selected pool is complete and causal; the query always sees itself when its pool is not complete.
    for b in range(B):
        for t in range(T):
            ids = sel[b, t][sel[b, t] >= 0]
            assert len(set(ids.tolist())) == len(ids) == min(4, (t + 1) // 4)
            assert np.all(4 * ids + 3 <= t)


def test_shared_indexer_layer_matches_torch(env):
    """Layer 1 ('shared') attends with layer 0's selection, like torch's prev_topk_indices path."""
    ref1, _ = _torch_call(env["t1"], env["x1"], prev=env["topk0"])
    y1, _, sel1 = _jit(env["m1"])(jnp.asarray(env["x1"]), selection=env["sel0"])
    r = rel(y1, ref1)
    print(f"shared layer vs torch: rel {r:.2e}")
    assert r <= TOL
    np.testing.assert_array_equal(np.asarray(sel1), np.asarray(env["sel0"]))
    with pytest.raises(ValueError, match="shared"):
        env["m1"](jnp.asarray(env["x1"]))
    assert env["m1"].indexer is None


# ------------------------------------------------------------------------------------------------ caches
def test_decode_matches_one_shot(env):
    """prefill(T-9) + 9 single-token decode steps (crossing two pool boundaries) == one-shot prefill(T)."""
    f0, x, y0, sel0 = env["f0"], jnp.asarray(env["x"]), np.asarray(env["y0"]), np.asarray(env["sel0"])
    n0 = T - 9
    cache = init_cache(CFG, B, T)
    y, cache, s = f0(x[:, :n0], cache, jnp.zeros((B,), jnp.int32))
    ys, sels = [np.asarray(y)], [np.asarray(s)]
    for t in range(n0, T):
        y, cache, s = f0(x[:, t : t + 1], cache, jnp.full((B,), t, jnp.int32))
        ys.append(np.asarray(y))
        sels.append(np.asarray(s))
    y = np.concatenate(ys, axis=1)
    r_one, r_torch = rel(y, y0), rel(y[:, n0:], env["ref0"][:, n0:])
    print(f"prefill({n0}) + 9 decode vs one-shot rel {r_one:.2e}; decoded rows vs torch rel {r_torch:.2e}")
    assert r_one <= TOL and r_torch <= TOL
    np.testing.assert_array_equal(np.concatenate(sels, axis=1), sel0)


def test_piecewise_prefill_matches_one_shot(env):
    """Prefill in pieces 29 + 40 + 11 == one shot: outputs, selections and the cache contents."""
    f0, x, y0, sel0 = env["f0"], jnp.asarray(env["x"]), np.asarray(env["y0"]), np.asarray(env["sel0"])
    _, full_cache, _ = f0(x, init_cache(CFG, B, T), jnp.zeros((B,), jnp.int32))
    cache, ys, sels, pos = init_cache(CFG, B, T), [], [], 0
    for n in (29, 40, 11):
        y, cache, s = f0(x[:, pos : pos + n], cache, jnp.full((B,), pos, jnp.int32))
        ys.append(np.asarray(y))
        sels.append(np.asarray(s))
        pos += n
    y = np.concatenate(ys, axis=1)
    r = rel(y, y0)
    print(f"prefill 29+40+11 vs one-shot rel {r:.2e}")
    assert r <= TOL
    np.testing.assert_array_equal(np.concatenate(sels, axis=1), sel0)
    for name in ("latent", "recent_k", "recent_gate", "pooled"):
        np.testing.assert_allclose(getattr(cache, name), getattr(full_cache, name), rtol=1e-5, atol=1e-6)


def test_streams_at_different_positions(env):
    """B=2 streams holding 29 and 40 cached tokens advance 8 tokens jointly == one-shot rows == torch rows.

    The joint cache takes stream 0 from a 29-token prefill and stream 1 from a 40-token prefill, so each stream
    sees only its own history at its own positions.
    """
    f0, x, y0, ref0 = env["f0"], jnp.asarray(env["x"]), np.asarray(env["y0"]), env["ref0"]
    starts, n = (29, 40), 8
    zeros = jnp.zeros((B,), jnp.int32)
    _, c29, _ = f0(x[:, :29], init_cache(CFG, B, T), zeros)
    _, c40, _ = f0(x[:, :40], init_cache(CFG, B, T), zeros)
    joint_cache = jax.tree.map(lambda a, b: jnp.concatenate([a[:1], b[1:]]), c29, c40)
    assert isinstance(joint_cache, DSACache)
    xj = jnp.stack([x[b, s0 : s0 + n] for b, s0 in enumerate(starts)])
    yj, _, _ = f0(xj, joint_cache, jnp.asarray(starts, jnp.int32))
    yj = np.asarray(yj)
    r_one = max(rel(yj[b], y0[b, s0 : s0 + n]) for b, s0 in enumerate(starts))
    r_torch = max(rel(yj[b], ref0[b, s0 : s0 + n]) for b, s0 in enumerate(starts))
    print(
        f"joint B=2 at positions {starts} vs one-shot rows rel {r_one:.2e}; vs torch rows rel {r_torch:.2e}"
    )
    assert r_one <= TOL and r_torch <= TOL


def test_absorbed_equals_expanded(env):
    """The expanded form (k = c W_uk, v = c W_uv per head) == the absorbed form, one-shot and from a cache."""
    me = DSA(CFG, rngs=nnx.Rngs(0), layer_idx=0, attn_form="expanded")
    nnx.update(me, nnx.state(env["m0"]))
    fe, x = _jit(me), jnp.asarray(env["x"])
    ye, _, _ = fe(x)
    cache = init_cache(CFG, B, T)
    _, cache, _ = env["f0"](x[:, :50], cache, jnp.zeros((B,), jnp.int32))
    ye_chunk, _, _ = fe(x[:, 50:], cache, jnp.full((B,), 50, jnp.int32))
    r1, r2 = rel(ye, env["y0"]), rel(ye_chunk, env["y0"][:, 50:])
    print(f"expanded vs absorbed: one-shot rel {r1:.2e}, chunk after cache rel {r2:.2e}")
    assert r1 <= TOL and r2 <= TOL


def test_bad_inputs_raise(env):
    m0, x = env["m0"], jnp.asarray(env["x"])
    with pytest.raises(ValueError, match="start_b"):
        m0(x[:, :4], cache=init_cache(CFG, B, 8), start_b=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="exceed the cache length"):
        m0(x[:, :12], cache=init_cache(CFG, B, 8), start_b=jnp.zeros((B,), jnp.int32))
    with pytest.raises(ValueError, match="selection must be"):
        env["m1"](x[:, :8], selection=jnp.zeros((B, 3, 4), jnp.int32))
    with pytest.raises(ValueError, match="attn_form"):
        DSA(CFG, rngs=nnx.Rngs(0), attn_form="bogus")


# ------------------------------------------------------------------------------------------------ kernel
def _np_sparse_mla(q, lat, ids, qpos, kpool, scale):
    """f64 numpy: explicit key lists (selected pools' tokens + tail, causal) and a softmax per (b, t, h)."""
    b_, t_, h_, _ = q.shape
    out = np.zeros(q.shape, np.float64)
    for b in range(b_):
        for t in range(t_):
            p = int(qpos[b, t])
            keys = {s for i in ids[b, t] if i >= 0 for s in range(kpool * i, kpool * i + kpool)}
            keys |= set(range(kpool * ((p + 1) // kpool), p + 1))
            keys = sorted(s for s in keys if s <= p)
            if not keys:  # no visible key (no pool selected, empty tail): zero output by convention
                continue
            c = lat[b, keys].astype(np.float64)  # [n, R]
            for h in range(h_):
                s = c @ q[b, t, h].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ c
    return out


def test_sparse_mla_kernel_vs_numpy():
    rs = np.random.RandomState(1)
    b, t, h, r, s, kp = 2, 6, 3, 8, 24, 4
    q = rs.randn(b, t, h, r).astype(np.float32)
    lat = rs.randn(b, s, r).astype(np.float32)
    qpos = np.array([[3, 9, 10, 17, 22, 23], [0, 1, 5, 6, 7, 19]], np.int32)
    ids = rs.randint(-1, 6, size=(b, t, 3)).astype(np.int32)
    ids = np.where(4 * ids + 3 <= qpos[:, :, None], ids, -1)  # only complete pools, duplicates allowed
    fn = jax.jit(functools.partial(api.sparse_mla, kpool=kp, scale=0.3))
    got = fn(jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), jnp.asarray(qpos))
    want = _np_sparse_mla(q, lat, ids, qpos, kp, 0.3)
    r_ = rel(got, want)
    print(f"sparse_mla reference vs f64 numpy rel {r_:.2e}")
    assert r_ <= 1e-6
    with pytest.raises(ValueError, match="unknown implementation"):
        api.sparse_mla(jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), jnp.asarray(qpos), kpool=kp, scale=0.3,
                       implementation="nope")  # fmt: skip
    with pytest.raises(ValueError, match="q_pos_bt"):
        api.sparse_mla(jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), jnp.asarray(qpos[:, :2]), kpool=kp,
                       scale=0.3)  # fmt: skip
