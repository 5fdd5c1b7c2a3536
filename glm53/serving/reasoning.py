"""Thinking: a generation's reasoning (between `<think>` and `</think>`) told apart from its answer.

GLM models reason in a `<think>...</think>` block that opens the assistant's turn. A request asks for thinking
(Anthropic `thinking: {"type": "enabled", "budget_tokens": N}`; OpenAI `reasoning_effort` other than "none", or
vLLM's `chat_template_kwargs: {"enable_thinking": true}`): the chat template is rendered with
`enable_thinking=True` and the prompt then ends inside the block (`<think>` is appended when the template did not
write it), so the generation starts as reasoning. A request that does not ask leaves the template's prompt as it
is; a generation that still opens with `<think>` has that block parsed as reasoning too.

`ThinkStream` splits the generated text as it streams: `push(delta)` returns the (kind, text) pieces safe to
send, kind "reasoning" or "content", holding back a tail that may begin a tag; `finish()` flushes the rest. The
tags themselves are never sent. The budget (`budget_tokens`) is enforced by the engine (`Request.think_budget`):
after that many tokens without `</think>` it feeds `</think>` instead of the next sampled token.
"""

from __future__ import annotations

from glm53.serving.errors import clip

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkStream:
    """Incremental split of generated text into reasoning and content (module docstring).

    `thinking`: the prompt ended inside a `<think>` block (the generation starts as reasoning)."""

    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "start"
        self.buf = ""  # received, not yet sent
        self.reasoning, self.content = "", ""  # everything sent so far, by kind

    def _out(self, kind: str, text: str, out: list) -> None:
        if not text:
            return
        setattr(self, kind, getattr(self, kind) + text)
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def push(self, delta: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += delta
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":  # does the generation open with <think>?
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.state, self.buf = "reasoning", s[len(THINK_OPEN) :]
                elif THINK_OPEN.startswith(s) and not final:
                    return out  # could still become <think>
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    self._out("reasoning", self.buf[:i], out)
                    self.state, self.buf = "close", self.buf[i + len(THINK_CLOSE) :]
                    continue
                hold = 0 if final else _partial_tail(self.buf, THINK_CLOSE)
                self._out("reasoning", self.buf[: len(self.buf) - hold], out)
                self.buf = self.buf[len(self.buf) - hold :]
                return out
            elif self.state == "close":  # the newlines after </think> are not content
                self.buf = self.buf.lstrip("\n")
                if self.buf:
                    self.state = "content"
            else:
                self._out("content", self.buf, out)
                self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The pieces still held back (the generation ended)."""
        return self.push("", final=True)


def split(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole generation."""
    s = ThinkStream(thinking)
    s.push(text)
    s.finish()
    return s.reasoning, s.content


def anthropic_thinking(thinking) -> tuple[bool, int | None]:
    """(enabled, budget_tokens) of an Anthropic `thinking` field; ValueError naming the field."""
    if thinking is None:
        return False, None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValueError("thinking: expected {'type': 'enabled', 'budget_tokens': N}, {'type': 'disabled'} or "
                         "{'type': 'adaptive'}")  # fmt: skip
    if thinking["type"] == "disabled":
        return False, None
    budget = thinking.get("budget_tokens")
    if thinking["type"] == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"thinking.budget_tokens: {clip(repr(budget))} is not a positive integer")
    return True, budget if thinking["type"] == "enabled" else None


def openai_thinking(reasoning_effort, chat_template_kwargs) -> bool:
    """Whether an OpenAI chat request asks for thinking; ValueError naming the field."""
    if reasoning_effort is not None and reasoning_effort not in OPENAI_EFFORTS:
        raise ValueError(f"reasoning_effort: {clip(repr(reasoning_effort))} is not one of {list(OPENAI_EFFORTS)}")
    kw = chat_template_kwargs or {}
    if "enable_thinking" in kw:
        if not isinstance(kw["enable_thinking"], bool):
            raise ValueError("chat_template_kwargs.enable_thinking: expected true or false")
        return kw["enable_thinking"]
    return reasoning_effort not in (None, "none")
