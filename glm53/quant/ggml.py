"""ctypes bindings to ggml's own quantizers and dequantizers (the shared libraries bundled with llama-cpp-python).

`quantize` runs `ggml_quantize_chunk` (llama.cpp's reference quantizer, the one `llama-quantize` uses) on f32
rows; `dequantize_row` runs the type's `to_float` from `ggml_get_type_traits` (`dequantize_row_*`,
`ggml_fp16_to_fp32_row`, ...). Both are independent references for glm53's JAX decoders and the basis of the
GGUF quantization tooling. The library is found next to the installed `llama_cpp` package (not imported: that
would load libllama), or in the directory named by $GLM53_GGML_LIB_DIR.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from glm53.quant.formats import QuantFormat, get_format

LIB_DIR_ENV = "GLM53_GGML_LIB_DIR"
_LIB_NAME = "libggml-base.so"


class GgmlUnavailableError(RuntimeError):
    """ggml's shared library could not be found or loaded."""


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# void (*ggml_to_float_t)(const void * x, float * y, int64_t k)
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def lib_dir() -> str:
    """Directory holding libggml-base.so: $GLM53_GGML_LIB_DIR, else llama_cpp/lib of the installed package."""
    env = os.environ.get(LIB_DIR_ENV)
    if env:
        return env
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlUnavailableError(
            f"llama-cpp-python is not installed and ${LIB_DIR_ENV} is not set: cannot find {_LIB_NAME} "
            "(pip install llama-cpp-python==0.3.36)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


@functools.cache
def _lib() -> ctypes.CDLL:
    path = os.path.join(lib_dir(), _LIB_NAME)
    if not os.path.exists(path):
        raise GgmlUnavailableError(f"ggml library not found: {path} (set ${LIB_DIR_ENV} to its directory)")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise GgmlUnavailableError(f"cannot load ggml library {path}: {e}") from e
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def available() -> bool:
    """True when ggml's library loads."""
    try:
        _lib()
    except GgmlUnavailableError:
        return False
    return True


def _gguf_format(fmt: str | int | QuantFormat) -> QuantFormat:
    f = fmt if isinstance(fmt, QuantFormat) else get_format(fmt)
    if f.ggml_type is None:
        raise ValueError(f"{f.name} is not a GGML type; ggml cannot (de)quantize it")
    return f


@functools.cache
def _traits(ggml_type: int) -> tuple[_TypeTraits, object]:
    t = _lib().ggml_get_type_traits(ggml_type).contents
    f = get_format(ggml_type)
    if (t.blck_size, t.type_size) != (f.block_size, f.type_size):  # pragma: no cover - ABI guard
        raise GgmlUnavailableError(
            f"ggml type {ggml_type} ({t.type_name!r}) reports block {t.blck_size}/{t.type_size} bytes, expected "
            f"{f.block_size}/{f.type_size}: ggml ABI mismatch"
        )
    if not t.to_float:  # F32: ggml copies rows as they are
        return t, lambda src, dst, n: ctypes.memmove(dst, src, 4 * n)
    return t, _TO_FLOAT(t.to_float)


def requires_imatrix(fmt: str | int | QuantFormat) -> bool:
    """Whether ggml refuses to quantize to this type without an importance matrix."""
    return bool(_lib().ggml_quantize_requires_imatrix(_gguf_format(fmt).ggml_type))


def quantize(
    rows: np.ndarray,
    fmt: str | int | QuantFormat,
    imatrix: np.ndarray | None = None,
    *,
    threads: int | None = None,
) -> bytes:
    """Quantizes f32 rows [n, k] to `fmt` with llama.cpp's quantizer; returns the n * row_bytes GGUF bytes.

    `imatrix` is the per-column importance [k]; types that ggml says require one (IQ2_XXS, IQ2_XS) get an
    all-ones matrix when it is None. Rows are split over `threads` workers (default: all CPUs).
    """
    f = _gguf_format(fmt)
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize({f.name}): rows must be 2-D [n, k], got shape {x.shape}")
    n, k = x.shape
    if k % f.block_size:
        raise ValueError(
            f"quantize({f.name}): row length {k} is not a multiple of the block size {f.block_size}"
        )
    if not np.isfinite(x).all():  # llama.cpp's i-quant searches abort the process on NaN/inf
        raise ValueError(f"quantize({f.name}): rows contain NaN or inf")
    if imatrix is None and requires_imatrix(f):
        imatrix = np.ones(k, np.float32)
    im = None
    if imatrix is not None:
        im = np.ascontiguousarray(imatrix, dtype=np.float32)
        if im.shape != (k,):
            raise ValueError(f"quantize({f.name}): imatrix must have shape ({k},), got {im.shape}")
    row_bytes = f.nbytes(k)
    out = np.zeros(n * row_bytes, np.uint8)
    lib = _lib()
    lib.ggml_quantize_init(f.ggml_type)  # thread-safe; done once up front so workers only read the tables
    im_ptr = None if im is None else im.ctypes.data

    def run(r0: int, r1: int) -> int:
        # ggml_quantize_chunk addresses src + start and dst + start_row * row_size itself.
        return lib.ggml_quantize_chunk(
            f.ggml_type, x.ctypes.data, out.ctypes.data, r0 * k, r1 - r0, k, im_ptr
        )

    workers = max(1, min(threads or os.cpu_count() or 1, n))
    bounds = np.linspace(0, n, workers + 1).astype(int)
    with ThreadPoolExecutor(workers) as pool:  # ctypes releases the GIL during the call
        written = sum(pool.map(run, bounds[:-1], bounds[1:]))
    if written != n * row_bytes:  # pragma: no cover - would mean an ABI mismatch
        raise RuntimeError(f"ggml_quantize_chunk({f.name}) wrote {written} bytes, expected {n * row_bytes}")
    return out.tobytes()


def dequantize_row(fmt: str | int | QuantFormat, data: bytes | np.ndarray, n: int) -> np.ndarray:
    """Decodes the first `n` weights of `data` (GGUF bytes of `fmt`) with ggml's to_float; returns f32 [n].

    F32 has no to_float in ggml (its rows are used as they are); it is copied.
    """
    f = _gguf_format(fmt)
    src = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(data, bytes | bytearray) else data)
    src = src.view(np.uint8).reshape(-1)
    need = f.nbytes(n)
    if src.size < need:
        raise ValueError(f"dequantize_row({f.name}): {n} weights need {need} bytes, got {src.size}")
    out = np.empty(n, np.float32)
    _traits(f.ggml_type)[1](src.ctypes.data, out.ctypes.data, n)
    return out


def dequantize_row_fn(fmt: str | int | QuantFormat):
    """The raw ggml to_float function of `fmt`, called as fn(src_ptr, dst_ptr, n) (for benchmarks)."""
    return _traits(_gguf_format(fmt).ggml_type)[1]
