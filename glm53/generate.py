"""Generation: jitted prefill / decode steps with donated caches, batched streams at different positions,
greedy or temperature / top-p / top-k sampling, EOS stops, and MTP speculative decoding.

The model is split once (`nnx.split`) into a graph definition and a state; every step is a pure jitted function
of (state, cache, tokens). Streams share one batched cache; each stream has its own length, so streams with
prompts of different lengths are prefilled one at a time into their rows of the cache and then decoded together.
A model placed on a mesh (`glm53.parallel.shard_model`) runs sharded; given that mesh and its rules, the
generator also keeps every cache it makes or returns in the cache shardings (`glm53.parallel.cache_shardings`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from glm53 import parallel as S
from glm53 import sampling
from glm53.layers.hyper_connections import HyperConnection
from glm53.layers.linear import Linear
from glm53.layers.moe import Experts
from glm53.model import Cache, Glm53Model
from kernels.matmul import cpu_ffi as matmul_ffi
from kernels.matmul.streamed import StreamedKernel
from kernels.moe import api as moe_api
from kernels.moe import expert_list


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
        sampling.check_params(self.temperature, self.top_p, self.top_k)
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


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per stream (EOS included when hit)
    prefill_s: float
    decode_s: float
    decode_steps: int
    accepted: int = 0  # speculative decoding: accepted drafts
    drafted: int = 0  # speculative decoding: drafts proposed
    steady_s: float = 0.0  # decode time after the first decode step (which includes compilation)
    steady_steps: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.tokens)
        return n / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def steady_tokens_per_s(self) -> float:
        """Decode steps per second per stream after the first (compiling) step; nan with fewer than 2 steps."""
        return self.steady_steps / self.steady_s if self.steady_s > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


def decode_state(model: Glm53Model, state: nnx.State, tokens: int = 1) -> nnx.State:
    """`state` for decode programs on the CPU: the same arrays (no copy), some wrapped so that their few-row
    products stream the weights once.

    - Every Linear kernel and mHC projection `fn` (f32 [in, out] on one CPU device) as a `StreamedKernel` when
      the C++ row-matmul kernel is available (kernels/matmul: products with <= MAX_ROWS rows run there, larger
      ones are jnp.matmul).
    - The dense routed-expert kernels of every MoE layer that decodes `tokens` tokens (all streams of a step
      together) with the xla_cpu form (moe_impl "xla_cpu", or "auto" on the CPU backend): `StreamedKernel`s
      (the decode form runs the row-matmul kernel over the distinct experts) when it is available, else
      `ExpertList`s (kernels/moe/expert_list.py: views of the stacked kernel; XLA:CPU copies every expert slice
      of a stacked kernel before its matmul).

    The layers of a LayerStack (scan_layers) keep their arrays: their parameters carry a leading repeat axis that
    the scan slices per layer (a per-expert view would be a copy). The state itself when nothing qualifies."""
    wrap = {}
    streamed = matmul_ffi.available()
    slots = tokens * model.cfg.num_experts_per_tok
    for path, m in nnx.iter_graph(model):
        if isinstance(m, Linear) and streamed and _on_one_cpu(m.kernel.get_value(), 2):
            wrap[(*path, "kernel")] = StreamedKernel
        if isinstance(m, HyperConnection) and streamed and _on_one_cpu(m.fn.get_value(), 2):
            wrap[(*path, "fn")] = StreamedKernel
        if not isinstance(m, Experts):
            continue
        if moe_api.select_implementation(m.implementation, slots, m.decode_max_slots) != "xla_cpu_decode":
            continue
        ws = [getattr(m, k).get_value() for k in _EXPERT_MATRICES]
        on_cpu = (isinstance(w, jax.Array) and w.ndim == 3 and {d.platform for d in w.devices()} == {"cpu"}
                  for w in ws)  # fmt: skip
        if all(on_cpu):
            split = StreamedKernel if streamed and all(_on_one_cpu(w, 3) for w in ws) else expert_list.split_experts
            wrap.update({(*path, k): split for k in _EXPERT_MATRICES})
    if not wrap:
        return state
    flat = [(p, v.replace(wrap[p](v.get_value())) if p in wrap else v) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def _on_one_cpu(w, ndim: int) -> bool:
    return (isinstance(w, jax.Array) and w.ndim == ndim and w.dtype == jnp.float32
            and len(w.devices()) == 1 and next(iter(w.devices())).platform == "cpu")  # fmt: skip


# ------------------------------------------------------------------------------------------------ caches
def map_layers(fn, layers: tuple, *others: tuple) -> tuple:
    """fn(layer cache, *the others' entries at the same place, lead=...) for every layer cache of a `Cache.layers`
    tuple. A LayerStack's entry (glm53.layers.stack: a tuple over its period positions of caches whose arrays are
    [repeats, B, ...]) gives fn each position's cache with lead=1, a plain layer's cache comes with lead=0: fn's
    batch axis is `lead`, its sequence axis lead + 1. The stack is read and written where it lies (no unstacking,
    no copy): the same slices and in-place updates as an unrolled cache's, one axis further."""

    def one(c, *o):
        if isinstance(c, tuple):
            return tuple(fn(cj, *oj, lead=1) for cj, *oj in zip(c, *o))
        return fn(c, *o, lead=0)

    return tuple(one(c, *o) for c, *o in zip(layers, *others))


