"""Answers in each API's shape, built from the engine's events (`glm53.serving.engine.Event`).

A chat generation is split by `Pieces` into reasoning (glm53.serving.reasoning), content and tool calls
(glm53.serving.tools); OpenAI gets `reasoning_content` / `content` / `tool_calls` (in the message, or as
`delta`s of `chat.completion.chunk`s ending `data: [DONE]`), Anthropic gets `thinking`, `text` and `tool_use`
content blocks (or the event stream: `message_start`, `content_block_start` / `_delta` (thinking_delta,
text_delta, input_json_delta) / `_stop` per block, `message_delta` with the stop reason and usage,
`message_stop`). A forced call's name is known before its arguments are generated, so its block (its
`tool_calls` delta) opens at once; every call's arguments are sent when the generation ends, parsed (a call the
model chose freely falls back to `{}` when its arguments are not JSON; a forced call's are decoded under the JSON
constraint of glm53.serving.constrain and always parse). A failed generation (an "error" event) ends a stream
with the API's error event (`error_event`: OpenAI `data: {"error": {...}}` then `data: [DONE]`, Anthropic
`event: error`) and a whole answer with a 500 `ApiError`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from glm53.serving import protocol as P
from glm53.serving import tools as T
from glm53.serving.engine import Event
from glm53.serving.reasoning import ThinkStream

Events = AsyncIterator[Event]


class Pieces:
    """A chat generation's text as ("reasoning" | "content", text) pieces as it streams, then its calls."""

    def __init__(self, gen: P.Generation):
        forced = gen.tools is not None and gen.tools.force is not None
        self.think = None if forced else ThinkStream(gen.thinking)  # a forced call's text is its arguments
        self.content = T.ContentStream(gen.tools)
        self.reasoning_text, self.content_text = "", ""

    def _route(self, pieces) -> list[tuple[str, str]]:
        out = []
        for kind, text in pieces:
            if kind == "content":
                text = self.content.push(text)
            if text:
                out.append((kind, text))
                if kind == "reasoning":
                    self.reasoning_text += text
                else:
                    self.content_text += text
        return out

    def push(self, delta: str) -> list[tuple[str, str]]:
        return self._route(self.think.push(delta) if self.think else [("content", delta)])

    def finish(self) -> tuple[list[tuple[str, str]], list[T.ToolCall]]:
        out = self._route(self.think.finish()) if self.think else []
        rest, calls = self.content.finish()
        if rest:
            out.append(("content", rest))
            self.content_text += rest
        return out, calls


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _failure(ev: Event) -> str:
    return f"generation failed: {ev.error or 'internal error'}"


def _check(ev: Event) -> None:
    """A failed generation (logged where its event arrived) as a 500 in the API's shape."""
    if ev.finish_reason == "error":
        e = P.ApiError(500, _failure(ev), None, "api_error")
        e.logged = True
        raise e


def error_event(api: str, message: str) -> str:
    """The terminal error of a stream: OpenAI's error chunk then `data: [DONE]` (as vLLM sends it), Anthropic's
    `event: error`."""
    body = P.error_body(api, P.ApiError(500, message, None, "api_error"))
    if api == "anthropic":
        return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
    return _sse(body) + "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------ OpenAI
def _usage(ev: Event) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}  # fmt: skip


def _finish(ev: Event) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def _call_json(c: T.ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}


async def openai_body(gen: P.Generation, events: Events, model: str, chat: bool) -> dict:
    """A whole `chat.completion` / `text_completion`."""
    pieces = Pieces(gen) if chat else None
    text = []
    async for ev in events:
        if pieces is not None:
            pieces.push(ev.text)
        else:
            text.append(ev.text)
    _check(ev)
    reason = _finish(ev)
    if chat:
        _, calls = pieces.finish()
        msg = {"role": "assistant", "content": pieces.content_text}
        if gen.thinking or pieces.reasoning_text:
            msg["reasoning_content"] = pieces.reasoning_text
        if calls:
            msg.update(content=pieces.content_text or None, tool_calls=[_call_json(c) for c in calls])
            reason = "tool_calls"
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": reason}
    return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(ev)}  # fmt: skip


