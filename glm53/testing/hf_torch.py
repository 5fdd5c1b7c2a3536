"""Randomized transformers `Glm5NextForConditionalGeneration` models built from a glm53 `ModelConfig`: the
reference that parity tests and benchmarks compare against (same weights, saved as an HF folder that glm53 loads
through its real checkpoint loader).

Needs the `test` extra (torch, transformers); the modeling code never imports this package.
"""

from __future__ import annotations

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from glm53.config import ModelConfig, as_hf_text_config

TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
                   projection_intermediate_size=64)  # fmt: skip


def hf_config(cfg: ModelConfig):
    """The transformers `Glm5NextConfig` of `cfg` (with a tiny vision tower, untied embeddings)."""
    text = as_hf_text_config(cfg)
    text["index_kpool"] = cfg.index_kpool  # transformers' class default is 16; always pass it
    return Glm5NextConfig(text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=False)


def randomize_(model, seed: int, std: float = 0.08) -> None:
    """Every parameter of the torch `model` drawn at random (in place), including those whose default init is
    constant (norm weights, A_log, dt_bias, KPool ape / gate, k_norm bias, mHC base / scale,
    e_score_correction_bias). Matrices get N(0, min(std, 1.5 / sqrt(fan_in))^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and leaf == "weight":
                v = 1.0 + 0.2 * r
            elif leaf == "bias" and "norm" in name:
                v = 0.2 * r
            elif leaf == "A_log":
                v = 0.5 * r
            elif leaf == "dt_bias":
                v = 0.5 * r
            elif "hc_" in name and name.endswith("scale"):
                v = 1.0 + 0.3 * r
            elif "hc_" in name and name.endswith("base"):
                v = 0.5 * r
            elif "e_score_correction_bias" in name:
                v = 0.3 * r
            elif "compress_ape" in name or "compress_gate" in name:
                v = 0.5 * r
            elif p.ndim >= 2:
                fan_in = p.shape[-1]
                v = r * min(std, 1.5 / fan_in**0.5)
            else:
                v = 0.2 * r
            p.copy_(v.to(p.dtype))


def random_hf_model(cfg: ModelConfig, seed: int):
    """A randomized fp32 eager-attention `Glm5NextForConditionalGeneration` of `cfg`, in eval mode."""
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration._from_config(
        hf_config(cfg), attn_implementation="eager", torch_dtype=torch.float32
    )
    randomize_(model, seed)
    return model.eval()


def hf_logits(model, ids):
    """Logits [B, T, V] (f32 torch tensor) of a whole-sequence forward without cache."""
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=False)
    return out.logits.float()
