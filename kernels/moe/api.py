"""Routed-expert kernel api: `moe_experts` (grouped expert SwiGLU + weighted combine).

Weights are dense kernels (w_gate / w_up [E, D, F], w_down [E, F, D]) or `glm53.quant.qweight.QuantizedExperts`
of those kernel shapes (any mix); decode programs' wrapped dense kernels (StreamedKernel, ExpertList) reach the
xla_cpu decode form as they are and every other implementation unwrapped (`READS_DECODE_WEIGHTS`).
Implementations:

  reference           sort slots by expert, `jax.lax.ragged_dot`, f32 accumulation; quantized weights are
                      dequantized whole first. The oracle.
  dense_einsum        every expert on every token, masked (tiny sizes only).
  blocked             slots sorted into expert-aligned blocks of rows, one batched matmul per block
                      (kernels.moe.blocked): dropless, static shapes, differentiable; dense kernels only. What
                      training runs.
  xla_quant           plain XLA, cost per distinct routed expert (kernels.moe.xla_quant): the GPU path.
                      xla_quant_decode / xla_quant_prefill force one form.
  xla_cpu             plain XLA shaped for XLA:CPU (kernels.moe.xla_cpu): one distinct expert at a time, dense
                      kernels sliced in place, quantized experts dequantized a chunk at a time outside loops;
                      prefill computes only the real expert group sizes. xla_cpu_decode / xla_cpu_prefill
                      force one form. The decode form runs QuantizedExperts through a C++ kernel
                      (kernels.moe.cpu_ffi) when it builds and takes the formats; xla_cpu_ffi_decode forces
                      that kernel, xla_cpu_xla_decode the plain-XLA decode.
  pallas_tpu          Pallas TPU kernels on QuantizedExperts in the formats they decode: decode (grid over
                      distinct experts, kernels.moe.pallas_tpu_decode) or prefill (ragged grouped GEMM,
                      kernels.moe.pallas_tpu_prefill); pallas_tpu_decode / pallas_tpu_prefill force one. Lowered
                      for TPU the kernels compile with Mosaic (a kernel Mosaic rejects fails the compile); lowered
                      for any other platform they run in interpret mode (correct, slow).
  pallas_gpu          Pallas Mosaic GPU kernels on QuantizedExperts in the formats they decode
                      (kernels.moe.pallas_gpu: IQ4_XS, Q4_K, Q8_0, IQ2_S_R, IQ3_S_R, BF16, F16, F32): decode
                      (grid over distinct experts x token groups, kernels.moe.pallas_gpu_decode) or prefill (row
                      tiles of slots sorted by expert, kernels.moe.pallas_gpu_prefill); pallas_gpu_decode /
                      pallas_gpu_prefill force one (bf16 prefill on the tensor cores where
                      kernels.moe.pallas_gpu_wgmma decodes the formats). Lowered for CUDA they are Mosaic
                      GPU kernels; lowered for any other platform they run in Pallas' interpreters (correct,
                      slow).
  auto                by backend (`jax.default_backend()`): tpu -> pallas_tpu, gpu -> pallas_gpu, cpu ->
                      xla_cpu, any other -> reference.

xla_quant, xla_cpu, pallas_tpu, pallas_gpu and auto take their decode form when the routed slots T*K <= decode_max_slots, else
their prefill form (`select_implementation`, the one decode / prefill rule). A named implementation that
cannot take the inputs (a format, layout or weight type its kernels do not handle) raises NotImplementedError;
only "auto" falls back to "reference" then, logging the reason once (`kernels.dispatch`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm53.quant.qweight import QuantizedExperts
from kernels import dispatch
from kernels.moe import (
    blocked,
    pallas_gpu,
    pallas_gpu_decode,
    pallas_gpu_prefill,
    pallas_tpu_decode,
    pallas_tpu_prefill,
    reference,
    xla_cpu,
    xla_quant,
)
from kernels.moe.reference import clamped_swiglu

__all__ = [
    "moe_experts",
    "clamped_swiglu",
    "select_implementation",
    "IMPLEMENTATIONS",
    "DEFAULT_DECODE_MAX_SLOTS",
]

DEFAULT_DECODE_MAX_SLOTS = 64


def _pallas_tpu(mode: str):
    """The Pallas TPU decode / prefill entry on the planes of QuantizedExperts.

    The kernels compile with Mosaic where the program is lowered for TPU and run in interpret mode for any
    other platform (`jax.lax.platform_dependent`: chosen per lowering platform, so a program compiled for TPU
    devices from a CPU host holds the Mosaic kernels and no interpreter).
    """

    def run(x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit):
        ws = (w_gate, w_up, w_down)
        if not all(isinstance(w, QuantizedExperts) for w in ws):
            kinds = [type(w).__name__ for w in ws]
            raise NotImplementedError(
                f"the Pallas kernels need QuantizedExperts for gate/up/down, got {kinds}"
            )

        fn = pallas_tpu_decode.moe_decode if mode == "decode" else pallas_tpu_prefill.moe_prefill

        def kernels(interpret):
            return lambda *args: fn(*args, swiglu_limit=swiglu_limit, interpret=interpret)

        args = (x_td, topk_ids_tk, topk_w_tk, *(w.planes for w in ws))
        return jax.lax.platform_dependent(*args, tpu=kernels(False), default=kernels(True))

    return run


def _pallas_gpu(mode: str):
    """The Pallas GPU decode / prefill entry on the planes of QuantizedExperts: Mosaic GPU kernels where the
    program is lowered for CUDA, Pallas' interpreter for any other platform (`jax.lax.platform_dependent`)."""

    def run(x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit):
        ws = (w_gate, w_up, w_down)
        if not all(isinstance(w, QuantizedExperts) for w in ws):
            kinds = [type(w).__name__ for w in ws]
            raise NotImplementedError(
                f"the Pallas GPU kernels need QuantizedExperts for gate/up/down, got {kinds}"
            )
        planes = [w.planes for w in ws]
        pallas_gpu.check_supported(*planes)  # NotImplementedError before tracing either branch
        fn = pallas_gpu_decode.moe_decode if mode == "decode" else pallas_gpu_prefill.moe_prefill

        def kernels(interpret):
            # interpreted, the CUDA-core kernels only: the tensor-core kernel's interpreter (the Mosaic GPU one)
            # has ordered effects, which a platform_dependent branch may not have
            return lambda *args: fn(
                *args, swiglu_limit=swiglu_limit, tensor_cores=not interpret, interpret=interpret
            )

        args = (x_td, topk_ids_tk, topk_w_tk, *planes)
        return jax.lax.platform_dependent(*args, cuda=kernels(False), default=kernels(True))

    return run


