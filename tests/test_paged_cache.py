"""Paged DSA caches (glm53.layers.dsa.DSACache with `pages`) against contiguous ones, at the model level.

A paged cache keeps every DSA layer's latent, scales and pooled keys in a pool of pages shared by all streams and
reads each stream's rows through its page table. Its contract: whatever pages a stream holds, in whatever order,
the model computes what it computes on a contiguous cache. The tables here are random permutations of the pool
(page 0, the scratch page, never handed out), different per stream, so a wrong index reads another stream's rows
or the wrong positions; prompts of different lengths cross page boundaries mid-chunk, the page size is not the
prefill chunk, and the selection is sparse (index_topk / kpool = 2 pools of up to 12).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from glm53.config import model_config_from_dict
from glm53.layers import dsa as dsa_lib
from glm53.layers import indexer as idx
from glm53.model import Glm53Model
from glm53.runtime.cache import join_pool, map_rows, set_pages, split_pool
from glm53.testing.params import randomize_params
from kernels.sparse_mla import api as sparse_mla_api

B, MAX_LEN, PT, NUM_PAGES = 3, 48, 8, 24  # 6 pages per stream at most
FAST = {"xla_backend_optimization_level": 0}


def _model(variant="default", **over):
    d = tiny.get_config(variant).model
    for k, v in over.items():
        setattr(d, k, v)
    cfg = model_config_from_dict(d)
    return randomize_params(Glm53Model(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32), seed=3)


def _tables(seed=0):
    """Per stream a table of MAX_LEN / PT distinct pages, no page shared between streams, page 0 never."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))[: B * (MAX_LEN // PT)]
    return perm.reshape(B, MAX_LEN // PT).astype(np.int32)


_FWD = {}


def _forward(model):
    """The model's forward, jitted once per model (every chunk shape and cache layout compiles once)."""
    if id(model) not in _FWD:
        gd, state = nnx.split(model)
        fn = jax.jit(lambda st, toks, cache: nnx.merge(gd, st)(toks, cache=cache), compiler_options=FAST)
        _FWD[id(model)] = (model, lambda toks, cache: fn(state, toks, cache))
    return _FWD[id(model)][1]


def _run(model, cache, chunks, steps, seed=0):
    """Feeds every stream the chunks of a random prompt, then `steps` greedy tokens; the logits of each call."""
    rng = np.random.default_rng(seed)
    fwd = _forward(model)
    out = []
    for c in chunks:
        toks = jnp.asarray(rng.integers(1, model.cfg.vocab_size, (B, c)), jnp.int32)
        logits, cache = fwd(toks, cache)
        out.append(np.asarray(logits))
    tok = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
    for _ in range(steps):
        logits, cache = fwd(tok, cache)
        out.append(np.asarray(logits))
        tok = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
    return out, cache


@pytest.mark.parametrize("latent", ["auto", "int8"])
def test_paged_equals_contiguous(latent):
    model = _model()
    if latent != "auto":
        model.set_latent_cache_dtype(latent)
    want, _ = _run(model, model.init_cache(B, MAX_LEN), [13, 6, 6], steps=9)
    paged = set_pages(model.init_cache(B, MAX_LEN, pages=(NUM_PAGES, PT)), _tables())
    got, cache = _run(model, paged, [13, 6, 6], steps=9)
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"call {i}")
    # the pools hold rows only in the streams' pages: the scratch page and the unused pages stay zero
    used = set(_tables().reshape(-1)[: B * 5].tolist()) | set(_tables().reshape(-1).tolist())
    lat = np.asarray(cache.layers[[i for i, c in enumerate(cache.layers) if isinstance(c, dsa_lib.DSACache)][0]].latent)
    assert not np.any(lat[[p for p in range(NUM_PAGES) if p not in used]])


def test_paged_scanned_and_mtp():
    """A scanned model's stacked paged caches (pools [repeats, P, ...], tables [repeats, B, M]) and the MTP block's."""
    d = dict(num_hidden_layers=8, layer_types=["kda", "kda", "kda", "dsa"] * 2, scan_layers=True,
             mlp_layer_types=["dense"] + ["moe"] * 7, indexer_types=["full"] * 8)  # fmt: skip
    model = _model(**d)
    assert any(isinstance(c, tuple) for c in model.init_cache(1, 8).layers)

    gd, state = nnx.split(model)

    @jax.jit
    def mtp(state, cache):  # the trunk on two more tokens, then the MTP block on them
        m = nnx.merge(gd, state)
        h, cache = m.hidden(jnp.ones((B, 2), jnp.int32), cache=cache)
        return m.mtp_logits(h, jnp.full((B, 2), 5, jnp.int32), cache=cache)[0]

    def run(cache):
        out, cache = _run(model, cache, [10], steps=3, seed=1)
        return out + [np.asarray(mtp(state, cache))]

    want = run(model.init_cache(B, MAX_LEN))
    got = run(set_pages(model.init_cache(B, MAX_LEN, pages=(NUM_PAGES, PT)), _tables(1)))
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"call {i}")


