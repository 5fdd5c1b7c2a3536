"""Typed configuration.

`ml_collections.ConfigDict` lives at the edge (``configs/*.py``, absl flags); it is converted once, here, into
frozen dataclasses that the library uses everywhere else. Conversion rejects unknown keys and inconsistent
values with a `ConfigError` that names the field.

  * `glm53.config.model`: `ModelConfig` (the architecture), `model_config_from_dict(d)` from our field names;
  * `glm53.config.hf`:    `model_config_from_hf(d)` / `load_hf_config(path)` from an HF ``config.json``
                          (composite ``glm5_next`` or ``glm5_next_text``), `as_hf_text_config` back;
  * `glm53.config.quant`: `QuantConfig`, the ``quant`` section (routed-expert storage);
  * `glm53.config.mesh`:  `MeshConfig`, the ``mesh`` section (axes, shape, rule set);
  * `glm53.config.kernels`: `KernelConfig`, the ``kernels`` section (the implementation of each kernel op). It
                          validates against the kernel packages' own tables, so it sits above `kernels` in the
                          layering (docs/architecture.md §14) and is imported from its module, not from here.

This package re-exports the public names of the other modules.
"""

from glm53.config.hf import as_hf_text_config, load_hf_config, model_config_from_hf
from glm53.config.mesh import RULE_SET_NAMES, MeshConfig, mesh_config_from_dict
from glm53.config.model import (
    ATTN_KINDS,
    INDEXER_KINDS,
    MLP_KINDS,
    ModelConfig,
    VisionConfig,
    model_config_from_dict,
    model_config_to_dict,
    validate,
)
from glm53.config.quant import QuantConfig, quant_config_from_dict
from glm53.errors import ConfigError

__all__ = [
    "ATTN_KINDS",
    "INDEXER_KINDS",
    "MLP_KINDS",
    "RULE_SET_NAMES",
    "ConfigError",
    "MeshConfig",
    "ModelConfig",
    "QuantConfig",
    "VisionConfig",
    "as_hf_text_config",
    "load_hf_config",
    "mesh_config_from_dict",
    "model_config_from_dict",
    "model_config_from_hf",
    "model_config_to_dict",
    "quant_config_from_dict",
    "validate",
]
