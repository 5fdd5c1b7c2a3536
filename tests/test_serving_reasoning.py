"""glm53.serving.reasoning: streaming split of a generation into reasoning and content, against a regex split of
the whole text, for every way of cutting the text into deltas; the request fields that ask for thinking."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm53.serving import reasoning as Rz


def _reference(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) by regex over the whole text (the format, written independently of ThinkStream)."""
    if not thinking:
        m = re.match(r"\s*<think>", text)
        if not m:
            return "", text
        text = text[m.end() :]
    m = re.search(r"</think>\n*", text)
    if m is None:
        return text, ""
    return text[: m.start()], text[m.end() :]


def _stream(deltas, thinking):
    s = Rz.ThinkStream(thinking)
    outs = [s.push(d) for d in deltas] + [s.finish()]
    for out in outs:  # each call's pieces: non-empty, consecutive ones of one kind merged
        assert all(t for _, t in out) and all(a[0] != b[0] for a, b in zip(out, out[1:]))
    pieces = [p for out in outs for p in out]
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content


ATOMS = ["<think>", "</think>", "<", "</", "<th", "</thi", "think", ">", "a", "b c", "\n", " ", "x</", "é"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ATOMS), max_size=12), st.booleans(), st.data())
def test_streamed_split_equals_the_whole_text_split(atoms, thinking, data):
    text = "".join(atoms)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert _stream(deltas, thinking) == _reference(text, thinking)
    assert Rz.split(text, thinking) == _reference(text, thinking)


def test_tags_are_held_back_until_they_resolve():
    s = Rz.ThinkStream(False)
    assert s.push("  <thi") == []  # may still open a thinking block
    assert s.push("nk>plan") == [("reasoning", "plan")]
    assert s.push(" more</th") == [("reasoning", " more")]  # may be closing
    assert s.push("ink>\n\nanswer") == [("content", "answer")]
    assert s.finish() == []
    s = Rz.ThinkStream(False)
    assert s.push("<th") == [] and s.finish() == [("content", "<th")]


def test_request_fields():
    assert Rz.anthropic_thinking(None) == (False, None)
    assert Rz.anthropic_thinking({"type": "enabled", "budget_tokens": 5}) == (True, 5)
    assert Rz.anthropic_thinking({"type": "disabled"}) == (False, None)
    assert Rz.anthropic_thinking({"type": "adaptive"}) == (True, None)
    for bad, field in (({"type": "on"}, "thinking"), ({"type": "enabled"}, "thinking.budget_tokens"),
                       ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"), ("yes", "thinking")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
            Rz.anthropic_thinking(bad)
    assert Rz.openai_thinking(None, None) is False
    assert Rz.openai_thinking("high", None) is True and Rz.openai_thinking("none", None) is False
    assert Rz.openai_thinking("high", {"enable_thinking": False}) is False
    assert Rz.openai_thinking(None, {"enable_thinking": True}) is True
    with pytest.raises(ValueError, match="^reasoning_effort:"):
        Rz.openai_thinking("max", None)
    with pytest.raises(ValueError, match="^chat_template_kwargs.enable_thinking:"):
        Rz.openai_thinking(None, {"enable_thinking": "yes"})