_IMPLEMENTATIONS = {
    "reference": reference.moe_experts,
    "dense_einsum": reference.moe_experts_dense,
    "blocked": blocked.moe_experts_blocked,
    "xla_quant_decode": xla_quant.moe_experts_decode,
    "xla_quant_prefill": xla_quant.moe_experts_prefill,
    "xla_cpu_decode": xla_cpu.moe_experts_decode,
    "xla_cpu_prefill": xla_cpu.moe_experts_prefill,
    "xla_cpu_ffi_decode": functools.partial(xla_cpu.moe_experts_decode, ffi=True),
    "xla_cpu_xla_decode": functools.partial(xla_cpu.moe_experts_decode, ffi=False),
    "pallas_tpu_decode": _pallas_tpu("decode"),
    "pallas_tpu_prefill": _pallas_tpu("prefill"),
    "pallas_gpu_decode": _pallas_gpu("decode"),
    "pallas_gpu_prefill": _pallas_gpu("prefill"),
}
# pick <name>_decode / <name>_prefill by routed slots
_BY_SLOTS = ("xla_quant", "xla_cpu", "pallas_tpu", "pallas_gpu")
_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "xla_cpu"}  # backend -> what "auto" runs
AUTO_BY_BACKEND = _AUTO  # public: what "auto" picks per backend (glm53.config.kernels, the entry points' start-up block)
# What "auto" runs where a gradient is taken (`kernels.dispatch.differentiable`, glm53.train's loss): the experts
# above loop over a dynamic number of distinct experts (no reverse mode); the grouped matmul has one.
AUTO_DIFFERENTIABLE = "blocked"
IMPLEMENTATIONS = (dispatch.AUTO, *_BY_SLOTS, *_IMPLEMENTATIONS)
# What each named implementation takes (checked where a model is built, glm53.model): the Pallas kernels decode
# QuantizedExperts only; the blocked grouped matmul multiplies dense kernels only.
QUANTIZED_ONLY = tuple(n for n in IMPLEMENTATIONS if n.startswith(("pallas_tpu", "pallas_gpu")))
DENSE_ONLY = ("blocked",)


# The implementations that read decode programs' wrapped expert weights as they are
# (`glm53.runtime.weights.decode_state`: kernels.matmul.streamed.StreamedKernel, kernels.moe.expert_list.ExpertList);
# every other one gets their `unwrap()`, the plain stacked array.
READS_DECODE_WEIGHTS = ("xla_cpu_decode",)


