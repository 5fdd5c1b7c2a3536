"""Scoring: full-sequence logits and mean next-token negative log-likelihood per sequence."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.model import Glm53Model
from glm53.parallel import distributed


def check_sequences(sequences, vocab_size: int | None = None, max_len: int | None = None) -> None:
    """ValueError naming the sequence unless `sequences` is a non-empty list of lists of at least 2 token ids
    (ints, not bools; a one-token sequence predicts nothing), in [0, vocab_size) and at most max_len long."""
    if not isinstance(sequences, list) or not sequences:
        raise ValueError("expected a non-empty JSON list of token-id sequences")
    for i, s in enumerate(sequences):
        if not isinstance(s, list) or len(s) < 2:
            raise ValueError(
                f"sequence {i}: expected a list of at least 2 token ids (NLL needs a next token)"
            )
        bad = [t for t in s if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ValueError(f"sequence {i}: token ids must be integers, got {bad[:5]!r}")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in s):
            raise ValueError(f"sequence {i}: token ids must be in [0, {vocab_size}), got {min(s)}..{max(s)}")
        if max_len is not None and len(s) > max_len:
            raise ValueError(f"sequence {i}: {len(s)} tokens exceed max_position_embeddings {max_len}")


def score(model: Glm53Model, sequences: list[list[int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Returns (logits [T_i, V] float32 per sequence, mean next-token NLL per sequence); the sequences must
    pass `check_sequences` (ValueError otherwise)."""
    check_sequences(sequences, model.cfg.vocab_size, model.cfg.max_position_embeddings)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens):
        logits, _ = nnx.merge(graphdef, state)(tokens)
        return logits

    all_logits, nll = [], []
    for seq in sequences:
        toks = np.asarray(seq, np.int64)
        logits = distributed.to_host(fwd(state, jnp.asarray(toks[None], jnp.int32)))[0].astype(np.float32)  # every process
        all_logits.append(logits)
        lp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
        nll.append(float(-jnp.mean(jnp.take_along_axis(lp, jnp.asarray(toks[1:, None]), axis=-1))))
    return all_logits, np.asarray(nll, np.float32)
