"""The three engines of the peer benchmark (glm53/benchmarks/peer.py), one interface: greedy prefill and decode of
B streams with prompts of equal length.

Each engine has `fresh(batch, max_len)` (an empty state: a cache, a cleared llama.cpp context, or nothing for
transformers), `prefill(state, prompts_bp)` -> (state, last-position logits [B, V] as numpy f32) and
`decode(prefilled, steps)` -> greedy tokens [B, steps + 1] (the first from the prefill's logits, then `steps`
one-token forwards of all B streams together).

  Glm53Engine      the runtime's programs, those the serving engine runs (glm53.benchmarks.greedy: one program per
                   shape, donated cache): the B prompts are one prefill of [B, P] (in chunks of `prefill_chunk`),
                   the first tokens come from the insert program, then one decode program of width B per step.
  TorchEngine      transformers eager, fp32, `torch.no_grad`, its own cache.
  LlamaCppEngine   llama.cpp through llama-cpp-python's low-level C API: one model, one context per
                   (streams, context length) with llama.cpp's default settings except n_ctx, n_batch (a whole
                   prompt per `llama_decode`), n_seq_max (B), n_threads / n_threads_batch and an F32 KV cache
                   (type_k / type_v F32: the default F16 cache also holds this arch's MLA latents and indexer keys
                   and moves F32-GGUF logits by ~2e-4, tests/gguf_fixtures.py). B streams decode as ONE
                   llama_batch of B tokens with sequence ids 0..B-1 per step; each prompt is one llama_batch.
"""

from __future__ import annotations

import logging
import os

import llama_cpp
import numpy as np
import torch

from glm53.benchmarks.greedy import GreedyStreams


class Glm53Engine(GreedyStreams):
    """glm53 on the runtime's programs (glm53.benchmarks.greedy): prompts [B, P] in one prefill, then B streams
    per decode step."""

    name = "glm53"


class TorchEngine:
    """transformers eager (fp32) with its own cache; the state of a fresh stream is None."""

    name = "transformers"

    def __init__(self, model):
        self.model = model

    def fresh(self, batch: int, max_len: int) -> None:
        """transformers makes its cache in the prefill."""

    @torch.no_grad()
    def prefill(self, state, prompts_bp: np.ndarray):
        del state
        out = self.model(input_ids=torch.as_tensor(prompts_bp, dtype=torch.long), use_cache=True)
        return out.past_key_values, out.logits[:, -1].float().numpy()

    @torch.no_grad()
    def decode(self, prefilled, steps: int) -> np.ndarray:
        pkv, logits_bv = prefilled
        toks = [logits_bv.argmax(-1)]
        for _ in range(steps):
            ids = torch.as_tensor(toks[-1][:, None], dtype=torch.long)
            out = self.model(input_ids=ids, past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            toks.append(out.logits[:, -1].float().numpy().argmax(-1))
        return np.stack(toks, axis=1).astype(np.int32)


_BACKEND_READY = []


class _Context:
    """One llama.cpp context for `n_seq` streams of up to `per_seq` tokens each, with a reusable batch."""

    def __init__(self, model, n_seq: int, per_seq: int, n_batch: int, threads: int):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = n_seq * -(-per_seq // 256) * 256  # llama.cpp splits n_ctx evenly over the streams
        p.n_batch = max(int(p.n_batch), n_batch, n_seq)
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = threads
        p.type_k = p.type_v = llama_cpp.GGML_TYPE_F32
        self.ctx = llama_cpp.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp: cannot create a context for {n_seq} streams x {per_seq} tokens")
        self.params = {"n_ctx": int(p.n_ctx), "n_batch": int(p.n_batch), "n_ubatch": int(p.n_ubatch),
                       "n_seq_max": n_seq, "n_threads": threads, "n_threads_batch": threads,
                       "type_k": "F32", "type_v": "F32", "flash_attn_type": int(p.flash_attn_type)}  # fmt: skip
        self.batch = llama_cpp.llama_batch_init(int(p.n_batch), 0, 1)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def decode(self, tokens, positions, seqs, want) -> None:
        """One llama_decode of len(tokens) tokens (token i of sequence seqs[i] at positions[i]; logits where want)."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, w) in enumerate(zip(tokens, positions, seqs, want)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), int(p), 1, int(w)
            b.seq_id[i][0] = int(s)
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama.cpp: llama_decode returned {rc}")

    def logits(self, i: int, n_vocab: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(n_vocab,)).copy()

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


class LlamaCppEngine:
    """llama.cpp on one GGUF file (module docstring); `close()` frees the contexts and the model."""

    name = "llama_cpp"

    def __init__(self, path: str | os.PathLike, threads: int):
        if not _BACKEND_READY:
            llama_cpp.llama_backend_init()
            _BACKEND_READY.append(True)
        self.threads = threads
        self.model = llama_cpp.llama_model_load_from_file(
            os.fspath(path).encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp: cannot load {os.fspath(path)}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.contexts: dict[tuple[int, int], _Context] = {}

    def context(self, batch: int, max_len: int) -> _Context:
        """The context for `batch` streams of up to `max_len` tokens (made once, reused)."""
        key = (batch, max_len)
        if key not in self.contexts:
            self.contexts[key] = _Context(self.model, batch, max_len, max_len, self.threads)
        return self.contexts[key]

    def params(self) -> dict:
        """The llama.cpp context settings used (of any context: they differ only in n_ctx / n_batch / n_seq)."""
        return next(iter(self.contexts.values())).params if self.contexts else {}

    def fresh(self, batch: int, max_len: int) -> _Context:
        ctx = self.context(batch, max_len)
        ctx.clear()
        return ctx

    def prefill(self, ctx: _Context, prompts_bp: np.ndarray):
        b, p = prompts_bp.shape
        out = []
        for s in range(b):  # one llama_batch per prompt, the logits of its last token only
            ctx.decode(prompts_bp[s], range(p), [s] * p, [False] * (p - 1) + [True])
            out.append(ctx.logits(p - 1, self.n_vocab))
        ctx.pos = p
        return ctx, np.stack(out)

    def decode(self, prefilled, steps: int) -> np.ndarray:
        ctx, logits_bv = prefilled
        b = logits_bv.shape[0]
        toks = [logits_bv.argmax(-1).astype(np.int32)]
        for i in range(steps):  # one llama_batch of B tokens, sequence ids 0..B-1
            ctx.decode(toks[-1], [ctx.pos + i] * b, range(b), [True] * b)
            toks.append(np.array([ctx.logits(s, self.n_vocab).argmax() for s in range(b)], np.int32))
        return np.stack(toks, axis=1)

    def close(self) -> None:
        for c in self.contexts.values():
            c.close()
        self.contexts.clear()
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None


def silence_llama_cpp() -> None:
    """llama.cpp's log lines off (llama-cpp-python routes them to its logger, shown at ERROR and above)."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
