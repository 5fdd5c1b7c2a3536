"""Each API's messages as the chat template's messages (`{"role": ..., "content": str}`): text only.

The model reads text, so a message's content becomes one string, and every kind of content block is either
read as text, rendered as text GLM style (glm53.serving.tools: calls and results), dropped, or refused with a
400 naming it (never pasted into the prompt as JSON):
  * OpenAI parts: `text` (and an assistant's `refusal`) are read; `image_url`, `input_audio`, `file` are
    refused as not supported by this model (text only); any other type is refused as unknown. An assistant's
    `tool_calls` are rendered as calls, a `tool` message as a tool result, `developer` is `system`; an
    assistant's `reasoning_content` (not a field of the OpenAI API) is ignored, like Anthropic's thinking.
  * Anthropic blocks: `text` is read; `tool_use` rendered as a call in the assistant's text, `tool_result` as
    a tool (observation) message before the user's remaining text (its own content: text blocks only); `image`
    and `document` refused as not supported (text only); `thinking` / `redacted_thinking` blocks of (previous)
    assistant turns dropped, as the Anthropic API ignores them (the shipped chat template has no place for
    earlier reasoning either: it renders `content` only); any other type refused as unknown. `system` is a
    string or text blocks.
"""

from __future__ import annotations

from glm53.serving import tools as T
from glm53.serving.errors import ApiError, clip

MEDIA = {
    "openai": ("image_url", "input_audio", "file", "input_image", "input_file"),
    "anthropic": ("image", "document"),
}
THINKING = ("thinking", "redacted_thinking")


def _refuse(api: str, kind, where: str, expected: str) -> ApiError:
    if kind in MEDIA[api]:
        return ApiError(400, f"{where}: {kind} content is not supported by this model (text only)", where)
    what = "part" if api == "openai" else "block"
    return ApiError(400, f"{where}: unknown content {what} type {clip(repr(kind))} (expected {expected})",
                    where)  # fmt: skip


def _text(part: dict, key: str, where: str) -> str:
    v = part.get(key)
    if not isinstance(v, str):
        raise ApiError(400, f"{where}.{key}: expected a string", f"{where}.{key}")
    return v


def _blocks(content, where: str) -> list:
    if not isinstance(content, list) or any(not isinstance(p, dict) for p in content):
        raise ApiError(400, f"{where}: expected a string or a list of content blocks", where)
    return content


# ------------------------------------------------------------------------------------------------ OpenAI
def _plain_text(content, where: str, api: str, kinds: tuple[str, ...]) -> str:
    """Text of a content that must be text: a string, or blocks of the `kinds` (joined); any other block is
    refused in `api`'s terms."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(_blocks(content, where)):
        w, kind = f"{where}[{j}]", part.get("type")
        if kind not in kinds:
            raise _refuse(api, kind, w, "'text'")
        out.append(_text(part, kind, w))
    return "".join(out)


def openai_message(m, i: int) -> dict:
    """One OpenAI chat message (glm53.serving.protocol.ChatMessage) as a template message."""
    where = f"messages[{i}]"
    content = _plain_text(m.content, f"{where}.content", "openai", ("text", "refusal"))
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


# ------------------------------------------------------------------------------------------------ Anthropic
def _anthropic_text(content, where: str) -> str:
    """Text of a system prompt or a tool result: a string or text blocks."""
    return _plain_text(content, where, "anthropic", ("text",))


def anthropic_system(system) -> str:
    return _anthropic_text(system, "system")


def anthropic_message(m, i: int) -> list[dict]:
    """One Anthropic message (glm53.serving.protocol.AnthropicMessage) as template messages: tool_use blocks
    become calls in the assistant's content, tool_result blocks tool (observation) messages before the user's
    remaining text, thinking blocks are dropped."""
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out, text = [], []
    for j, part in enumerate(_blocks(m.content, where)):
        w, kind = f"{where}[{j}]", part.get("type")
        if kind == "text":
            text.append(_text(part, "text", w))
        elif kind in THINKING:
            if m.role != "assistant":
                raise ApiError(400, f"{w}: {kind} blocks belong to assistant messages", w)
        elif kind == "tool_result":
            result = _anthropic_text(part.get("content"), f"{w}.content")
            out.append({"role": "tool", "content": T.render_result(result)})
        elif kind == "tool_use":
            inp = part.get("input")
            text.append(T.render_call(_text(part, "name", w), inp if isinstance(inp, dict) else {}))
        else:
            raise _refuse("anthropic", kind, w, "'text', 'tool_use', 'tool_result' or 'thinking'")
    if text or not out:
        out.append({"role": m.role, "content": "".join(text)})
    return out
