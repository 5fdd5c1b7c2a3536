"""One decode token of the KDA recurrence in a C++ kernel for XLA:CPU (`jax.ffi`, csrc/recurrent.cc).

`kernels.kda.xla_cpu.recurrent_kda` writes the T = 1 step as passes over the [B, H, dk, dv] f32 state (the
fresh-stream select, the decay, k^T S, the rank-1 update, q^T S), which XLA:CPU runs as separate loops. The
kernel makes two passes per (stream, head) while its rows are in L1, zeros the state of streams that are not
`live` itself, and writes the new state over the old (`input_output_aliases`: in place when the caller donates
it). Same math, f32, a fixed order per stream (the other streams change nothing).

Built on first use (kernels/ffi_build.py), registered as the CPU FFI target "glm53_kda_step"; GLM53_KDA_FFI=0
turns it off (read when a program is traced). Callers put it in a `lax.platform_dependent`, so programs lowered
for other platforms keep the XLA form.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import ffi_build

ENV = "GLM53_KDA_FFI"
TARGET = "glm53_kda_step"
SOURCE = Path(__file__).parent / "csrc" / "recurrent.cc"
KERNEL = ffi_build.Kernel(SOURCE, "Glm53KdaStep", TARGET, ENV, "CPU KDA step kernel")


def available() -> bool:
    """True when the kernel is enabled and built (builds it on the first call; warns once when it cannot)."""
    return KERNEL.available()


def step(q, k, v, g, beta, live, state, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """(o [B, H, dv], new state [B, H, dk, dv]) for f32 q, k, g [B, H, dk], v [B, H, dv], beta [B, H], live bool
    [B] (False: that stream's state is taken as zeros) and state [B, H, dk, dv]: the T = 1 recurrence. Needs
    `available()`; runs on the CPU only."""
    if not available():
        raise NotImplementedError(f"the KDA step kernel is unavailable ({KERNEL.load() or 'disabled'})")
    b, h, dk, dv = state.shape
    out = (jax.ShapeDtypeStruct((b, h, dv), jnp.float32), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential", input_output_aliases={6: 1})
    args = [a.astype(jnp.float32) for a in (q, k, v, g, beta)]
    return call(*args, live.astype(jnp.int32), state.astype(jnp.float32), scale=np.float32(scale))
