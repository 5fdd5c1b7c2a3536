"""The HTTP APIs' request models (pydantic) and the two thin adapters onto one internal request.

OpenAI: chat completions and completions; Anthropic: messages and count_tokens. Unknown top-level fields are
refused (both APIs do), nested message parts are read leniently. `ApiError` carries an HTTP status, an error type
and the offending field; the app writes it in the calling API's error shape.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from glm53.serving import tools as T
from glm53.serving.constrain import Constraint, TokenTable
from glm53.serving.engine import Request
from glm53.serving.reasoning import THINK_CLOSE, THINK_OPEN, anthropic_thinking, openai_thinking


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


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
    top_k: int = Field(0, ge=0)  # an extension (vLLM, llama.cpp)
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
    top_k: int = Field(0, ge=0)
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


def _text_of(content, where: str) -> str:
    """Text of a message's content: a string, or parts (text parts joined; other parts as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    if not isinstance(content, list) or any(not isinstance(p, dict) for p in content):
        raise ApiError(400, f"{where}: expected a string or a list of content blocks", where)
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{i}].text: expected a string", f"{where}[{i}].text")
            out.append(part["text"])
        elif kind == "tool_result":
            out.append(_text_of(part.get("content"), f"{where}[{i}].content"))
        else:
            out.append(json.dumps(part, ensure_ascii=False))
    return "".join(out)


def _render(tok, messages: list[dict], mode: T.ToolMode | None = None, thinking: bool = False) -> list[int]:
    """The chat template's prompt; with tools, their system message first and a forced call's prefix last; with
    thinking, rendered with enable_thinking=True and ending inside a `<think>` block."""
    if mode is not None:
        messages = [{"role": "system", "content": T.render_tools(mode.tools)}, *messages]
    kw = {"enable_thinking": True} if thinking else {}
    try:
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, **kw))
    except ValueError as e:  # TokenizerError: a template that refuses the conversation
        raise ApiError(400, f"messages: {e}", "messages") from None
    if thinking:
        open_ids = list(tok.encode(THINK_OPEN, add_special_tokens=False))
        if ids[-len(open_ids) :] != open_ids:
            ids += open_ids
    if mode is not None and mode.forced_prefix:
        ids += list(tok.encode(mode.forced_prefix, add_special_tokens=False))
    return ids


def _thinking(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(":")[0]) from None


def _no_forced_call(thinking: bool, mode: T.ToolMode | None) -> None:
    if thinking and mode is not None and mode.force is not None:
        raise ApiError(400, "thinking: cannot be enabled when tool_choice forces a tool call", "thinking")


def _tool_mode(fn, *args) -> T.ToolMode | None:
    try:
        return fn(*args)
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(":")[0]) from None


def _openai_message(m: ChatMessage, i: int) -> dict:
    where = f"messages[{i}]"
    content = _text_of(m.content, f"{where}.content")
    if m.role == "tool":
        return {"role": "tool", "content": T.render_result(content)}
    for j, c in enumerate(m.tool_calls or ()):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls[{j}].function: expected a name and arguments",
                           f"{where}.tool_calls[{j}].function")  # fmt: skip
        args = f.get("arguments")
        content += T.render_call(f["name"], args if isinstance(args, (str, dict)) else {})
    return {"role": "system" if m.role == "developer" else m.role, "content": content}


def _anthropic_messages(m: AnthropicMessage, i: int) -> list[dict]:
    """One Anthropic message as template messages: tool_use blocks become calls in the assistant's content,
    tool_result blocks tool (observation) messages before the user's remaining text."""
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out, rest = [], []
    for j, part in enumerate(m.content):
        kind = part.get("type")
        if kind == "tool_result":
            out.append(
                {"role": "tool", "content": T.render_result(_text_of(part.get("content"), f"{where}[{j}]"))}
            )
        elif kind == "tool_use":
            if not isinstance(part.get("name"), str):
                raise ApiError(400, f"{where}[{j}].name: expected a string", f"{where}[{j}].name")
            inp = part.get("input")
            rest.append(
                {"type": "text", "text": T.render_call(part["name"], inp if isinstance(inp, dict) else {})}
            )
        else:
            rest.append(part)
    if rest or not out:
        out.append({"role": m.role, "content": _text_of(rest, where)})
    return out


def _stop(stop) -> tuple[str, ...]:
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    if any(not s for s in stop):
        raise ApiError(400, "stop: stop sequences must be non-empty", "stop")
    return tuple(stop)


