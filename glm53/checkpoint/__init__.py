"""Checkpoints into and out of glm53 models.

  * `hf` (+ `hf_rules` names, `hf_fp8` the FP8 form): HF safetensors folders (bf16 / fp32 / FP8);
  * `gguf` (+ `gguf_rules`): llama.cpp GGUF files, and the hybrid of HF non-experts with GGUF routed experts;
  * `gguf_export`: writing GGUF files and re-quantizing their routed experts;
  * `orbax`: glm53's own Orbax format (layout, restore onto a mesh); `convert` writes it from HF (+ GGUF);
  * `scan`: checkpoints name per-layer tensors whatever `ModelConfig.scan_layers` (writers' per-layer view,
    loaders building per layer and stacking after).

This package re-exports the HF loader's public names.
"""

from glm53.checkpoint.hf import LoadReport, load_hf_checkpoint, load_hf_weights
from glm53.errors import CheckpointError
from glm53.io.safetensors import SafetensorsFile

__all__ = ["CheckpointError", "LoadReport", "SafetensorsFile", "load_hf_checkpoint", "load_hf_weights"]