def map_rows(op, cache: Cache, *others: Cache) -> Cache:
    """`cache` with op(a, *the others' arrays at the same place, axis=a's batch axis) on every array: its length,
    every layer's cache (axis 1 in a LayerStack's stacked caches, `map_layers`) and the MTP block's."""

    def per(c, *o, lead):
        return jax.tree.map(lambda a, *b: op(a, *b, axis=lead), c, *o)

    return cache.replace(
        length=op(cache.length, *(o.length for o in others), axis=0),
        layers=map_layers(per, cache.layers, *(o.layers for o in others)),
        mtp=per(cache.mtp, *(o.mtp for o in others), lead=0),
    )


def _slice_stream(cache: Cache, b: int) -> Cache:
    return map_rows(lambda a, axis: jax.lax.slice_in_dim(a, b, b + 1, axis=axis), cache)


def _put_stream(cache: Cache, b: int, sub: Cache) -> Cache:
    return map_rows(lambda a, s, axis: a.at[(slice(None),) * axis + (slice(b, b + 1),)].set(s), cache, sub)


class Generator:
    """Holds a split model and its jitted steps. Steps donate the cache argument.

    mesh / rules: the mesh and rule set the model was placed with (None: an unsharded model); caches are then
    created and kept in their shardings, so a donated cache comes back with the same layout.
    One-token steps (decode) run on `decode_state`: the state with the dense routed experts of xla_cpu MoE
    layers split per expert (`decode_state`, no copy); everything else on `state`.
    compiler_options: XLA options of the forward program (prefill and decode), e.g.
    {"xla_cpu_experimental_ynn_fusion_type": ""}; None: the backend's defaults.
    """

    def __init__(
        self,
        model: Glm53Model,
        *,
        mesh: Mesh | None = None,
        rules: str | S.Rules = "tp",
        prefill_chunk: int = 256,
        compiler_options: dict | None = None,
    ):
        self.cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        # one-token steps (decode) read the routed experts as separate arrays on the CPU (`decode_state`)
        self.decode_state = self.state if mesh is not None else decode_state(model, self.state)
        self.prefill_chunk = prefill_chunk
        self.has_mtp = model.mtp is not None

        gd = self.graphdef

        def place(cache):
            if mesh is None:
                return cache
            return jax.lax.with_sharding_constraint(cache, S.cache_shardings(cache, mesh, rules))

        @functools.partial(
            jax.jit, donate_argnums=(1,), static_argnames=("last_only",), compiler_options=compiler_options
        )
        def forward(state, cache, tokens, last_only=False):
            m = nnx.merge(gd, state)
            h, cache = m.hidden(tokens, cache=cache)
            # last_only: the lm head of the last position only (prefill needs no other; [T, D] x [D, V] is the
            # largest matmul of a long prompt when V is 155k)
            return h, m.logits(h[:, -1:] if last_only else h), place(cache)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def mtp(state, cache, h, next_tokens):
            m = nnx.merge(gd, state)
            logits, cache = m.mtp_logits(h, next_tokens, cache=cache)
            return logits, place(cache)

        @functools.partial(jax.jit, static_argnames=("top_k",))
        def sample(logits, key, temperature, top_p, top_k):
            return sampling.sample(logits, key, temperature=temperature, top_p=top_p, top_k=top_k)

        self._forward, self._mtp, self._sample = forward, mtp, sample
        self._init_cache = jax.jit(
            lambda state, batch, max_len: place(nnx.merge(gd, state).init_cache(batch, max_len)),
            static_argnums=(1, 2),
        )

    # ------------------------------------------------------------------------------------------- primitives
    def init_cache(self, batch: int, max_len: int) -> Cache:
        return self._init_cache(self.state, batch, max_len)

    def forward(
        self, cache: Cache, tokens_bt, *, last_only: bool = False
    ) -> tuple[jnp.ndarray, jnp.ndarray, Cache]:
        """(hidden [B,T,D], logits [B,T,V], cache) for T new tokens of every stream (cache is donated).

        last_only: logits [B,1,V] of the last position only."""
        tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
        state = self.decode_state if tokens_bt.shape[1] == 1 else self.state
        return self._forward(state, cache, tokens_bt, last_only=last_only)

    def prefill(self, cache: Cache, tokens_t, stream: int = 0):
        """Feeds a prompt to one stream in pieces of `prefill_chunk`; returns (hidden, logits of the last token, cache)."""
        tokens_t = np.asarray(tokens_t, np.int32)
        whole = cache.batch == 1  # slicing a batch of one may alias the buffer that the step donates
        sub = cache if whole else _slice_stream(cache, stream)
        hs = []
        for s in range(0, len(tokens_t), self.prefill_chunk):
            h, logits, sub = self.forward(sub, tokens_t[None, s : s + self.prefill_chunk], last_only=True)
            hs.append(h)
        cache = sub if whole else _put_stream(cache, stream, sub)
        return jnp.concatenate(hs, axis=1), logits[:, -1], cache

    def sample(self, logits_bv, key, sp: SamplingParams):
        return self._sample(logits_bv, key, sp.temperature, sp.top_p, sp.top_k)

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], sp: SamplingParams, *, max_len: int | None = None):
        """Generates up to sp.max_new tokens for each prompt (streams decoded together, each at its own position)."""
        prompts = [list(p) for p in prompts]
        check_prompts(prompts, self.cfg.vocab_size, self.cfg.max_position_embeddings, sp.max_new)
        b = len(prompts)
        if sp.max_new == 0:
            return GenerationResult([[] for _ in range(b)], prefill_s=0.0, decode_s=0.0, decode_steps=0)
        max_len = max_len or max(len(p) for p in prompts) + sp.max_new + 1
        cache = self.init_cache(b, max_len)
        key = jax.random.key(sp.seed)
        t0 = time.perf_counter()
        last = []
        for i, p in enumerate(prompts):
            _, lg, cache = self.prefill(cache, p, stream=i)
            last.append(lg)
        logits = jnp.concatenate(last, axis=0)
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
        out: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        eos = set(sp.eos_ids)
        steps = 0
        t_first = None
        while True:
            key, sub = jax.random.split(key)
            tok = np.asarray(self.sample(logits, sub, sp))
            for i in range(b):
                if not done[i]:
                    out[i].append(int(tok[i]))
                    done[i] = tok[i] in eos or len(out[i]) >= sp.max_new
            if done.all():
                break
            _, logits, cache = self.forward(cache, tok[:, None])
            logits = logits[:, -1]
            steps += 1
            if steps == 1:
                jax.block_until_ready(logits)
                t_first = time.perf_counter()
        t2 = time.perf_counter()
        res = GenerationResult(out, prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=steps)
        if t_first is not None and steps > 1:
            res.steady_s, res.steady_steps = t2 - t_first, steps - 1
        return res

    def generate_speculative(
        self, prompt: list[int], max_new: int, *, eos_ids=(), max_len: int | None = None
    ):
        """Greedy decoding of one stream with MTP drafts: each step verifies [next, draft] with the trunk.

        Accepted draft -> two tokens per trunk step. Rejected -> the cache from before the step is restored and
        the trunk is re-run on the single verified token, so the output is exactly greedy decoding's.
        """
        if not self.has_mtp:
            raise ValueError("generate_speculative needs a model with the MTP block")
        _check_count("max_new", max_new)
        prompt = list(prompt)
        check_prompts([prompt], self.cfg.vocab_size, self.cfg.max_position_embeddings, max_new)
        if max_new == 0:
            return GenerationResult([[]], prefill_s=0.0, decode_s=0.0, decode_steps=0)
        max_len = max_len or len(prompt) + max_new + 2
        cache = self.init_cache(1, max_len)
        t0 = time.perf_counter()
        h, last_logits, cache = self.prefill(cache, prompt)
        x_next = int(jnp.argmax(last_logits[0]))
        # MTP over the prompt: pairs (h_p, token_{p+1}) for p = 0..L-1 (the last pair uses the predicted token).
        mtp_tokens = np.asarray(list(prompt[1:]) + [x_next], np.int32)[None]
        dl, cache = self._mtp(self.state, cache, h, mtp_tokens)
        draft = int(jnp.argmax(dl[0, -1]))
        jax.block_until_ready(dl)
        t1 = time.perf_counter()
        out, eos = [x_next], set(eos_ids)
        accepted = drafted = steps = 0
        while len(out) < max_new and out[-1] not in eos:
            saved = jax.tree.map(jnp.copy, cache)  # the step donates `cache`
            h2, lg, cache2 = self.forward(cache, [[x_next, draft]])
            y0, y1 = (int(v) for v in jnp.argmax(lg[0], axis=-1))
            drafted += 1
            steps += 1
            if y0 == draft:
                accepted += 1
                new = [draft, y1]
                dl, cache = self._mtp(self.state, cache2, h2, np.asarray([[draft, y1]], np.int32))
                x_next = y1
            else:
                new = [y0]
                h1, _, cache = self.forward(saved, [[x_next]])
                dl, cache = self._mtp(self.state, cache, h1, np.asarray([[y0]], np.int32))
                x_next = y0
            draft = int(jnp.argmax(dl[0, -1]))
            for tok in new:
                if len(out) < max_new and out[-1] not in eos:
                    out.append(tok)
        t2 = time.perf_counter()
        return GenerationResult([out], t1 - t0, t2 - t1, steps, accepted=accepted, drafted=drafted)


def identity_line(spec: list[int], greedy: list[int]) -> str:
    """Whether speculative decoding gave plain greedy decoding's tokens (it must: drafts are only verified)."""
    if spec == greedy:
        return f"greedy identity: speculative and plain greedy decoding give the same {len(spec)} tokens"
    i = next((k for k, (a, b) in enumerate(zip(spec, greedy)) if a != b), min(len(spec), len(greedy)))
    return (f"greedy identity FAILS: speculative and plain greedy decoding differ from new token {i}; plain "
            f"greedy ids: {greedy}")  # fmt: skip
