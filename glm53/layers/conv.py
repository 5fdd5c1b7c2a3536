"""Causal depthwise short convolution with a carried state (the KDA q/k/v short conv)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.layers.param import param


class ShortConv(nnx.Module):
    """y_t[c] = act( sum_{j=0..K-1} weight[j, c] * x_{t-K+1+j}[c] ), causal, per channel.

    Weight index K-1 multiplies the current token (PyTorch ``F.conv1d(padding=K-1)[..., :T]`` semantics; HF
    ``conv1d.weight [C, 1, K]`` is ``weight.T``). Tokens before the sequence start come from ``conv_state``:
    the last K-1 *pre-conv* inputs (zeros for a fresh sequence). ``activation`` is applied to the conv output
    ("silu" as in KDA, or None). The conv and activation run in f32 (the weight is kept f32, as in
    transformers); y is cast back to x.dtype.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        axis: str = dims.KDA_QKV,
        *,
        rngs: nnx.Rngs,
        activation: str | None = "silu",
        dtype=jnp.float32,
    ):
        if activation not in ("silu", None):
            raise ValueError(f"ShortConv: activation must be 'silu' or None, got {activation!r}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        del dtype  # the conv weight is always float32 (transformers keeps conv1d in fp32)
        std = (3.0 * kernel_size) ** -0.5  # variance of torch's default uniform(+-1/sqrt(K)) init
        self.weight = param(rngs, (kernel_size, channels), (dims.CONV, axis), jnp.float32, std=std)

    def __call__(
        self, x_btc: jnp.ndarray, conv_state: jnp.ndarray | None = None
    ) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x_btc [B, T, C], conv_state [B, K-1, C] or None -> (y_btc [B, T, C], new_state [B, K-1, C]).

        new_state holds the last K-1 pre-conv inputs of (state ++ x), in the state's dtype (x.dtype if None).
        """
        B, T, C = x_btc.shape
        K = self.kernel_size
        if C != self.channels:
            raise ValueError(f"ShortConv: input has {C} channels, weight has {self.channels}")
        if conv_state is None:
            conv_state = jnp.zeros((B, K - 1, C), x_btc.dtype)
        elif conv_state.shape != (B, K - 1, C):
            raise ValueError(
                f"ShortConv: conv_state must be [B={B}, K-1={K - 1}, C={C}], got {conv_state.shape}"
            )
        xx = jnp.concatenate([conv_state.astype(x_btc.dtype), x_btc], axis=1)  # [B, K-1+T, C]
        new_state = xx[:, T:].astype(conv_state.dtype)
        xf = xx.astype(jnp.float32)
        w = self.weight[...].astype(jnp.float32)  # [K, C]
        y = sum(w[j] * xf[:, j : j + T] for j in range(K))  # [B, T, C]
        if self.activation == "silu":
            y = jax.nn.silu(y)
        return y.astype(x_btc.dtype), new_state
