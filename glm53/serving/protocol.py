"""The HTTP APIs' request models (pydantic) and the thin adapters onto one internal request (`Generation`).

OpenAI: chat completions and completions; Anthropic: messages and count_tokens. Unknown top-level fields are
refused (both APIs do), nested message parts are read by glm53.serving.content (text only: media refused,
earlier thinking dropped). Each adapter takes the server's `Limits` (keyword `limits`, default `Limits()`): stop
strings, tools, a tool's name and schema depth are bounded by it. Every string that reaches the tokenizer or
the chat template (contents, system, prompt, tools, tool_choice, stop) must be valid Unicode (no lone
surrogate). `ApiError` (glm53.serving.errors) carries an HTTP status, an error type and the offending parameter;
the app writes it in the calling API's error shape; `Generation.api` says which API a request came from, for
`param_for` / `api_error` (an engine's `ValueError("prompt: ...")` is about `messages` for chat and Anthropic).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from glm53.serving import content as C
from glm53.serving import tools as T
from glm53.serving.constrain import Constraint, TokenTable
from glm53.serving.engine import Request
from glm53.serving.errors import (  # noqa: F401 - re-exported: the app's names for them
    ANTHROPIC_ERROR_TYPES,
    OPENAI_ERROR_TYPES,
    ApiError,
    api_error,
    check_text,
    clip,
    error_body,
    param_for,
    validation_error,
)
from glm53.serving.limits import INT32_MAX, Limits
from glm53.serving.reasoning import THINK_CLOSE, THINK_OPEN, anthropic_thinking, openai_thinking


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------------------ OpenAI
class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's call


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=INT32_MAX)  # an extension (vLLM, llama.cpp)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=0, le=0)
    presence_penalty: float | None = Field(None, ge=0, le=0)


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # thinking unless "none" (glm53.serving.reasoning)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: {"enable_thinking": bool}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = Field(False, le=False)


# ------------------------------------------------------------------------------------------------ Anthropic
class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _AnthropicBase(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(_AnthropicBase):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0, le=1)  # not in the newest SDK's signature: send it in extra_body
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    stop_sequences: list[str] | None = None
    stream: bool = False


class CountTokensRequest(_AnthropicBase):
    pass


# ------------------------------------------------------------------------------------------------ internal
@dataclasses.dataclass
class Generation:
    """The one internal request both APIs become: the engine request plus how to answer."""

    request: Request
    stream: bool
    include_usage: bool = False
    tools: T.ToolMode | None = None  # tools offered / a call forced: the answer is parsed for calls
    thinking: bool = False  # the prompt ends inside a <think> block: the generation starts as reasoning
    api: str = "chat"  # "chat", "completion" or "anthropic" (glm53.serving.errors.param_for)


def _check_unicode(r: BaseModel, fields: tuple[str, ...]) -> None:
    """400 naming the first string of these fields (all the text that reaches the tokenizer) that holds a lone
    surrogate, e.g. `messages[0].content`."""
    for f in fields:
        v = getattr(r, f, None)
        if v is not None:
            check_text([m.model_dump() for m in v] if f == "messages" else v, f)


def _render(tok, messages: list[dict], mode: T.ToolMode | None = None, thinking: bool = False) -> list[int]:
    """The chat template's prompt; with tools, their system message first and a forced call's prefix last; with
    thinking, rendered with enable_thinking=True and ending inside a `<think>` block."""
    if mode is not None:
        messages = [{"role": "system", "content": T.render_tools(mode.tools)}, *messages]
    kw = {"enable_thinking": True} if thinking else {}
    try:
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, **kw))
    except ValueError as e:  # TokenizerError: a template that refuses the conversation
        raise ApiError(400, f"messages: {clip(str(e), 1000)}", "messages") from None
    if thinking:
        open_ids = list(tok.encode(THINK_OPEN, add_special_tokens=False))
        if ids[-len(open_ids) :] != open_ids:
            ids += open_ids
    if mode is not None and mode.forced_prefix:
        ids += list(tok.encode(mode.forced_prefix, add_special_tokens=False))
    return ids


def _named(fn, *args):
    """fn(*args), its ValueError ("field: ...") a 400 naming the field."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(":")[0]) from None


def _no_forced_call(thinking: bool, mode: T.ToolMode | None) -> None:
    if thinking and mode is not None and mode.force is not None:
        raise ApiError(400, "thinking: cannot be enabled when tool_choice forces a tool call", "thinking")


def _stop(stop, limits: Limits, param: str = "stop") -> tuple[str, ...]:
    """The stop strings: at most `max_stop`, each non-empty and at most `max_stop_chars` characters."""
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"{param}: at most {limits.max_stop} stop sequences ({len(stop)} were given)", param)
    for i, s in enumerate(stop):
        if not s:
            raise ApiError(400, f"{param}: stop sequences must be non-empty", param)
        if len(s) > limits.max_stop_chars:
            raise ApiError(400, f"{param}: a stop sequence is at most {limits.max_stop_chars} characters "
                                f"({param}[{i}] has {len(s)})", param)  # fmt: skip
    return tuple(stop)


def _types(props: dict, keys: list[str]) -> dict:
    """Each key's schema `type` (any JSON value: constrain.first_chars reads a name or a list of names and
    leaves anything else free)."""
    return {k: props[k].get("type") for k in keys if isinstance(props[k], dict)}


