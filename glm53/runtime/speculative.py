"""MTP speculative decoding inside the batched decode step: the speculative variant of the runtime's programs
(`Programs(..., speculative=True)`, glm53.runtime.programs; `Engine(..., speculative=True)` runs it).

Every slot holds its pending token x (emitted, not yet fed: position n = its cache length) and the MTP block's
draft d for the token after x. One step feeds [x, d] to every slot (T = 2) and reads two tokens: y0 after x
(sampled by the slot's own parameters; argmax for a greedy slot) and y1, the argmax after d.
  * a greedy slot whose draft was right (y0 == d) emits d and y1 and advances two positions;
  * any other slot emits y0 and advances one: its KDA layers are rolled back to their state after the first
    token, which the same pass computed (`KDACache.after_first`): no cache copy, no second pass. Its MLA latent /
    indexer rows past the new length hold the rejected draft's and are overwritten by the next step (a query
    never sees a row past its own position; a pool is re-pooled by the step that completes it).
A sampled slot never accepts, so it draws from exactly the plain step's distribution (same logits, same key)
and every slot can share the one program (no per-batch choice of program, and the MTP cache stays complete).
Nor does a slot whose next token is forced (Request.think_budget): the forced token replaces the emitted one,
which must not be a draft already in the cache (its MTP pair then holds the sampled token: a worse next draft,
never a wrong token). Nor does a constrained slot (Request.constraint): y0 is drawn from its masked logits.
The MTP block then runs on the pairs (h_n, e0), (h_n+1, y1) with e0 = d when accepted, else y0; the next draft
is its argmax at the last valid pair. Greedy output is exactly plain greedy decoding's (tests/test_serving_spec.py).

Prefill keeps the MTP cache in step with the trunk: a chunk [s, s+c) runs the MTP block on its positions paired
with the next prompt tokens; the last pair's next token is not known yet, so the next chunk first redoes the
pair at s-1 with the hidden state the previous chunk returned (`h_prev`), and `insert` redoes the prompt's last
pair with the first sampled token, whose MTP logits give the first draft.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from glm53.layers.kda import KDACache
from glm53.model import Cache
from glm53.runtime import sampling
from glm53.runtime.cache import map_layers, write_rows


def _with_first(cache: Cache) -> Cache:
    """Asks every KDA layer for its state after the first of the step's tokens (a scanned group's too: the scan
    hands each layer its slice of the stacked `after_first` and stacks what the layers return)."""
    def one(c, lead):
        return c.replace(after_first=(c.conv_state, c.state)) if isinstance(c, KDACache) else c

    return cache.replace(layers=map_layers(one, cache.layers))


def _roll_back(cache: Cache, keep: jnp.ndarray) -> Cache:
    """Per slot: the KDA state after both tokens where `keep`, else after the first; `after_first` dropped."""

    def one(c, lead):  # lead: a stacked cache's repeat axis in front of the batch axis (broadcast over it)
        if not isinstance(c, KDACache):
            return c
        conv, st = c.after_first
        sel = lambda a, b: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1 - lead)), a, b)  # noqa: E731
        return KDACache(sel(c.conv_state, conv), sel(c.state, st))

    return cache.replace(layers=map_layers(one, cache.layers))


def build(graphdef, keys):
    """The speculative decode, prefill and insert functions (see the module docstring; not compiled: `Programs`
    compiles them); `keys(seeds, counts)` makes the per-slot sampling keys."""
    gd = graphdef

    def decode(state, cache, tokens, drafts, active, verify, mask, counts, seeds, temp, top_p, top_k):
        """-> int32 [B, 4] (y0, y1, accepted, next draft) and the cache (lengths +2 / +1 / +0 inactive).
        verify [B]: the slots whose draft may be accepted (active, greedy, no token forced next, unconstrained);
        mask [B, V]: the tokens y0 may be (constrained decoding; y1 only counts where verify)."""
        m = nnx.merge(gd, state)
        n = cache.length
        h, new = m.hidden(jnp.stack([tokens, drafts], axis=1), cache=_with_first(cache))
        logits = m.logits(h)  # [B, 2, V]
        y0 = sampling.sample(jnp.where(mask, logits[:, 0], -jnp.inf), keys(seeds, counts), temp, top_p, top_k)
        y1 = jnp.argmax(logits[:, 1], axis=-1).astype(jnp.int32)
        acc = verify & active & (temp <= 0) & (y0 == drafts)
        dl, new = m.mtp_logits(h, jnp.stack([jnp.where(acc, drafts, y0), y1], axis=1), cache=new)
        draft = jnp.argmax(jnp.where(acc[:, None], dl[:, 1], dl[:, 0]), axis=-1).astype(jnp.int32)
        new = _roll_back(new, acc).replace(length=n + jnp.where(active, jnp.where(acc, 2, 1), 0))
        return jnp.stack([y0, y1, acc.astype(jnp.int32), draft], axis=1), new

    def prefill(state, staging, tokens, h_prev):
        """-> (last logits [w, V], last hidden [w, 1, D], staging) for the chunk `tokens` [w, C]."""
        m = nnx.merge(gd, state)
        s = staging.length
        h, staging = m.hidden(tokens, cache=staging)
        end = staging.length
        # the pair at s-1 (at s = 0 a placeholder at 0 that the chunk's own pairs overwrite)
        _, staging = m.mtp_logits(h_prev, tokens[:, :1], cache=staging.replace(length=jnp.maximum(s, 1)),
                                  last_only=True)  # fmt: skip
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # the last pair is redone later
        _, staging = m.mtp_logits(h, nxt, cache=staging.replace(length=end), last_only=True)
        return m.logits(h[:, -1:])[:, -1], h[:, -1:], staging

    def insert(state, cache, staging, slots, logits, h_last, mask, seed, temp, top_p, top_k):
        """-> int32 [w, 2] (first token, its draft) per staging row and the cache with row i in slot `slots[i]`
        (rows with a negative slot are not written: glm53.runtime.cache.write_rows)."""
        m = nnx.merge(gd, state)
        logits = jnp.where(mask, logits, -jnp.inf)  # [w, V]: a constrained request's first token
        tok = sampling.sample(logits, keys(seed, jnp.zeros_like(slots)), temp, top_p, top_k)
        dl, staging = m.mtp_logits(h_last, tok[:, None], cache=staging)
        draft = jnp.argmax(dl[:, -1], axis=-1).astype(jnp.int32)
        return jnp.stack([tok, draft], axis=1), write_rows(cache, staging, slots)

    return decode, prefill, insert
