"""Fuzzing the HTTP server: thousands of generated requests, none may hurt the server or get an answer out of shape.

One in-process server (the shipped glm53-mini behind `make_app`, uvicorn on a free loopback port in a thread).
Requests come from three sources:
  * schemathesis, from the app's own OpenAPI schema: bodies valid by the schema (positive) and bodies that break
    it (negative), for every POST route;
  * hand-written hypothesis strategies for each API's bodies: what a careless or hostile client sends (content
    blocks of every kind, tools with odd JSON schemas, extreme sampling parameters, lone surrogates, long stop
    lists, NaN / huge numbers);
  * raw HTTP: unknown routes, wrong methods, random bytes, invalid UTF-8, deeply nested JSON, wrong content types.
The engine runs on paged caches with fewer pages than its slots could hold. Every answer must be < 500, in the calling API's shape (OpenAI `{"error": {...}}`, Anthropic
`{"type": "error", "error": {...}}`) with an `x-request-id`, an error text of bounded size, and a stream must end
with its terminal event. At the end, at least `MIN_REQUESTS` were sent, a fixed greedy request still returns
the text it returned before the fuzzing, and every page is back in the pool.
"""

import collections
import json
import math
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from glm53 import assets, build, tokenizer
from glm53.serving.app import make_app
from glm53.serving.engine import Engine
from glm53.serving.limits import Limits
from glm53.serving.reasoning import THINK_CLOSE, THINK_OPEN
from glm53.serving.text import detokenizer
from tests.serving_helpers import AppServer

MODEL = "glm53-mini"
MIN_REQUESTS = 2000
MAX_ERROR_CHARS = 2000  # no error text may echo more of a client's input than this
SENT: collections.Counter = collections.Counter()  # status -> requests sent (every test of this module)
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)
GREEDY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


class _Server(AppServer):
    """The shipped model behind the app, served by uvicorn in a thread (tests/serving_helpers.py)."""

    def __init__(self):
        weights = assets.require_default_model()
        cfg, model = build.load_model(weights)
        tok = tokenizer.load_tokenizer(weights, vocab_size=cfg.vocab_size)
        # paged caches (the server's default) with fewer pages than 2 slots x 192 tokens: streams run out of pages
        self.engine = Engine(model, slots=2, max_len=192, buckets=(1, 16), eos_ids=cfg.eos_token_ids, max_queue=8,
                             compiler_options={"xla_backend_optimization_level": 0}, cache_tokens=256, page_tokens=16,
                             detokenize=detokenizer(tok, keep=(THINK_OPEN, THINK_CLOSE)))  # fmt: skip
        self.app = make_app(self.engine, tok, MODEL, log=lambda s: None)
        super().__init__(self.app, Limits())
        deadline = time.time() + 300
        while self.request("GET", "/health")[0] != 200:
            assert time.time() < deadline and self.thread.is_alive(), "the fuzzed server did not compile"
            time.sleep(0.25)

    def request(self, method, path, body=None, headers=None, timeout=120):
        status, headers, text = super().request(method, path, body, headers, timeout)
        SENT[status] += 1
        return status, headers, text


@pytest.fixture(scope="module")
def server():
    s = _Server()
    status, _, body = s.request("POST", "/v1/chat/completions", json.dumps(GREEDY).encode())
    assert status == 200, body
    s.greedy_text = json.loads(body)["choices"][0]["message"]["content"]
    SENT.clear()  # the warm-up's /health polls (503 while compiling) are not fuzzing
    yield s
    s.stop()


