"""Greedy prefill and decode of B streams on the runtime's programs (glm53.runtime.programs: those the serving
engine runs), with the prefill and the decode steps callable apart, as the peer and model benchmarks time them.

`fresh(batch, max_len)` -> an empty staging cache of `batch` rows; `prefill(state, prompts_bp)` -> (state, the
last position's logits [B, V] as numpy f32): the prompts [B, P] fed together, in chunks of `prefill_chunk`
tokens (one prefill program per chunk shape); `decode(prefilled, steps)` -> greedy tokens [B, steps + 1]: the
insert program writes the staging rows into slots 0 .. B-1 and takes each first token (argmax on device), then
`steps` decode steps of all B streams together (one program of width B). One `Programs` per (batch, max_len),
kept: every call after the first runs compiled programs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glm53.runtime.programs import Programs, greedy_args


class GreedyStreams:
    """The runtime's programs for greedy streams (module docstring); `compiler_options` go to every program."""

    def __init__(self, model, prefill_chunk: int = 256, compiler_options: dict | None = None):
        self.model, self.prefill_chunk, self.compiler_options = model, prefill_chunk, compiler_options
        self._programs: dict[tuple[int, int], Programs] = {}

    def programs(self, batch: int, max_len: int) -> Programs:
        key = (batch, max_len)
        if key not in self._programs:
            self._programs[key] = Programs(self.model, slots=batch, max_len=max_len, decode_widths=(batch,),
                                           prefill_widths=(batch,), compiler_options=self.compiler_options)  # fmt: skip
        return self._programs[key]

    def fresh(self, batch: int, max_len: int):
        rt = self.programs(batch, max_len)
        return rt, rt.init(batch), rt.h0(batch)

    def prefill(self, state, prompts_bp) -> tuple[tuple, np.ndarray]:
        rt, staging, h = state
        prompts_bp = np.asarray(prompts_bp, np.int32)
        for s in range(0, prompts_bp.shape[1], self.prefill_chunk):
            logits, h, staging = rt.prefill(staging, prompts_bp[:, s : s + self.prefill_chunk], h)
        return (rt, staging, h, logits), np.asarray(logits, np.float32)

    def decode(self, prefilled, steps: int) -> np.ndarray:
        (rt, staging, h, logits), _ = prefilled
        b = rt.slots
        mask, args = jnp.ones((b, rt.cfg.vocab_size), bool), greedy_args(b)
        toks = [rt.insert(staging, np.arange(b, dtype=np.int32), logits, h, mask, *args)[:, 0]]
        active, verify, counts = np.ones(b, bool), np.zeros(b, bool), np.zeros(b, np.int32)
        for _ in range(steps):
            toks.append(rt.decode(toks[-1], toks[-1], active, verify, mask, counts, args))
        return np.stack(toks, axis=1).astype(np.int32)
