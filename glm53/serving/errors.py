"""What a refused request is told: `ApiError` (HTTP status, message, offending parameter) in each API's shape.

Every message starts with the parameter it is about (`messages[1].content[0]: ...`). Messages never echo much
of a client's input: `clip` shortens (and makes JSON-safe) whatever is quoted back. `param_for` / `api_error`
turn a field of the internal request (an engine `ValueError("prompt: ...")`) into the calling API's parameter
(`messages` for a chat or an Anthropic request, `prompt` for a completion). `check_text` refuses strings the
tokenizer cannot take (a lone surrogate: JSON allows `"\\ud800"`, UTF-8 does not).

API kinds (`Generation.api`): "chat" (OpenAI chat completions), "completion" (OpenAI completions), "anthropic"
(Anthropic messages and count_tokens).
"""

from __future__ import annotations

API_KINDS = ("chat", "completion", "anthropic")
CLIP_CHARS = 64  # what an error message quotes of a client's value by default


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def clip(value, n: int = CLIP_CHARS) -> str:
    """A client's value as an error message may quote it: a string as it is, anything else as its repr; at
    most `n` characters of it, then `... (N characters)` when it was longer; lone surrogates escaped
    (`\\ud800`), so the text always encodes as UTF-8 (JSON answers). `clip(repr(s))` quotes a string."""
    s = value if isinstance(value, str) else repr(value)
    out = s[:n] + (f"... ({len(s)} characters)" if len(s) > n else "")
    return out if out.isascii() else out.encode("utf-8", "backslashreplace").decode("utf-8")


# ------------------------------------------------------------------------------------------------ parameters
_PARAMS = {
    "chat": {"prompt": "messages"},
    "anthropic": {"prompt": "messages", "stop": "stop_sequences"},
    "completion": {},
}


def param_for(api: str, field: str) -> str:
    """The calling API's parameter for a field of the internal request (`glm53.serving.request.Request`): the
    prompt is `messages` for "chat" and "anthropic" and `prompt` for "completion"; Anthropic's stop strings
    are `stop_sequences`; other fields keep their name."""
    return _PARAMS.get(api, {}).get(field, field)


def api_error(api: str, e: ValueError, status: int = 400) -> ApiError:
    """The ApiError of a ValueError naming an internal field (`"prompt: ..."`, `"top_k=...: ..."`): the field
    mapped by `param_for`, in the message's start too (`"messages: ..."`); the message clipped to 1,000
    characters."""
    text = str(e)
    field = text.split(":")[0].split("=")[0].strip()
    param = param_for(api, field)
    if param != field and text.startswith(field):
        text = param + text[len(field) :]
    return ApiError(status, clip(text, 1000), clip(param) if field else None)


# ------------------------------------------------------------------------------------------------ text
def _bad(s: str) -> bool:
    """Whether `s` has a lone surrogate (cannot be encoded as UTF-8, so cannot be tokenized)."""
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_text(value, where: str) -> None:
    """ApiError 400 naming the place (`where`, then `.key` / `[i]` down to the string) of the first string in
    `value` (nested dicts and lists, their keys too) that holds a lone surrogate."""
    if isinstance(value, str):
        if _bad(value):
            raise ApiError(400, f"{where}: invalid Unicode (a lone surrogate)", where)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _bad(k):
                raise ApiError(400, f"{where}: invalid Unicode (a lone surrogate) in a key", where)
            check_text(v, f"{where}.{clip(k)}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]")


# ------------------------------------------------------------------------------------------------ shapes
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
    """The first pydantic / FastAPI validation error as a 400 naming its field (each part of the field's path
    clipped: an unknown key may be long)."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [clip(str(x)) for x in err.get("loc", ()) if x != "body"]
    field = ".".join(loc) or "body"
    if err.get("type") == "json_invalid":
        return ApiError(400, f"body: malformed JSON ({clip(err.get('msg'), 200)})", "body")
    return ApiError(400, f"{field}: {clip(err.get('msg', 'invalid'), 500)}", field)