# ------------------------------------------------------------------------------------------------ the checks
def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def check_answer(path: str, status: int, headers: dict, text: str, stream: bool = False) -> None:
    """The invariants of every answer (see the module docstring)."""
    assert status < 500, f"{status} on {path}: {text[:500]}"
    assert headers.get("x-request-id"), f"no x-request-id on a {status} of {path}"
    if status >= 400:
        body = json.loads(text)
        if _is_anthropic(path):
            assert body.get("type") == "error" and set(body.get("error", ())) >= {"type", "message"}, body
            message = body["error"]["message"]
        else:
            assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
            message = body["error"]["message"]
        assert isinstance(message, str) and message, body
        assert len(message) <= MAX_ERROR_CHARS, f"an error text of {len(message)} characters: {message[:200]}..."

        if status in (429, 503):
            assert headers.get("retry-after"), f"{status} without Retry-After"
        return
    if not stream:
        body = json.loads(text)
        if _is_anthropic(path):
            assert body.get("type") == "message" or isinstance(body.get("input_tokens"), int), body
        elif path.startswith("/v1/"):
            assert body.get("object") in ("chat.completion", "text_completion", "list", "model"), body
        return
    if _is_anthropic(path):  # the event stream ends with message_stop, or with an error event
        events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert events and events[0] == "message_start" and events[-1] in ("message_stop", "error"), events[-3:]
    else:
        data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", data[-3:]
        last = json.loads(data[-2])
        assert "error" in last or last["choices"] == [] or last["choices"][0]["finish_reason"], last


def post(server, path: str, body) -> None:
    if isinstance(body, (bytes, bytearray)):  # schemathesis' negative mode: a body that is not JSON at all
        raw = bytes(body)
    else:
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    note(f"POST {path} {raw[:1000]!r}")
    status, headers, text = server.request("POST", path, raw)
    check_answer(path, status, headers, text, stream=isinstance(body, dict) and body.get("stream") is True)


# ------------------------------------------------------------------------------------------------ schemathesis
@pytest.fixture(scope="module")
def operations(server):
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    return {(o.method.upper(), o.path): o for o in (r.ok() for r in schema.get_all_operations())}


POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]


def _small(body, data) -> object:
    """A schema-valid body pointed at this server's model most of the time, with few tokens to generate."""
    if isinstance(body, dict):
        if data.draw(st.integers(0, 3)):
            body["model"] = MODEL
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and data.draw(st.booleans()):
                body[key] = data.draw(st.integers(1, 3))
    return body


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_bodies(server, operations, path, mode):
    op = operations[("POST", path)]

    @settings(FUZZ, max_examples=130 if mode == GenerationMode.POSITIVE else 100)
    @given(case=op.as_strategy(generation_mode=mode), data=st.data())
    def run(case, data):
        body = _small(case.body, data)
        if isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 2  # OpenAI's default is the rest of the context: keep the run short
        post(server, path, body)

    run()


# ------------------------------------------------------------------------------------------------ hand-written
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff"])
TEXT = st.one_of(st.text(max_size=30), SURROGATES, st.just(""), st.text(min_size=300, max_size=600))
HUGE_INTS = st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**32, 2**53, 2**63, 2**64, 10**30])
FLOATS = st.one_of(st.floats(0, 2), st.sampled_from([-1.0, 1e30, math.nan, math.inf, -math.inf, 0.0, 1.0]))
NAME = st.one_of(st.sampled_from(["get_weather", "search", "f"]), st.text(max_size=20), st.text(min_size=300, max_size=400))


def _json_values(max_leaves=12):
    return st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                        max_leaves=max_leaves)  # fmt: skip


TYPES = st.one_of(st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "null"]),
                  st.lists(st.sampled_from(["string", "null", "integer"]), max_size=3), _json_values(4))  # fmt: skip
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": TYPES}),
    lambda c: st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(NAME, c, max_size=3)},
                                    optional={"required": st.lists(NAME, max_size=2),
                                              "additionalProperties": st.booleans()}),  # fmt: skip
    max_leaves=25,
)


def _deep_schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"x": s}}
    return s


PARAMETERS = st.one_of(SCHEMA, st.integers(1, 40).map(_deep_schema), _json_values())


