"""Test helpers: tiny transformers `Glm5NextForConditionalGeneration` models with every parameter randomized,
saved as HF folders that glm53 loads through its real checkpoint loader (see glm53.testing.hf_torch)."""

from __future__ import annotations

from glm53.testing.hf_torch import TINY_VISION, hf_config, hf_logits, randomize_
from glm53.testing.hf_torch import random_hf_model as tiny_hf_model

__all__ = ["TINY_VISION", "hf_config", "hf_logits", "randomize_", "tiny_hf_model"]
