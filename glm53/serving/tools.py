"""Tool calls in the GLM chat format: rendering tools, calls and results into the conversation, and parsing calls.

The shipped chat template knows the roles `system`, `user`, `assistant` and `observation` (a `tool` message is
rendered as `<|observation|>`) and renders string contents verbatim, so tools are rendered here into strings,
GLM style:
  * the tools offered: a system message (`# Tools` ... `<tools>` one JSON schema a line `</tools>`, then how to
    call), before the conversation's own system message;
  * a call the assistant made: `<tool_call>NAME\\n{JSON arguments}</tool_call>` appended to its content;
  * a tool's result: an observation message `<tool_response>RESULT</tool_response>`.
The model answers a call in the same form; `parse` splits a generation into content and calls.

Forcing a call (OpenAI `tool_choice` naming a function or "required"; Anthropic `{"type": "tool"}` / "any"):
the text up to the arguments, `<tool_call>NAME\\n`, is fed as forced tokens after the generation prompt, and the
model generates the arguments under a constraint (glm53.serving.constrain, built by glm53.serving.protocol):
every sampled token must keep the text a prefix of a JSON object that can still close within max_tokens, so the
arguments always parse and the generation ends as soon as the object closes. With "required" / "any" and several
tools, only `<tool_call>` is forced and the constraint also makes the generated name one of the tools' (an unknown
name, possible only without a constraint, falls back to the first tool). `_arguments` still replaces arguments
that do not parse by `{}` (only unconstrained generation can produce them). `tool_choice` "none": the tools
are not offered at all. Streaming: content is sent as it comes except a tail that may begin `<tool_call>`;
calls are sent when the generation ends (a forced call's name at once, its arguments at the end).
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from glm53.serving.errors import clip
from glm53.serving.limits import Limits

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"


@dataclasses.dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = dataclasses.field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclasses.dataclass
class ToolMode:
    """How a request uses tools: `tools` offered (rendered and parsed); `force` a call: None (the model decides),
    a tool's name, or "" (some tool: "required" / "any")."""

    tools: list[Tool]
    force: str | None = None

    @property
    def forced_prefix(self) -> str:
        """The text fed after the generation prompt when a call is forced ('' when none is)."""
        if self.force is None:
            return ""
        return CALL_OPEN + (f"{self.force}\n" if self.force else "")


def render_tools(tools: list[Tool]) -> str:
    """The system message that offers `tools`."""
    lines = [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                        ensure_ascii=False) for t in tools]  # fmt: skip
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + "\n".join(lines) + "\n</tools>\n\nFor each function call, output the function name and its "
            f"arguments as a JSON object in this format:\n{CALL_OPEN}{{function-name}}\n"
            f"{{arguments-json}}{CALL_CLOSE}")  # fmt: skip


def render_call(name: str, arguments: dict | str) -> str:
    """One call in an assistant message (`arguments` a dict or its JSON text, as OpenAI sends it)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_OPEN}{name}\n{args}{CALL_CLOSE}"


def render_result(content: str) -> str:
    return f"{RESULT_OPEN}{content}{RESULT_CLOSE}"


def _arguments(text: str) -> dict:
    """The generated arguments: the JSON object they begin with; {} when they do not (the documented fall-back)."""
    try:
        v, _ = json.JSONDecoder().raw_decode(text.strip() or "{}")
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def arguments_done(text: str) -> bool:
    """Whether generated arguments are finished: an object whose braces closed (outside strings), or text that
    cannot begin a JSON object (its first non-blank character is not `{`; it will fall back to {})."""
    text = text.lstrip()
    if not text:
        return False
    if text[0] != "{":
        return True
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return True
    return False


def _call(body: str, mode: ToolMode) -> ToolCall:
    """A call from the text between `<tool_call>` and `</tool_call>` (`NAME\\n{args}`)."""
    name, _, args = body.partition("\n")
    name = name.strip()
    names = [t.name for t in mode.tools]
    if name not in names and mode.force is not None and names:
        name = mode.force or names[0]  # a forced call always names an offered tool
    return ToolCall(name, _arguments(args))


def parse(text: str, mode: ToolMode) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a generation. With a forced call, `text` is what followed the forced prefix."""
    if mode.force is not None:
        body = mode.forced_prefix[len(CALL_OPEN) :] + text
        return "", [_call(body.split(CALL_CLOSE, 1)[0], mode)]
    i = text.find(CALL_OPEN)
    if i < 0:
        return text, []
    content, rest, calls = text[:i], text[i:], []
    while rest.startswith(CALL_OPEN):
        body, closed, rest = rest[len(CALL_OPEN) :].partition(CALL_CLOSE)
        call = _call(body, mode)
        if call.name in {t.name for t in mode.tools}:
            calls.append(call)
        if not closed:
            break
        rest = rest.lstrip()
    return content.rstrip() if calls else text, calls


