"""Constrained decoding of tool-call arguments (glm53.serving.constrain) and the engine's masked sampling.

The reference for the grammar is Python's `json` module: every prefix of a JSON object it writes is accepted,
every accepted text closes (by the machine's own closing characters, exactly `need` of them) into text `json`
parses as an object, and on small alphabets the accepted texts that can close within L characters are exactly the
prefixes of the objects of at most L characters (exhaustive). The engine: constrained requests on the tiny random
model give JSON objects (its unconstrained greedy text is not JSON), their unconstrained batch neighbours give
exactly the tokens they give alone, the speculative engine gives the plain engine's constrained tokens, and no
program is compiled after warm-up.
"""

import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import tiny
from glm53 import build, tokenizer
from glm53.config import model_config_from_dict
from glm53.serving import constrain as C
from glm53.serving import engine as E

FAST = {"xla_backend_optimization_level": 0}
G = C.JsonObject()


def _close(g, state) -> str:
    out = ""
    while not g.done(state):
        ch = g.closing(state)
        out, state = out + ch, g.step(state, ch)
    return out


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------ the grammar
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.text(max_size=6)
    | st.floats(allow_nan=False, allow_infinity=False)
)
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                     max_size=3), max_leaves=8)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    obj=st.dictionaries(st.text(max_size=5), _values, max_size=4), ascii_=st.booleans(), compact=st.booleans()
)
def test_every_prefix_of_a_json_object_is_accepted_and_closes(obj, ascii_, compact):
    text = json.dumps(obj, ensure_ascii=ascii_, separators=(",", ":") if compact else None)
    s = G.start()
    for i, ch in enumerate(text):
        assert not G.done(s)
        s = G.step(s, ch)
        assert s is not None, (text, i)
        closing = _close(G, s)
        assert len(closing) == G.need(s) and json.loads(text[: i + 1] + closing) is not None
        assert _is_object(text[: i + 1] + closing)
    assert G.done(s) and G.need(s) == 0
    assert G.feed(s, C.CLOSE) is not None and G.feed(s, " ") is None and G.feed(s, "}") is None


def test_accepted_texts_are_exactly_the_prefixes_that_can_close_in_time():
    """Exhaustive on two small alphabets: accepted with need <= L - len  <=>  a prefix of an object of <= L (so
    `need` is the fewest characters that close the object)."""
    cases = [("{", '{}[]":0,', 6), ('{"":', "-0.eE+1}", 5)]  # structure; numbers after a key
    for head, alphabet, L in cases:  # (every object begins with "{": the words after it)
        words = [head + "".join(w) for n in range(L + 1) for w in itertools.product(alphabet, repeat=n)]
        prefixes = {w[:i] for w in words if _is_object(w) for i in range(len(w) + 1)}
        assert len(prefixes) > 50
        for w in words:
            s = G.feed(G.start(), w)
            ok = s is not None and G.need(s) <= len(head) + L - len(w)
            assert ok == (w in prefixes), w


TYPES = {"s": str, "i": (int, float), "b": bool, "o": dict, "a": list, "z": type(None)}
KEYED = C.JsonObject(
    keys=["s", "i", "b", "o", "a", "z", "free", "fr"],
    types={"s": "string", "i": "integer", "b": "boolean", "o": "object", "a": "array", "z": "null"},
)


def test_random_walks_close_and_invalid_texts_are_refused():
    rng = random.Random(0)
    alphabet = '{}[]",:0123456789-+.eEtrufalsnbizoa\\/ Ax\n\t\x01'
    for g in (G, KEYED):
        for _ in range(300):
            s, text = g.start(), ""
            for _ in range(rng.randrange(1, 40)):
                nxt = [(c, t) for c in alphabet if (t := g.step(s, c)) is not None]
                if not nxt or g.done(s):
                    break
                c, s = rng.choice(nxt)
                text += c
                assert _is_object(text + _close(g, s)), text
                if g is KEYED:  # the schema's keys only, each value of its type
                    obj = json.loads(text + _close(g, s))
                    assert set(obj) <= set(g.keys), text
                    assert all(isinstance(v, TYPES[k]) for k, v in obj.items() if k in TYPES), text
    ok = '{"s": "x", "i": -3, "o": {"any": [1]}, "free": [null], "fr": 1, "z": null, "b": true, "a": []}'
    assert KEYED.feed(KEYED.start(), ok) is not None and KEYED.done(KEYED.feed(KEYED.start(), ok))
    for bad in ['{"t"', '{"frees"', '{"s": 1', '{"i": "1"', '{"b": null', '{"o": [', '{"z": 0', '{"s\\u0041']:
        assert KEYED.feed(KEYED.start(), bad) is None, bad
    for bad in [
        "[",
        "x",
        '{"a"}',
        '{"a":01',
        '{"a":1.}',
        '{"a":tru }',
        "{,",
        '{"a":1,}',
        '{"\x01',
        '{"\\x',
        '{"\\u12G',
        '{"a":-}',
        "{} ",
        "{}}",
        '{"a":[}',
        '{"a":1]',
        '{"a":[1,]',
        '{"a":nulx',
        '{"a":+1',
        '{"a":  1}',
        " {}",
        "{}</tool_call>x",
    ]:  # fmt: skip (whitespace: runs of <= MAX_WS, none before / after)
        assert G.feed(G.start(), bad) is None, bad
    names = C.JsonObject(["get_weather", "get"])
    assert (
        names.feed(names.start(), "get_weather\n{}") is not None and names.feed(names.start(), "gex") is None
    )
    assert names.feed(names.start(), "get\n{") is not None and names.need(names.start()) == len("get\n{}")


