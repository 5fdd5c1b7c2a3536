"""One GLM-5.3 decoder layer: mHC around an attention sublayer (KDA or DSA) and an FFN sublayer (dense or MoE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.config import ModelConfig
from glm53.config.kernels import kernel_config
from glm53.layers import dsa as dsa_lib
from glm53.layers import kda as kda_lib
from glm53.layers.hyper_connections import HyperConnection
from glm53.layers.mlp import MLP
from glm53.layers.moe import MoE
from glm53.layers.norm import RMSNorm


class DecoderLayer(nnx.Module):
    """Streams x [B, T, n, D] -> streams; the layer kinds come from cfg.layer_types / cfg.mlp_layer_types.

    attention sublayer:  u, post, comb = attn_hc(x); y = self_attn(input_layernorm(u)); x = attn_hc.expand(x, y, ...)
    ffn sublayer:        u, post, comb = ffn_hc(x);  y = mlp(post_attention_layernorm(u)); x = ffn_hc.expand(...)

    kernels: the implementation of each kernel op (`glm53.config.kernels.KernelConfig`, or a mapping of it;
    None: every op "auto").
    """

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32, kernels=None, quant=None
    ):
        kernels = kernel_config(kernels)
        self.layer_idx = layer_idx
        self.attn_kind = cfg.layer_types[layer_idx]
        self.mlp_kind = cfg.mlp_layer_types[layer_idx]
        eps = cfg.rms_norm_eps
        hc_impl = kernels.mhc
        self.attn_hc = HyperConnection(cfg, rngs=rngs, dtype=dtype, implementation=hc_impl)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, rngs=rngs, dtype=dtype)
        if self.attn_kind == "kda":
            self.self_attn = kda_lib.KDA(cfg, rngs=rngs, dtype=dtype, implementation=kernels.kda)
        else:
            self.self_attn = dsa_lib.DSA(
                cfg,
                rngs=rngs,
                dtype=dtype,
                layer_idx=layer_idx,
                implementation=kernels.sparse_mla,
            )
        self.ffn_hc = HyperConnection(cfg, rngs=rngs, dtype=dtype, implementation=hc_impl)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, rngs=rngs, dtype=dtype)
        if self.mlp_kind == "dense":
            self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)
        else:
            self.mlp = MoE(
                cfg, rngs=rngs, dtype=dtype, implementation=kernels.moe, quant=quant,
                layer_idx=layer_idx,
            )  # fmt: skip

    def init_cache(self, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, pages=None):
        """This layer's empty cache; pages=(num_pages, page_tokens): a DSA layer's is paged (KDA: per stream)."""
        if self.attn_kind == "kda":
            return kda_lib.init_cache(cfg, batch, max_len, dtype)
        return self.self_attn.init_cache(batch, max_len, dtype, pages=pages)

    def __call__(self, x_btnd, *, cache=None, start_b=None, selection=None):
        """Returns (new streams, new layer cache or None, indexer selection (DSA) or the one passed in).

        Each piece runs under a `jax.named_scope` (attn_hc, attn_kda / attn_dsa, ffn_hc, mlp / moe): the op
        names in compiled programs and profiles say which sublayer an op belongs to."""
        with jax.named_scope("attn_hc"):
            u, post, comb = self.attn_hc(x_btnd)
        with jax.named_scope(f"attn_{self.attn_kind}"):
            h = self.input_layernorm(u)
            if self.attn_kind == "kda":
                y, cache = self.self_attn(h, cache=cache, start_b=start_b)
            else:
                y, cache, selection = self.self_attn(h, cache=cache, start_b=start_b, selection=selection)
        with jax.named_scope("attn_hc"):
            x_btnd = self.attn_hc.expand(x_btnd, y, post, comb)

        with jax.named_scope("ffn_hc"):
            u, post, comb = self.ffn_hc(x_btnd)
        with jax.named_scope("mlp" if self.mlp_kind == "dense" else "moe"):
            y = self.mlp(self.post_attention_layernorm(u))
        with jax.named_scope("ffn_hc"):
            x_btnd = self.ffn_hc.expand(x_btnd, y, post, comb)
        return x_btnd, cache, selection
