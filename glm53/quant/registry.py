"""The expert-format registry: one entry per block format, the single home of what a format is and who runs it.

An entry holds the format's block bytes and named fields (llama.cpp memory order, `ggml-common.h`; for the
re-encoded gather-free layouts, glm53's own), the GGUF format its bytes come from, its plane layout (derived:
`glm53.quant.planes` turns every field into one uint32 plane; 2-byte fields are stored two blocks to a word), a
one-line reference of its decode math, and the set of backends that implement it. Everything else reads from
here: `glm53.quant.formats` builds its `QuantFormat`s from the entries, the jnp dequantizers and every kernel
backend take their supported sets from `formats_for(backend)`, the CPU kernel its format codes from
`cpu_codes()`, and the README / docs/quantization.md support matrix is `support_matrix_markdown()`
(`python -m glm53.quant.registry` prints it). tests/test_expert_formats.py checks that each backend's decoder
table names exactly the registry's formats and runs one shared test body over every (backend, format) pair.

Adding a format: one `Entry` below (and the backends it names must then have a decoder for it; the test says
which is missing). This module imports nothing from glm53 (formats.py imports it).
"""

from __future__ import annotations

import dataclasses

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# backend name -> where it lives and what it is (the support matrix's columns, in this order)
BACKENDS: dict[str, str] = {
    "jnp": "glm53/quant/dequant.py, reencode.py: jnp dequantizers (XLA paths: reference, xla_quant, xla_cpu)",
    "cpu_ffi": "kernels/moe/cpu_ffi.py + csrc/qmatvec.cc: C++ matvec for XLA:CPU (decode)",
    "pallas_tpu": "kernels/moe/pallas_common.py decoders in pallas_tpu_decode.py / pallas_tpu_prefill.py",
    "pallas_gpu": "kernels/moe/pallas_gpu.py: Mosaic GPU CUDA-core decoders (decode, f32 prefill)",
    "pallas_gpu_wgmma": "kernels/moe/pallas_gpu_wgmma.py: Mosaic GPU tensor-core prefill (bf16)",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One block format. `fields` are (name, bytes) in memory order; a block of `block_size` weights."""

    name: str  # "IQ2_S", "Q4_K", "IQ2_S_R", ...
    block_size: int  # weights per block
    fields: tuple[tuple[str, int], ...]
    decode: str  # the decode math, one line (the code: glm53.quant.dequant._dec_<name> / reencode)
    backends: frozenset[str]
    source: str | None = None  # the GGUF format a re-encoded layout is made from (None: a GGUF type itself)
    codebook: bool = False  # decoding looks a grid table up (the kernels then need a gather or a lookup)
    cpu_code: int | None = None  # the C++ kernel's `enum Format` value (cpu_ffi backend only)

    @property
    def gguf(self) -> bool:
        """True for a GGUF type (its bytes are a GGUF tensor's), False for a re-encoded layout."""
        return self.source is None

    @property
    def ggml_type(self) -> int | None:
        return int(GGMLQuantizationType[self.name]) if self.gguf else None

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return sum(n for _, n in self.fields)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    @property
    def dense(self) -> bool:
        """An unquantized float format (one weight per "block")."""
        return self.block_size == 1

    @property
    def plane_layout(self) -> tuple[tuple[str, str], ...]:
        """(field, its plane) per field: "k words/block" for a multiple-of-4 field, "paired" for a 2-byte one
        (two blocks to a uint32 word), as `glm53.quant.planes.pack_planes` stores it."""
        return tuple(
            (f, "paired" if n == 2 else f"{n // 4} words/block" if n % 4 == 0 else "not packable")
            for f, n in self.fields
        )


def _e(name, block_size, fields, decode, backends, **kw) -> Entry:
    return Entry(name, block_size, tuple(fields), decode, frozenset(backends.split()), **kw)


_QK = 256  # super-block of the K- and i-quants
_ALL_GPU = "jnp pallas_tpu pallas_gpu"

ENTRIES: tuple[Entry, ...] = (
    # ------------------------------------------------------------------------------------------- floats
    _e("F32", 1, [("w", 4)], "w", _ALL_GPU),
    _e("F16", 1, [("w", 2)], "f16(w)", _ALL_GPU),
    _e("BF16", 1, [("w", 2)], "bf16(w)", _ALL_GPU + " pallas_gpu_wgmma"),
    # ----------------------------------------------------------------------------------- simple quants
    _e("Q4_0", 32, [("d", 2), ("qs", 16)], "d * (q4 - 8)", "jnp"),
    _e("Q8_0", 32, [("d", 2), ("qs", 32)], "d * int8(q)", "jnp cpu_ffi pallas_gpu pallas_gpu_wgmma", cpu_code=6),
    _e("IQ4_NL", 32, [("d", 2), ("qs", 16)], "d * kvalues_iq4nl[q4]", "jnp"),
    # ----------------------------------------------------------------------------------------- K-quants
    _e("Q2_K", _QK, [("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)], "d * sc4 * q2 - dmin * m4", "jnp"),
    _e(
        "Q3_K", _QK, [("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)],
        "d * (sc6 - 32) * (q2 - 4 * !hbit)", "jnp",
    ),
    _e(
        "Q4_K", _QK, [("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)], "d * sc6 * q4 - dmin * m6",
        "jnp cpu_ffi pallas_tpu pallas_gpu pallas_gpu_wgmma", cpu_code=7,
    ),
    _e(
        "Q5_K", _QK, [("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)],
        "d * sc6 * (q4 + 16 hbit) - dmin * m6", "jnp",
    ),
    _e("Q6_K", _QK, [("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)], "d * int8(sc) * (q6 - 32)", "jnp"),
    # ---------------------------------------------------------------------------------------- i-quants
    _e(
        "IQ2_XXS", _QK, [("d", 2), ("qs", 64)], "d * (0.5 + s4) / 4 * grid[q8] * ksigns[s7]", "jnp",
        codebook=True,
    ),
    _e(
        "IQ2_XS", _QK, [("d", 2), ("qs", 64), ("scales", 8)], "d * (0.5 + s4) / 4 * grid[q9] * ksigns[s7]",
        "jnp", codebook=True,
    ),
    # qs holds 32 grid-index low bytes, `signs` the 32 sign bytes that follow them in llama.cpp's qs[64]
    _e(
        "IQ2_S", _QK, [("d", 2), ("qs", 32), ("signs", 32), ("qh", 8), ("scales", 8)],
        "d * (0.5 + s4) / 4 * grid[q10] * sign", "jnp cpu_ffi pallas_tpu", codebook=True, cpu_code=1,
    ),
    _e(
        "IQ3_XXS", _QK, [("d", 2), ("qs", 64), ("scales_signs", 32)],
        "d * (0.5 + s4) / 2 * grid[q8] * ksigns[s7]", "jnp", codebook=True,
    ),
    _e(
        "IQ3_S", _QK, [("d", 2), ("qs", 64), ("qh", 8), ("signs", 32), ("scales", 4)],
        "d * (1 + 2 s4) * grid[q9] * sign", "jnp cpu_ffi pallas_tpu", codebook=True, cpu_code=2,
    ),
    _e(
        "IQ4_XS", _QK, [("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)],
        "d * (sc6 - 32) * kvalues_iq4nl[q4]", "jnp cpu_ffi pallas_tpu pallas_gpu pallas_gpu_wgmma", cpu_code=5,
    ),
    # ------------------------------------------------------------- re-encoded (gather-free, glm53.quant.reencode)
    _e(
        "IQ2_S_R", _QK, [("d", 2), ("scales", 8), ("signs", 32), ("levels", 64)],
        "d * (0.5 + s4) / 4 * (8, 25, 43)[q2] * sign", "jnp cpu_ffi pallas_tpu pallas_gpu pallas_gpu_wgmma",
        source="IQ2_S", cpu_code=3,
    ),
    _e(
        "IQ3_S_R", _QK, [("d", 2), ("scales", 4), ("codes", 128)], "d * (1 + 2 s4) * (2 q4 - 15)",
        "jnp cpu_ffi pallas_tpu pallas_gpu pallas_gpu_wgmma", source="IQ3_S", cpu_code=4,
    ),
)  # fmt: skip

REGISTRY: dict[str, Entry] = {e.name: e for e in ENTRIES}


def _check() -> None:
    """Consistency of the table itself (import time): GGUF sizes, backend names, unique CPU codes."""
    for e in ENTRIES:
        if e.gguf:
            want = GGML_QUANT_SIZES[GGMLQuantizationType[e.name]]
            if want != (e.block_size, e.type_size):  # pragma: no cover - consistency guard
                raise AssertionError(f"{e.name}: layout {(e.block_size, e.type_size)} != gguf {want}")
        elif e.source not in REGISTRY or not REGISTRY[e.source].gguf:  # pragma: no cover
            raise AssertionError(f"{e.name}: source {e.source!r} is not a GGUF entry")
        if not e.backends <= set(BACKENDS) or "jnp" not in e.backends:  # pragma: no cover
            raise AssertionError(f"{e.name}: backends {sorted(e.backends)} (known: {list(BACKENDS)}; jnp needed)")
        if (e.cpu_code is None) == ("cpu_ffi" in e.backends):  # pragma: no cover
            raise AssertionError(f"{e.name}: a cpu_code exactly when cpu_ffi implements it")
    codes = [e.cpu_code for e in ENTRIES if e.cpu_code is not None]
    if len(set(codes)) != len(codes):  # pragma: no cover
        raise AssertionError(f"duplicate CPU kernel format codes {codes}")


_check()


def entry(name: str) -> Entry:
    """The entry of a format name (case-insensitive); KeyError naming the known ones."""
    key = str(name).strip().upper()
    if key not in REGISTRY:
        raise KeyError(f"no expert format {name!r} in the registry; known: {list(REGISTRY)}")
    return REGISTRY[key]


def formats_for(backend: str) -> tuple[str, ...]:
    """The formats `backend` implements, in registry order."""
    if backend not in BACKENDS:
        raise KeyError(f"unknown backend {backend!r}; known: {list(BACKENDS)}")
    return tuple(e.name for e in ENTRIES if backend in e.backends)


def gguf_formats() -> tuple[str, ...]:
    return tuple(e.name for e in ENTRIES if e.gguf)


def reencoded_formats() -> dict[str, str]:
    """GGUF source format -> its re-encoded layout ("IQ2_S" -> "IQ2_S_R")."""
    return {e.source: e.name for e in ENTRIES if not e.gguf}


def cpu_codes() -> dict[str, int]:
    """Format -> the C++ kernel's format code (csrc/qmatvec.cc `enum Format`)."""
    return {e.name: e.cpu_code for e in ENTRIES if e.cpu_code is not None}


_MARK = {True: "yes", False: ""}


def support_matrix_markdown() -> str:
    """The support matrix (a markdown table): one row per format, one column per backend, plus block bytes."""
    head = ["format", "block (weights / bytes)", "bits/weight", "decode", *BACKENDS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in ENTRIES:
        name = f"{e.name} (from {e.source})" if e.source else e.name
        cells = [name, f"{e.block_size} / {e.type_size}", f"{e.bits_per_weight:g}", f"`{e.decode}`"]
        cells += [_MARK[b in e.backends] for b in BACKENDS]
        rows.append("| " + " | ".join(cells) + " |")
    legend = "; ".join(f"`{b}`: {what}" for b, what in BACKENDS.items())
    return "\n".join(rows) + "\n\nBackends: " + legend + ".\n"


if __name__ == "__main__":
    print(support_matrix_markdown(), end="")