def _plain(w):
    """A decode-wrapped weight's plain array (its `unwrap()`); any other weight as it is."""
    unwrap = getattr(w, "unwrap", None)
    return w if unwrap is None else unwrap()


def select_implementation(
    implementation: str,
    n_slots: int,
    decode_max_slots: int = DEFAULT_DECODE_MAX_SLOTS,
    backend: str | None = None,
) -> str:
    """The concrete implementation `moe_experts` runs for `implementation` and T*K = `n_slots` routed slots.

    "auto": by `backend` (default `jax.default_backend()`, see the module docstring); xla_quant / xla_cpu /
    pallas_tpu / pallas_gpu then take their decode form when n_slots <= decode_max_slots, else their prefill form. Unknown names raise
    ValueError.
    """
    name = dispatch.resolve("moe_experts", implementation, IMPLEMENTATIONS, _AUTO, backend, AUTO_DIFFERENTIABLE)
    if name in _BY_SLOTS:
        name += "_decode" if n_slots <= decode_max_slots else "_prefill"
    return name


def moe_experts(
    x_td: jnp.ndarray,
    topk_ids_tk: jnp.ndarray,
    topk_w_tk: jnp.ndarray,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
    *,
    implementation: str = "reference",
    decode_max_slots: int = DEFAULT_DECODE_MAX_SLOTS,
) -> jnp.ndarray:
    """y[t] = sum_k topk_w[t, k] * down_e(clamped_swiglu(x[t] gate_e, x[t] up_e)), e = topk_ids[t, k].

    Args:
      x_td: tokens [T, D] (model dtype).
      topk_ids_tk: int [T, K] expert ids in [0, E]; E marks an empty slot (contributes zero).
      topk_w_tk: [T, K] routing weights (applied in f32).
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] expert weights: arrays or QuantizedExperts of these kernel
        shapes (only ``.shape`` is read outside the matmuls).
      swiglu_limit: the SwiGLU clamp L (gate: min(a, L); up: clip(b, -L, L)).
      implementation: one of IMPLEMENTATIONS (module docstring).
      decode_max_slots: T*K up to which "auto" / "xla_quant" / "xla_cpu" / "pallas_tpu" / "pallas_gpu" take their
        decode form.
    Returns:
      [T, D] in x's dtype.
    """
    if len(x_td.shape) != 2:
        raise ValueError(f"moe_experts: x_td must be [T, D], got shape {tuple(x_td.shape)}")
    t, d = x_td.shape
    if len(topk_ids_tk.shape) != 2 or topk_ids_tk.shape[0] != t:
        raise ValueError(f"moe_experts: topk_ids_tk must be [T={t}, K], got shape {tuple(topk_ids_tk.shape)}")
    if tuple(topk_w_tk.shape) != tuple(topk_ids_tk.shape):
        raise ValueError(
            f"moe_experts: topk_w_tk shape {tuple(topk_w_tk.shape)} != topk_ids_tk shape {tuple(topk_ids_tk.shape)}"
        )
    if not jnp.issubdtype(topk_ids_tk.dtype, jnp.integer):
        raise ValueError(f"moe_experts: topk_ids_tk must be integer, got {topk_ids_tk.dtype}")
    if len(w_gate.shape) != 3 or w_gate.shape[1] != d:
        raise ValueError(f"moe_experts: w_gate must be [E, D={d}, F], got shape {tuple(w_gate.shape)}")
    e, _, f = w_gate.shape
    for arg, w, want in (("w_up", w_up, (e, d, f)), ("w_down", w_down, (e, f, d))):
        if tuple(w.shape) != want:
            raise ValueError(
                f"moe_experts: {arg} must be {want} to match w_gate {tuple(w_gate.shape)}, "
                f"got {tuple(w.shape)}"
            )
    if not swiglu_limit > 0:
        raise ValueError(f"moe_experts: swiglu_limit must be > 0, got {swiglu_limit}")
    name = select_implementation(implementation, t * topk_ids_tk.shape[1], decode_max_slots)
    if name not in READS_DECODE_WEIGHTS:  # decode-wrapped weights (StreamedKernel, ExpertList) as plain arrays
        w_gate, w_up, w_down = (_plain(w) for w in (w_gate, w_up, w_down))
    args = (x_td, topk_ids_tk, topk_w_tk, w_gate, w_up, w_down, swiglu_limit)
    return dispatch.run("moe_experts", implementation, name, _IMPLEMENTATIONS, *args)
