"""Scoring: full-sequence logits and mean next-token negative log-likelihood per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.model import Glm53Model


def score(model: Glm53Model, sequences: list[list[int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Returns (logits [T_i, V] float32 per sequence, mean next-token NLL per sequence (nan if T_i < 2))."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens):
        logits, _ = nnx.merge(graphdef, state)(tokens)
        return logits

    vocab = model.cfg.vocab_size
    all_logits, nll = [], []
    for i, seq in enumerate(sequences):
        toks = np.asarray(seq, np.int64)
        if toks.ndim != 1 or len(toks) == 0:
            raise ValueError(f"sequence {i}: expected a non-empty list of token ids")
        if toks.min() < 0 or toks.max() >= vocab:
            raise ValueError(
                f"sequence {i}: token ids must be in [0, {vocab}), got {toks.min()}..{toks.max()}"
            )
        logits = np.asarray(fwd(state, jnp.asarray(toks[None], jnp.int32))[0], np.float32)
        all_logits.append(logits)
        if len(toks) < 2:
            nll.append(float("nan"))
            continue
        lp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
        nll.append(float(-jnp.mean(jnp.take_along_axis(lp, jnp.asarray(toks[1:, None]), axis=-1))))
    return all_logits, np.asarray(nll, np.float32)
