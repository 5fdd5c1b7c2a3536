"""Where a forward's time goes: every sublayer of every layer jitted alone on the inputs the model gives it.

One forward of `tokens` [B, T] after a cache holding `context` tokens is replayed piece by piece: the embedding,
then per decoder layer its attention hyper-connection (`attn_hc`: the mHC weights, Sinkhorn and the collapse
of the 4 streams), the attention with its input norm (`attention`: KDA or DSA + indexer, reading and updating
the layer's cache), the expansion back to 4 streams (`attn_expand`), the same three for the FFN (`ffn_hc`,
`ffn`: the dense MLP or the MoE with its router, `ffn_expand`), and last the final norm + lm head (`head`, last
position only, as generation computes it). Each piece is its own jitted program (a layer's cache donated, a
fresh copy per call, outside the timing) timed with `harness.time_calls`, all pieces and the whole forward (one
program, the model's own `hidden` + `logits`) interleaved in rounds, so the ratios hold on a loaded machine.

The pieces' sum differs from the whole program: XLA fuses across the pieces inside the whole forward, and each
piece pays a program launch. The shares say which piece to work on; the whole is what generation pays. Decode
(T = 1) runs on `glm53.runtime.weights.decode_state` (dense routed experts as per-expert views), as the serving
engine's decode programs do.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.benchmarks import harness
from glm53.runtime.weights import decode_state

PARTS = ("embed", "attn_hc", "attention", "attn_expand", "ffn_hc", "ffn", "ffn_expand", "head")


def _program(module, call: Callable, donate: bool = False) -> Callable:
    """call(module, *args) as a jitted function of (state, *args); args[0] donated when `donate`."""
    gd, st = nnx.split(module)
    f = jax.jit(lambda st, *a: call(nnx.merge(gd, st), *a), donate_argnums=(1,) if donate else ())
    return lambda *a: f(st, *a)


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, tree)


def forward_parts(model, tokens: np.ndarray, context: int, *, repeats: int = 5, seed: int = 0) -> dict:
    """Times every piece of one forward of `tokens` [B, T] after `context` random tokens of cache (see the
    module docstring). Returns {"pieces": [{"layer", "kind", "part", "median_s", "min_s"}], "whole": Timing
    fields, "sum_median_s", "replay_max_abs_diff" (the pieces' logits vs the whole's), "by_part": {part: {"median_s", "share"}}, "by_kind": {...}} (shares of the sum)."""
    b, t = tokens.shape
    cfg = model.cfg
    if t == 1:  # decode: the step's state, as the engine's decode programs read it
        gd, st = nnx.split(model)
        model = nnx.merge(gd, decode_state(model, st, b))
    cache = model.init_cache(b, context + t)
    if context:
        ctx = np.random.default_rng(seed).integers(1, cfg.vocab_size, (b, context), dtype=np.int32)
        _, cache = nnx.jit(lambda m, x, c: m.hidden(x, cache=c))(model, jnp.asarray(ctx), cache)
    toks = jnp.asarray(tokens, jnp.int32)
    fns, setup, labels = {}, {}, {}

    def add(key, label, fn, args, cache_arg=None):
        labels[key] = label
        if cache_arg is None:
            fns[key] = lambda fn=fn, args=args: fn(*args)
        else:
            fns[key] = lambda c, fn=fn, args=args: fn(c, *args)
            setup[key] = lambda c=cache_arg: _copy(c)

    add("embed", (None, None, "embed"), _program(model.embed, lambda m, x: m(x)), (toks,))
    e = model.embed(toks)
    x = jnp.broadcast_to(e[:, :, None, :], (b, t, cfg.hc_mult, e.shape[-1]))
    start_b, selection, layer_caches = cache.length, None, list(cache.layers)
    for i, layer in enumerate(model.layers):
        kind = f"{layer.attn_kind}+{layer.mlp_kind}"
        hc = _program(layer.attn_hc, lambda m, x: m(x))
        add(f"{i}.attn_hc", (i, kind, "attn_hc"), hc, (x,))
        u, post, comb = layer.attn_hc(x)

        def attention(lay, c, h, s, sel):
            h = lay.input_layernorm(h)
            if lay.attn_kind == "kda":
                return lay.self_attn(h, cache=c, start_b=s)
            return lay.self_attn(h, cache=c, start_b=s, selection=sel)

        attn = _program(layer, attention, donate=True)
        add(
            f"{i}.attention", (i, kind, "attention"), attn, (u, start_b, selection), cache_arg=layer_caches[i]
        )
        out = attn(_copy(layer_caches[i]), u, start_b, selection)
        y = out[0]
        if layer.attn_kind != "kda":
            selection = out[2]
        expand = _program(layer.attn_hc, lambda m, x, y, p, c: m.expand(x, y, p, c))
        add(f"{i}.attn_expand", (i, kind, "attn_expand"), expand, (x, y, post, comb))
        x = layer.attn_hc.expand(x, y, post, comb)
        add(f"{i}.ffn_hc", (i, kind, "ffn_hc"), _program(layer.ffn_hc, lambda m, x: m(x)), (x,))
        u, post, comb = layer.ffn_hc(x)
        ffn = _program(layer, lambda lay, h: lay.mlp(lay.post_attention_layernorm(h)))
        add(f"{i}.ffn", (i, kind, "ffn"), ffn, (u,))
        y = ffn(u)
        expand = _program(layer.ffn_hc, lambda m, x, y, p, c: m.expand(x, y, p, c))
        add(f"{i}.ffn_expand", (i, kind, "ffn_expand"), expand, (x, y, post, comb))
        x = layer.ffn_hc.expand(x, y, post, comb)
    head = _program(model, lambda m, x: m.logits(m.norm(jnp.mean(x[:, -1:], axis=2)))[:, -1])
    add("head", (None, None, "head"), head, (x,))

    whole = _program(model, lambda m, c, x: m.logits(m.hidden(x, cache=c)[0][:, -1:])[:, -1], donate=True)
    fns["whole"] = lambda c: whole(c, toks)
    setup["whole"] = lambda: _copy(cache)
    with warnings.catch_warnings():  # a layer's program returns a new cache: some donated leaves go unused
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        times = harness.time_calls(fns, warmup=1, repeats=repeats, setup=setup)
    # the pieces replay the forward: the last one's logits are the whole program's (to f32 rounding)
    replay = float(jnp.max(jnp.abs(times["head"].result - times["whole"].result)))
    pieces = [dict(layer=labels[k][0], kind=labels[k][1], part=labels[k][2], median_s=times[k].median_s,
                   min_s=times[k].min_s) for k in labels]  # fmt: skip
    total = sum(p["median_s"] for p in pieces)
    by_part, by_kind = collections.Counter(), collections.Counter()
    for p in pieces:
        by_part[p["part"]] += p["median_s"]
        by_kind[f"{p['kind']} {p['part']}" if p["kind"] else p["part"]] += p["median_s"]

    def shares(c):
        return {k: {"median_s": v, "share": v / total} for k, v in c.most_common()}

    return dict(tokens=[b, t], context=context, pieces=pieces, whole=times["whole"].to_dict(),
                sum_median_s=total, replay_max_abs_diff=replay, by_part=shares(by_part), by_kind=shares(by_kind))  # fmt: skip
