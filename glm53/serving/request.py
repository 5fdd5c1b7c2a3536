"""The engine's requests and what it sends back: `Request`, `Event` (to a request's `Sink`), `QueueFull`."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

from glm53 import sampling


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: the request is refused (HTTP 429 / 503)."""


@dataclasses.dataclass
class Request:
    """One generation request: prompt token ids and how to sample / stop. ValueError naming a bad field."""

    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] | None = None  # None: the engine's
    id: str = ""
    # Called with the whole text so far after each token: True ends the request ("stop"), e.g. a tool call's
    # arguments that are complete or can no longer parse (glm53.serving.tools.arguments_done).
    until: Callable[[str], bool] | None = None
    # Thinking's budget (glm53.serving.reasoning): (N, the ids of `</think>`): after N generated tokens without
    # those ids, they are fed in place of the next sampled tokens, which ends the reasoning.
    think_budget: tuple[int, list[int]] | None = None
    # Constrained decoding (glm53.serving.constrain.Constraint): `allowed(text, n) -> bool [V]` (the text and the
    # number of tokens so far) masks the logits of every sampled token, the first one included; the slot never
    # accepts MTP drafts.
    constraint: object | None = None

    def __post_init__(self):
        sampling.check_params(self.temperature, self.top_p, self.top_k)
        for name in ("max_tokens", "seed"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, numbers.Integral)
                or v < (1 if name == "max_tokens" else 0)
            ):
                raise ValueError(f"{name}={v!r}: must be an integer >= {1 if name == 'max_tokens' else 0}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: stop sequences must be non-empty strings")


@dataclasses.dataclass
class Event:
    """What a request's sink receives: new token ids and text; finish_reason set on the last event
    ("stop": EOS or a stop string, "length": max_tokens or the context, "cancelled", "error")."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the request
    drafted: int = 0  # speculative decoding (last event): MTP drafts verified for this request
    accepted: int = 0  # ... and accepted (each one a token gained)
    prefix_tokens: int = 0  # prompt tokens resumed from the prefix cache (not prefilled)


Sink = Callable[[Event], None]


def check_request(req: Request, vocab_size: int, max_len: int, has_text: bool) -> None:
    """ValueError naming the field when `req` cannot run on an engine of this vocabulary and context (has_text:
    the engine detokenizes, which constrained decoding needs)."""
    p = req.prompt
    if not isinstance(p, list) or not p:
        raise ValueError("prompt: at least one token is needed")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size for t in p):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if len(p) + req.max_tokens > max_len:
        raise ValueError(f"max_tokens: the prompt's {len(p)} tokens + max_tokens {req.max_tokens} exceed the "
                         f"context of {max_len} tokens")  # fmt: skip
    if req.constraint is not None and not has_text:
        raise ValueError("constraint: constrained decoding needs the engine's detokenize (the text so far)")
