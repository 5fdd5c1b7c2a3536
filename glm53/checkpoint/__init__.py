"""Checkpoint I/O: HF safetensors (bf16 / fp32 / FP8) into glm53 models."""

from glm53.checkpoint.hf import LoadReport, load_hf_checkpoint, load_hf_weights
from glm53.errors import CheckpointError
from glm53.io.safetensors import SafetensorsFile

__all__ = ["CheckpointError", "LoadReport", "SafetensorsFile", "load_hf_checkpoint", "load_hf_weights"]
