"""glm53.runtime.sampling against transformers' logits warpers (f64 torch) and an f64 numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from glm53.runtime.sampling import filtered_logits, filtered_logprobs, sample

# (temperature, top_p, top_k) per stream; no ties in the logits and no cumulative mass near a p boundary.
PARAMS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.8, 7), (2.0, 0.6, 3), (1.0, 0.95, 1)]
V = 40


def _hf_logprobs(row: np.ndarray, t: float, p: float, k: int) -> np.ndarray:
    """transformers' warpers in their generate() order, in f64, then log-softmax."""
    s = torch.tensor(row[None], dtype=torch.float64)
    s = TemperatureLogitsWarper(t)(None, s)
    if k > 0:
        s = TopKLogitsWarper(k)(None, s)
    if p < 1.0:
        s = TopPLogitsWarper(p)(None, s)
    return torch.log_softmax(s, -1)[0].numpy()


def _numpy_logprobs(row: np.ndarray, t: float, p: float, k: int) -> np.ndarray:
    """An independent f64 statement of the definition in glm53/sampling.py."""
    x = row.astype(np.float64) / t
    keep = np.ones(V, bool)
    if k > 0:
        keep &= x >= np.sort(x)[::-1][k - 1]
    z = np.where(keep, x, -np.inf)
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    order = np.argsort(-prob, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(prob[order])[:-1]])
    kept = order[(before < p) | (p >= 1.0)]
    final = np.full(V, -np.inf)
    final[kept] = z[kept]
    return final - np.log(np.sum(np.exp(final[kept] - final[kept].max()))) - final[kept].max()


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(len(PARAMS), V)) * 2.0
    # Guard the test's own premise: no p lands within 1e-3 of a cumulative-mass boundary.
    for row, (t, p, k) in zip(x, PARAMS):
        lp = _numpy_logprobs(row, t, 1.0, k)
        c = np.cumsum(np.sort(np.exp(lp[np.isfinite(lp)]))[::-1])
        assert p >= 1.0 or np.min(np.abs(c - p)) > 1e-3
    return x.astype(np.float32)


def _args():
    t, p, k = (np.array(a) for a in zip(*PARAMS))
    return jnp.asarray(t, jnp.float32), jnp.asarray(p, jnp.float32), jnp.asarray(k, jnp.int32)


def test_filtered_logprobs_match_transformers_and_numpy(logits):
    got = np.asarray(jax.jit(filtered_logprobs)(jnp.asarray(logits), *_args()))
    kept_counts = []
    for b, (t, p, k) in enumerate(PARAMS):
        ref = _hf_logprobs(logits[b], t, p, k)
        ref2 = _numpy_logprobs(logits[b], t, p, k)
        np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(ref), err_msg=f"stream {b} kept set")
        np.testing.assert_array_equal(np.isfinite(ref2), np.isfinite(ref))
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[b][fin], ref[fin], atol=2e-6, rtol=0)
        np.testing.assert_allclose(ref2[fin], ref[fin], atol=1e-12, rtol=0)
        kept_counts.append(int(fin.sum()))
    # The filters really cut (counts from the transformers reference): all, nucleus, top-k, both, both, top-1.
    assert kept_counts == [V, 10, 5, 4, 2, 1]


def test_top_k_keeps_ties_like_transformers():
    row = np.array([[3.0, 1.0, 2.0, 2.0, 0.5, 2.0]], np.float32)
    got = np.asarray(filtered_logprobs(jnp.asarray(row), 1.0, 1.0, 2))
    ref = _hf_logprobs(row[0], 1.0, 1.0, 2)
    np.testing.assert_array_equal(np.isfinite(got[0]), np.isfinite(ref))
    assert np.isfinite(got[0]).sum() == 4


def test_greedy_streams_take_the_argmax(logits):
    t = jnp.array([0.0, 1.0, 0.0, 0.7, 0.0, 1.0])
    key = jax.random.key(3)
    ids = np.asarray(jax.jit(sample)(jnp.asarray(logits), key, t, 0.5, 4))
    am = logits.argmax(-1)
    np.testing.assert_array_equal(ids[[0, 2, 4]], am[[0, 2, 4]])
    lp = np.asarray(filtered_logprobs(jnp.asarray(logits), t, 0.5, 4))
    np.testing.assert_array_equal(lp[0], np.where(np.arange(V) == am[0], 0.0, -np.inf))


def test_empirical_frequencies_match_filtered_distribution(logits):
    n = 20000
    b = len(PARAMS)
    t, p, k = _args()
    tile = lambda a: jnp.tile(a, n)
    big = jnp.tile(jnp.asarray(logits), (n, 1))  # row r is stream r % b
    keys = jax.random.split(jax.random.key(7), n * b)
    ids = np.asarray(jax.jit(sample)(big, keys, tile(t), tile(p), tile(k))).reshape(n, b)
    for s, (tt, pp, kk) in enumerate(PARAMS):
        prob = np.exp(_hf_logprobs(logits[s], tt, pp, kk))
        freq = np.bincount(ids[:, s], minlength=V) / n
        assert np.all(freq[prob == 0] == 0), f"stream {s} drew a filtered token"
        sigma = np.sqrt(prob * (1 - prob) / n)
        assert np.all(np.abs(freq - prob) <= 5 * sigma + 1e-3), (s, np.max(np.abs(freq - prob)))


def test_stream_draw_depends_only_on_its_key_and_logits(logits):
    keys = jax.random.split(jax.random.key(11), len(PARAMS))
    t, p, k = _args()
    full = np.asarray(sample(jnp.asarray(logits), keys, t, p, k))
    for s in (1, 3):
        one = np.asarray(sample(jnp.asarray(logits[s : s + 1]), keys[s : s + 1], t[s], p[s], k[s]))
        assert one[0] == full[s]
    raw = jax.random.split(jax.random.PRNGKey(11), len(PARAMS))  # raw uint32 keys are accepted too
    assert sample(jnp.asarray(logits), raw, t, p, k).shape == (len(PARAMS),)
    with pytest.raises(ValueError, match="3 keys for 6 streams"):
        sample(jnp.asarray(logits), keys[:3], t, p, k)


def test_rows_that_filter_nothing_draw_without_the_sort(logits):
    """A batch of greedy rows and rows with neither top-k nor top-p takes `sample`'s sort-free branch; its tokens
    equal the draw from `filtered_logits` (the sorting path), key for key, and equal each row's token in a batch
    that filters (which runs the sorting path for every row). The empirical test above covers the distribution."""
    n = 64
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(n, V)).astype(np.float32) * 2.0)
    keys = jax.random.split(jax.random.key(13), n)
    t = jnp.asarray(np.where(np.arange(n) % 4 == 0, 0.0, rng.uniform(0.3, 2.0, n)), jnp.float32)
    ids = np.asarray(jax.jit(sample)(x, keys, t, 1.0, 0))
    filt = filtered_logits(x, t, 1.0, 0)
    ref = jax.vmap(lambda kk, row: jax.random.categorical(kk, row))(keys, filt)
    ref = np.where(np.asarray(t) <= 0, np.asarray(x).argmax(-1), np.asarray(ref))
    np.testing.assert_array_equal(ids, ref)
    assert len(set(ids[np.asarray(t) > 0].tolist())) > 5  # real draws, not one token
    # the same rows next to one that filters (top-k 3): every row through the sorting path, the same tokens
    mixed = np.asarray(jax.jit(sample)(x, keys, t, 1.0, jnp.asarray([3] + [0] * (n - 1), jnp.int32)))
    np.testing.assert_array_equal(mixed[1:], ids[1:])