class ContentStream:
    """Streams the content before any call: `push` returns the text safe to send (a tail that may begin
    `<tool_call>` is held back); after `<tool_call>` everything is held for `parse` at the end."""

    def __init__(self, mode: ToolMode | None):
        self.mode, self.text, self.sent = mode, "", 0

    def push(self, delta: str) -> str:
        self.text += delta
        if self.mode is None:
            self.sent = len(self.text)
            return delta
        if self.mode.force is not None:
            return ""
        i = self.text.find(CALL_OPEN)
        end = i if i >= 0 else len(self.text)
        if i < 0:
            for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
                if self.text.endswith(CALL_OPEN[:k]):
                    end -= k
                    break
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls)."""
        if self.mode is None:
            return "", []
        content, calls = parse(self.text, self.mode)
        if not calls:
            content = self.text
        out = content[self.sent :] if len(content) > self.sent else ""
        self.sent = len(self.text)
        return out, calls


# ------------------------------------------------------------------------------------------------ the APIs
def _depth(x) -> int:
    """Nesting of a JSON value: 0 for a scalar, 1 + its deepest child's for an object or an array."""
    if isinstance(x, dict):
        x = list(x.values())
    if not isinstance(x, list):
        return 0
    return 1 + max((_depth(v) for v in x), default=0)


def _tool(name, description, schema, where: str, names: set, limits: Limits, fn: str = "") -> Tool:
    """A Tool from an offer's fields; ValueError naming the field (`where` the tool, `fn` the path of its
    name, description and schema inside it). A name is non-empty, unique, printable without spaces (it is
    written as `<tool_call>NAME\\n`) and at most `max_name_chars`; a schema is an object nested at most
    `max_schema_depth` deep (the schema itself is depth 1)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}{fn}.name: expected a non-empty string")
    if len(name) > limits.max_name_chars:
        raise ValueError(f"{where}{fn}.name: longer than {limits.max_name_chars} characters ({len(name)})")
    if not name.isprintable() or " " in name:
        raise ValueError(f"{where}{fn}.name: {clip(repr(name))} has spaces or control characters")
    if name in names:
        raise ValueError(f"{where}{fn}.name: {clip(repr(name))} names another tool too; names must be unique")
    names.add(name)
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}{fn}.description: expected a string")
    param = f"{where}{fn}.{'parameters' if fn else 'input_schema'}"
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"{param}: expected a JSON schema object")
    if schema is not None and _depth(schema) > limits.max_schema_depth:
        raise ValueError(f"{param}: nested deeper than {limits.max_schema_depth} levels")
    return Tool(name, description or "", schema or Tool("").parameters)


def _offered(tools, limits: Limits | None, fields) -> list[Tool]:
    """The Tools of an API's offer: fields(i, tool) -> (name, description, schema, where, fn) of `_tool`, or a
    ValueError for a malformed entry; at most `max_tools` of them."""
    limits = limits or Limits()
    if len(tools) > limits.max_tools:
        raise ValueError(f"tools: at most {limits.max_tools} tools may be offered ({len(tools)} were)")
    names: set = set()
    out = []
    for i, t in enumerate(tools):
        name, description, schema, where, fn = fields(i, t)
        out.append(_tool(name, description, schema, where, names, limits, fn))
    return out


def openai_tools(tools, tool_choice, param: str = "tools", limits: Limits | None = None) -> ToolMode | None:
    """ToolMode of OpenAI `tools` / `tool_choice`; ValueError naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: a tool choice needs tools")
        return None

    def fields(i, t):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function":
            raise ValueError(f"{param}[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        return f.get("name"), f.get("description"), f.get("parameters"), f"{param}[{i}]", ".function"

    return _mode(_offered(tools, limits, fields), tool_choice, "function", "tool_choice")


def anthropic_tools(tools, tool_choice, limits: Limits | None = None) -> ToolMode | None:
    """ToolMode of Anthropic `tools` / `tool_choice`; ValueError naming the field."""
    if not tools:
        if tool_choice is not None and (
            not isinstance(tool_choice, dict) or tool_choice.get("type") not in ("none", "auto")
        ):
            raise ValueError("tool_choice: a tool choice needs tools")
        return None

    def fields(i, t):
        if not isinstance(t, dict):
            raise ValueError(f"tools[{i}]: expected {{'name': ..., 'input_schema': ...}}")
        return t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]", ""

    return _mode(_offered(tools, limits, fields), tool_choice, "tool", "tool_choice")


def _mode(tools: list[Tool], choice, named: str, param: str) -> ToolMode | None:
    if isinstance(choice, dict):
        kind = choice.get("type")
        f = choice.get("function")
        name = (f.get("name") if isinstance(f, dict) else None) if named == "function" else choice.get("name")
        if kind == named:
            if not isinstance(name, str) or name not in [t.name for t in tools]:
                raise ValueError(f"{param}: {clip(repr(name))} is not one of the tools")
            return ToolMode(tools, name)
        choice = "required" if kind == "any" else kind  # (kind may be any JSON value: compared, never hashed)
    if choice in (None, "auto"):
        return ToolMode(tools)
    if choice == "none":
        return None
    if choice == "required":
        return ToolMode(tools, tools[0].name if len(tools) == 1 else "")
    raise ValueError(f"{param}: {clip(repr(choice))} is not a valid tool choice")
