"""Routed-expert matvecs from quantized planes in a C++ kernel for XLA:CPU (`jax.ffi`), for the decode form.

XLA:CPU does not fuse a dequantization into a dot, so the plain-XLA decode (`kernels.moe.xla_cpu`) writes every
routed expert's weights out in f32 and reads them back for the matmul. `csrc/qmatvec.cc` instead decodes a tile
of 16 output rows one block at a time into an L1-sized buffer (vectorized over the rows, the planes' lane axis)
and multiplies it straight into the tokens' f32 accumulators: y[i, t, :] = W_{ids[i]} x[i or 0, t, :] for the n
experts `ids` (ids outside [0, E): zeros), from the full [E, words, rows] planes (no gather). Values are decoded
exactly as `glm53.quant.dequant` / `reencode` do; accumulation is f32 in a fixed order.

Formats (`FORMAT_CODES`, from `glm53.quant.registry`): IQ2_S, IQ3_S, IQ4_XS, Q8_0, Q4_K ("planes" layout) and
IQ2_S_R, IQ3_S_R ("reencoded"), any block splits. Anything else stays on the XLA path.

The source is compiled on first use (kernels/ffi_build.py: the system C++ compiler, a per-user cache keyed by
a hash of the source, flags, compiler and jax version) and registered as the CPU FFI target "glm53_qmatvec".
No compiler or a failed build: one warning, and `available()` is False (the XLA path runs).
GLM53_MOE_FFI=0 turns the kernel off; GLM53_MOE_FFI_THREADS sets its threads (default min(2, cores); the
kernel's worker pool is sized by the first call in a process). Both are read when a program is traced.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from glm53.quant import registry, tables
from glm53.quant.planes import Planes
from kernels import ffi_build

ENV = "GLM53_MOE_FFI"
ENV_THREADS = "GLM53_MOE_FFI_THREADS"
TARGET = "glm53_qmatvec"
SOURCE = Path(__file__).parent / "csrc" / "qmatvec.cc"
# format (the planes' block format name) -> the kernel's format code: the registry's (backend "cpu_ffi"); the C++
# `enum Format` must match (tests/test_expert_formats.py reads it from the source)
FORMAT_CODES = registry.cpu_codes()
_TABLES = {"IQ2_S": tables.GRID_WORDS["IQ2_S"], "IQ3_S": tables.GRID_WORDS["IQ3_S"]}  # grid words per entry


KERNEL = ffi_build.Kernel(SOURCE, "Glm53QMatvec", TARGET, ENV, "CPU quantized-expert kernel")


def enabled() -> bool:
    """False when $GLM53_MOE_FFI is 0 / false / off / no (read at trace time)."""
    return KERNEL.enabled()


def default_threads() -> int:
    """$GLM53_MOE_FFI_THREADS, else min(2, cores)."""
    return ffi_build.threads(ENV_THREADS)


def _cache_dir() -> Path:
    return ffi_build.cache_dir()


def _compiler() -> str | None:
    return ffi_build.compiler()


def library_path(cxx: str) -> Path:
    """Where the built kernel for this source, compiler, flags and jax version lives in the cache."""
    return ffi_build.library_path(cxx, SOURCE)


def _build(cxx: str, out: Path) -> None:
    ffi_build.build(cxx, SOURCE, out)


def available() -> bool:
    """True when the kernel is enabled and built (builds it on the first call; warns once when it cannot)."""
    return KERNEL.available()


def unsupported_reason(planes: Planes) -> str | None:
    """None when the kernel decodes these planes, else why not."""
    if planes.fmt.name not in FORMAT_CODES:
        return f"format {planes.fmt.name} (the CPU kernel decodes {sorted(FORMAT_CODES)})"
    if len(planes.lead_shape) != 1:
        return f"planes with leading axes {planes.lead_shape} (one expert axis expected)"
    return None


def qmatvec(x: jax.Array, ids: jax.Array, planes: Planes, threads: int | None = None) -> jax.Array:
    """f32 [n, T, rows]: y[i, t] = W_{ids[i]} @ x[i or 0, t] for x f32 [1 or n, T, cols], ids int [n].

    W is expert ids[i] of `planes` ([E, words, rows] planes of one of FORMAT_CODES); an id outside [0, E)
    gives zeros. Needs `available()`.
    """
    reason = unsupported_reason(planes)
    if reason is not None:
        raise NotImplementedError(reason)
    if not available():  # also registers the target (a process that never asked would get NOT_FOUND)
        raise NotImplementedError(f"qmatvec: the kernel is unavailable ({KERNEL.load() or 'disabled'})")
    n = ids.shape[0]
    if x.ndim != 3 or x.shape[0] not in (1, n) or x.shape[2] != planes.cols:
        raise ValueError(f"qmatvec: x must be [1 or {n}, T, {planes.cols}], got {tuple(x.shape)}")
    fields = [planes.fields[fd.name] for fd in planes.fmt.fields]
    if planes.fmt.name in _TABLES:
        fields.append(jnp.asarray(np.ascontiguousarray(_TABLES[planes.fmt.name]).reshape(-1)))
    out = jax.ShapeDtypeStruct((n, x.shape[1], planes.rows), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(
        x.astype(jnp.float32),
        ids.astype(jnp.int32),
        *fields,
        fmt=np.int64(FORMAT_CODES[planes.fmt.name]),
        rows=np.int64(planes.rows),
        cols=np.int64(planes.cols),
        splits=np.int64(planes.block_splits),
        threads=np.int64(default_threads() if threads is None else threads),
    )
