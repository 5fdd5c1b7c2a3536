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

from glm53.benchmarks import harness, moe_cpu
from glm53.runtime.weights import decode_state
from kernels import dispatch
from kernels.kda import api as kda_api
from kernels.mhc import api as mhc_api
from kernels.sparse_mla import api as mla_api

PARTS = ("embed", "attn_hc", "attention", "attn_expand", "ffn_hc", "ffn", "ffn_expand", "head")


def _program(module, call: Callable, donate: bool = False) -> Callable:
    """call(module, *args) as a jitted function of (state, *args); args[0] donated when `donate`."""
    gd, st = nnx.split(module)
    f = jax.jit(lambda st, *a: call(nnx.merge(gd, st), *a), donate_argnums=(1,) if donate else ())
    return lambda *a: f(st, *a)


def _resolved(api_module, op: str, name: str) -> str:
    """The implementation `name` runs as on this backend ("auto" through the op's table)."""
    table = getattr(api_module, "AUTO_BY_BACKEND", None) or getattr(api_module, "_AUTO", {})
    return dispatch.resolve(op, name, api_module.IMPLEMENTATIONS, table)


def layer_kernels(layer, tokens: int, dtype, top_k: int) -> dict[str, str]:
    """{part: the kernel implementation it runs} of a decoder layer on `tokens` tokens of `dtype`, `top_k`
    routed experts each."""
    hc = f"mhc {_resolved(mhc_api, 'mhc', layer.attn_hc.implementation)}"
    attn = layer.self_attn.implementation
    out = {"attn_hc": hc, "attn_expand": hc, "ffn_hc": hc, "ffn_expand": hc}
    if layer.attn_kind == "kda":
        out["attention"] = f"kda {_resolved(kda_api, 'kda', attn)}"
    else:
        out["attention"] = f"sparse_mla {_resolved(mla_api, 'sparse_mla', attn)}"
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None:
        out["ffn"] = "dense MLP (XLA)"
    else:
        ws = [getattr(experts, f"{m}_proj").get_value() for m in ("gate", "up", "down")]
        slots = tokens * top_k
        out["ffn"] = "moe " + moe_cpu.moe_kernel(
            experts.implementation, slots, ws, decode_max_slots=experts.decode_max_slots, tokens=tokens,
            x_dtype=dtype,
        )  # fmt: skip
    return out


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, tree)


def forward_parts(model, tokens: np.ndarray, context: int, *, repeats: int = 5, seed: int = 0) -> dict:
    """Times every piece of one forward of `tokens` [B, T] after `context` random tokens of cache (see the
    module docstring). Returns {"pieces": [{"layer", "kind", "part", "kernel", "median_s", "min_s", "max_s"}],
    "whole": Timing fields, "sum_median_s", "replay_max_abs_diff" (the pieces' logits vs the whole's), "by_part":
    {part: {"median_s", "min_s", "max_s" (sums over its pieces), "share"}}, "by_kind": {...; "kernel"}} (shares of
    the sum of medians). A piece's kernel is the implementation its op runs (`layer_kernels`)."""
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
    fns, setup, labels, kernel = {}, {}, {}, {}

    def add(key, label, fn, args, cache_arg=None):
        labels[key] = label
        kernel[key] = "XLA" if label[0] is None else layer_kinds[label[0]][label[2]]
        if cache_arg is None:
            fns[key] = lambda fn=fn, args=args: fn(*args)
        else:
            fns[key] = lambda c, fn=fn, args=args: fn(c, *args)
            setup[key] = lambda c=cache_arg: _copy(c)

    add("embed", (None, None, "embed"), _program(model.embed, lambda m, x: m(x)), (toks,))
    e = model.embed(toks)
    layer_kinds = [layer_kernels(layer, b * t, e.dtype, cfg.num_experts_per_tok) for layer in model.layers]
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
    pieces = [dict(layer=labels[k][0], kind=labels[k][1], part=labels[k][2], kernel=kernel[k],
                   **{f: getattr(times[k], f) for f in ("median_s", "min_s", "max_s")}) for k in labels]  # fmt: skip
    total = sum(p["median_s"] for p in pieces)
    by_part, by_kind = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    kernels_of = collections.defaultdict(set)
    for p in pieces:
        group = f"{p['kind']} {p['part']}" if p["kind"] else p["part"]
        kernels_of[group].add(p["kernel"])
        for f in ("median_s", "min_s", "max_s"):
            by_part[p["part"]][f] += p[f]
            by_kind[group][f] += p[f]

    def shares(c, kernels=None):
        out = {}
        for k, v in sorted(c.items(), key=lambda kv: -kv[1]["median_s"]):
            out[k] = {**v, "share": v["median_s"] / total}
            if kernels is not None:
                out[k]["kernel"] = ", ".join(sorted(kernels[k]))
        return out

    return dict(tokens=[b, t], context=context, pieces=pieces, whole=times["whole"].to_dict(),
                sum_median_s=total, replay_max_abs_diff=replay, by_part=shares(by_part), by_kind=shares(by_kind, kernels_of))  # fmt: skip
