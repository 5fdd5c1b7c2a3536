"""mHC shaped for XLA:CPU: kernels.mhc.reference's math with the stream contractions shaped for XLA:CPU.

`mhc_pre`'s collapse u = sum_i pre_i X_i reduces over the MIDDLE (stream) axis of [B, T, n, D]; XLA:CPU (jax
0.10.2) turns that multiply + reduce into a YNNPACK fusion about 100x slower than the same sum written as n
multiply-adds (measured on [1, 512, 4, 1024]: 120.7 ms vs 0.83 ms; it was half of a 512-token prefill of
configs/tiny.py:small), so it is the n-term sum. `mhc_post`'s einsum "btij,btid->btjd" becomes a dot batched
over the B*T tokens, each a [4, 4] x [4, D] product (16.2 ms on the same shape), so its mix is a sum of
broadcast products over the stream axis, as ONE reduce: written as an n-term sum (1.9 ms alone) it was fused
into each of its consumers, and a site's new streams feed the next site's weights, collapse and mix, so the
fusions recomputed earlier sites' mixes inside later ones (work growing with the tokens: glm53-mini's serving
decode step at 8 slots 5.6 -> 4.7 ms, 1 slot unchanged; its forward at T = 16 / 512 under XLA's default
options 12.9 -> 9.8 / 165 -> 114 ms). A reduce is not fused into its consumers: each site's streams are
computed once (alone the two forms cost the same with YNNPACK fusions off, the reduce ~35% more with them on).
The mixing weights (projection, sigmoids, Sinkhorn) are the reference's own code. Results equal the reference
up to f32 summation order (tests/test_mhc.py runs both against transformers and f64 numpy).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.mhc import reference


def mhc_pre(x_btnd, fn, base, scale, *, eps: float, hc_eps: float, sinkhorn_iters: int):
    """(u_btd, post_btn, comb_btnn) as `reference.mhc_pre`; u summed stream by stream in f32."""
    pre, post, comb = reference.mixing_weights(
        x_btnd, fn, base, scale, eps=eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    xf = x_btnd.astype(jnp.float32)
    u = pre[..., 0, None] * xf[:, :, 0]
    for i in range(1, x_btnd.shape[2]):
        u = u + pre[..., i, None] * xf[:, :, i]
    return u.astype(x_btnd.dtype), post, comb


def mhc_post(x_btnd, y_btd, post_btn, comb_btnn):
    """X_new[j] = post[j] * y + sum_i comb[i, j] * X[i] as `reference.mhc_post` (post / comb cast to x's dtype,
    the mix accumulated in f32 and rounded once), the mix one reduce over the streams (module docstring)."""
    dt = x_btnd.dtype
    comb = comb_btnn.astype(dt).astype(jnp.float32)  # [B, T, i, j]
    xf = x_btnd.astype(jnp.float32)
    mix = jnp.sum(comb[:, :, :, :, None] * xf[:, :, :, None, :], axis=2)  # [B, T, j, D]: a reduce (docstring)
    expand = post_btn.astype(dt)[..., None] * y_btd.astype(dt)[..., None, :]
    return expand + mix.astype(dt)
