"""Bias-free linear layer. Kernel is stored [in, out] (``x @ w``); HF's [out, in] is transposed on load."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from glm53.layers.param import param
from glm53.quant.int8 import Int8Weight
from kernels.matmul.streamed import StreamedKernel


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] with logical axes `axes` = (in_axis, out_axis)."""

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
        w = self.kernel.get_value()
        if isinstance(w, Int8Weight | StreamedKernel):  # int8 storage (a loader option); decode programs' few-row
            return w.matmul(x)  # products (glm53.generate.decode_state)
        return jnp.matmul(x, self.kernel[...].astype(x.dtype))