def test_streams_share_a_pool_without_seeing_each_other():
    """Stream 1's pages are stream 0's pages of another run: rows written by one never reach the other (a
    stream alone in a pool of stale rows of other prompts computes what it computes alone)."""
    model = _model()
    tables = _tables(2)
    cache = set_pages(model.init_cache(B, MAX_LEN, pages=(NUM_PAGES, PT)), tables)
    _, cache = _run(model, cache, [16, 16], steps=0, seed=5)  # every page written with other prompts' rows
    fresh = model.init_cache(B, MAX_LEN, pages=(NUM_PAGES, PT))
    rows, pool = split_pool(fresh)
    _, stale = split_pool(cache)
    reused = set_pages(join_pool(rows, stale), tables[::-1])  # the pages of other streams, full of their rows
    want, _ = _run(model, model.init_cache(B, MAX_LEN), [11, 1], steps=5, seed=6)
    got, _ = _run(model, reused, [11, 1], steps=5, seed=6)
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"call {i}")


def test_row_maps_leave_the_pool():
    """map_rows slices rows (KDA states, rings, tables, lengths) and leaves the page pools whole."""
    model = _model()
    cache = model.init_cache(B, MAX_LEN, pages=(NUM_PAGES, PT))
    one = map_rows(lambda a, axis: jax.lax.slice_in_dim(a, 0, 1, axis=axis), cache)
    for c, o in zip(cache.layers, one.layers):
        if isinstance(c, dsa_lib.DSACache):
            assert o.latent.shape == c.latent.shape and o.pooled.shape == c.pooled.shape
            assert o.pages.shape == (1, MAX_LEN // PT) and o.recent_k.shape[0] == 1
    rows, pool = split_pool(cache)
    assert all(getattr(c, "latent", 0) is None for c in rows.layers if isinstance(c, dsa_lib.DSACache))
    back = join_pool(rows, pool)
    assert jax.tree.structure(back) == jax.tree.structure(cache)


def test_select_paged_equals_blocked():
    """The indexer's paged selection (a loop over the blocks holding candidates, gathered through the table) is
    the contiguous blocked selection, tie rule included, for queries of different lengths and small blocks."""
    rng = np.random.default_rng(0)
    b, t, h, c, kp, ppp, m = 2, 3, 4, 8, 4, 2, 7
    pool = rng.normal(size=(20, ppp, c)).astype(np.float32)
    pool[3, 1] = pool[5, 0]  # an exact tie between two pools
    table = np.stack([rng.permutation(np.arange(1, 20))[:m] for _ in range(b)]).astype(np.int32)
    logical = pool[table].reshape(b, m * ppp, c)
    iq = jnp.asarray(rng.normal(size=(b, t, h, c)), jnp.float32)
    w = jnp.asarray(np.abs(rng.normal(size=(b, t, h))), jnp.float32)
    q = jnp.asarray([[3, 20, 55], [7, 8, 27]], jnp.int32)
    for k in (1, 3, 5):
        for bp in (1, 2, 7):
            want = idx.select_pools_blocked(iq, w, jnp.asarray(logical), q, kpool=kp, num_select=k, block=2)
            got = idx.select_pools_paged(iq, w, jnp.asarray(pool), jnp.asarray(table), q, kpool=kp, num_select=k,
                                         block_pages=bp)  # fmt: skip
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=f"k={k} pages={bp}")


@pytest.mark.parametrize("impl", ["reference", "gather"])
def test_sparse_mla_through_pages(impl):
    """Both implementations read a paged latent (and its int8 scales) as the contiguous one."""
    rng = np.random.default_rng(1)
    b, t, hh, r, pt, m, kp = 2, 5, 2, 8, 4, 4, 4
    pool = rng.integers(-127, 127, (12, pt, r)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (12, pt)).astype(np.float32)
    table = np.asarray([[3, 7, 1, 9], [11, 2, 5, 4]], np.int32)
    q = jnp.asarray(rng.normal(size=(b, t, hh, r)), jnp.float32)
    ids = jnp.asarray(rng.integers(-1, 4, (b, t, 2)), jnp.int32)
    qpos = jnp.asarray([[4, 8, 9, 13, 15], [0, 1, 6, 11, 14]], jnp.int32)
    kw = dict(kpool=kp, scale=0.3, implementation=impl)
    want = sparse_mla_api.sparse_mla(q, jnp.asarray(pool[table].reshape(b, m * pt, r)), ids, qpos,
                                     latent_scale_bs=jnp.asarray(scale[table].reshape(b, m * pt)), **kw)  # fmt: skip
    got = sparse_mla_api.sparse_mla(q, jnp.asarray(pool), ids, qpos, latent_scale_bs=jnp.asarray(scale),
                                    page_table_bm=jnp.asarray(table), **kw)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_bad_pages_named():
    model = _model()
    with pytest.raises(ValueError, match="page_tokens=6.*multiple of index_kpool=4"):
        model.init_cache(1, 16, pages=(4, 6))
    with pytest.raises(ValueError, match="num_pages=0"):
        model.init_cache(1, 16, pages=(0, 8))
