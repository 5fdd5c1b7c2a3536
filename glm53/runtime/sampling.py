"""Next-token sampling: greedy, temperature, top-k and (exact) top-p, batched over streams and jit-able.

Per stream b (all parameters may be scalars or arrays [B]):
  * temperature[b] <= 0: greedy, argmax of the raw logits (first index on ties);
  * otherwise logits / temperature, then top-k, then top-p (the order of transformers' logits warpers):
      - top-k (k > 0): keep the tokens whose scaled logit is >= the k-th largest (ties at the boundary kept);
      - top-p (p < 1): sort the top-k survivors by probability (descending) and keep a token while the mass of
        the tokens before it is < p (the smallest prefix with mass >= p; the most likely token is always kept);
    and draw from the renormalized distribution with the stream's own key.
k <= 0 disables top-k; p >= 1 disables top-p. `filtered_logprobs` exposes the exact distribution sampled from.
`check_params` is the domain every caller's parameters must be in (entry points validate flags with it);
`SamplingParams` holds a caller's parameters (checked) and `check_prompts` the prompts' domain.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


def check_params(temperature=0.0, top_p=1.0, top_k=0) -> None:
    """ValueError naming the parameter unless temperature is finite and >= 0 (0: greedy), 0 < top_p <= 1 and
    top_k is an integer >= 0 (0: off)."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"{name}={v!r}: expected a finite number")
    if temperature < 0:
        raise ValueError(f"temperature={temperature!r}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1] (1 = off)")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: must be an integer >= 0 (0 = off)")


def _check_count(name: str, v, minimum: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name}={v!r}: must be an integer >= {minimum}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample; ValueError naming the field for values outside their domain (`sampling.check_params`,
    max_new >= 0: 0 generates nothing)."""

    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> no top-k filter
    max_new: int = 32
    eos_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        check_params(self.temperature, self.top_p, self.top_k)
        _check_count("max_new", self.max_new)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed={self.seed!r}: must be an integer")


def check_prompts(prompts, vocab_size: int, max_len: int, max_new: int = 0) -> None:
    """ValueError unless `prompts` is a non-empty list of non-empty lists of token ids (ints, not bools) in
    [0, vocab_size), each with room for `max_new` more tokens within `max_len` positions."""
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("expected a non-empty list of prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p:
            raise ValueError(f"prompt {i}: every prompt needs at least one token")
        bad = [t for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ValueError(f"prompt {i}: token ids must be integers, got {bad[:5]}")
        out = [t for t in p if not 0 <= t < vocab_size]
        if out:
            raise ValueError(f"prompt {i}: token ids outside the vocabulary [0, {vocab_size}): {out[:5]}")
        if len(p) + max_new > max_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_new {max_new} exceed the model's "
                             f"max_position_embeddings {max_len}")  # fmt: skip


def _per_stream(x, b: int, dtype) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(x, dtype), (b,))


def filtered_logits(logits_bv: jax.Array, temperature=1.0, top_p=1.0, top_k=0) -> jax.Array:
    """Temperature-scaled logits [B, V] (f32) with -inf at every token removed by top-k / top-p.

    Greedy streams (temperature <= 0) keep only their argmax (value 0).
    """
    b, v = logits_bv.shape
    x = logits_bv.astype(jnp.float32)
    t = _per_stream(temperature, b, jnp.float32)
    p = _per_stream(top_p, b, jnp.float32)
    k = _per_stream(top_k, b, jnp.int32)
    greedy = t <= 0
    x = x / jnp.where(greedy, 1.0, t)[:, None]

    order_bv = jnp.argsort(-x, axis=-1, stable=True)  # descending, ties by index
    sorted_bv = jnp.take_along_axis(x, order_bv, axis=-1)
    kth = jnp.take_along_axis(sorted_bv, jnp.clip(k - 1, 0, v - 1)[:, None], axis=-1)  # [B, 1]
    in_top_k = jnp.where((k > 0)[:, None], sorted_bv >= kth, True)  # a prefix of the sorted order
    sorted_bv = jnp.where(in_top_k, sorted_bv, -jnp.inf)

    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    mass_before = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    keep_sorted = (mass_before < p[:, None]) | (p >= 1.0)[:, None]
    keep_sorted = keep_sorted.at[:, 0].set(True) & in_top_k
    rows = jnp.arange(b)[:, None]
    keep_bv = jnp.zeros((b, v), bool).at[rows, order_bv].set(keep_sorted)

    first = jax.nn.one_hot(jnp.argmax(logits_bv, axis=-1), v, dtype=bool)
    keep_bv = jnp.where(greedy[:, None], first, keep_bv)
    x = jnp.where(greedy[:, None], 0.0, x)
    return jnp.where(keep_bv, x, -jnp.inf)


def filtered_logprobs(logits_bv: jax.Array, temperature=1.0, top_p=1.0, top_k=0) -> jax.Array:
    """Log-probabilities [B, V] of the distribution `sample` draws from (-inf for removed tokens)."""
    return jax.nn.log_softmax(filtered_logits(logits_bv, temperature, top_p, top_k), axis=-1)


def stream_keys(key: jax.Array, b: int) -> jax.Array:
    """A key per stream: `key` is one key (split into b) or already a batch of b keys."""
    key = jnp.asarray(key)
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    single = key.ndim == (0 if typed else 1)
    if single:
        return jax.random.split(key, b)
    if key.shape[0] != b:
        raise ValueError(f"sample: {key.shape[0]} keys for {b} streams")
    return key


def sample(logits_bv: jax.Array, key: jax.Array, temperature=1.0, top_p=1.0, top_k=0) -> jax.Array:
    """Token ids [B] (int32) drawn from `filtered_logprobs`; greedy where temperature <= 0.

    key: one PRNG key, or one key per stream ([B] typed keys / [B, 2] raw keys): a stream's draw then depends
    only on its own key and logits, not on the rest of the batch.
    """
    b = logits_bv.shape[0]
    keys = stream_keys(key, b)
    t = _per_stream(temperature, b, jnp.float32)
    greedy = t <= 0
    argmax = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    # rows that keep every token (no top-k, no top-p): their draw needs no sort
    plain = greedy | ((_per_stream(top_k, b, jnp.int32) <= 0) & (_per_stream(top_p, b, jnp.float32) >= 1.0))

    def draw(x):
        drawn = jax.vmap(lambda kk, row: jax.random.categorical(kk, row))(keys, x)
        return jnp.where(greedy, argmax, drawn).astype(jnp.int32)

    def unfiltered():  # the same logits `filtered_logits` gives a row that removes nothing: the same draw
        return draw(logits_bv.astype(jnp.float32) / jnp.where(greedy, 1.0, t)[:, None])

    # An all-greedy batch skips the filtering, and a batch of greedy and plain rows skips the sort: the sort over
    # the vocabulary costs ~1 ms per stream for 4k tokens on a CPU core (and grows with the vocabulary), more
    # than a small model's whole decode step.
    case = jnp.where(jnp.all(greedy), 0, jnp.where(jnp.all(plain), 1, 2))
    filtered = lambda: draw(filtered_logits(logits_bv, temperature, top_p, top_k))  # noqa: E731
    return jax.lax.switch(case, [lambda: argmax, unfiltered, filtered])