def _request(api: str, prompt, max_tokens, r, stop, default_max: int, mode: T.ToolMode | None = None,
             think_budget: tuple[int, list[int]] | None = None, tok=None) -> Request:  # fmt: skip
    """A forced call (with `tok`) is decoded under a constraint (glm53.serving.constrain): its arguments (and its
    name, when the model picks the tool) always parse, a named tool's top-level keys are its schema's properties
    (unless additionalProperties is true) and their values begin as their `type` (a list of types: as one of
    them; a malformed type: free), and it stops as soon as the object closes (without `tok`: unconstrained, it
    stops when its arguments are a whole JSON object or can no longer be one)."""
    until, constraint = (T.arguments_done if mode is not None and mode.force else None), None
    if mode is not None and mode.force is not None and tok is not None:
        names = () if mode.force else [t.name for t in mode.tools]
        schema = next((t.parameters for t in mode.tools if t.name == mode.force), None)
        props = schema.get("properties") if isinstance(schema, dict) else None
        keys = list(props) if isinstance(props, dict) and schema.get("additionalProperties") is not True else []
        constraint = Constraint(TokenTable.of(tok), names, max_tokens or default_max, keys, _types(props, keys))
        until = constraint.done
    try:
        return Request(prompt=prompt, max_tokens=max_tokens or default_max, temperature=r.temperature,
                       top_p=r.top_p, top_k=r.top_k, seed=getattr(r, "seed", None) or 0, stop=stop,
                       until=until, think_budget=think_budget, constraint=constraint)  # fmt: skip
    except ValueError as e:
        raise api_error(api, e) from None


_CHAT_TEXT = ("messages", "tools", "tool_choice", "stop")
_ANTHROPIC_TEXT = ("system", "messages", "tools", "tool_choice", "stop_sequences")


def openai_chat(r: ChatRequest, tok, max_len: int, *, limits: Limits | None = None) -> Generation:
    """max_tokens defaults to the rest of the context (`max_len` positions); a prompt that fills the context is
    a 400 about `messages`."""
    limits = limits or Limits()
    _check_unicode(r, _CHAT_TEXT)
    stop = _stop(r.stop, limits)
    mode = _named(T.openai_tools, r.tools, r.tool_choice, "tools", limits)
    thinking = _named(openai_thinking, r.reasoning_effort, r.chat_template_kwargs)
    _no_forced_call(thinking, mode)
    prompt = _render(tok, [C.openai_message(m, i) for i, m in enumerate(r.messages)], mode, thinking)
    if len(prompt) >= max_len:
        raise ApiError(400, f"messages: the prompt's {len(prompt)} tokens leave no room for an answer in the "
                            f"context of {max_len} tokens", "messages")  # fmt: skip
    inc = bool(r.stream_options and r.stream_options.include_usage)
    stop += (T.CALL_CLOSE,) if mode and mode.force is not None else ()
    req = _request("chat", prompt, r.max_completion_tokens or r.max_tokens, r, stop, max_len - len(prompt),
                   mode, tok=tok)  # fmt: skip
    return Generation(req, r.stream, inc, mode, thinking, api="chat")


def openai_completion(r: CompletionRequest, tok, vocab_size: int, default_max: int = 16, *,
                      limits: Limits | None = None) -> Generation:  # fmt: skip
    limits = limits or Limits()
    _check_unicode(r, ("prompt", "stop"))
    stop = _stop(r.stop, limits)
    if isinstance(r.prompt, str):
        prompt = list(tok.encode(r.prompt))
    else:
        if any(not 0 <= t < vocab_size for t in r.prompt):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", "prompt")
        prompt = list(r.prompt)
    if not prompt:
        raise ApiError(400, "prompt: encodes to no tokens", "prompt")
    inc = bool(r.stream_options and r.stream_options.include_usage)
    req = _request("completion", prompt, r.max_tokens, r, stop, default_max)
    return Generation(req, r.stream, inc, api="completion")


def anthropic_prompt(r: _AnthropicBase, tok, mode: T.ToolMode | None = None, thinking: bool = False) -> list[int]:
    msgs = [{"role": "system", "content": C.anthropic_system(r.system)}] if r.system else []
    for i, m in enumerate(r.messages):
        msgs += C.anthropic_message(m, i)
    return _render(tok, msgs, mode, thinking)


def _anthropic_mode(r: _AnthropicBase, limits: Limits | None) -> tuple[T.ToolMode | None, bool, int | None]:
    _check_unicode(r, _ANTHROPIC_TEXT)
    mode = _named(T.anthropic_tools, r.tools, r.tool_choice, limits or Limits())
    thinking, budget = _named(anthropic_thinking, r.thinking)
    return mode, thinking, budget


def anthropic_count(r: _AnthropicBase, tok, *, limits: Limits | None = None) -> int:
    """count_tokens: the prompt's length, tools, thinking's opening and a forced call's prefix included."""
    mode, thinking, _ = _anthropic_mode(r, limits)
    return len(anthropic_prompt(r, tok, mode, thinking))


def anthropic_messages(r: MessagesRequest, tok, *, limits: Limits | None = None) -> Generation:
    mode, thinking, budget = _anthropic_mode(r, limits)
    stop = _stop(r.stop_sequences, limits or Limits(), "stop_sequences")
    _no_forced_call(thinking, mode)
    if mode and mode.force is not None:
        stop += (T.CALL_CLOSE,)
    if budget is not None and budget >= r.max_tokens:
        raise ApiError(400, f"thinking.budget_tokens: {clip(str(budget))} must be less than max_tokens "
                            f"{clip(str(r.max_tokens))}", "thinking.budget_tokens")  # fmt: skip
    close = list(tok.encode(THINK_CLOSE, add_special_tokens=False)) if budget is not None else []
    req = _request("anthropic", anthropic_prompt(r, tok, mode, thinking), r.max_tokens, r, stop, r.max_tokens,
                   mode, (budget, close) if budget is not None else None, tok)  # fmt: skip
    return Generation(req, r.stream, tools=mode, thinking=thinking, api="anthropic")


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn", "error": "end_turn"}
