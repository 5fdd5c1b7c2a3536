"""Build glm53's C++ `jax.ffi` kernels for XLA:CPU on first use and register them (kernels/moe/cpu_ffi.py,
kernels/matmul/cpu_ffi.py).

A kernel's source is compiled with the system C++ compiler ($CXX, else c++) and `FLAGS` (-march=native: the
build is for this machine) into a per-user cache ($XDG_CACHE_HOME or ~/.cache, then glm53/ffi/), named by a hash
of the source, the shared headers in kernels/csrc/ (the thread pool), the flags, the compiler and the jax
version. The library is written to a temporary name, then renamed: a concurrent builder sees nothing or a whole
library. `load` returns None once the target is registered, else the reason it could not be (no compiler, a
failed build): callers then warn once and take their XLA path.
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

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
INCLUDE = Path(__file__).parent / "csrc"  # headers shared by the kernels (pool.h)


def threads(env: str, default: int | None = None) -> int:
    """The kernel threads: $`env` (a positive integer, else ValueError naming it), else `default` (None:
    min(2, cores))."""
    v = os.environ.get(env, "").strip()
    if not v:
        return max(1, min(2, os.cpu_count() or 1)) if default is None else default
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"${env} must be a positive integer, got {v!r}")
    return n


def enabled(env: str) -> bool:
    """False when $`env` is 0 / false / off / no (kernels read it when a program is traced)."""
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "glm53" / "ffi"


def compiler() -> str | None:
    """The C++ compiler's path ($CXX, else c++), None when there is none."""
    return shutil.which(os.environ.get("CXX") or "c++")


def library_path(cxx: str, source: Path) -> Path:
    """Where the library built from `source` by `cxx` (with these flags, headers and jax) lives in the cache."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    parts = [source.read_bytes(), *(p.read_bytes() for p in sorted(INCLUDE.glob("*.h")))]
    for part in (*parts, " ".join(FLAGS).encode(), version.encode(), jax.__version__.encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"{source.stem}-{h.hexdigest()[:20]}.so"


def build(cxx: str, source: Path, out: Path) -> None:
    """Compiles `source` into `out` (RuntimeError with the compiler's output on failure; nothing left behind)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{INCLUDE}", f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder either sees nothing or a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, symbol: str, target: str) -> str | None:
    """Builds `source` (once per cache key) and registers its handler `symbol` as the CPU FFI target `target`;
    None when registered, else the reason it is not."""
    cxx = compiler()
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not found)"
    try:
        path = library_path(cxx, source)
        if not path.exists():
            build(cxx, source, path)
        lib = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any build / load failure means: use the XLA path
        return f"{type(e).__name__}: {e}"
    return None


class Kernel:
    """One C++ kernel: its source, handler symbol, FFI target and on/off switch ($env, read at trace time).

    `available()` builds and registers it on the first call (`load`, cached) and warns once per reason when it
    cannot; callers then take their XLA path."""

    def __init__(self, source: Path, symbol: str, target: str, env: str, what: str):
        self.source, self.symbol, self.target, self.env, self.what = source, symbol, target, env, what

    def enabled(self) -> bool:
        return enabled(self.env)

    @functools.cache  # noqa: B019 - one Kernel per module, alive for the process
    def load(self) -> str | None:
        """None once built and registered, else why not (cached: a process builds at most once)."""
        return load(self.source, self.symbol, self.target)

    def available(self) -> bool:
        if not self.enabled():
            return False
        reason = self.load()
        if reason is not None:
            self.warn(reason)
        return reason is None

    @functools.cache  # noqa: B019
    def warn(self, reason: str) -> None:
        warnings.warn(f"glm53: the {self.what} ({self.source.name}) is unavailable, using the XLA path: {reason}",
                      RuntimeWarning, stacklevel=4)  # fmt: skip