def _request(prompt, max_tokens, r, stop, default_max: int, mode: T.ToolMode | None = None,
             think_budget: tuple[int, list[int]] | None = None, tok=None) -> Request:  # fmt: skip
    """A forced call (with `tok`) is decoded under a constraint (glm53.serving.constrain): its arguments (and its
    name, when the model picks the tool) always parse, a named tool's top-level keys are its schema's properties
    (unless additionalProperties is true) and their values begin as their `type`, and it stops as soon as the
    object closes (without `tok`:
    unconstrained, it stops when its arguments are a whole JSON object or can no longer be one)."""
    until, constraint = (T.arguments_done if mode is not None and mode.force else None), None
    if mode is not None and mode.force is not None and tok is not None:
        names = () if mode.force else [t.name for t in mode.tools]
        schema = next((t.parameters for t in mode.tools if t.name == mode.force), None)
        props = schema.get("properties") if isinstance(schema, dict) else None
        keys = list(props) if isinstance(props, dict) and schema.get("additionalProperties") is not True else []
        types = {k: props[k].get("type") for k in keys if isinstance(props[k], dict)}
        constraint = Constraint(TokenTable.of(tok), names, max_tokens or default_max, keys, types)
        until = constraint.done
    try:
        return Request(prompt=prompt, max_tokens=max_tokens or default_max, temperature=r.temperature,
                       top_p=r.top_p, top_k=r.top_k, seed=getattr(r, "seed", None) or 0, stop=stop,
                       until=until, think_budget=think_budget, constraint=constraint)  # fmt: skip
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split("=")[0]) from None


def openai_chat(r: ChatRequest, tok, max_len: int) -> Generation:
    """max_tokens defaults to the rest of the context (`max_len` positions)."""
    mode = _tool_mode(T.openai_tools, r.tools, r.tool_choice)
    thinking = _thinking(openai_thinking, r.reasoning_effort, r.chat_template_kwargs)
    _no_forced_call(thinking, mode)
    prompt = _render(tok, [_openai_message(m, i) for i, m in enumerate(r.messages)], mode, thinking)
    inc = bool(r.stream_options and r.stream_options.include_usage)
    default = max(1, max_len - len(prompt))
    stop = _stop(r.stop) + ((T.CALL_CLOSE,) if mode and mode.force is not None else ())
    return Generation(_request(prompt, r.max_completion_tokens or r.max_tokens, r, stop, default, mode, tok=tok),
                      r.stream, inc, mode, thinking)  # fmt: skip


def openai_completion(r: CompletionRequest, tok, vocab_size: int, default_max: int = 16) -> Generation:
    if isinstance(r.prompt, str):
        prompt = list(tok.encode(r.prompt))
    else:
        if any(not 0 <= t < vocab_size for t in r.prompt):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", "prompt")
        prompt = list(r.prompt)
    if not prompt:
        raise ApiError(400, "prompt: encodes to no tokens", "prompt")
    inc = bool(r.stream_options and r.stream_options.include_usage)
    return Generation(_request(prompt, r.max_tokens, r, _stop(r.stop), default_max), r.stream, inc)


def anthropic_prompt(r: _AnthropicBase, tok, mode: T.ToolMode | None = None, thinking: bool = False) -> list[int]:
    msgs = []
    if r.system:
        msgs.append({"role": "system", "content": _text_of(r.system, "system")})
    for i, m in enumerate(r.messages):
        msgs += _anthropic_messages(m, i)
    return _render(tok, msgs, mode, thinking)


def anthropic_count(r: _AnthropicBase, tok) -> int:
    """count_tokens: the prompt's length, tools, thinking's opening and a forced call's prefix included."""
    thinking, _ = _thinking(anthropic_thinking, r.thinking)
    return len(anthropic_prompt(r, tok, _tool_mode(T.anthropic_tools, r.tools, r.tool_choice), thinking))


def anthropic_messages(r: MessagesRequest, tok) -> Generation:
    stop = tuple(r.stop_sequences or ())
    if any(not s for s in stop):
        raise ApiError(400, "stop_sequences: stop sequences must be non-empty", "stop_sequences")
    mode = _tool_mode(T.anthropic_tools, r.tools, r.tool_choice)
    thinking, budget = _thinking(anthropic_thinking, r.thinking)
    _no_forced_call(thinking, mode)
    if mode and mode.force is not None:
        stop += (T.CALL_CLOSE,)
    if budget is not None and budget >= r.max_tokens:
        raise ApiError(400, f"thinking.budget_tokens: {budget} must be less than max_tokens {r.max_tokens}",
                       "thinking.budget_tokens")  # fmt: skip
    close = list(tok.encode(THINK_CLOSE, add_special_tokens=False)) if budget is not None else []
    req = _request(anthropic_prompt(r, tok, mode, thinking), r.max_tokens, r, stop, r.max_tokens, mode,
                   (budget, close) if budget is not None else None, tok)  # fmt: skip
    return Generation(req, r.stream, tools=mode, thinking=thinking)


# ------------------------------------------------------------------------------------------------ errors
OPENAI_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                      429: "rate_limit_error", 503: "service_unavailable"}  # fmt: skip
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error"}  # fmt: skip


def error_body(api: str, e: ApiError) -> dict:
    if api == "anthropic":
        kind = ANTHROPIC_ERROR_TYPES.get(e.status, e.kind)
        return {"type": "error", "error": {"type": kind, "message": e.message}}
    kind = OPENAI_ERROR_TYPES.get(e.status, e.kind)
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": None}}


def validation_error(errors: list[dict]) -> ApiError:
    """The first pydantic / FastAPI validation error as a 400 naming its field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    field = ".".join(loc) or "body"
    if err.get("type") == "json_invalid":
        return ApiError(400, f"body: malformed JSON ({err.get('msg')})", "body")
    return ApiError(400, f"{field}: {err.get('msg', 'invalid')}", field)


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn", "error": "end_turn"}
