"""Test helpers: tiny transformers `Glm5NextForConditionalGeneration` models with every parameter randomized,
saved as HF folders that glm53 loads through its real checkpoint loader."""

from __future__ import annotations

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from glm53.config import ModelConfig, as_hf_text_config

TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
                   projection_intermediate_size=64)  # fmt: skip


def hf_config(cfg: ModelConfig) -> Glm5NextConfig:
    text = as_hf_text_config(cfg)
    text["index_kpool"] = cfg.index_kpool  # transformers' class default is 16; always pass it
    return Glm5NextConfig(text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=False)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Every parameter drawn at random, including those whose default init is constant (norm weights, A_log,
    dt_bias, KPool ape / gate, k_norm bias, mHC base / scale, e_score_correction_bias)."""
    g = torch.Generator().manual_seed(seed)
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


def tiny_hf_model(cfg: ModelConfig, seed: int) -> Glm5NextForConditionalGeneration:
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration._from_config(
        hf_config(cfg), attn_implementation="eager", torch_dtype=torch.float32
    )
    randomize_(model, seed)
    return model.eval()


@torch.no_grad()
def hf_logits(model, ids) -> torch.Tensor:
    out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=False)
    return out.logits.float()
