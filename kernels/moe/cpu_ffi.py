"""Routed-expert matvecs from quantized planes in a C++ kernel for XLA:CPU (`jax.ffi`), for the decode form.

XLA:CPU does not fuse a dequantization into a dot, so the plain-XLA decode (`kernels.moe.xla_cpu`) writes every
routed expert's weights out in f32 and reads them back for the matmul. `csrc/qmatvec.cc` instead decodes a tile
of 16 output rows one block at a time into an L1-sized buffer (vectorized over the rows, the planes' lane axis)
and multiplies it straight into the tokens' f32 accumulators: y[i, t, :] = W_{ids[i]} x[i or 0, t, :] for the n
experts `ids` (ids outside [0, E): zeros), from the full [E, words, rows] planes (no gather). Values are decoded
exactly as `glm53.quant.dequant` / `reencode` do; accumulation is f32 in a fixed order.

Formats: IQ2_S, IQ3_S, IQ4_XS, Q8_0, Q4_K ("planes" layout) and IQ2_S_R, IQ3_S_R ("reencoded"), any block
splits. Anything else stays on the XLA path.

The source is compiled on first use with the system C++ compiler ($CXX, else c++) into a per-user cache
($XDG_CACHE_HOME or ~/.cache, then glm53/ffi/), named by a hash of the source, the flags, the compiler and the
jax version (written to a temporary name, then renamed), and registered as the CPU FFI target
"glm53_qmatvec". No compiler or a failed build: one warning, and `available()` is False (the XLA path runs).
GLM53_MOE_FFI=0 turns the kernel off; GLM53_MOE_FFI_THREADS sets its threads (default min(2, cores); the
kernel's worker pool is sized by the first call in a process). Both are read when a program is traced.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from glm53.quant import tables
from glm53.quant.planes import Planes

ENV = "GLM53_MOE_FFI"
ENV_THREADS = "GLM53_MOE_FFI_THREADS"
TARGET = "glm53_qmatvec"
SOURCE = Path(__file__).parent / "csrc" / "qmatvec.cc"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# format (the planes' block format name) -> the kernel's format code
FORMAT_CODES = {"IQ2_S": 1, "IQ3_S": 2, "IQ2_S_R": 3, "IQ3_S_R": 4, "IQ4_XS": 5, "Q8_0": 6, "Q4_K": 7}
_TABLES = {"IQ2_S": tables.GRID_WORDS["IQ2_S"], "IQ3_S": tables.GRID_WORDS["IQ3_S"]}  # grid words per entry


def enabled() -> bool:
    """False when $GLM53_MOE_FFI is 0 / false / off / no (read at trace time)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def default_threads() -> int:
    v = os.environ.get(ENV_THREADS, "").strip()
    if v:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"${ENV_THREADS} must be a positive integer, got {v!r}") from None
        if n < 1:
            raise ValueError(f"${ENV_THREADS} must be a positive integer, got {v!r}")
        return n
    return max(1, min(2, os.cpu_count() or 1))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "glm53" / "ffi"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx)


def library_path(cxx: str) -> Path:
    """Where the built kernel for this source, compiler, flags and jax version lives in the cache."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), jax.__version__.encode()):
        h.update(part)
        h.update(b"\0")
    return _cache_dir() / f"qmatvec-{h.hexdigest()[:20]}.so"


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder either sees nothing or a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> str | None:
    """Builds (once per cache key) and registers the kernel; None when ready, else the reason it is not."""
    cxx = _compiler()
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not found)"
    try:
        path = library_path(cxx)
        if not path.exists():
            _build(cxx, path)
        lib = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.Glm53QMatvec), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any build / load failure means: use the XLA path
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """True when the kernel is enabled and built (builds it on the first call; warns once when it cannot)."""
    if not enabled():
        return False
    reason = _load()
    if reason is not None:
        _warn(reason)
    return reason is None


@functools.cache
def _warn(reason: str) -> None:
    warnings.warn(
        f"glm53: the CPU quantized-expert kernel ({SOURCE.name}) is unavailable, using the XLA path: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )


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
