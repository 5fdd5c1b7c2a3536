"""Incremental detokenization with stop strings: the text a stream may send after each new token.

The whole generation is decoded after every token (a tokenizer may merge bytes across tokens) and only what is
final is released: never a trailing U+FFFD (an incomplete UTF-8 sequence) nor a tail that could still become a
stop string. When a stop string appears, the text before its first occurrence is the stream's whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopText:
    """Per-stream text state. `detokenize` None: no text at all (token-only use; stop strings never match)."""

    def __init__(self, stop: Sequence[str], detokenize: Callable[[list[int]], str] | None):
        self.stop = tuple(stop)
        self.detokenize = detokenize
        self.ids: list[int] = []
        self.sent = 0  # characters released so far
        self.text = ""

    def _hold(self, text: str) -> int:
        """How many trailing characters may not be released yet."""
        hold = 0
        if text.endswith("\ufffd"):
            hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:  # the longest proper prefix of s that the text ends with: it starts at an s[0]
            i = text.find(s[0], max(0, len(text) - len(s) + 1))
            while i >= 0 and not s.startswith(text[i:]):
                i = text.find(s[0], i + 1)
            if i >= 0:
                hold = max(hold, len(text) - i)
        return hold

    def push(self, tok: int) -> tuple[str, str | None]:
        """(text to send now, the stop string that ended the stream or None)."""
        if self.detokenize is None:
            return "", None
        self.ids.append(tok)
        self.text = text = self.detokenize(self.ids)
        hits = [(i, s) for s in self.stop if (i := text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if hits:
            i, s = min(hits)
            end = max(i, self.sent)
            out, self.sent = text[self.sent : end], end
            return out, s
        end = max(len(text) - self._hold(text), self.sent)
        out, self.sent = text[self.sent : end], end
        return out, None

    def flush(self) -> str:
        """Everything not yet sent (the stream ends without a stop string)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def detokenizer(tok, keep: Sequence[str] = ()) -> Callable[[list[int]], str]:
    """ids -> text for the engine: special tokens are dropped except those spelled in `keep` (e.g. the thinking
    tags, which glm53.serving.reasoning parses). A tokenizer without special tokens decodes everything."""
    added = getattr(getattr(tok, "tok", None), "get_added_tokens_decoder", None)
    if added is None:
        return lambda ids: tok.decode(ids)
    drop = frozenset(i for i, t in added().items() if t.special and t.content not in set(keep))
    return lambda ids: tok.decode([i for i in ids if i not in drop], skip_special_tokens=False)
