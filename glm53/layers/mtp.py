"""The MTP block (checkpoint layer 45): a plain pre-norm residual block (no mHC) with DeepSeek-V3-style fusion.

x = eh_proj(concat[enorm(Embed[token_{p+1}]), hnorm(h_p)])      # embedding first
x = x + DSA(input_layernorm(x))
x = x + MoE(post_attention_layernorm(x))
logits_{p+2} = lm_head(shared_head_norm(x))                      # lm_head and embedding shared with the trunk
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from glm53 import dims
from glm53.config import ModelConfig
from glm53.config.kernels import kernel_config
from glm53.layers import dsa as dsa_lib
from glm53.layers.linear import Linear
from glm53.layers.moe import MoE
from glm53.layers.norm import RMSNorm


class MTPBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, kernels=None, quant=None):
        kernels = kernel_config(kernels)  # KernelConfig, a mapping of it, or None (every op "auto")
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.enorm = RMSNorm(d, eps, rngs=rngs, dtype=dtype)
        self.hnorm = RMSNorm(d, eps, rngs=rngs, dtype=dtype)
        self.eh_proj = Linear(2 * d, d, (None, dims.EMBED), rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(d, eps, rngs=rngs, dtype=dtype)
        self.self_attn = dsa_lib.DSA(
            cfg, rngs=rngs, dtype=dtype, layer_idx=None, implementation=kernels.sparse_mla
        )
        self.post_attention_layernorm = RMSNorm(d, eps, rngs=rngs, dtype=dtype)
        self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, implementation=kernels.moe, quant=quant)
        self.shared_head_norm = RMSNorm(d, eps, rngs=rngs, dtype=dtype)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, *, pages=None):
        return self.self_attn.init_cache(batch, max_len, dtype, pages=pages)

    def __call__(self, h_btd, e_btd, *, cache=None, start_b=None):
        """h: trunk final-normed hidden [B, T, D] at positions p; e: embeddings of tokens p+1 [B, T, D].

        Returns (normed output [B, T, D] for the shared lm_head, new cache)."""
        x = self.eh_proj(jnp.concatenate([self.enorm(e_btd), self.hnorm(h_btd)], axis=-1))
        y, cache, _ = self.self_attn(self.input_layernorm(x), cache=cache, start_b=start_b)
        x = x + y
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head_norm(x), cache
