"""The int8 embedding (`glm53.quant.int8.Int8Rows`: int8 rows + one f32 scale per vocabulary row, as the memory
budget stores it): quantization and lookup against an f64 numpy computation, the lookup dequantizes only the
gathered rows, `Embed` reads it, and the rules split it by vocabulary (values and scales)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from glm53 import parallel as S
from glm53.model import Embed
from glm53.quant.int8 import Int8Rows, quantize_int8_rows

V, D = 48, 40


def _table(seed=0) -> np.ndarray:
    w = np.random.default_rng(seed).normal(0, 0.02, (V, D)).astype(np.float32)
    w[5] = 0.0  # an all-zero row: scale 1, values 0
    w[7, 3] = 0.5  # one large entry: its row's scale is set by it
    return w


def _f64_reference(w: np.ndarray, ids: np.ndarray):
    """(values, scale, lookup) in f64 numpy: scale = max |w| / 127 per row (1 for a zero row), values = the
    nearest integer to w / scale (ties to even) clipped to [-127, 127], lookup = values[ids] * scale[ids]."""
    w64 = w.astype(np.float64)
    amax = np.abs(w64).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    values = np.clip(np.rint(w64 / scale[:, None]), -127, 127)
    return values, scale, values[ids] * scale[ids][..., None]


def test_quantize_and_lookup_match_f64():
    w = _table()
    ids = np.array([[0, 5, 7, 47, 7], [3, 3, 46, 1, 0]], np.int32)
    values, scale, want = _f64_reference(w, ids)
    q = quantize_int8_rows(w)
    assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32 and q.dtype == np.float32
    assert q.shape == (V, D) and q.scale.shape == (V,)
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-7)  # the f32 scale of the f64 one
    # values may differ from f64 only where w / scale sits within f32 rounding of a half-integer
    diff = np.asarray(q.values, np.float64) != values
    assert diff.sum() <= 1, np.argwhere(diff)
    got = np.asarray(q.take(jnp.asarray(ids)), np.float64)
    assert got.shape == (2, 5, D)
    exact = ~diff[ids]
    np.testing.assert_allclose(got[exact], want[exact], rtol=2e-7, atol=0)  # one f32 product and rounding
    # and the round trip is within half a quantization step of the table
    err = np.abs(got - w.astype(np.float64)[ids])
    assert np.all(err <= 0.5 * scale[ids][..., None] * (1 + 1e-6))
    assert np.all(got[0, 1] == 0.0) and got[0, 2, 3] == pytest.approx(0.5, rel=1e-7)
    # take as dtype, the dense view, astype
    np.testing.assert_array_equal(
        np.asarray(q.take(jnp.asarray(ids), jnp.bfloat16)), got.astype(jnp.bfloat16)
    )
    np.testing.assert_array_equal(np.asarray(q[...])[ids], got.astype(np.float32))
    assert q.astype(jnp.bfloat16).dtype == jnp.bfloat16
    b = quantize_int8_rows(jnp.asarray(w, jnp.bfloat16))
    assert b.dtype == jnp.bfloat16 and b.take(jnp.asarray(ids)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"need a table \[rows, cols\]"):
        quantize_int8_rows(w[0])


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (jnp.take is a jitted function)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def test_lookup_dequantizes_only_the_gathered_rows():
    """The jaxpr of a lookup gathers from the int8 table and converts nothing of the table's size to float."""
    q = quantize_int8_rows(_table())
    ids = jnp.zeros((2, 3), jnp.int32)
    eqns = list(_eqns(jax.make_jaxpr(lambda q, ids: q.take(ids))(q, ids).jaxpr))
    converts = [e for e in eqns if e.primitive.name == "convert_element_type"]
    assert converts and all(e.invars[0].aval.shape != (V, D) for e in converts)
    gathers = [e for e in eqns if e.primitive.name == "gather"]
    assert {str(e.invars[0].aval.dtype) for e in gathers} == {"int8", "float32"}


def test_embed_reads_int8_rows():
    emb = Embed(V, D, rngs=nnx.Rngs(0), dtype=jnp.float32)
    w = np.asarray(emb.embedding.get_value())
    ids = jnp.array([[1, 2, 47], [0, 0, 5]], jnp.int32)
    dense = np.asarray(emb(ids))
    np.testing.assert_array_equal(dense, w[np.asarray(ids)])  # the default path is the dense table
    emb.embedding.set_value(quantize_int8_rows(w))
    got = np.asarray(emb(ids), np.float64)
    want = _f64_reference(w, np.asarray(ids))[2]
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-12)
    assert np.abs(got - dense).max() <= 0.5 * np.abs(w).max() / 127 * (1 + 1e-6)


def test_rules_split_values_and_scales_by_vocabulary():
    mesh = S.make_mesh(ml_collections.ConfigDict(dict(axes=("data", "model"), shape=(1, 8), rules="tp")))
    emb = Embed(V, D, rngs=nnx.Rngs(1), dtype=jnp.float32)
    emb.embedding.set_value(quantize_int8_rows(np.asarray(emb.embedding.get_value())))
    sharded = S.shard_model(emb, mesh, "tp")
    q = sharded.embedding.get_value()
    assert isinstance(q, Int8Rows)
    assert q.values.sharding.spec == PartitionSpec("model", None) and q.scale.sharding.spec == PartitionSpec(
        "model"
    )
    assert S.device_nbytes(q) == [(V // 8) * D + (V // 8) * 4] * 8
    ids = jnp.array([[0, 11, 47, 23]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda i: sharded(i))(ids)), np.asarray(emb(ids)))
