"""mHC kernel api: `mhc_pre` (mixing weights + collapsed input) and `mhc_post` (stream update).

Both take `implementation=`: "reference" (pure jnp, f32 weights; the default and the oracle), "xla_cpu" (the
same math with the stream contractions as n-term sums, which XLA:CPU runs ~10-100x faster) or "auto" (the
backend's choice in `_AUTO`: xla_cpu on CPU, reference where it names none; what the model's layers use).
Backends register in `_PRE` / `_POST`; a named one that cannot take the inputs raises NotImplementedError, only
"auto" falls back (`kernels.dispatch`).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels import dispatch
from kernels.mhc import reference, xla_cpu

_PRE = {"reference": reference.mhc_pre, "xla_cpu": xla_cpu.mhc_pre}
_POST = {"reference": reference.mhc_post, "xla_cpu": xla_cpu.mhc_post}
_AUTO: dict[str, str] = {"cpu": "xla_cpu"}  # backend -> implementation "auto" runs
AUTO_BY_BACKEND = _AUTO  # public: what "auto" picks per backend (glm53.config.kernels, the entry points' start-up block)
IMPLEMENTATIONS = (dispatch.AUTO, *_PRE)  # the names `implementation=` takes (glm53.config.kernels validates)


def mhc_pre(
    x_btnd: jnp.ndarray,
    fn: jnp.ndarray,
    base: jnp.ndarray,
    scale: jnp.ndarray,
    *,
    eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    implementation: str = "reference",
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Computes one mHC site's weights from the n streams and collapses them.

    Args:
      x_btnd: streams [B, T, n, D] (model dtype).
      fn: projection [n*D, (2+n)*n] (HF ``hc_*_fn`` transposed); base [(2+n)*n]; scale [3] (pre, post, comb).
      eps: the unweighted RMS norm eps (rms_norm_eps); hc_eps: the floor added by the sigmoid / Sinkhorn steps;
      sinkhorn_iters: total Sinkhorn iterations (the first is a column normalisation only).
    Returns:
      u_btd [B, T, D] in x's dtype (sum_i pre_i X_i), post_btn [B, T, n] f32 (in (0, 2)),
      comb_btnn [B, T, n, n] f32, doubly stochastic up to hc_eps, comb[..., i, j] = weight of stream i in output j.
    """
    if x_btnd.ndim != 4:
        raise ValueError(f"mhc_pre: x_btnd must be [B, T, n, D], got shape {x_btnd.shape}")
    n, d = x_btnd.shape[2:]
    mix = (2 + n) * n
    if fn.shape != (n * d, mix):
        raise ValueError(
            f"mhc_pre: fn must be [n*D, (2+n)*n] = {(n * d, mix)} for x {x_btnd.shape}, got {fn.shape}"
        )
    if base.shape != (mix,):
        raise ValueError(f"mhc_pre: base must be [{mix}], got {base.shape}")
    if scale.shape != (3,):
        raise ValueError(f"mhc_pre: scale must be [3], got {scale.shape}")
    if sinkhorn_iters < 1:
        raise ValueError(f"mhc_pre: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    kw = dict(eps=eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    return dispatch.call("mhc_pre", implementation, _PRE, _AUTO, x_btnd, fn, base, scale, **kw)


def mhc_post(
    x_btnd: jnp.ndarray,
    y_btd: jnp.ndarray,
    post_btn: jnp.ndarray,
    comb_btnn: jnp.ndarray,
    *,
    implementation: str = "reference",
) -> jnp.ndarray:
    """Stream update after a sublayer: X_new[j] = post[j] * y + sum_i comb[i, j] * X[i], in x's dtype.

    Args: x_btnd [B, T, n, D] streams before the sublayer; y_btd [B, T, D] sublayer output; post_btn, comb_btnn
    from `mhc_pre` (cast to x's dtype before use, as transformers does).
    """
    if x_btnd.ndim != 4:
        raise ValueError(f"mhc_post: x_btnd must be [B, T, n, D], got shape {x_btnd.shape}")
    b, t, n, d = x_btnd.shape
    for name, a, want in (
        ("y_btd", y_btd, (b, t, d)),
        ("post_btn", post_btn, (b, t, n)),
        ("comb_btnn", comb_btnn, (b, t, n, n)),
    ):
        if a.shape != want:
            raise ValueError(f"mhc_post: {name} must have shape {want} for x {x_btnd.shape}, got {a.shape}")
    return dispatch.call("mhc_post", implementation, _POST, _AUTO, x_btnd, y_btd, post_btn, comb_btnn)
