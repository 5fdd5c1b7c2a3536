"""llama.cpp's logits on a GGUF through llama-cpp-python's low-level API: the cross-check column of the ablation.

One model and one context of exactly one chunk (n_ctx tokens, one llama_batch, logits at every position, an F32
KV cache: the default F16 cache also holds this architecture's MLA latents and indexer keys and moves logits by
~2e-4, see glm53/benchmarks/peer_engines.py); the cache is cleared before each chunk, as llama-perplexity does.
Tokens are fed as ids (the GGUFs glm53 writes have tokenizer model "none"; no BOS is added).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from glm53 import logs

INSTALL = "pip install llama-cpp-python==0.3.36 (or pip install -e '.[test]')"
_READY: list[bool] = []


def check_available() -> None:
    """RuntimeError saying how to install llama-cpp-python when it is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError(f"llama-cpp-python is not installed: {INSTALL}")


class LlamaLogits:
    """`logits(tokens)` -> float32 [n, n_vocab] for one chunk of n <= n_ctx tokens; `close()` frees everything."""

    def __init__(self, path: str | os.PathLike, n_ctx: int, threads: int | None = None, quiet: bool | None = None):
        """`quiet`: llama.cpp's logs off (None: unless the run asks for logs, `glm53.logs.quiet_llama_cpp`)."""
        check_available()
        import llama_cpp  # optional dependency (the `test` extra); loaded only when a cross-check runs

        self._l = llama_cpp
        logs.quiet_llama_cpp(quiet)  # load logs ("load: adding N dummy tokens", ...) only with --verbosity >= 0
        if not _READY:
            llama_cpp.llama_backend_init()
            _READY.append(True)
        self.model = llama_cpp.llama_model_load_from_file(
            os.fspath(path).encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp: cannot load {os.fspath(path)}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = -(-n_ctx // 256) * 256
        p.n_batch = p.n_ubatch = p.n_ctx
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = threads or os.cpu_count() or 1
        p.type_k = p.type_v = llama_cpp.GGML_TYPE_F32
        self.ctx = llama_cpp.llama_init_from_model(self.model, p)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp: cannot create a context of {n_ctx} tokens for {os.fspath(path)}")
        self.n_ctx = n_ctx
        self.batch = llama_cpp.llama_batch_init(int(p.n_batch), 0, 1)

    def logits(self, tokens) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"a chunk of {len(tokens)} tokens does not fit the context of {self.n_ctx}")
        lc = self._l
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
            b.seq_id[i][0] = 0
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama.cpp: llama_decode returned {rc}")
        ptr = lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(tokens) * self.n_vocab,)).reshape(len(tokens), -1).copy()

    def close(self) -> None:
        if self.ctx:
            self._l.llama_batch_free(self.batch)
            self._l.llama_free(self.ctx)
            self._l.llama_model_free(self.model)
            self.ctx = self.model = None

    def __enter__(self) -> LlamaLogits:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quiet() -> None:
    """llama.cpp's log lines off unless the run asks for logs (`glm53.logs.quiet_llama_cpp`; every load of
    `LlamaLogits` does this too)."""
    logs.quiet_llama_cpp()