def test_token_masks_on_the_shipped_tokenizer():
    """The mini tokenizer's 4096 tokens: the mask is the per-token check; a budget keeps the object closable."""
    tok = tokenizer.load_tokenizer("glm53/assets/mini")
    table = C.TokenTable.of(tok)
    assert C.TokenTable.of(tok) is table and table.vocab == tok.vocab_size
    assert all(t is None or "\ufffd" not in t for t in table.texts)
    c = C.Constraint(table, max_tokens=30)
    for text in ["", "{", '{"city', '{"city": ', '{"city": 1', '{"a": [1, {"b": tru']:
        m = c.allowed(text, 5)
        want = [t is not None and G.feed(G.feed(G.start(), text), t) is not None for t in table.texts]
        assert m.tolist() == want, text
    # 3 tokens left after this one: '{"a' (need 4: '":0}') may only take a token after which 3 close it.
    m = c.allowed('{"a', 26)
    assert m.any() and all(G.need(G.feed(G.start(), '{"a' + table.texts[i])) <= 3 for i in np.flatnonzero(m))
    assert c.done('{"a": 1}') and not c.done('{"a": 1')


# ------------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = build.random_model(cfg, seed=0, with_mtp=True)
    tok = tokenizer.ByteTokenizer(cfg.vocab_size)  # 128 ids: ASCII, one character each
    kw = dict(slots=3, max_len=48, buckets=(1, 8), compiler_options=FAST, detokenize=tok.decode, prefill_batch=1)
    plain = E.Engine(model, **kw)
    plain.warmup()
    spec = E.Engine(model, speculative=True, **kw)
    spec.warmup()
    return plain, spec, C.TokenTable.of(tok), tok


def _constrained(table, prompt, n, names=(), **kw):
    c = C.Constraint(table, names, max_tokens=n)
    return E.Request(prompt, max_tokens=n, constraint=c, until=c.done, **kw)


def test_engine_constrained_requests_give_json_and_leave_neighbours_unchanged(setup):
    plain, spec, table, tok = setup
    n0, s0 = plain.compiled_programs(), spec.compiled_programs()
    prompts = [[1, 2, 3], [9, 4, 4, 9, 30, 31, 32, 33, 34], [7]]
    free = [E.Request(p, max_tokens=10) for p in prompts]
    alone = [E.generate(plain, [r])[0] for r in free]
    assert not any(_is_object(tok.decode(t)) for t in alone)  # the random model does not write JSON by itself
    reqs = [_constrained(table, prompts[0], 12), E.Request(prompts[1], max_tokens=10),
            _constrained(table, prompts[2], 16, temperature=1.0, seed=3), E.Request(prompts[0], max_tokens=10),
            _constrained(table, prompts[1], 20, names=("get_weather", "f"))]  # fmt: skip
    out = E.generate(plain, reqs)
    assert out[1] == alone[1] and out[3] == alone[0]  # batching with constrained slots changes nothing
    texts = [tok.decode(out[i]) for i in (0, 2, 4)]
    assert _is_object(texts[0]) and _is_object(texts[1]), texts
    name, _, args = texts[2].partition("\n")
    assert name in ("get_weather", "f") and _is_object(args), texts[2]
    # Speculative: constrained slots never accept drafts: the plain engine's tokens, first token included.
    again = E.generate(spec, [_constrained(table, prompts[0], 12), E.Request(prompts[1], max_tokens=10),
                              _constrained(table, prompts[2], 16, temperature=1.0, seed=3)])  # fmt: skip
    assert again == out[:3]
    assert plain.compiled_programs() == n0 and spec.compiled_programs() == s0
