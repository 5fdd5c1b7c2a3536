"""Token files and the deterministic, resumable packing loader.

A split is one flat token file ``NAME.bin`` (uint16 when the vocabulary fits, else uint32; native little-endian
numpy layout) holding every document followed by the EOS id, plus ``NAME.json`` (dtype, token / document counts,
vocabulary size, EOS id). `PackedLoader` memory-maps the file and cuts it into ``seq_len``-token windows
(window w = tokens [w L, (w + 1) L); the last one is padded with `pad_id` and masked). Training batch `step`
holds windows ``perm_e[k]`` for the global sample indices i = step B + j (e = i // n_windows,
k = i % n_windows), where ``perm_e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``: a
batch is a pure function of (file, seed, step), so resuming a run needs only its step number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from glm53.data.corpus import DataError
from glm53.files import atomic_write, write_json


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_token_file(
    path: str | os.PathLike, docs: Iterable[list[int]], *, eos_id: int, vocab_size: int
) -> dict:
    """Writes the documents (each followed by `eos_id`) to ``path`` (``.bin``) and its ``.json`` sidecar, both
    atomically; returns the sidecar's dict. An id outside [0, vocab_size) is a DataError."""
    path = os.fspath(path)
    dtype = token_dtype(vocab_size)
    n_tokens = n_docs = 0
    with atomic_write(path, "wb") as f:
        for ids in docs:
            a = np.asarray(list(ids) + [eos_id], dtype=np.int64)
            if a.size and (a.min() < 0 or a.max() >= vocab_size):
                raise DataError(f"{path}: document {n_docs} has a token id outside [0, {vocab_size})")
            f.write(a.astype(dtype).tobytes())
            n_tokens += a.size
            n_docs += 1
    meta = dict(dtype=dtype.name, n_tokens=n_tokens, n_docs=n_docs, vocab_size=vocab_size, eos_id=eos_id)
    write_json(_sidecar(path), meta)
    return meta


def _sidecar(path: str) -> str:
    return os.path.splitext(path)[0] + ".json"


def open_tokens(path: str | os.PathLike) -> tuple[np.ndarray, dict]:
    """(read-only memory map of the tokens, sidecar dict); DataError naming the file when missing or wrong."""
    path = os.fspath(path)
    side = _sidecar(path)
    try:
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{side}: cannot read the token file's sidecar ({e})") from None
    try:
        dtype = np.dtype(meta["dtype"])
        n = int(meta["n_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{side}: bad sidecar ({e})") from None
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such token file")
    if os.path.getsize(path) != n * dtype.itemsize:
        raise DataError(f"{path}: {os.path.getsize(path)} bytes, the sidecar says {n} tokens of {dtype.name}")
    if n == 0:
        raise DataError(f"{path}: holds no tokens")
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)), meta


class PackedLoader:
    """Batches of ``seq_len``-token windows of one token file (module docstring).

    batch(step) -> {"tokens": int32 [B, L], "mask": float32 [B, L]} (mask 0 on padding only).
    """

    def __init__(self, path: str | os.PathLike, *, batch_size: int, seq_len: int, seed: int = 0,
                 pad_id: int | None = None):  # fmt: skip
        if batch_size < 1 or seq_len < 2:
            raise DataError(f"loader: need batch_size >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
        self.path = os.fspath(path)
        self.tokens, self.meta = open_tokens(self.path)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.pad_id = int(self.meta["eos_id"] if pad_id is None else pad_id)
        self.n_windows = -(-len(self.tokens) // seq_len)
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 [L], mask float32 [L]) of window w."""
        if not 0 <= w < self.n_windows:
            raise IndexError(f"{self.path}: window {w} outside [0, {self.n_windows})")
        a = np.asarray(self.tokens[w * self.seq_len : (w + 1) * self.seq_len], dtype=np.int32)
        mask = np.ones(self.seq_len, np.float32)
        if a.size < self.seq_len:
            mask[a.size :] = 0.0
            a = np.concatenate([a, np.full(self.seq_len - a.size, self.pad_id, np.int32)])
        return a, mask

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._perm[1]

    def window_ids(self, step: int) -> np.ndarray:
        """The window of each row of training batch `step`, int64 [B]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        out = np.empty(self.batch_size, np.int64)
        for j in range(self.batch_size):
            i = step * self.batch_size + j
            out[j] = self.permutation(i // self.n_windows)[i % self.n_windows]
        return out

    def _stack(self, ids) -> dict[str, np.ndarray]:
        rows = [self.window(int(w)) for w in ids]
        return {"tokens": np.stack([r[0] for r in rows]), "mask": np.stack([r[1] for r in rows])}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self._stack(self.window_ids(step))

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size / self.n_windows

    def eval_batches(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Every window in file order (the last batch filled with fully masked rows), at most `max_batches`."""
        n = self.n_windows if max_batches is None else min(self.n_windows, max_batches * self.batch_size)
        for start in range(0, n, self.batch_size):
            ids = list(range(start, min(start + self.batch_size, n)))
            b = self._stack(ids)
            short = self.batch_size - len(ids)
            if short:
                b = {k: np.concatenate([v, np.zeros((short, self.seq_len), v.dtype)]) for k, v in b.items()}
                b["tokens"][len(ids) :] = self.pad_id
            yield b
