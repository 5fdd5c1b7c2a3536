"""The ``kernels`` section of an experiment config: which implementation runs each kernel op.

`KernelConfig` names one implementation per op of `kernels/` (the `implementation=` argument of its api.py).
Every field defaults to "auto" (the backend's best: each op's `_AUTO` table, resolved by `kernels.dispatch`), the
one default of models, entry points and training alike; a config that wants another sets it (configs/train.py:
``kernels.moe = "blocked"``; ``--config.kernels.moe=reference`` on the command line).

The valid names come from the kernel packages themselves (`OPS`: each op's ``IMPLEMENTATIONS``), so this module
sits just above `kernels` in the layering (docs/architecture.md §14), not with the other config dataclasses:
`glm53.config` does not re-export it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from glm53.config.fields import field_error, from_dict
from glm53.errors import ConfigError
from kernels import dispatch
from kernels.kda import api as kda_api
from kernels.mhc import api as mhc_api
from kernels.moe import api as moe_api
from kernels.sparse_mla import api as sparse_mla_api

# op -> the implementation names its api takes (including "auto"), from the op's own package
OPS: dict[str, tuple[str, ...]] = {
    "mhc": tuple(mhc_api.IMPLEMENTATIONS),  # kernels.mhc.api.mhc_pre / mhc_post: the hyper-connection sites
    "kda": tuple(kda_api.IMPLEMENTATIONS),  # kernels.kda.api.chunk_kda / recurrent_kda: KDA attention
    "sparse_mla": tuple(sparse_mla_api.IMPLEMENTATIONS),  # kernels.sparse_mla.api.sparse_mla: DSA attention
    "moe": tuple(moe_api.IMPLEMENTATIONS),  # kernels.moe.api.moe_experts: the routed experts
}
# op -> {backend: the implementation "auto" runs there}
AUTO_TABLES: dict[str, dict[str, str]] = {
    "mhc": mhc_api.AUTO_BY_BACKEND,
    "kda": kda_api.AUTO_BY_BACKEND,
    "sparse_mla": sparse_mla_api.AUTO_BY_BACKEND,
    "moe": moe_api.AUTO_BY_BACKEND,
}
# implementation-name prefix -> the platform its Pallas kernels compile for (interpreted anywhere else)
PALLAS_PLATFORMS = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
# op -> what "auto" runs where a gradient is taken (`dispatch.differentiable`), for the ops whose choice differs
AUTO_DIFFERENTIABLE: dict[str, str] = {"moe": moe_api.AUTO_DIFFERENTIABLE}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The implementation of each kernel op (the ``kernels`` section of an experiment config).

    mhc: the mHC sites (kernels/mhc); kda: KDA attention (kernels/kda); sparse_mla: DSA attention over the
    indexer's selection (kernels/sparse_mla); moe: the routed experts (kernels/moe; its decode / prefill form by
    routed slots, `QuantConfig.decode_max_slots`). Each one of `OPS[op]`; "auto" (the default) is the backend's
    best. An unknown name is a ConfigError naming the field ``kernels.<op>`` and the valid choices.
    """

    mhc: str = dispatch.AUTO
    kda: str = dispatch.AUTO
    sparse_mla: str = dispatch.AUTO
    moe: str = dispatch.AUTO

    def __post_init__(self):
        for op, valid in OPS.items():
            name = getattr(self, op)
            if name not in valid:
                raise field_error(
                    f"kernels.{op}", f"unknown implementation {name!r}; expected one of {list(valid)}"
                )

    def replace(self, **changes: str) -> KernelConfig:
        """A copy with `changes` (op -> implementation), validated; an unknown op is a ConfigError."""
        unknown = sorted(set(changes) - set(OPS))
        if unknown:
            raise ConfigError(f"kernels config: unknown ops {unknown}; valid ops are {sorted(OPS)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def resolved(self, backend: str | None = None, differentiable: bool = False) -> dict[str, str]:
        """op -> what runs on `backend` (default: JAX's): the implementation named, or the one "auto" picks there
        (`dispatch.resolve`; `differentiable`: where a gradient is taken, as training's loss), marked "(auto)"; a
        Pallas kernel for another platform is marked "(interpret mode)": it runs in Pallas' interpreter, correct
        and slow."""
        backend = backend or jax.default_backend()
        out = {}
        for op in OPS:
            asked = getattr(self, op)
            grad = AUTO_DIFFERENTIABLE.get(op) if differentiable else None
            name = grad if asked == dispatch.AUTO and grad else dispatch.resolve(op, asked, OPS[op], AUTO_TABLES[op], backend)
            note = " (auto)" if asked == dispatch.AUTO else ""
            platform = next((p for k, p in PALLAS_PLATFORMS.items() if name.startswith(k)), None)
            if platform is not None and platform != backend:
                note += " (interpret mode)"
            out[op] = name + note
        return out

    def describe(self, backend: str | None = None, differentiable: bool = False) -> str:
        """One line: `resolved` per op, e.g. "kernels (cpu): mhc=xla_cpu (auto), ... moe=pallas_tpu (interpret
        mode)"; "kernels (cpu, under grad): ..." where `differentiable`."""
        backend = backend or jax.default_backend()
        where = f"{backend}, under grad" if differentiable else backend
        ops = self.resolved(backend, differentiable)
        return f"kernels ({where}): " + ", ".join(f"{op}={v}" for op, v in ops.items())


def kernel_config_from_dict(d: Any) -> KernelConfig:
    """A KernelConfig from the ``kernels`` ConfigDict / dict (missing ops: "auto"); unknown ops are an error."""
    return from_dict(KernelConfig, d, "kernels config")


def kernel_config(value: KernelConfig | Mapping[str, str] | None) -> KernelConfig:
    """`value` as a KernelConfig: None -> KernelConfig() (every op "auto"); a mapping or ConfigDict through
    `kernel_config_from_dict` (the same validation); a KernelConfig as it is."""
    if value is None:
        return KernelConfig()
    if isinstance(value, KernelConfig):
        return value
    return kernel_config_from_dict(value)


def check_expert_kernel(kernels: KernelConfig, quant, num_moe_layers: int) -> None:
    """ConfigError where ``kernels.moe`` names an implementation that cannot take the experts a model holds
    (`quant`: its QuantConfig or None for dense experts): checked where a model is built and where an entry point
    reads its config, so an override that could not take effect is rejected before any work."""
    if num_moe_layers == 0:
        return
    quantized = quant is not None and quant.quantized
    if kernels.moe in moe_api.QUANTIZED_ONLY and not quantized:
        raise field_error(
            "kernels.moe", f"{kernels.moe!r} decodes GGUF expert blocks, and the experts are dense "
            "(quant.experts='none'): set quant.experts (e.g. --config.quant.experts=q4_k) or another kernels.moe",
        )  # fmt: skip
    if kernels.moe in moe_api.DENSE_ONLY and quantized:
        raise field_error(
            "kernels.moe", f"{kernels.moe!r} multiplies dense experts, and the experts are GGUF blocks "
            f"(quant.experts={quant.experts!r}): set another kernels.moe (e.g. auto) or quant.experts='none'",
        )  # fmt: skip
