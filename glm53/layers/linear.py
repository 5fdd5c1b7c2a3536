"""Bias-free linear layer. Kernel is stored [in, out] (``x @ w``); HF's [out, in] is transposed on load."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from glm53.layers.param import param
from kernels.matmul import api as matmul_api


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] with logical axes `axes` = (in_axis, out_axis).

    The kernel is an array or a weight with its own product (`kernels.matmul.api.matmul`): int8 storage (a loader
    option) or a decode program's StreamedKernel (`glm53.runtime.weights.decode_state`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: Sequence[str | None],
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        std: float = 0.02,
    ):
        self.in_features = in_features
        self.out_features = out_features
        self.kernel = param(rngs, (in_features, out_features), axes, dtype, std=std)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return matmul_api.matmul(x, self.kernel.get_value())
