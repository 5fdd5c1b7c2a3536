"""Few-row f32 matmuls in a C++ kernel for XLA:CPU (`jax.ffi`): y[i, t] = x[i or 0, t] @ W[ids[i]].

XLA:CPU runs a [T, K] x [K, N] dot with T > 1 as an Eigen GEMM, which packs the weight matrix before
multiplying. A decode step reads every weight once, from memory, so the packing is extra traffic: on glm53-mini
an 8-row dense MLP layer cost 3.6x a 1-row one with its weights out of cache (226 vs 62 us per layer, 35 layers'
weights in turn), against 1.4x with them in cache. `csrc/rowmm.cc` reads each weight once, row by row, into the
accumulators of up to 8 tokens (in L1), so 8 rows cost about what 1 row does. Each output element is one chain
of fused multiply-adds in ascending k: a row's result does not depend on the other rows in the call.

Built on first use (kernels/ffi_build.py) and registered as the CPU FFI target "glm53_rowmm". No compiler or a
failed build: one warning, and `available()` is False (callers take jnp.matmul). GLM53_MATMUL_FFI=0 turns it off;
GLM53_MATMUL_FFI_THREADS sets its threads (default 1: XLA:CPU already runs independent ops of a step on its
own threads, and a second kernel thread measured no faster on 2 cores; calls under 1M weights always run on one
thread). Both are read when a program is traced.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import ffi_build

ENV = "GLM53_MATMUL_FFI"
ENV_THREADS = "GLM53_MATMUL_FFI_THREADS"
TARGET = "glm53_rowmm"
SOURCE = Path(__file__).parent / "csrc" / "rowmm.cc"
KERNEL = ffi_build.Kernel(SOURCE, "Glm53RowMatmul", TARGET, ENV, "CPU few-row matmul kernel")


def enabled() -> bool:
    """False when $GLM53_MATMUL_FFI is 0 / false / off / no."""
    return KERNEL.enabled()


def available() -> bool:
    """True when the kernel is enabled and built (builds it on the first call; warns once when it cannot)."""
    return KERNEL.available()


def row_matmul(x: jax.Array, ids: jax.Array, w: jax.Array, threads: int | None = None) -> jax.Array:
    """f32 [n, T, N]: y[i, t] = x[i or 0, t] @ w[ids[i]] for x f32 [1 or n, T, K], ids int [n], w f32 [E, K, N]
    (an id outside [0, E) gives zeros). Needs `available()`; runs on the CPU only."""
    n = ids.shape[0]
    if w.ndim != 3 or x.ndim != 3 or x.shape[0] not in (1, n) or x.shape[2] != w.shape[1]:
        raise ValueError(f"row_matmul: x [1 or {n}, T, K] and w [E, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise TypeError(f"row_matmul: f32 operands only, got x {x.dtype}, w {w.dtype}")
    if not available():
        raise NotImplementedError(f"row_matmul: the kernel is unavailable ({KERNEL.load() or 'disabled'})")
    out = jax.ShapeDtypeStruct((n, x.shape[1], w.shape[2]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    t = ffi_build.threads(ENV_THREADS, 1) if threads is None else threads
    return call(x, ids.astype(jnp.int32), w, threads=np.int64(t))
