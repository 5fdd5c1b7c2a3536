"""Building the model an entry point runs: a seeded random model from an experiment config, or a model restored
from weights on disk, placed on the device mesh of the config's ``mesh`` section (`sharded_model`)."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from glm53 import parallel as S
from glm53.checkpoint import gguf, hf, orbax
from glm53.config import (
    MeshConfig,
    ModelConfig,
    QuantConfig,
    load_hf_config,
    mesh_config_from_dict,
    model_config_from_dict,
    model_config_to_dict,
    quant_config_from_dict,
)
from glm53.config.kernels import KernelConfig, check_expert_kernel, kernel_config, kernel_config_from_dict
from glm53.errors import CheckpointError, ConfigError, ShardingError
from glm53.layers.stack import describe_groups
from glm53.model import Glm53Model

_log = logging.getLogger(__name__)

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


def kernels_from_experiment_config(config) -> KernelConfig:
    """The experiment config's optional `kernels` section as a KernelConfig (no config or no section: every op
    "auto")."""
    if config is None or "kernels" not in config or config.kernels is None:
        return KernelConfig()
    return kernel_config_from_dict(config.kernels)


def model_from_experiment_config(config) -> tuple[ModelConfig, Glm53Model]:
    """From an experiment ConfigDict (``configs/*.py:get_config``): its `model`, `seed`, `param_dtype` and the
    optional `quant` (routed-expert formats) and `kernels` (the implementation of each op) sections. Unsharded."""
    cfg = model_config_from_dict(config.model)
    quant = quant_from_experiment_config(config)
    kernels = kernels_from_experiment_config(config)
    dtype = parse_dtype(config.param_dtype)
    return cfg, random_model(cfg, seed=config.seed, dtype=dtype, quant=quant, kernels=kernels)


def check_experiment_config(config) -> None:
    """Validates every section an experiment config has (model, quant, kernels, mesh, param_dtype) and that the
    expert kernel can take the experts (`check_expert_kernel`): a ConfigError naming the field. Entry points call
    it as soon as the flags are parsed, so an override that cannot take effect is a usage error before any work."""
    if config is None:
        return
    cfg = model_config_from_dict(config.model) if "model" in config and config.model is not None else None
    quant = quant_from_experiment_config(config) if "quant" in config and config.quant is not None else None
    kernels = kernels_from_experiment_config(config)
    if "mesh" in config and config.mesh is not None:
        mesh_config_from_dict(config.mesh)
    if "param_dtype" in config:
        try:
            parse_dtype(config.param_dtype)
        except ValueError as e:
            raise ConfigError(f"config field 'param_dtype': {e}") from None
    if cfg is not None:
        check_expert_kernel(kernels, quant, cfg.num_moe_layers)


MTP_CHOICES = {"auto": None, "on": True, "off": False}


def weights_config(weights: str) -> ModelConfig:
    """The ModelConfig of weights on disk, read from their metadata only (no tensors): an Orbax checkpoint's
    sidecar, an HF folder's config.json or a GGUF's metadata."""
    if os.path.isdir(weights):
        if orbax.is_checkpoint(weights):
            try:
                return model_config_from_dict(orbax.read_metadata(weights)["config"])
            except (ConfigError, KeyError, TypeError) as e:
                raise CheckpointError(f"{weights}: corrupted {orbax.META}: {e}") from None
        return load_hf_config(weights)
    if os.path.isfile(weights):
        with gguf.open_gguf_model(weights) as g:
            return gguf.gguf_config(g)
    raise CheckpointError(f"{weights}: neither a checkpoint folder nor a GGUF file")


def load_model(
    weights: str, *, experts: str | None = None, dtype=jnp.float32, **kw
) -> tuple[ModelConfig, Glm53Model]:
    """A model from weights on disk, unsharded: an HF safetensors folder (bf16 / fp32 / FP8), a glm53 Orbax
    checkpoint folder (`experiments.convert`; floats cast to `dtype`) or a complete GGUF file; with `experts` (a
    GGUF file), the HF folder's non-expert weights and that GGUF's routed experts. Keyword arguments go to the
    loader (with_mtp: None builds the MTP block when the weights have one; `abstract_fn` places each tensor)."""
    if experts is not None:
        if not os.path.isdir(weights):
            raise CheckpointError(
                f"{weights}: with experts={experts!r} the weights must be an HF checkpoint folder"
            )
        return gguf.load_hybrid(weights, experts, dtype=dtype, **kw)
    if os.path.isdir(weights):
        if orbax.is_checkpoint(weights):
            return orbax.load_checkpoint(weights, dtype=dtype, **kw)
        return hf.load_hf_model(weights, dtype=dtype, **kw)
    if os.path.isfile(weights):
        return gguf.load_gguf_model(weights, dtype=dtype, **kw)
    raise CheckpointError(f"{weights}: neither a checkpoint folder nor a GGUF file")


# config.model fields that say how the model runs, not what the weights are: taken from the experiment config
# (`runtime_fields`), never compared with the weights' config.
RUNTIME_FIELDS = ("latent_cache_dtype", "scan_layers")


def runtime_fields(config) -> dict:
    """The RUNTIME_FIELDS that `config.model` sets (an empty dict without a model section)."""
    if config is None or "model" not in config or config.model is None:
        return {}
    return {k: config.model[k] for k in RUNTIME_FIELDS if k in config.model}


def apply_runtime_fields(model: Glm53Model, config) -> Glm53Model:
    """Sets the RUNTIME_FIELDS that `config.model` names on a loaded model (the latent cache layout; stacking or
    unstacking its layers); returns it."""
    runtime = runtime_fields(config)
    if "latent_cache_dtype" in runtime:
        model.set_latent_cache_dtype(runtime["latent_cache_dtype"])
    if "scan_layers" in runtime:  # weights load per layer (unrolled); a scanned run stacks them here, on device
        model.set_scan_layers(runtime["scan_layers"])
    return model


def check_model_section(config, cfg: ModelConfig) -> None:
    """ConfigError naming the first `config.model` field that differs from `cfg` (the weights' config);
    RUNTIME_FIELDS are not compared (they come from the experiment config)."""
    if config is None or "model" not in config or config.model is None:
        return
    mine = model_config_to_dict(model_config_from_dict(config.model))
    theirs = model_config_to_dict(cfg)
    diff = [k for k in mine if mine[k] != theirs.get(k) and k not in RUNTIME_FIELDS]
    if diff:
        k = diff[0]
        raise ConfigError(f"config.model.{k}={mine[k]!r}, but the weights have {k}={theirs.get(k)!r} "
                          f"({len(diff)} field(s) differ: {diff[:8]}); the model shape comes from the weights")  # fmt: skip


# ------------------------------------------------------------------------------------------------ on a mesh
@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """A model placed on its device mesh by a rule set: what the entry points run."""

    cfg: ModelConfig
    model: Glm53Model
    mesh: Mesh
    rules: S.Rules


def experiment_mesh(config, cfg: ModelConfig) -> tuple[Mesh, S.Rules]:
    """(mesh, rules) of an experiment config's ``mesh`` section (None or no section: `MeshConfig()`, every
    device on "model", tensor parallel) for the model `cfg`.

    The default mesh is a preference: a model whose heads / widths do not split over every device runs on one
    device (logged). Any other mesh is required: ShardingError naming the config field that does not split.
    """
    section = config.mesh if config is not None and "mesh" in config else None
    mesh_cfg = MeshConfig() if section is None else mesh_config_from_dict(section)
    mesh, rules = S.make_mesh(mesh_cfg), S.get_rules(mesh_cfg.rules)
    try:
        S.check_config(cfg, mesh, rules)
    except ShardingError as e:
        if mesh_cfg != MeshConfig() or jax.process_count() > 1:  # several processes: no one-device fallback
            raise ShardingError(f"mesh {dict(mesh.shape)} with rules {rules.name!r}: {e}") from None
        _log.warning("the model does not split over %d devices (%s): running on one device", mesh.size, e)
        mesh = S.make_mesh(MeshConfig(shape=(1, 1)), jax.devices()[:1])
    return mesh, rules


def sharded_model(
    config=None,
    *,
    weights: str | None = None,
    experts: str | None = None,
    dtype=jnp.float32,
    with_mtp: bool | None = None,
    verify: bool = True,
    kernels: KernelConfig | dict[str, str] | None = None,
) -> ShardedModel:
    """The model an entry point runs, on the mesh of `config` (`experiment_mesh`).

    Without `weights`: the seeded random model of the experiment config (`model_from_experiment_config`),
    initialized directly into its shardings (with_mtp False leaves the MTP block out). With `weights` (see
    `load_model`; `dtype` is the parameter dtype): the model shape comes from the weights, `config` (optional)
    gives the ``mesh`` section and, for GGUF experts, the ``quant`` section; a ``model`` section that disagrees
    with the weights is a ConfigError (`check_model_section`). Every tensor is read straight into its shards
    (an Orbax checkpoint leaf by leaf, checksums checked unless `verify` is False; HF / GGUF tensors placed by
    `glm53.parallel.abstract_sharded_model`). with_mtp: None builds the MTP block when the weights have one.
    kernels: the implementation of each kernel op (`Glm53Model`); None: the config's ``kernels`` section
    (`kernels_from_experiment_config`: every op "auto" without one).
    """
    kernels = kernels_from_experiment_config(config) if kernels is None else kernel_config(kernels)
    if weights is None:
        cfg = model_config_from_dict(config.model)
        mesh, rules = experiment_mesh(config, cfg)
        quant = quant_from_experiment_config(config)
        dtype = parse_dtype(config.param_dtype)
        mtp = with_mtp is not False
        model = S.init_sharded_model(
            lambda: random_model(cfg, seed=config.seed, dtype=dtype, quant=quant, with_mtp=mtp, kernels=kernels),
            mesh,
            rules,
        )
        return ShardedModel(cfg, model, mesh, rules)
    cfg = weights_config(weights)
    check_model_section(config, cfg)
    mesh, rules = experiment_mesh(config, cfg)
    if experts is None and orbax.is_checkpoint(weights):
        model = orbax.restore_model(  # a scanned run: each layer restored straight into its stack
            weights, mesh, rules, dtype=dtype, with_mtp=with_mtp, verify=verify, kernels=kernels,
            scan_layers=runtime_fields(config).get("scan_layers"),
        )  # fmt: skip
    else:
        quant = quant_from_experiment_config(config) if config is not None else None
        kw = {"quant": quant, "kernels": kernels} if quant is not None else {"kernels": kernels}
        if quant is not None and experts is None and os.path.isdir(weights):
            raise ConfigError("config.quant: quantized experts need GGUF experts (--experts or a GGUF file)")
        _, model = load_model(
            weights, experts=experts, dtype=dtype, with_mtp=with_mtp,
            abstract_fn=lambda build: S.abstract_sharded_model(build, mesh, rules), **kw,
        )  # fmt: skip
    cfg = apply_runtime_fields(model, config).cfg
    return ShardedModel(cfg, model, mesh, rules)


def weights_kind(weights: str) -> str:
    """What a --weights path holds, in words."""
    if os.path.isdir(weights):
        return "Orbax checkpoint" if orbax.is_checkpoint(weights) else "HF safetensors folder"
    return "GGUF file"


def describe_experts(model: Glm53Model, weights: str | None = None) -> str:
    """How the routed experts are held: dense arrays of their dtype, or GGUF blocks (the mix and the layout)."""
    if model.cfg.num_moe_layers == 0:
        return "none (no MoE layer)"
    quant = getattr(model, "quant", None)
    if quant is None or not quant.quantized:
        if weights is not None and os.path.isfile(weights):  # a GGUF file, loaded without a quant section
            return ("dense (the parameter dtype), dequantized from the GGUF's blocks on load (a config's quant "
                    "section keeps them quantized)")  # fmt: skip
        return "dense (the parameter dtype)"
    return f"GGUF blocks, {quant.experts} ({quant.layout} layout), decoded inside the expert kernel"


def describe_run(run: ShardedModel, **kw) -> str:
    """`describe_model` of an entry point's ShardedModel (its mesh and rules)."""
    return describe_model(run.model, mesh=run.mesh, rules=run.rules, **kw)


def describe_model(model: Glm53Model, *, mesh: Mesh | None = None, rules: S.Rules | None = None,
                   config_name: str | None = None, seed: int | None = None, weights: str | None = None,
                   label: str | None = None, training: bool = False) -> str:  # fmt: skip
    """The model part of an entry point's start-up block (docs/workbench.md), one line each: what runs (`label`,
    e.g. the default model's name, else the weights, or the config and seed of a random model, whose output is
    noise), the parameter count and the MTP block; the weights; the mesh (None: one device, unsharded); the
    parameter dtype; the layer groups; how the routed experts are held; the implementation each kernel op
    dispatches to on this backend (`training`: under the gradient, where "auto" picks differentiable ones)."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    n = sum(int(np.prod(x.shape)) for x in params)
    dtypes = sorted({str(x.dtype) for x in params if jnp.issubdtype(x.dtype, jnp.floating)})
    what = label or (
        f"weights {weights}"
        if weights
        else f"config {config_name}, random weights (seed {seed})" + ("" if training else ": output is noise")
    )
    mtp = "with" if model.mtp is not None else "without"
    if mesh is None:
        placed = f"one {jax.devices()[0].platform} device, unsharded"
    else:
        placed = f"{dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].platform} device(s), rules {rules.name}"
    lines = [
        f"  model: {what}; {n / 1e6:.2f}M parameters, {mtp} MTP",
        f"  weights: {weights} ({weights_kind(weights)})" if weights else (
            f"  weights: random init (seed {seed}), unless the work directory's latest checkpoint is resumed"
            if training else "  weights: random init"
        ),
        f"  mesh: {placed}",
        f"  dtype: parameters {'/'.join(dtypes)}",
        f"  {describe_groups(model.groups)}",
        f"  experts: {describe_experts(model, weights)}",
        f"  {kernel_config(model.kernels).describe(differentiable=training)}",
    ]
    return "\n".join(lines)
