"""mHC hyper-connection site: learned weights that collapse n residual streams into one sublayer input and
expand the sublayer output back into the streams (docs/architecture.md §5)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.config import ModelConfig
from glm53.layers.param import param
from kernels import dispatch
from kernels.mhc import api as mhc_api


class HyperConnection(nnx.Module):
    """One mHC site (``attn_hc`` or ``ffn_hc`` of a decoder layer).

    Parameters (HF ``hc_{attn,ffn}_{fn,base,scale}``): fn [n*D, (2+n)*n] (HF's [(2+n)*n, n*D] transposed; param
    dtype), base [(2+n)*n] and scale [3] (always f32, as transformers keeps them). Init follows transformers:
    fn ~ N(0, 0.02^2), base = 0, scale = 1.

    Usage inside a decoder layer::

        u_btd, post_btn, comb_btnn = hc(x_btnd)      # collapse
        y_btd = sublayer(norm(u_btd))
        x_btnd = hc.expand(x_btnd, y_btd, post_btn, comb_btnn)
    """

    def __init__(
        self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, implementation: str = dispatch.AUTO
    ):
        n, d = cfg.hc_mult, cfg.hidden_size
        mix = (2 + n) * n
        self.hc_mult = n
        self.eps = cfg.rms_norm_eps
        self.hc_eps = cfg.hc_eps
        self.sinkhorn_iters = cfg.hc_sinkhorn_iters
        self.implementation = implementation
        self.fn = param(rngs, (n * d, mix), (dims.HC_FLAT, dims.HC_MIX), dtype, std=0.02)
        self.base = param(rngs, (mix,), (dims.HC_MIX,), jnp.float32, init="zeros")
        self.scale = param(rngs, (3,), (dims.HC_SCALE,), jnp.float32, init="ones")

    def __call__(self, x_btnd: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """Returns (u_btd in x's dtype, post_btn f32, comb_btnn f32) for streams x_btnd [B, T, n, D]."""
        if x_btnd.ndim != 4 or x_btnd.shape[2] != self.hc_mult:
            raise ValueError(
                f"HyperConnection: expected streams [B, T, {self.hc_mult}, D], got {x_btnd.shape}"
            )
        return mhc_api.mhc_pre(
            x_btnd,
            self.fn.get_value(),  # an array, or decode_state's StreamedKernel of it
            self.base[...],
            self.scale[...],
            eps=self.eps,
            hc_eps=self.hc_eps,
            sinkhorn_iters=self.sinkhorn_iters,
            implementation=self.implementation,
        )

    def expand(
        self, x_btnd: jnp.ndarray, y_btd: jnp.ndarray, post_btn: jnp.ndarray, comb_btnn: jnp.ndarray
    ) -> jnp.ndarray:
        """New streams [B, T, n, D]: post[j] * y + sum_i comb[i, j] * x[i] (x being the streams before the site)."""
        return mhc_api.mhc_post(x_btnd, y_btd, post_btn, comb_btnn, implementation=self.implementation)
