"""`matmul(x, w)`: x @ w for any weight a layer holds, so that no layer or reference tests a weight's type.

A weight is a plain array [K, N] (jnp.matmul with w cast to x's dtype) or an object with its own
``matmul(x, *, precision=None)``: `glm53.quant.int8.Int8Weight` (int8 storage, a loader option) and
`kernels.matmul.streamed.StreamedKernel` (decode programs' few-row products in C++, `glm53.runtime`'s decode
weights). Each such type computes what jnp.matmul(x, w.astype(x.dtype)) would, by its own means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w, *, precision=None) -> jax.Array:
    """x [..., K] @ w [K, N] in x's dtype: `w.matmul(x, precision=...)` when the weight has one, else jnp.matmul
    of x and w cast to x's dtype."""
    own = getattr(w, "matmul", None)
    if own is not None:
        return own(x, precision=precision)
    return jnp.matmul(x, w.astype(x.dtype), precision=precision)