def _openai_part():
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "data:image/png;base64,AAAA"})}),
        st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.just({"data": "AAAA", "format": "wav"})}),
        st.fixed_dictionaries({"type": st.just("file"), "file": st.just({"file_data": "AAAA"})}),
        st.dictionaries(st.text(max_size=5), _json_values(4), max_size=3),
        _json_values(3),
    )  # fmt: skip


def _openai_message():
    content = st.one_of(TEXT, st.none(), st.lists(_openai_part(), max_size=3), _json_values(3))
    call = st.fixed_dictionaries({"id": st.text(max_size=8), "type": st.just("function"),
                                  "function": st.fixed_dictionaries({"name": NAME, "arguments": st.one_of(
                                      TEXT, _json_values(4))})})  # fmt: skip
    return st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]), "content": content},
        optional={"tool_calls": st.lists(call, max_size=2), "tool_call_id": st.text(max_size=8), "name": NAME},
    )


def _openai_tool():
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": NAME}, optional={"description": TEXT, "parameters": PARAMETERS})}),  # fmt: skip
        _json_values(4),
    )


def _sampling(anthropic: bool):
    ints = st.one_of(st.integers(1, 3), HUGE_INTS)
    opt = {"temperature": FLOATS, "top_p": FLOATS, "top_k": st.one_of(st.integers(0, 50), HUGE_INTS),
           "stream": st.booleans()}  # fmt: skip
    stop = st.one_of(st.lists(TEXT, max_size=4), st.lists(st.just("x"), min_size=17, max_size=40),
                     st.lists(st.text(min_size=257, max_size=300), min_size=1, max_size=2))  # fmt: skip
    if anthropic:
        return {"max_tokens": ints}, {**opt, "stop_sequences": stop}
    return {"max_tokens": ints}, {**opt, "stop": st.one_of(TEXT, stop), "seed": st.one_of(st.integers(0, 9), HUGE_INTS),
                                  "n": st.integers(0, 2), "stream_options": st.just({"include_usage": True})}  # fmt: skip


MODEL_NAMES = st.one_of(st.just(MODEL), st.just(MODEL), st.text(max_size=10), st.just("m" * 100_000))


def chat_bodies():
    required, optional = _sampling(anthropic=False)
    return st.fixed_dictionaries(
        {"model": MODEL_NAMES, "messages": st.lists(_openai_message(), min_size=1, max_size=4), **required},
        optional={**optional, "tools": st.lists(_openai_tool(), max_size=3),
                  "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries(
                      {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})})),
                  "reasoning_effort": st.sampled_from(["none", "low", "high", "bogus"]),
                  "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()})},
    )  # fmt: skip


def _anthropic_block():
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
        st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT, "signature": st.just("sig")}),
        st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": st.just("AAAA")}),
        st.fixed_dictionaries({"type": st.just("image"), "source": st.just(
            {"type": "base64", "media_type": "image/png", "data": "AAAA"})}),  # fmt: skip
        st.fixed_dictionaries({"type": st.just("document"), "source": st.just(
            {"type": "text", "media_type": "text/plain", "data": "hello"})}),  # fmt: skip
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=8), "name": NAME,
                               "input": _json_values(4)}),  # fmt: skip
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=8),
                               "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                   {"type": st.just("text"), "text": TEXT}), max_size=2))}),  # fmt: skip
        st.dictionaries(st.text(max_size=5), _json_values(3), max_size=3),
    )


def _anthropic_message():
    return st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                  "content": st.one_of(TEXT, st.lists(_anthropic_block(), max_size=3))})  # fmt: skip


def _anthropic_tool():
    return st.one_of(st.fixed_dictionaries({"name": NAME, "input_schema": PARAMETERS}, optional={"description": TEXT}),
                     _json_values(4))  # fmt: skip


