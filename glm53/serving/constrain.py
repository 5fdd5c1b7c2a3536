"""Constrained decoding of a tool call's arguments: only tokens that keep the text a prefix of a JSON object.

`JsonObject` is a character-level state machine over the JSON grammar (RFC 8259: objects, arrays, strings with
escapes and `\\uXXXX`, numbers, `true` / `false` / `null`, nesting) for text that is `{...}` then, after the
top-level object closes, at most a prefix of `</tool_call>`; with `names`, the text first is one of the names and a
newline (a call whose name is generated too: `NAME\\n{...}`); with `keys` (a schema's `properties`), the top-level
object's keys are among them (spelled without escapes) and, with `types` (their schemas' `type`), their values
begin as that type does (`"` for a string, `{` an object, a digit or `-` a number...; the rest stays free). A
list of types (`["string", "null"]`) is their union (a value begins as any of them does); any other `type` (an
unknown name, an object, an empty list, a list with an unknown name) leaves that value free. The object begins
at once and whitespace outside
strings comes in runs of at most `MAX_WS` characters (one: `json.dumps`'s `, ` and `: ` spacing; a subset of
JSON, so that a model cannot spend its tokens on whitespace: the shipped mini model would).

`TokenTable` holds each token id's text, computed once per tokenizer: special tokens, tokens that decode to
nothing and tokens whose text alone is not valid UTF-8 (a byte-level BPE token holding part of a character:
its decoded text contains U+FFFD) are never allowed inside the constraint (conservative: non-ASCII text is then
spelled by whole-character tokens only). `Constraint.allowed(text)` is the bool mask [V] of the tokens whose text
appended to `text` still parses; the engine applies it to a constrained slot's logits before sampling.

Cost: a mask depends only on the machine's state after `text` (the mode, the open containers, a literal's or
escape's progress), so masks are cached per state (a string's characters all share one state); a new state
walks the tokens grouped by first character (one step rejects a whole group: outside strings most groups) and
runs the rest character by character. On the shipped 4,096-token vocabulary a new state costs a few ms; on a
155k vocabulary it is ~40x that, once per state (tens of states per request, mostly cached across requests);
a character trie over the token texts would share the walks of common prefixes.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

CLOSE = "</tool_call>"
MAX_WS = 1
NEVER = 2**30
_WS = " \t\n\r"
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_FIRST = {
    "string": '"',
    "number": "0-123456789",
    "integer": "0-123456789",
    "boolean": "tf",
    "null": "n",
    "object": "{",
    "array": "[",
}  # a JSON schema type's first characters (the first: its closing move)


def first_chars(t) -> str:
    """The characters a value of JSON schema `type` `t` may begin with, the closing move first: a type's, the
    union of a list's (in `_FIRST` order, so the shortest close leads); '' (the value stays free) for anything
    else (an unknown name, a non-string, an empty list or one holding an unknown name)."""
    if isinstance(t, str):
        return _FIRST.get(t, "")
    if not isinstance(t, (list, tuple)) or not t or not all(isinstance(x, str) and x in _FIRST for x in t):
        return ""
    return "".join(dict.fromkeys("".join(f for name, f in _FIRST.items() if name in t)))


class JsonObject:
    """The grammar's transitions. A state is a hashable tuple (mode, stack of open containers 'o' / 'a', aux);
    `step(state, ch)` is the state after `ch` or None when `ch` cannot follow."""

    def __init__(
        self, names: Sequence[str] = (), keys: Sequence[str] = (), types: Mapping[str, object] | None = None
    ):
        self.names = tuple(names)
        # key -> the characters its value may begin with (`first_chars` of its type; free keys left out)
        firsts = ((k, first_chars(t)) for k, t in (types or {}).items() if isinstance(k, str))
        self.types = tuple(sorted((k, f) for k, f in firsts if f))
        plain = all(k and '"' not in k and "\\" not in k and min(k) >= " " for k in keys)
        self.keys = (
            tuple(keys) if plain else ()
        )  # the top-level object's keys (a schema's properties); () any
        self._need: dict = {}

    def start(self):
        return ("name", (), "") if self.names else ("top", (), 0)

    def feed(self, state, text: str):
        for ch in text:
            state = self.step(state, ch)
            if state is None:
                return None
        return state

    @staticmethod
    def done(state) -> bool:
        """The top-level object has closed."""
        return state is not None and state[0] == "tail"

    def closing(self, state) -> str:
        """The next character of a short way to close the object from `state` ('' when done): a name's rest,
        `{`, a string's quote (a key's `:0` after it), an escape's `n`, hex `0`s, a literal's rest, a digit where a
        number needs one, `0` for a value, then the brackets. Each one lowers `need` by exactly one."""
        mode, stack, aux = state
        if mode in ("name", "kname"):
            name = min(
                (n for n in (self.names if mode == "name" else self.keys) if n.startswith(aux)), key=len
            )
            return name[len(aux)] if len(name) > len(aux) else ("\n" if mode == "name" else '"')
        if mode in ("lit", "tail"):
            return aux[:1] if mode == "lit" else ""
        if mode in ("tcolon", "tvalue"):
            return ":" if mode == "tcolon" else aux[0][0]
        fixed = {"top": "{", "str": '"', "esc": "n", "hex": "0", "colon": ":", "key": '"', "value": "0",
                 "num-": "0", "num.": "0", "numE": "0", "numE-": "0"}  # fmt: skip
        return fixed.get(mode) or ("}" if stack[-1] == "o" else "]")

    def need(self, state) -> int:
        """How many characters `closing` takes to close the object (memoized per state)."""
        n = self._need.get(state)
        if n is None:
            n, s = 0, state
            while not self.done(s):
                s, n = self.step(s, self.closing(s)), n + 1
            self._need[state] = n
        return n

    def step(self, state, ch):  # noqa: C901 - one branch per mode is the clearest form of the grammar
        mode, stack, aux = state
        if mode == "name":
            if ch == "\n" and aux in self.names:
                return ("top", (), 0)
            name = aux + ch
            return ("name", (), name) if any(n.startswith(name) for n in self.names) else None
        if mode == "kname":  # a top-level key, one of `keys` (aux: its text so far)
            if ch == '"':
                t = dict(self.types).get(aux)
                return (
                    None if aux not in self.keys else ("tcolon", stack, (t, 0)) if t else ("colon", stack, 0)
                )
            name = aux + ch
            return ("kname", stack, name) if any(k.startswith(name) for k in self.keys) else None
        if mode == "str":  # aux: the string is a key
            if ch == '"':
                return ("colon", stack, 0) if aux else ("after", stack, 0)
            if ch == "\\":
                return ("esc", stack, aux)
            return None if ch < " " else state
        if mode == "esc":
            if ch == "u":
                return ("hex", stack, (aux, 4))
            return ("str", stack, aux) if ch in '"\\/bfnrt' else None
        if mode == "hex":
            if ch not in _HEX:
                return None
            key, left = aux
            return ("str", stack, key) if left == 1 else ("hex", stack, (key, left - 1))
        if mode == "lit":
            if not aux or ch != aux[0]:
                return None
            return ("lit", stack, aux[1:]) if len(aux) > 1 else ("after", stack, 0)
        if mode.startswith("num"):
            nxt = _number(mode, ch)
            if nxt is not None:
                return (nxt, stack, 0)
            if mode not in ("num0", "numi", "numf", "nume"):  # a number cannot end after '-', '.', 'e', 'e-'
                return None
            return self.step(("after", stack, 0), ch)
        if mode == "tail":
            return ("tail", (), aux + 1) if aux < len(CLOSE) and CLOSE[aux] == ch else None
        if mode in ("tcolon", "tvalue"):  # a typed key's colon / value (aux: first characters, whitespace)
            t, ws = aux
            if ch in _WS:
                return (mode, stack, (t, ws + 1)) if ws < MAX_WS else None
            if mode == "tcolon":
                return ("tvalue", stack, (t, 0)) if ch == ":" else None
            return self.step(("value", stack, 0), ch) if ch in t else None
        # the structural modes: top (before the object), key / key_or_end, colon, value / value_or_end, after
        if ch in _WS:
            return (mode, stack, aux + 1) if aux < MAX_WS and mode != "top" else None
        if mode == "top":
            return ("key_or_end", ("o",), 0) if ch == "{" else None
        if mode in ("key", "key_or_end"):
            if ch == '"':
                return ("kname", stack, "") if self.keys and len(stack) == 1 else ("str", stack, True)
            return self._close(stack, "o") if ch == "}" and mode == "key_or_end" else None
        if mode == "colon":
            return ("value", stack, 0) if ch == ":" else None
        if mode in ("value", "value_or_end"):
            if ch == "]" and mode == "value_or_end":
                return self._close(stack, "a")
            if ch == "{":
                return ("key_or_end", stack + ("o",), 0)
            if ch == "[":
                return ("value_or_end", stack + ("a",), 0)
            if ch == '"':
                return ("str", stack, False)
            if ch in _LITERALS:
                return ("lit", stack, _LITERALS[ch])
            nxt = _number("num", ch)
            return None if nxt is None else (nxt, stack, 0)
        if mode == "after":
            if ch == ",":
                return ("key", stack, 0) if stack[-1] == "o" else ("value", stack, 0)
            if ch in "}]":
                return self._close(stack, "o" if ch == "}" else "a")
        return None

    @staticmethod
    def _close(stack, kind):
        if not stack or stack[-1] != kind:
            return None
        return ("after", stack[:-1], 0) if len(stack) > 1 else ("tail", (), 0)


def _number(mode: str, ch: str) -> str | None:
    """The number's next mode (num: none yet, num-: after '-', num0: a leading 0, numi: integer digits, num.:
    after '.', numf: fraction digits, numE: after 'e', numE-: after its sign, nume: exponent digits)."""
    digit = ch in _DIGITS
    if mode in ("num", "num-"):
        if ch == "-" and mode == "num":
            return "num-"
        return ("num0" if ch == "0" else "numi") if digit else None
    if mode in ("num0", "numi"):
        if digit and mode == "numi":
            return "numi"
        return {".": "num.", "e": "numE", "E": "numE"}.get(ch)
    if mode in ("num.", "numf"):
        if digit:
            return "numf"
        return {"e": "numE", "E": "numE"}.get(ch) if mode == "numf" else None
    if mode in ("numE", "numE-", "nume"):
        if digit:
            return "nume"
        return "numE-" if ch in "+-" and mode == "numE" else None
    return None


class TokenTable:
    """Each token id's text (None: never allowed in a constraint), and the ids grouped by first character."""

    def __init__(self, texts: Sequence[str | None]):
        self.texts = list(texts)
        self.vocab = len(self.texts)
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for i, t in enumerate(self.texts):
            if t:
                groups[t[0]].append(i)
        self.groups = {c: np.asarray(ids, np.int64) for c, ids in groups.items()}
        self.cache: collections.OrderedDict = collections.OrderedDict()  # (names, keys, state) -> needs

    @classmethod
    def of(cls, tok, vocab_size: int | None = None) -> TokenTable:
        """The table of a glm53 tokenizer (HFTokenizer or ByteTokenizer), built once per tokenizer object."""
        table = getattr(tok, "_constrain_table", None)
        if table is not None:
            return table
        n = vocab_size or tok.vocab_size
        added = getattr(getattr(tok, "tok", None), "get_added_tokens_decoder", None)
        special = frozenset(added()) if added is not None else frozenset()
        texts = []
        for i in range(n):
            t = None if i in special else tok.decode([i])
            texts.append(t if t and "\ufffd" not in t else None)
        table = cls(texts)
        tok._constrain_table = table
        return table

    def needs(self, grammar: JsonObject, state, cache_size: int = 512) -> np.ndarray:
        """int32 [V]: per token, the characters still needed to close the object after it (NEVER: not allowed)."""
        key = (grammar.names, grammar.keys, grammar.types, state)
        m = self.cache.get(key)
        if m is not None:
            self.cache.move_to_end(key)
            return m
        m = np.full(self.vocab, NEVER, np.int32)
        for c, ids in self.groups.items():
            s1 = grammar.step(state, c)
            if s1 is None:
                continue
            for i in ids.tolist():
                s2 = grammar.feed(s1, self.texts[i][1:])
                if s2 is not None:
                    m[i] = grammar.need(s2)
        self.cache[key] = m
        if len(self.cache) > cache_size:
            self.cache.popitem(last=False)
        return m


