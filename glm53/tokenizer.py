"""Tokenizers: the model's own (``tokenizer.json`` + chat template) or a byte-level fallback for tiny configs.

`load_tokenizer(folder)` returns an object with ``encode``, ``decode`` and ``apply_chat_template``:
  * `HFTokenizer` when the folder has ``tokenizer.json``: text is tokenized with the `tokenizers` library and chat
    messages are rendered with the model's Jinja chat template (``chat_template.jinja``, or ``chat_template`` in
    ``tokenizer_config.json``) in a sandboxed environment that offers what HF templates use (``tojson``,
    ``raise_exception``, ``strftime_now``, ``namespace``, loop controls, trim_blocks / lstrip_blocks). Without a
    template, messages are rendered in the plain GLM format (`glm_chat_text`).
  * `ByteTokenizer` otherwise: token id = UTF-8 byte value mod vocab_size (documented lossy for vocab < 256 and
    non-ASCII text); chat messages in the plain GLM format, special markers spelled out as text.

Plain GLM format: ``[gMASK]<sop>`` then ``<|role|>content`` per message (roles system / user / assistant /
observation; role "tool" is written as observation), then ``<|assistant|>`` when a generation prompt is asked for.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """A tokenizer folder or chat template that cannot be used; the message names the file."""


Message = Mapping[str, Any]

_ROLE_TAG = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>",
             "observation": "<|observation|>", "tool": "<|observation|>"}  # fmt: skip


def glm_chat_text(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The plain GLM chat format (no tools, no thinking blocks) as text."""
    parts = ["[gMASK]<sop>"]
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLE_TAG:
            raise TokenizerError(f"message {i}: unknown role {role!r}; expected one of {sorted(_ROLE_TAG)}")
        content = m.get("content") or ""
        if not isinstance(content, str):  # [{"type": "text", "text": ...}, ...]
            content = "".join(c.get("text", "") if isinstance(c, Mapping) else str(c) for c in content)
        parts.append(_ROLE_TAG[role] + content)
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def _jinja_env():
    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the model's chat template and special tokens."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        path = os.path.join(self.folder, "tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{path}: cannot load ({e})") from None
        self.config = _read_json(os.path.join(self.folder, "tokenizer_config.json"))
        self.chat_template = self._find_template()
        self.special_tokens = {k: _token_str(self.config[k]) for k in
                               ("bos_token", "eos_token", "pad_token", "unk_token") if self.config.get(k)}  # fmt: skip
        self._compiled = None

    def _find_template(self) -> str | None:
        jinja_path = os.path.join(self.folder, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        t = self.config.get("chat_template")
        if isinstance(t, list):  # [{"name": ..., "template": ...}]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, Mapping)}
            t = named.get("default")
            if t is None:
                raise TokenizerError(f"{self.folder}/tokenizer_config.json: chat_template list has no 'default' "
                                     f"entry (names: {sorted(named)})")  # fmt: skip
        if t is not None and not isinstance(t, str):
            raise TokenizerError(f"{self.folder}/tokenizer_config.json: chat_template is not a string")
        return t

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat as text: the model's template (with the special tokens and `kwargs` in scope) or plain GLM."""
        if self.chat_template is None:
            return glm_chat_text(messages, add_generation_prompt)
        if self._compiled is None:
            try:
                self._compiled = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise TokenizerError(
                    f"{self.folder}: chat template syntax error line {e.lineno}: {e}"
                ) from None
        scope = {**self.special_tokens, **kwargs}
        return self._compiled.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **scope
        )

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:  # fmt: skip
        """Token ids of the rendered chat (no extra special tokens added), or the text with tokenize=False."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class ByteTokenizer:
    """Byte-level fallback: id = UTF-8 byte mod vocab_size; decode maps ids < 256 back to bytes."""

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise TokenizerError(f"byte tokenizer: vocab_size {vocab_size} is too small")
        self.vocab_size = int(vocab_size)
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs) -> str:
        return glm_chat_text(messages, add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:  # fmt: skip
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text


def _token_str(t) -> str:
    return t.get("content", "") if isinstance(t, Mapping) else str(t)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return d


def load_tokenizer(
    folder: str | os.PathLike | None, vocab_size: int | None = None
) -> HFTokenizer | ByteTokenizer:
    """The folder's tokenizer (``tokenizer.json``), else a `ByteTokenizer` of `vocab_size` (default: the
    ``vocab_size`` in the folder's config.json)."""
    if folder is not None and os.path.exists(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder)
    if vocab_size is None and folder is not None:
        cfg = _read_json(os.path.join(folder, "config.json"))
        vocab_size = (cfg.get("text_config") or cfg).get("vocab_size")
    if vocab_size is None:
        raise TokenizerError(f"{folder}: no tokenizer.json and no vocab_size for the byte-level fallback")
    return ByteTokenizer(vocab_size)
