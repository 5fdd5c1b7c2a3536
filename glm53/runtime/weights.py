"""Decode-time weight preparation: the state a decode program reads on the CPU (`decode_state`).

Decode programs (glm53.runtime.programs) multiply a few rows by every weight: on a CPU they stream each weight
once through the C++ row-matmul kernel (kernels/matmul/streamed.py) and read dense routed experts as arrays of
their own (kernels/moe/expert_list.py). `decode_state` wraps the model state's arrays accordingly, without a copy;
prefill and every other program read the plain state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.layers.hyper_connections import HyperConnection
from glm53.layers.linear import Linear
from glm53.layers.moe import Experts
from glm53.model import Glm53Model
from kernels.matmul import cpu_ffi as matmul_ffi
from kernels.matmul.streamed import StreamedKernel
from kernels.moe import api as moe_api
from kernels.moe import expert_list

_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


def decode_state(model: Glm53Model, state: nnx.State, tokens: int = 1) -> nnx.State:
    """`state` for decode programs on the CPU: the same arrays (no copy), some wrapped so that their few-row
    products stream the weights once.

    - Every Linear kernel and mHC projection `fn` (f32 [in, out] on one CPU device) as a `StreamedKernel` when
      the C++ row-matmul kernel is available (kernels/matmul: products with <= MAX_ROWS rows run there, larger
      ones are jnp.matmul).
    - The dense routed-expert kernels of every MoE layer that decodes `tokens` tokens (all streams of a step
      together) with the xla_cpu form (kernels.moe "xla_cpu", or "auto" on the CPU backend): `StreamedKernel`s
      (the decode form runs the row-matmul kernel over the distinct experts) when it is available, else
      `ExpertList`s (kernels/moe/expert_list.py: views of the stacked kernel; XLA:CPU copies every expert slice
      of a stacked kernel before its matmul).

    The layers of a LayerStack (scan_layers) keep their arrays: their parameters carry a leading repeat axis that
    the scan slices per layer (a per-expert view would be a copy). The state itself when nothing qualifies."""
    wrap = {}
    streamed = matmul_ffi.available()
    slots = tokens * model.cfg.num_experts_per_tok
    for path, m in nnx.iter_graph(model):
        if isinstance(m, Linear) and streamed and _on_one_cpu(m.kernel.get_value(), 2):
            wrap[(*path, "kernel")] = StreamedKernel
        if isinstance(m, HyperConnection) and streamed and _on_one_cpu(m.fn.get_value(), 2):
            wrap[(*path, "fn")] = StreamedKernel
        if not isinstance(m, Experts):
            continue
        if moe_api.select_implementation(m.implementation, slots, m.decode_max_slots) != "xla_cpu_decode":
            continue
        ws = [getattr(m, k).get_value() for k in _EXPERT_MATRICES]
        on_cpu = (isinstance(w, jax.Array) and w.ndim == 3 and {d.platform for d in w.devices()} == {"cpu"}
                  for w in ws)  # fmt: skip
        if all(on_cpu):
            split = StreamedKernel if streamed and all(_on_one_cpu(w, 3) for w in ws) else expert_list.split_experts
            wrap.update({(*path, k): split for k in _EXPERT_MATRICES})
    if not wrap:
        return state
    flat = [(p, v.replace(wrap[p](v.get_value())) if p in wrap else v) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def _on_one_cpu(w, ndim: int) -> bool:
    return (isinstance(w, jax.Array) and w.ndim == ndim and w.dtype == jnp.float32
            and len(w.devices()) == 1 and next(iter(w.devices())).platform == "cpu")  # fmt: skip
