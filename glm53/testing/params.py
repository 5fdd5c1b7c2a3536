"""Randomized parameters for comparisons of two of glm53's own paths (sharded vs not, batched vs alone, several
processes vs one, scanned vs unrolled).

Several parameters are constant at init (RMSNorm weights, `A_log`, `dt_bias`, biases, the router's correction
bias, the mHC bases and scales): a comparison on such a model can pass through a symmetry (every head or stream
alike, a bias that cancels) where a wrong index or a dropped term would show on trained weights. The oracle
comparisons against transformers randomize the torch model (`glm53.testing.hf_torch.randomize_`); this is the same
for a model glm53 built itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def randomize_params(model: nnx.Module, seed: int = 1, scale: float = 0.05) -> nnx.Module:
    """Every floating array of `model`'s state moved by `scale` * N(0, 1), in place (deterministic in `seed`:
    every process of a multi-process test draws the same values); quantized expert planes and integer state are
    left as they are. Apply before sharding. Returns the model."""
    key = jax.random.key(seed)
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model))):
        v = var.get_value()
        if isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating):
            var.set_value(v + jnp.asarray(scale, v.dtype) * jax.random.normal(jax.random.fold_in(key, i), v.shape,
                                                                               v.dtype))  # fmt: skip
    return model
