"""The DSA serving layouts: the gathered sparse MLA, the blocked indexer, the int8 latent, the indexer ring.

Oracles: the masked dense reference (`kernels/sparse_mla/reference.py`, itself checked against f64 numpy and
transformers in test_dsa.py), an f64 numpy attention over explicit key lists, the one-shot `select_pools` over
every pool, and one-shot prefill of the same layer. rel = max|ours - ref| / max|ref|.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm53.layers import indexer as idx
from glm53.layers.dsa import DSA, check_cache, init_cache
from glm53.quant.int8 import dequantize_rows, quantize_rows
from kernels.sparse_mla import api, gather, reference
from tests.test_dsa import CFG, _np_sparse_mla, rel

B, T = 2, 80


def _selection_case(seed, b, t, s, k, kp, *, past=True, repeats=True, out_of_range=True):
    """Random pool ids with every awkward kind of slot: -1, repeats, the tail pool, pools past the query, ids
    past the cache."""
    rs = np.random.RandomState(seed)
    npools = -(-s // kp)
    qpos = np.sort(rs.randint(0, s, size=(b, t)), axis=1).astype(np.int32)
    ids = rs.randint(-1, npools + (2 if out_of_range else 0), size=(b, t, k)).astype(np.int32)
    if not past:
        ids = np.where(kp * ids + kp - 1 <= qpos[:, :, None], ids, -1)
    if repeats:
        ids[:, :, 1] = ids[:, :, 0]
    ids[:, ::3, 2] = (qpos[:, ::3] + 1) // kp  # the tail pool itself
    return rs, ids, qpos


@pytest.mark.parametrize("select_tail", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_equals_reference_and_f64(seed, select_tail):
    """Empty slots, repeated ids, the tail pool selected, pools past the query, ids past the cache, a cache
    length that is not a multiple of kpool: the gathered attention == the masked dense one."""
    b, t, h, r, s, k, kp = 2, 7, 3, 8, 30, 5, 4
    rs, ids, qpos = _selection_case(seed, b, t, s, k, kp)
    q = rs.randn(b, t, h, r).astype(np.float32)
    lat = rs.randn(b, s, r).astype(np.float32)
    kw = dict(kpool=kp, scale=0.4, select_tail=select_tail)
    args = (jnp.asarray(q), jnp.asarray(lat), jnp.asarray(ids), jnp.asarray(qpos))
    got = jax.jit(functools.partial(api.sparse_mla, implementation="gather", **kw))(*args)
    want = jax.jit(functools.partial(api.sparse_mla, implementation="reference", **kw))(*args)
    r1 = rel(got, want)
    assert r1 <= 1e-6, r1
    if select_tail:  # the f64 oracle implements the tail rule
        valid = np.where(ids < -(-s // kp), ids, -1)
        assert rel(got, _np_sparse_mla(q, lat, valid, qpos, kp, 0.4)) <= 1e-6


def test_gather_prefill_blocks_and_int8():
    """T > q_block (queries in blocks, padded), bf16 and int8 latents: gather == reference on the same stored
    latent; the int8 latent is the rows' dequantization."""
    b, t, h, r, s, k, kp = 2, 45, 2, 16, 64, 4, 4
    rs, ids, qpos = _selection_case(3, b, t, s, k, kp, past=False)
    q = jnp.asarray(rs.randn(b, t, h, r).astype(np.float32))
    lat = jnp.asarray(rs.randn(b, s, r).astype(np.float32))
    kw = dict(kpool=kp, scale=0.3)
    for stored, scale in ((lat.astype(jnp.bfloat16), None), quantize_rows(lat)):
        sel = (jnp.asarray(ids), jnp.asarray(qpos))
        got = gather.sparse_mla(q, stored, *sel, latent_scale_bs=scale, q_block=8, **kw)
        want = reference.sparse_mla(q, stored, *sel, latent_scale_bs=scale, **kw)
        assert rel(got, want) <= 1e-6
        deq = dequantize_rows(stored, scale, jnp.float32)
        assert rel(got, reference.sparse_mla(q, deq, *sel, **kw)) <= 1e-6
    # int8 rows: per-row absmax scale, error <= scale / 2
    v, sc = quantize_rows(lat)
    err = np.abs(np.asarray(dequantize_rows(v, sc, jnp.float32)) - np.asarray(lat))
    assert np.all(err <= np.asarray(sc)[..., None] / 2 + 1e-7)
    assert np.max(np.abs(np.asarray(v))) == 127


