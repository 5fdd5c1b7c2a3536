"""Training losses from the model's own forward pieces (`Glm53Model.hidden`, `.logits`, the MTP block).

Batch: ``tokens`` int32 [B, T] and ``mask`` [B, T] (1 = real token, 0 = padding; padding only at the end of a
row). With ``nll(p) = -log softmax(logits_p)[token]``:

    next-token loss  L_lm  = sum_{b, p < T-1} mask[b, p+1] nll(trunk logits at p, tokens[b, p+1]) / sum mask[:, 1:]
    MTP loss         L_mtp = sum_{b, p < T-2} mask[b, p+2] nll(MTP logits at p, tokens[b, p+2]) / sum mask[:, 2:]

(`L_lm` is exactly transformers' ``labels=tokens`` loss with -100 on padding.) The MTP block sees the trunk's
final-normed hidden state h_p and the embedding of token p+1 and predicts token p+2 (glm53/layers/mtp.py), as at
inference. Total: ``L_lm + mtp_weight * L_mtp + balance_weight * L_balance`` (glm53/train/routing.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.train import routing


@dataclasses.dataclass(frozen=True)
class LossConfig:
    mtp_weight: float = 0.3
    balance_weight: float = 0.0


def token_nll(logits_btv: jnp.ndarray, targets_bt: jnp.ndarray) -> jnp.ndarray:
    """-log softmax(logits)[target], f32 [B, T]."""
    lg = logits_btv.astype(jnp.float32)
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked


def masked_mean(x: jnp.ndarray, w: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sum(x w) / max(sum w, 1), sum w)."""
    w = w.astype(jnp.float32)
    n = jnp.sum(w)
    return jnp.sum(x * w) / jnp.maximum(n, 1.0), n


def next_token_loss(logits_btv, tokens_bt, mask_bt):
    """(mean NLL of tokens[:, 1:] given logits[:, :-1] over unmasked targets, number of targets)."""
    return masked_mean(token_nll(logits_btv[:, :-1], tokens_bt[:, 1:]), mask_bt[:, 1:])


def mtp_logits(model: nnx.Module, h_btd: jnp.ndarray, tokens_bt: jnp.ndarray) -> jnp.ndarray:
    """MTP logits [B, T-1, V] for tokens p+2 from h_p and token p+1 (p = 0 .. T-2), no cache (a fresh sequence)."""
    e = model.embed(tokens_bt[:, 1:])
    b = tokens_bt.shape[0]
    x, _ = model.mtp(h_btd[:, :-1], e, cache=None, start_b=jnp.zeros((b,), jnp.int32))
    return model.logits(x)


def mtp_loss(model: nnx.Module, h_btd, tokens_bt, mask_bt):
    """(mean NLL of tokens[:, 2:] under the MTP logits at p = 0 .. T-3, number of targets)."""
    lg = mtp_logits(model, h_btd, tokens_bt)[:, :-1]
    return masked_mean(token_nll(lg, tokens_bt[:, 2:]), mask_bt[:, 2:])


def losses(model: nnx.Module, batch: dict, cfg: LossConfig, router_names=()) -> tuple[jnp.ndarray, dict]:
    """(total loss, aux) for one batch. aux: lm / mtp / balance losses, their target counts, and ``loads``
    {router name: f32 [E] assignments} (stop-gradient) for every name in `router_names` (instrumented routers,
    see glm53.train.routing; MTP routers count positions whose MTP input token is real). A router of a scanned
    LayerStack records once per repeat: its loads are [R, E] and each repeat is one router of the balance loss's
    mean, as when unrolled."""
    tokens, mask = batch["tokens"], batch["mask"].astype(jnp.float32)
    b, t = tokens.shape
    with_mtp = model.mtp is not None and cfg.mtp_weight > 0
    with routing.record_routing() as rec:
        h, _ = model.hidden(tokens)
        lm, n_lm = next_token_loss(model.logits(h), tokens, mask)
        mtp, n_mtp = mtp_loss(model, h, tokens, mask) if with_mtp else (jnp.zeros(()), jnp.zeros(()))
    loads, balance = {}, []
    for name in router_names:
        if name not in rec:
            continue  # e.g. the MTP router when the MTP loss is off
        ids, probs = rec[name]
        stacked = ids.ndim == 3  # a router of a scanned LayerStack: one record per repeat [R, N, ...]
        ids_r, probs_r = (ids, probs) if stacked else (ids[None], probs[None])
        valid = mask if ids_r.shape[1] == b * t else mask[:, 1:]
        steps, n_experts = valid.shape[1], probs.shape[-1]
        load = jnp.stack([routing.expert_load(i, valid.reshape(-1), n_experts) for i in ids_r])
        loads[name] = jax.lax.stop_gradient(load if stacked else load[0])
        if cfg.balance_weight:
            balance.extend(routing.sequence_balance_loss(
                i.reshape(b, steps, -1), p.reshape(b, steps, -1), valid) for i, p in zip(ids_r, probs_r))  # fmt: skip
    bal = jnp.mean(jnp.stack(balance)) if balance else jnp.zeros(())
    total = lm + cfg.mtp_weight * mtp + cfg.balance_weight * bal
    aux = dict(lm_loss=lm, mtp_loss=mtp, balance_loss=bal, lm_tokens=n_lm, mtp_tokens=n_mtp, loads=loads)
    return total, aux
