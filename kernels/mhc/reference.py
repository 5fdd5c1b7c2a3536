"""Pure-jnp mHC reference: the default implementation and the oracle for every other backend.

All weight computations (projection, sigmoids, softmax, Sinkhorn) run in f32. Shapes:
  x_btnd [B, T, n, D] streams; fn [n*D, (2+n)*n]; base [(2+n)*n]; scale [3];
  u_btd [B, T, D]; post_btn [B, T, n]; comb_btnn [B, T, n, n] with comb[..., i, j] = weight of input stream i in
  output stream j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.matmul import api as matmul_api

_HIGHEST = jax.lax.Precision.HIGHEST


def sinkhorn(comb_logits: jnp.ndarray, *, hc_eps: float, iters: int) -> jnp.ndarray:
    """Projects [..., n, n] logits onto (approximately) doubly-stochastic matrices.

    softmax over the last axis + hc_eps, a column normalisation, then `iters - 1` rounds of
    (row, column) normalisation; every division adds hc_eps to the denominator.
    """
    c = jax.nn.softmax(comb_logits.astype(jnp.float32), axis=-1) + hc_eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    return jax.lax.fori_loop(0, iters - 1, body, c)


def mhc_pre(
    x_btnd: jnp.ndarray,
    fn: jnp.ndarray,
    base: jnp.ndarray,
    scale: jnp.ndarray,
    *,
    eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Mixing weights of one mHC site and the collapsed sublayer input; returns (u_btd, post_btn, comb_btnn)."""
    pre, post, comb = mixing_weights(
        x_btnd, fn, base, scale, eps=eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    u = jnp.sum(pre[..., None] * x_btnd.astype(jnp.float32), axis=2).astype(x_btnd.dtype)
    return u, post, comb


def mixing_weights(
    x_btnd: jnp.ndarray,
    fn: jnp.ndarray,
    base: jnp.ndarray,
    scale: jnp.ndarray,
    *,
    eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One mHC site's f32 weights from the streams: (pre_btn, post_btn, comb_btnn) (docs/architecture.md §5)."""
    b, t, n, d = x_btnd.shape
    f = x_btnd.reshape(b, t, n * d).astype(jnp.float32)
    f = f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)  # unweighted RMS norm
    # fn: an array or a weight with its own product (a decode program's StreamedKernel: few rows in C++, f32 fma
    # chains as exact as HIGHEST; kernels/matmul/api.py)
    m = matmul_api.matmul(f, fn, precision=_HIGHEST)  # [B, T, (2+n)*n]
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps  # [B, T, n]
    post = 2.0 * jax.nn.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])  # [B, T, n]
    comb_logits = (m[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(b, t, n, n)
    comb = sinkhorn(comb_logits, hc_eps=hc_eps, iters=sinkhorn_iters)
    return pre, post, comb


def mhc_post(
    x_btnd: jnp.ndarray, y_btd: jnp.ndarray, post_btn: jnp.ndarray, comb_btnn: jnp.ndarray
) -> jnp.ndarray:
    """X_new[j] = post[j] * y + sum_i comb[i, j] * X[i], in x's dtype.

    post and comb are cast to x's dtype first (the checkpoint-native update); the stream mix accumulates in f32
    and is rounded once, the expansion term is formed in x's dtype.
    """
    dt = x_btnd.dtype
    mix = jnp.einsum(
        "btij,btid->btjd",
        comb_btnn.astype(dt),
        x_btnd,
        precision=_HIGHEST,
        preferred_element_type=jnp.float32,
    ).astype(dt)
    expand = post_btn.astype(dt)[..., None] * y_btd.astype(dt)[..., None, :]  # [B, T, n, D]
    return expand + mix