class Constraint:
    """One request's constraint (Request.constraint): the generated text must stay a prefix of `NAME\\n` (with
    `names`) then a JSON object then at most `</tool_call>`. With `max_tokens`, a token is allowed only if the
    object can still close within the tokens left (one token per closing character: the table must hold them
    as single-character tokens, as byte-level vocabularies do), so the object always closes by max_tokens.
    `allowed(text, generated)`: the mask of the next token; `done(text)`: the object has closed (the request's
    `until`)."""

    def __init__(self, table: TokenTable, names: Sequence[str] = (), max_tokens: int | None = None,
                 keys: Sequence[str] = (), types: Mapping[str, object] | None = None):  # fmt: skip
        self.table, self.grammar, self.max_tokens = table, JsonObject(names, keys, types), max_tokens
        self._text, self._state = "", self.grammar.start()

    def state(self, text: str):
        """The machine's state after `text` (None: not a valid prefix); incremental over a growing text."""
        if text.startswith(self._text) and self._state is not None:
            s = self.grammar.feed(self._state, text[len(self._text) :])
        else:
            s = self.grammar.feed(self.grammar.start(), text)
        self._text, self._state = (text, s) if s is not None else ("", self.grammar.start())
        return s

    def allowed(self, text: str, generated: int = 0) -> np.ndarray:
        """bool [V]: the tokens that keep `text` (`generated` tokens so far) a valid prefix that can close in
        time. All true where `text` is not a valid prefix or no token would do (an unconstrained request: the
        parser's fall-back to {} then applies)."""
        s = self.state(text)
        if s is not None:
            left = NEVER - 1 if self.max_tokens is None else self.max_tokens - generated - 1
            m = self.table.needs(self.grammar, s) <= left
            if m.any():
                return m
        return np.ones(self.table.vocab, bool)

    def done(self, text: str) -> bool:
        return self.grammar.done(self.state(text))
