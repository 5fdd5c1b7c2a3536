"""Sequence-sharded DSA caches (glm53/parallel/dsa.py) on 8 virtual CPU devices == one device.

A DSA layer with its own indexer and one that shares it (tests/test_dsa.py's tiny config, every parameter
random), prefilled in pieces then decoded across pool boundaries, sharded over the 8 devices of a 1x8 and a
2x4 mesh ("tp" and "ep" rules put cache_seq on "model"), against the same layer on one device: outputs f32
rel <= 1e-5 and identical selections, for the exact and the int8 latent layouts. Each device holds 1/n of the
latent and pooled rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from glm53 import parallel as S
from glm53.errors import ShardingError
from glm53.layers.dsa import DSA
from glm53.model import Cache
from glm53.parallel.dsa import seq_sharded
from glm53.serving.pages import PagePool, PageTable
from tests.test_dsa import CFG, rel

B, T, MAX = 2, 80, 96  # 96 positions = 24 pools: 3 per device on 8 devices; 4 pools selected per query
PIECES = (29, 40) + (1,) * 5 + (6,)  # prefill, decode across the pool boundaries at 72 and 76, a last chunk


def _layers(cfg):
    full = DSA(cfg, rngs=nnx.Rngs(0), layer_idx=0)
    shared = DSA(cfg, rngs=nnx.Rngs(1), layer_idx=1)
    rs = np.random.RandomState(0)
    for m in (full, shared):
        for _, v in nnx.to_flat_state(nnx.state(m)):  # every parameter random, constant-init ones included
            a = v.get_value()
            scale = 1.5 / max(a.shape[0], 1) ** 0.5
            v.set_value(jnp.asarray(rs.randn(*a.shape).astype(np.float32) * scale + (a.ndim == 1)))
    return full, shared


def _run(full, shared, x, cache_full, cache_shared):
    """Both layers through PIECES; returns (outputs of both, selections) concatenated over the pieces."""
    g0, s0 = nnx.split(full)
    g1, s1 = nnx.split(shared)

    @jax.jit
    def step(s0, s1, x, c0, c1, start):
        y0, c0, sel = nnx.merge(g0, s0)(x, cache=c0, start_b=start)
        y1, c1, _ = nnx.merge(g1, s1)(x, cache=c1, start_b=start, selection=sel)
        return y0, y1, sel, c0, c1

    ys0, ys1, sels, pos = [], [], [], 0
    for n in PIECES:
        start = jnp.full((B,), pos, jnp.int32)
        y0, y1, sel, cache_full, cache_shared = step(s0, s1, x[:, pos : pos + n], cache_full, cache_shared, start)
        ys0.append(np.asarray(y0))
        ys1.append(np.asarray(y1))
        sels.append(np.asarray(sel))
        pos += n
    return np.concatenate(ys0, 1), np.concatenate(ys1, 1), np.concatenate(sels, 1), cache_full


def _place(cache, mesh, rules):
    wrapped = Cache(length=jnp.zeros((B,), jnp.int32), layers=(cache,), mtp=None)
    return S.shard_cache(wrapped, mesh, rules).layers[0]


@pytest.mark.parametrize("latent", ["auto", "int8"])
@pytest.mark.parametrize("shape,rules", [((1, 8), "tp"), ((2, 4), "ep")])
def test_sharded_equals_one_device(latent, shape, rules):
    cfg = CFG.replace(latent_cache_dtype=latent)
    full, shared = _layers(cfg)
    x = jnp.asarray(np.random.RandomState(3).randn(B, T, CFG.hidden_size).astype(np.float32))
    want = _run(full, shared, x, full.init_cache(B, MAX), shared.init_cache(B, MAX))

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(shape), ("data", "model"))
    step = seq_sharded(mesh, rules)
    full.seq_shard = shared.seq_shard = step
    assert step.shards == shape[1]
    c0, c1 = (_place(m.init_cache(B, MAX), mesh, rules) for m in (full, shared))
    n = shape[1]
    assert c0.latent.addressable_shards[0].data.shape[1] == MAX // n  # each device: 1/n of the positions
    assert c0.pooled.addressable_shards[0].data.shape[1] == MAX // 4 // n
    got = _run(full, shared, x, c0, c1)
    r = max(rel(got[0], want[0]), rel(got[1], want[1]))
    print(f"{rules} {shape} latent={latent}: sharded vs one device rel {r:.2e}")
    assert r <= 1e-5
    np.testing.assert_array_equal(got[2], want[2])
    assert (want[2] >= 0).sum() > 0 and (want[2] < 0).sum() > 0  # real selections, and empty slots early on
    assert got[3].latent.sharding.spec[1] == "model"  # the cache stays split by sequence


def test_lengths_round_to_whole_pools_per_device_and_bad_meshes_are_named():
    full, _ = _layers(CFG)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    full.seq_shard = seq_sharded(mesh, "tp")
    assert full.init_cache(1, 37).latent.shape[1] == 64  # 37 tokens -> 2 pools of 4 per device
    full.seq_shard = None
    odd = full.init_cache(1, 36)  # 9 pools over 8 devices
    with pytest.raises(ShardingError, match=r"DSA cache 0: 9 pools of 4 tokens do not split over 8"):
        _place(odd, mesh, "tp")
    with pytest.raises(ShardingError, match="cache_pools"):
        seq_sharded(mesh, S.TP_RULES.replace(cache_pools=None))
    assert seq_sharded(mesh, S.TP_RULES.replace(cache_seq=None, cache_pools=None)) is None


def _spread_tables(n: int, num_pages: int, pt: int) -> np.ndarray:
    """Both streams' tables from a pool of n devices (page i of a stream on device i % n), with pages taken and
    given back first so that the streams' pages interleave and are not in id order."""
    pool = PagePool(num_pages, pt, devices=n)
    junk = PageTable(pool)
    junk.ensure(3 * pt)
    tables = [PageTable(pool) for _ in range(B)]
    for length in range(pt, MAX + 1, pt):
        for tb in tables[:: 1 if length % (2 * pt) else -1]:
            tb.ensure(length)
        if length == 2 * pt:
            junk.release()
    return np.stack([tb.as_array(MAX // pt) for tb in tables])


@pytest.mark.parametrize("latent", ["auto", "int8"])
@pytest.mark.parametrize("shape,rules", [((1, 8), "tp"), ((2, 4), "ep")])
def test_paged_sharded_equals_one_device(latent, shape, rules):
    """Paged caches split by pages over the devices (glm53/parallel/dsa.py, "Paged caches"), every stream's pages
    spread round-robin by the host pool, == the contiguous cache on one device: outputs and selections (the merge
    orders candidates by (score desc, pool id asc) itself, device order not being pool order)."""
    cfg = CFG.replace(latent_cache_dtype=latent)
    full, shared = _layers(cfg)
    x = jnp.asarray(np.random.RandomState(3).randn(B, T, CFG.hidden_size).astype(np.float32))
    want = _run(full, shared, x, full.init_cache(B, MAX), shared.init_cache(B, MAX))

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(shape), ("data", "model"))
    n, pt = shape[1], 8
    num_pages = n * (-(-2 * MAX // pt // n) + 2)
    tables = jnp.asarray(_spread_tables(n, num_pages, pt))
    full.seq_shard = shared.seq_shard = seq_sharded(mesh, rules)
    c0, c1 = (_place(m.init_cache(B, MAX, pages=(num_pages, pt)).replace(pages=tables), mesh, rules)
              for m in (full, shared))  # fmt: skip
    assert c0.latent.addressable_shards[0].data.shape[0] == num_pages // n  # each device: a block of pages
    got = _run(full, shared, x, c0, c1)
    r = max(rel(got[0], want[0]), rel(got[1], want[1]))
    assert r <= 1e-5, r
    np.testing.assert_array_equal(got[2], want[2])
    assert got[3].latent.sharding.spec[0] == "model"