def test_auto_picks_gather_only_when_it_reads_less(monkeypatch):
    q = jnp.zeros((1, 1, 2, 8))
    ids, qpos = jnp.zeros((1, 1, 3), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    ran = []
    for name in ("gather", "reference"):
        fn = api._MLA[name]
        monkeypatch.setitem(api._MLA, name, lambda *a, _n=name, _f=fn, **k: ran.append(_n) or _f(*a, **k))
    for s, want in ((64, "gather"), (16, "reference")):  # (3 + 1) * 4 = 16 rows gathered
        api.sparse_mla(q, jnp.zeros((1, s, 8)), ids, qpos, kpool=4, scale=1.0, implementation="auto")
        assert ran.pop() == want
    assert api.gathered_rows(512, 4, True, 1 << 18) == 2052
    with pytest.raises(ValueError, match="latent_scale_bs"):
        api.sparse_mla(q, jnp.zeros((1, 8, 8), jnp.int8), ids, qpos, kpool=4, scale=1.0)
    with pytest.raises(ValueError, match="latent_scale_bs"):
        api.sparse_mla(q, jnp.zeros((1, 8, 8)), ids, qpos, kpool=4, scale=1.0, latent_scale_bs=jnp.ones((1, 8)))


@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_blocked_selection_equals_one_shot(block):
    """Scoring pools in blocks with a running top-k selects exactly what one top-k over every pool selects,
    ties included (duplicated pooled rows and all-clipped scores make many exact ties)."""
    rs = np.random.RandomState(block)
    b, t, h, c, p, kp = 2, 9, 4, 8, 40, 4
    pooled = rs.randn(b, p, c).astype(np.float32)
    pooled[:, 10:20] = pooled[:, 0:10]  # exact ties between pools 0-9 and 10-19
    pooled[:, 25:30] = -5.0  # strongly negative: relu clips to 0 for most queries -> ties at 0
    iq = rs.randn(b, t, h, c).astype(np.float32)
    w = np.abs(rs.randn(b, t, h)).astype(np.float32)
    qpos = np.sort(rs.randint(0, p * kp, size=(b, t)), axis=1).astype(np.int32)
    qpos[0, 0] = 2  # no complete pool yet: every slot empty
    for num_select in (4, 12, 50):
        want = idx.select_pools(
            idx.pool_scores(jnp.asarray(iq), jnp.asarray(w), jnp.asarray(pooled)), jnp.asarray(qpos),
            kpool=kp, num_select=min(num_select, p),
        )  # fmt: skip
        _, got = idx.select_pools_blocked(
            jnp.asarray(iq), jnp.asarray(w), jnp.asarray(pooled), jnp.asarray(qpos), kpool=kp,
            num_select=num_select, block=block,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _layer(cfg, seed=0):
    m = DSA(cfg, rngs=nnx.Rngs(seed), layer_idx=0)
    rs = np.random.RandomState(seed)
    for _, v in nnx.to_flat_state(nnx.state(m)):  # every parameter random, the constant-init ones included
        a = v.get_value()
        v.set_value(jnp.asarray(rs.randn(*a.shape).astype(np.float32) * (1.5 / max(a.shape[0], 1) ** 0.5)
                                + (1.0 if a.ndim == 1 else 0.0)))  # fmt: skip
    g, st = nnx.split(m)
    f = jax.jit(lambda st, x, c, s: nnx.merge(g, st)(x, cache=c, start_b=s))
    return lambda x, c, s: f(st, x, c, s)


@pytest.mark.parametrize("latent", ["auto", "int8"])
def test_pieces_decode_and_rollback_equal_one_shot(latent):
    """Prefill 29 + 40, 3 decode steps, two steps whose drafts are rejected (one crossing a pool boundary), the
    rest re-decoded == one-shot prefill: outputs and selections."""
    cfg = CFG.replace(latent_cache_dtype=latent)
    f = _layer(cfg)
    x = jnp.asarray(np.random.RandomState(5).randn(B, T, CFG.hidden_size).astype(np.float32))
    zeros = jnp.zeros((B,), jnp.int32)
    y0, _, sel0 = f(x, init_cache(cfg, B, T), zeros)
    cache, ys, sels, pos = init_cache(cfg, B, T), [], [], 0
    for n in (29, 40, 1, 1, 1):
        y, cache, s = f(x[:, pos : pos + n], cache, jnp.full((B,), pos, jnp.int32))
        ys.append(y)
        sels.append(s)
        pos += n
    # rejected drafts: at 72 two wrong tokens after x72; at 73 four wrong ones after x73, crossing the pool
    # boundary at 76 (the ring keeps the open pool's accepted members); only each step's first token is kept
    noise = jnp.asarray(np.random.RandomState(6).randn(B, 4, CFG.hidden_size).astype(np.float32))
    for n_bad in (2, 4):
        xs = jnp.concatenate([x[:, pos : pos + 1], noise[:, :n_bad]], axis=1)
        y, cache, s = f(xs, cache, jnp.full((B,), pos, jnp.int32))
        ys.append(y[:, :1])
        sels.append(s[:, :1])
        pos += 1
    for n in (1, 5):
        y, cache, s = f(x[:, pos : pos + n], cache, jnp.full((B,), pos, jnp.int32))
        ys.append(y)
        sels.append(s)
        pos += n
    assert pos == T
    got = np.concatenate([np.asarray(y) for y in ys], axis=1)
    assert rel(got, y0) <= 1e-5
    np.testing.assert_array_equal(np.concatenate([np.asarray(s) for s in sels], axis=1), np.asarray(sel0))


def test_int8_latent_is_close_and_layouts_are_checked():
    f32, i8 = CFG, CFG.replace(latent_cache_dtype="int8")
    x = jnp.asarray(np.random.RandomState(7).randn(B, T, CFG.hidden_size).astype(np.float32))
    zeros = jnp.zeros((B,), jnp.int32)
    y_exact, c_exact, _ = _layer(f32)(x, init_cache(f32, B, T), zeros)
    y_int8, c_int8, _ = _layer(i8)(x, init_cache(i8, B, T), zeros)
    assert c_int8.latent.dtype == jnp.int8 and c_int8.latent_scale.shape == (B, T)
    assert c_exact.latent_scale.shape == (B, 0)
    r = rel(y_int8, y_exact)
    assert 0 < r < 0.05, r
    assert init_cache(f32.replace(latent_cache_dtype="bfloat16"), B, T).latent.dtype == jnp.bfloat16
    m = DSA(f32, rngs=nnx.Rngs(0), layer_idx=0)
    with pytest.raises(ValueError, match="latent_cache_dtype"):
        m(x[:, :4], cache=init_cache(i8, B, T), start_b=zeros)
    with pytest.raises(ValueError, match="latent_cache_dtype"):
        DSA(i8, rngs=nnx.Rngs(0), layer_idx=0)(x[:, :4], cache=init_cache(f32, B, T), start_b=zeros)
    old = init_cache(f32, B, T)
    old = old.replace(recent_k=jnp.zeros((B, T, CFG.index_head_dim)))  # the per-token layout of every position
    with pytest.raises(ValueError, match="recent_k has 80 rows"):
        check_cache(f32, old, "cache")
    with pytest.raises(Exception, match="latent_cache_dtype"):
        CFG.replace(latent_cache_dtype="int4")