async def openai_stream(gen: P.Generation, events: Events, model: str, chat: bool) -> AsyncIterator[str]:
    """`data:` chunks ending `data: [DONE]`; the usage chunk last when `stream_options.include_usage`."""
    oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(delta_or_text, reason=None):
        c = {"index": 0, "finish_reason": reason, "logprobs": None}
        c.update({"delta": delta_or_text} if chat else {"text": delta_or_text})
        d = {"id": oid, "object": obj, "created": created, "model": model, "choices": [c]}
        if gen.include_usage:
            d["usage"] = None
        return _sse(d)

    def deltas(pieces):
        for kind, text in pieces:
            yield chunk({"reasoning_content" if kind == "reasoning" else "content": text})

    mode = gen.tools if chat else None
    forced = mode is not None and mode.force
    pieces = Pieces(gen) if chat else None
    if chat:
        yield chunk({"role": "assistant", "content": ""})
    if forced:  # the name is known before the arguments are generated
        call = T.ToolCall(mode.force, {})
        yield chunk({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]})  # fmt: skip
    async for ev in events:
        if chat:
            for c in deltas(pieces.push(ev.text)):
                yield c
        elif ev.text:
            yield chunk(ev.text)
        if ev.finish_reason is None:
            continue
        if ev.finish_reason == "error":
            yield error_event("openai", _failure(ev))
            return
        reason = _finish(ev)
        if chat:
            rest, calls = pieces.finish()
            for c in deltas(rest):
                yield c
            for k, call in enumerate(calls):
                d = {"index": k, "function": {"arguments": call.arguments_json}}
                if not forced:
                    d.update(id=call.id, type="function")
                    d["function"]["name"] = call.name
                yield chunk({"tool_calls": [d]})
            reason = "tool_calls" if calls else reason
        yield chunk({} if chat else "", reason)
        if gen.include_usage:
            yield _sse({"id": oid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": _usage(ev)})  # fmt: skip
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------ Anthropic
def _stop_reason(ev: Event, calls) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if ev.stop_sequence:
        return "stop_sequence", ev.stop_sequence
    return P.STOP_REASONS[ev.finish_reason], None


def _tool_use(c: T.ToolCall, input_=None) -> dict:
    return {"type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name,
            "input": c.arguments if input_ is None else input_}  # fmt: skip


async def anthropic_body(gen: P.Generation, events: Events, model: str) -> dict:
    pieces = Pieces(gen)
    async for ev in events:
        pieces.push(ev.text)
    _check(ev)
    _, calls = pieces.finish()
    content = []
    if gen.thinking or pieces.reasoning_text:
        content.append({"type": "thinking", "thinking": pieces.reasoning_text, "signature": ""})
    if pieces.content_text or not calls:
        content.append({"type": "text", "text": pieces.content_text})
    content += [_tool_use(c) for c in calls]
    reason, stop_seq = _stop_reason(ev, calls)
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": stop_seq,
            "usage": {"input_tokens": len(gen.request.prompt), "output_tokens": ev.completion_tokens}}  # fmt: skip


class _Blocks:
    """The content blocks of an Anthropic stream: a new block starts when the kind of content changes."""

    DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
             "tool_use": ("input_json_delta", "partial_json")}  # fmt: skip

    def __init__(self):
        self.index, self.kind = -1, None

    def start(self, block: dict) -> list[str]:
        out = self.stop()
        self.index, self.kind = self.index + 1, block["type"]
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def delta(self, kind: str, text: str) -> list[str]:
        out = []
        if kind != self.kind:
            empty = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}[kind]  # fmt: skip
            out = self.start(empty)
        name, field = self.DELTA[kind]
        return out + [_event("content_block_delta", {"index": self.index, "delta": {"type": name, field: text}})]


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def anthropic_stream(gen: P.Generation, events: Events, model: str) -> AsyncIterator[str]:
    mid = "msg_" + uuid.uuid4().hex[:24]
    yield _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": len(gen.request.prompt), "output_tokens": 0}}})  # fmt: skip
    blocks, pieces = _Blocks(), Pieces(gen)
    forced = gen.tools is not None and gen.tools.force
    if forced:  # the name is known before the arguments are generated: a tool_use block at once
        for e in blocks.start(_tool_use(T.ToolCall(forced, {}), {})):
            yield e
    yield _event("ping", {})
    async for ev in events:
        for kind, text in pieces.push(ev.text):
            for e in blocks.delta("thinking" if kind == "reasoning" else "text", text):
                yield e
        if ev.finish_reason is None:
            continue
        if ev.finish_reason == "error":
            yield error_event("anthropic", _failure(ev))
            return
        rest, calls = pieces.finish()
        for kind, text in rest:
            for e in blocks.delta("thinking" if kind == "reasoning" else "text", text):
                yield e
        for k, c in enumerate(calls):
            if not (forced and k == 0):
                for e in blocks.start(_tool_use(c, {})):
                    yield e
            for e in blocks.delta("tool_use", c.arguments_json):
                yield e
        if blocks.index < 0:  # nothing was generated: one empty text block
            for e in blocks.start({"type": "text", "text": ""}):
                yield e
        for e in blocks.stop():
            yield e
        reason, stop_seq = _stop_reason(ev, calls)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                                       "usage": {"output_tokens": ev.completion_tokens}})  # fmt: skip
        yield _event("message_stop", {})
