"""Synchronous generation on the serving engine: prompts in, tokens out (`generate`), for the callers that want
the new tokens of a few prompts rather than a server: experiments.generate, the benchmarks, the model card's MTP
acceptance (glm53.train.card) and the tests.

`generate(model_or_engine, prompts, sp)` runs every prompt as one request of an `Engine` (glm53.serving.engine; by
default one slot per prompt, prefill chunks of `BUCKETS` tokens) in this thread, to completion. The engine's
decode path is the only one: greedy tokens are its greedy tokens, sampling draws on device with a key from
(sp.seed + the prompt's index, token index), and `speculative=True` runs its MTP speculative decoding (drafts
verified in the batched step, rejected ones rolled back from the KDA state: glm53.runtime.speculative), whose
greedy output is plain greedy decoding's (`identity_line` says whether it was).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from glm53.model import Glm53Model
from glm53.runtime.sampling import SamplingParams, check_prompts
from glm53.serving.engine import Engine, Event, Request

BUCKETS = (1, 4, 16, 64, 256)  # prefill chunk sizes: any prompt splits into at most 3 chunks of each


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (EOS included when hit)
    prefill_s: float  # until every prompt's first token (compiles on a cold engine)
    decode_s: float  # from then to the last token
    decode_steps: int
    accepted: int = 0  # speculative decoding: accepted drafts
    drafted: int = 0  # speculative decoding: drafts proposed
    steady_s: float = 0.0  # decode time after the first decode step (which compiles on a cold engine)
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


def engine_for(model: Glm53Model, prompts: Sequence[Sequence[int]], max_new: int, *, slots: int | None = None,
               buckets: Sequence[int] = BUCKETS, **engine_kw) -> Engine:  # fmt: skip
    """An engine sized for `prompts` and `max_new` new tokens each (slots: one per prompt unless given); engine_kw
    go to `Engine` (speculative, compiler_options, mesh, rules, decode_widths, ...)."""
    need = max(len(p) for p in prompts) + max_new
    max_len = max(min(need + 2, model.cfg.max_position_embeddings), need)  # + 2: a speculative step's two rows
    return Engine(model, slots=slots or len(prompts), max_len=max_len, buckets=buckets, **engine_kw)


def generate(model: Glm53Model | Engine, prompts: list[list[int]], sp: SamplingParams | None = None, *,
             slots: int | None = None, **engine_kw) -> GenerationResult:  # fmt: skip
    """Up to sp.max_new new tokens for each prompt (sp None: greedy, 32; module docstring); ValueError for bad
    prompts (`check_prompts`). `model`: a model (an engine is built for the call: `engine_for` with slots / engine_kw)
    or an engine to reuse (compiled programs kept across calls; it must fit the prompts)."""
    sp = SamplingParams() if sp is None else sp
    if isinstance(prompts, list):
        prompts = [list(p) if isinstance(p, (list, tuple)) else p for p in prompts]
    cfg = model.cfg
    check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings, sp.max_new)
    if sp.max_new == 0:
        return GenerationResult([[] for _ in prompts], prefill_s=0.0, decode_s=0.0, decode_steps=0)
    eng = model if isinstance(model, Engine) else engine_for(model, prompts, sp.max_new, slots=slots, **engine_kw)
    out: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    ends: dict[int, Event] = {}

    def sink(i):
        def on(ev: Event) -> None:
            times[i].extend([time.perf_counter()] * len(ev.token_ids))
            out[i].extend(ev.token_ids)
            if ev.finish_reason is not None:
                ends[i] = ev

        return on

    steps0 = eng.stats["steps"]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.submit(Request(p, max_tokens=sp.max_new, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                           seed=sp.seed + i, eos_ids=tuple(sp.eos_ids)), sink(i))  # fmt: skip
    eng.run_until_idle()
    for i, ev in ends.items():
        if ev.finish_reason == "error":
            raise RuntimeError(f"prompt {i}: {ev.error}")
    steps = eng.stats["steps"] - steps0
    first = max(t[0] for t in times)
    last = max(t[-1] for t in times)
    res = GenerationResult(out, prefill_s=first - t0, decode_s=last - first, decode_steps=steps,
                           accepted=sum(e.accepted for e in ends.values()),
                           drafted=sum(e.drafted for e in ends.values()))  # fmt: skip
    after = [x for t in times for x in t if x > first]  # tokens of the decode steps after the prefill
    second = min(after, default=None)
    if second is not None and steps > 1 and last > second:
        res.steady_s, res.steady_steps = last - second, steps - 1
    return res


def identity_line(spec: list[int], greedy: list[int]) -> str:
    """Whether speculative decoding gave plain greedy decoding's tokens (it must: drafts are only verified)."""
    if spec == greedy:
        return f"greedy identity: speculative and plain greedy decoding give the same {len(spec)} tokens"
    i = next((k for k, (a, b) in enumerate(zip(spec, greedy)) if a != b), min(len(spec), len(greedy)))
    return (f"greedy identity FAILS: speculative and plain greedy decoding differ from new token {i}; plain "
            f"greedy ids: {greedy}")  # fmt: skip
