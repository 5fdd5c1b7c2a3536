"""Dimension glossary and logical axis names.

Single letters in variable names (``x_btd``, ``w_edf``) and the logical axis names carried by every parameter
(``logical_axes`` metadata on `nnx.Param`) are defined here; the physical mapping lives in the sharding rules.

  b  batch / streams of generation        t  tokens (sequence)          s  cached key positions
  d  hidden (4096)                        v  vocabulary (154880)        f  FFN width (dense 12288 / expert 2048)
  e  routed experts (288)                 k  top-k slots (8)            n  mHC streams (4)
  h  attention heads (KDA 64, MLA 64, indexer 32)                       c  head dim / channels
  r  low-rank width (q_lora 1536, kv_lora 512, KDA gate rank 128)       p  KPool pools
"""

# Logical axis names (strings so they can be used in PartitionSpec-like tuples).
EMBED = "embed"  # d
VOCAB = "vocab"  # v
MLP = "mlp"  # dense FFN width
EXPERT = "expert"  # e
EXPERT_MLP = "expert_mlp"  # routed / shared expert width
HEADS = "heads"  # MLA query heads
KV_HEADS = "kv_heads"  # MLA k/v heads (== heads, no GQA)
Q_LORA = "q_lora"
KV_LORA = "kv_lora"
KDA_HEADS = "kda_heads"  # KDA heads (flattened head*dim axes use KDA_QKV)
KDA_QKV = "kda_qkv"  # linear_num_heads * linear_head_dim
KDA_RANK = "kda_rank"  # low-rank width of the forget / output gates
CONV = "conv"  # short-conv taps
INDEX_HEADS = "index_heads"
INDEX_QK = "index_qk"  # index_n_heads * index_head_dim
INDEX_HEAD_DIM = "index_head_dim"
KPOOL = "kpool"  # members of one KPool (ape rows)
HC_FLAT = "hc_flat"  # hc_mult * hidden
HC_MIX = "hc_mix"  # (2 + hc_mult) * hc_mult mixing logits
HC_SCALE = "hc_scale"  # 3 scales
NORM = "norm"  # vectors of norm weights / biases (replicated)
LAYERS = "layers"  # the repeat axis of a scanned LayerStack's parameters and caches (never sharded)
