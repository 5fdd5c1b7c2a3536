"""Building models: a seeded random model from a config, or a model restored from weights on disk."""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from glm53.config import ModelConfig, QuantConfig, model_config_from_dict, quant_config_from_dict
from glm53.model import Glm53Model

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32, **kw) -> Glm53Model:
    """The deterministic seeded-init model of `cfg` (what entry points run when given --config without --weights)."""
    return Glm53Model(cfg, rngs=nnx.Rngs(seed), dtype=dtype, **kw)


def quant_from_experiment_config(config) -> QuantConfig | None:
    """The experiment config's optional `quant` section as a QuantConfig (None when the section is absent)."""
    return quant_config_from_dict(config.quant) if "quant" in config else None


def model_from_experiment_config(config) -> tuple[ModelConfig, Glm53Model]:
    """From an experiment ConfigDict (``configs/*.py:get_config``): its `model`, `seed`, `param_dtype` and the
    optional `quant` section (routed-expert formats and the expert kernel)."""
    cfg = model_config_from_dict(config.model)
    quant = quant_from_experiment_config(config)
    return cfg, random_model(cfg, seed=config.seed, dtype=parse_dtype(config.param_dtype), quant=quant)


def load_model(
    weights: str, *, experts: str | None = None, dtype=jnp.float32, **kw
) -> tuple[ModelConfig, Glm53Model]:
    """A model from weights on disk: an HF safetensors folder (bf16 / fp32 / FP8), a glm53 Orbax checkpoint
    folder (`experiments.convert`; floats cast to `dtype`) or a complete GGUF file; with `experts` (a GGUF
    file), the HF folder's non-expert weights and that GGUF's routed experts."""
    if experts is not None:
        if not os.path.isdir(weights):
            raise ValueError(
                f"{weights}: with experts={experts!r} the weights must be an HF checkpoint folder"
            )
        from glm53.checkpoint import gguf

        return gguf.load_hybrid(weights, experts, dtype=dtype, **kw)
    if os.path.isdir(weights):
        from glm53.checkpoint import orbax_io

        if orbax_io.is_checkpoint(weights):  # a glm53 Orbax checkpoint (experiments.convert)
            return orbax_io.load_checkpoint(weights, dtype=dtype, **kw)
        from glm53.checkpoint import hf

        return hf.load_hf_model(weights, dtype=dtype, **kw)
    if os.path.isfile(weights):
        from glm53.checkpoint import gguf

        return gguf.load_gguf_model(weights, dtype=dtype, **kw)
    raise ValueError(f"{weights}: neither a checkpoint folder nor a GGUF file")
