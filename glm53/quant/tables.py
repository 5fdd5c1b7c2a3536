"""Codebooks of the llama.cpp i-quants as numpy constants, read from gguf-py at import time.

The source of truth is gguf-py's `gguf.quants` (the grids it decodes from its hex strings, its `ksigns` and
`kvalues`); this module only re-expresses them in forms that decode cheaply:

- `GRIDS[name]`: uint8 [n_entries, entry_len] coordinate magnitudes (entry_len 8 for IQ2_*, 4 for IQ3_*).
- `GRID_WORDS[name]`: uint32 [n_entries, entry_len // 4]: the same bytes packed little-endian four to a word,
  as llama.cpp stores them (byte j of word w is coordinate 4 w + j).
- `GRID_CODES[name]`: uint32 [n_entries]: each coordinate replaced by its level index into `GRID_LEVELS[name]`,
  packed `bits` bits per coordinate (2 for IQ2_*, 3 for IQ3_*), coordinate j at bit `bits * j`.
- `KSIGNS`: uint8 [128]: the 7-bit sign index -> 8 sign bits (bit 7 is the parity of the other seven).
- `KVALUES_IQ4NL`: int8 [16]: the IQ4_NL / IQ4_XS non-linear levels; `KVALUES_IQ4NL_WORDS`: the same 16 bytes
  as 4 little-endian uint32 words.
"""

from __future__ import annotations

import numpy as np
from gguf import quants as _q

IQ_GRID_FORMATS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def _grid_u8(cls) -> np.ndarray:
    cls.init_grid()  # gguf-py decodes its hex grid lazily into a float32 [1, 1, n, entry_len] array
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    out = grid.astype(np.uint8)
    if not np.array_equal(out.astype(np.float32), grid):  # pragma: no cover - guards a gguf-py change
        raise AssertionError(f"gguf-py {cls.__name__} grid is not a byte table")
    return out


def _levels(grid: np.ndarray) -> np.ndarray:
    return np.unique(grid).astype(np.uint8)


def _pack_words(grid: np.ndarray) -> np.ndarray:
    """uint8 [n, 4 k] -> uint32 [n, k], little-endian bytes."""
    return np.ascontiguousarray(grid).view("<u4").astype(np.uint32)


def _pack_codes(grid: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, int]:
    bits = max(1, int(np.ceil(np.log2(len(levels)))))
    codes = np.searchsorted(levels, grid).astype(np.uint32)  # [n, entry_len]
    shifts = (bits * np.arange(grid.shape[1], dtype=np.uint32))[None, :]
    return np.bitwise_or.reduce(codes << shifts, axis=1).astype(np.uint32), bits


_CLASSES = {
    "IQ2_XXS": _q.IQ2_XXS,
    "IQ2_XS": _q.IQ2_XS,
    "IQ2_S": _q.IQ2_S,
    "IQ3_XXS": _q.IQ3_XXS,
    "IQ3_S": _q.IQ3_S,
}

GRIDS: dict[str, np.ndarray] = {name: _grid_u8(cls) for name, cls in _CLASSES.items()}
GRID_WORDS: dict[str, np.ndarray] = {name: _pack_words(g) for name, g in GRIDS.items()}
GRID_LEVELS: dict[str, np.ndarray] = {name: _levels(g) for name, g in GRIDS.items()}
GRID_CODES: dict[str, np.ndarray] = {}
GRID_CODE_BITS: dict[str, int] = {}
for _name, _g in GRIDS.items():
    GRID_CODES[_name], GRID_CODE_BITS[_name] = _pack_codes(_g, GRID_LEVELS[_name])

KSIGNS: np.ndarray = np.frombuffer(_q.IQ2_XXS.ksigns, dtype=np.uint8).copy()  # [128]
KVALUES_IQ4NL: np.ndarray = np.asarray(_q.IQ4_NL.kvalues, dtype=np.int8)  # [16]
KVALUES_IQ4NL_WORDS: np.ndarray = KVALUES_IQ4NL.view(np.uint8).copy().view("<u4").astype(np.uint32)  # [4]

for _g in GRIDS.values():
    _g.setflags(write=False)
for _d in (GRID_WORDS, GRID_CODES):
    for _a in _d.values():
        _a.setflags(write=False)
KSIGNS.setflags(write=False)
KVALUES_IQ4NL.setflags(write=False)
KVALUES_IQ4NL_WORDS.setflags(write=False)