def _anthropic_base():
    return (
        {"model": MODEL_NAMES, "messages": st.lists(_anthropic_message(), min_size=1, max_size=4)},
        {"system": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)),
         "tools": st.lists(_anthropic_tool(), max_size=3),
         "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool"])},
                                                        optional={"name": NAME}), _json_values(3)),
         "thinking": st.one_of(st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": st.one_of(
             st.integers(0, 4), HUGE_INTS)}), st.just({"type": "disabled"}), _json_values(3))},
    )  # fmt: skip


def messages_bodies():
    required, optional = _sampling(anthropic=True)
    base, base_opt = _anthropic_base()
    return st.fixed_dictionaries({**base, **required}, optional={**base_opt, **optional})


def count_tokens_bodies():
    base, base_opt = _anthropic_base()
    return st.fixed_dictionaries(base, optional=base_opt)


def completion_bodies():
    required, optional = _sampling(anthropic=False)
    prompt = st.one_of(TEXT, st.lists(st.one_of(st.integers(0, 50), HUGE_INTS), min_size=0, max_size=8), _json_values(3))
    return st.fixed_dictionaries({"model": MODEL_NAMES, "prompt": prompt, **required},
                                 optional={**optional, "echo": st.booleans()})  # fmt: skip


@pytest.mark.parametrize(
    "path,bodies,n",
    [("/v1/chat/completions", chat_bodies, 300), ("/v1/messages", messages_bodies, 300),
     ("/v1/completions", completion_bodies, 150), ("/v1/messages/count_tokens", count_tokens_bodies, 100)],
    ids=["chat", "messages", "completions", "count_tokens"],
)  # fmt: skip
def test_hand_written_bodies(server, path, bodies, n):
    @settings(FUZZ, max_examples=n)
    @given(body=bodies())
    def run(body):
        post(server, path, body)

    run()


# ------------------------------------------------------------------------------------------------ raw HTTP
PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                         "/v1/models", f"/v1/models/{MODEL}", "/v1/models/nope", "/v1/nothing", "/nothing",
                         "/v1/messages/batches", "/health", "/metrics"])  # fmt: skip
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
RAW_BODIES = st.one_of(
    st.binary(max_size=200),
    st.just(b'{"model": "glm53-mini", "messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 2}'),
    st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 200_000).map(lambda d: b'{"a":' * d + b"1" + b"}" * d),
    st.just(b"{}"), st.just(b"null"), st.just(b"[]"), st.just(b'"text"'), st.just(b"NaN"),
)  # fmt: skip
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])


def test_raw_requests(server):
    @settings(FUZZ, max_examples=300)
    @given(method=METHODS, path=PATHS, body=RAW_BODIES, ctype=CONTENT_TYPES)
    def run(method, path, body, ctype):
        status, headers, text = server.request(method, path, body if method != "GET" else None,
                                               {"content-type": ctype} if ctype else {})  # fmt: skip
        if path in ("/health", "/metrics") and status == 200:
            return
        check_answer(path, status, headers, text)

    run()


# ------------------------------------------------------------------------------------------------ afterwards
def test_the_server_still_answers_as_before(server):
    """Runs last: enough requests were sent, the engine is idle, and the fixed greedy request gives its text."""
    assert sum(SENT.values()) >= MIN_REQUESTS, dict(SENT)
    assert {s for s in SENT if s >= 500} == set(), dict(SENT)
    assert SENT[200] >= 50 and len({s for s in SENT if 400 <= s < 500}) >= 3, dict(SENT)  # both outcomes reached
    deadline = time.time() + 60
    while server.engine.busy_slots or server.engine.queue_depth:
        assert time.time() < deadline, "requests still running a minute after the fuzzing"
        time.sleep(0.1)
    status, _, body = server.request("POST", "/v1/chat/completions", json.dumps(GREEDY).encode())
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == server.greedy_text
    pool = server.engine.pool  # every request's pages came back (finished, cancelled by a dropped stream, failed)
    assert pool.free_count() == pool.capacity and not pool.refs.any()
