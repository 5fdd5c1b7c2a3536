"""The engine's requests and what it sends back: `Request`, `Event` (to a request's `Sink`), `QueueFull`, `Closed`.

Validation is the engine's boundary: whatever `Request` and `check_request` accept, the engine's programs can
represent (int32 top_k and token ids, float32 sampling parameters, a context that holds the prompt); each
ValueError's message starts with the field's name (`top_k=...: ...`, `prompt: ...`), which the HTTP layer
reports as the bad parameter.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import numpy as np

from glm53.runtime import sampling
from glm53.serving.limits import INT32_MAX, Limits

F32_MAX = float(np.finfo(np.float32).max)


class QueueFull(RuntimeError):
    """The engine holds as many live requests as it may (slots + max_queue): the request is refused (HTTP 429)."""


class Closed(RuntimeError):
    """The engine is draining (`Engine.drain`: the server is shutting down): the request is refused (HTTP 503)."""


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
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field (also run by `check_request`: a field set after construction)."""
        sampling.check_params(self.temperature, self.top_p, self.top_k)
        if self.top_k > INT32_MAX:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer in [0, {INT32_MAX}] (0 = off)")
        if self.temperature > F32_MAX:
            raise ValueError(f"temperature={self.temperature!r}: must be at most {F32_MAX:.4g} (float32)")
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
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop: stop sequences must be non-empty strings")  # not echoed: it may be large
        self.stop = tuple(self.stop)


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


def _ids_ok(ids, vocab_size: int) -> bool:
    return all(
        not isinstance(t, bool) and isinstance(t, numbers.Integral) and 0 <= t < vocab_size for t in ids
    )


def check_request(
    req: Request, vocab_size: int, max_len: int, has_text: bool, limits: Limits | None = None
) -> None:
    """ValueError naming the field when `req` cannot run on an engine of this vocabulary and context (has_text:
    the engine detokenizes, which constrained decoding needs; limits: its stop strings' bounds, default Limits())."""
    limits = Limits() if limits is None else limits
    req.validate()
    p = req.prompt
    if not isinstance(p, list) or not p:
        raise ValueError("prompt: at least one token is needed")
    if not _ids_ok(p, vocab_size):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if len(p) >= max_len:
        raise ValueError(f"prompt: {len(p)} tokens; the context holds {max_len} (prompt and new tokens)")
    if len(req.stop) > limits.max_stop:
        raise ValueError(f"stop: {len(req.stop)} stop sequences; at most {limits.max_stop}")
    if any(len(s) > limits.max_stop_chars for s in req.stop):
        raise ValueError(f"stop: a stop sequence of {max(map(len, req.stop))} characters; at most "
                         f"{limits.max_stop_chars}")  # fmt: skip
    eos = req.eos_ids
    if eos is not None and not (
        isinstance(eos, (list, tuple, set, frozenset)) and _ids_ok(eos, INT32_MAX + 1)
    ):
        raise ValueError(f"eos_ids: token ids must be integers in [0, {INT32_MAX}]")
    if req.think_budget is not None:
        b = req.think_budget
        ok = isinstance(b, (tuple, list)) and len(b) == 2 and not isinstance(b[0], bool)
        if not (ok and isinstance(b[0], numbers.Integral) and b[0] >= 0 and isinstance(b[1], (list, tuple))
                and b[1] and _ids_ok(b[1], vocab_size)):  # fmt: skip
            raise ValueError(f"think_budget: (N >= 0, the closing token ids in [0, {vocab_size})) expected")
    if req.until is not None and not callable(req.until):
        raise ValueError("until: must be callable (text -> bool)")
    if req.constraint is not None and not callable(getattr(req.constraint, "allowed", None)):
        raise ValueError("constraint: must have allowed(text, n) -> bool [V]")
    if len(p) + req.max_tokens > max_len:
        raise ValueError(f"max_tokens: the prompt's {len(p)} tokens + max_tokens {req.max_tokens} exceed the "
                         f"context of {max_len} tokens")  # fmt: skip
    if req.constraint is not None and not has_text:
        raise ValueError("constraint: constrained decoding needs the engine's detokenize (the text so far)")
