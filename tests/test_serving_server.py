"""`python -m experiments.serve` on the shipped model, driven by the official `openai` and `anthropic` SDKs.

One server process for the module (a free loopback port, an API key, 4 slots, a queue of 16). Greedy requests
are deterministic, so "alone" (one at a time) and "together" (concurrent streams over the shared batch) must give
the same text; both APIs render the same conversation with the model's chat template, so they agree too.
"""

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
MODEL = "glm53-mini"
GREEDY = {"temperature": 0}  # the anthropic SDK has no temperature argument any more: an extra body field


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One CPU device; the least XLA optimization: compiles in ~60% of the time (start-up dominates this module).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_experimental_ynn_fusion_type="}  # fmt: skip
    args = [sys.executable, "-m", "experiments.serve", "--port=0", "--slots=4", "--max_len=256", "--max_queue=16",
            "--buckets=1,16", f"--api_key={KEY}", "--compilation_cache="]  # fmt: skip
    log = tmp_path_factory.mktemp("serve") / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=out, text=True)
    port = None
    try:
        for line in proc.stdout:
            if line.startswith("listening on"):
                port = int(line.rsplit(":", 1)[1])
                break
        assert port, f"the server did not start: {log.read_text()[-2000:]}"
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
        deadline = time.time() + 300
        while _get(port, "/health")[0] != 200:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


def _post(port, path, body, headers=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    h = {
        "content-type": "application/json",
        "authorization": f"Bearer {KEY}",
        "x-api-key": KEY,
        **(headers or {}),
    }
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body), headers=h)
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    return r.status, data


def _oversized_status(port, path, size) -> int:
    """The status answering a body of `size` bytes: the server refuses it once the Content-Length is read and
    closes the connection, so the rest of the body may never be sent (a broken pipe for the sender)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Length: {size}\r\n\r\n")  # fmt: skip
        s.sendall(head.encode())
        with contextlib.suppress(OSError):
            s.sendall(b"x" * size)
        return int(s.makefile("rb").readline().split()[1])


def _oai(port, **kw):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=kw.pop("key", KEY), max_retries=0, timeout=120
    )


def _ant(port, **kw):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=kw.pop("key", KEY), max_retries=0,
                               timeout=120)  # fmt: skip


def _metric(port, name) -> float:
    text = _get(port, "/metrics")[1]
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def _chat(port, content, n, stream=False, **kw):
    c = _oai(port)
    msgs = [{"role": "user", "content": content}]
    if not stream:
        return c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0, **kw)
    return c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=n, temperature=0, stream=True, **kw
    )


def test_openai_chat_completions_and_models(server):
    r = _chat(server, "Why is the sky blue?", 12)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(
        _chat(server, "Why is the sky blue?", 12, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    # The raw stream: SSE data lines ending with [DONE].
    status, raw = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3, "stream": True})  # fmt: skip
    assert status == 200 and raw.rstrip().endswith("data: [DONE]") and raw.startswith("data: {")
    # Completions (text and token-id prompts), a stop string, and the model list.
    c = _oai(server)
    full = c.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0)
    t = full.choices[0].text
    assert full.object == "text_completion" and full.usage.completion_tokens == 16 and t
    stop = t.strip()[2:5] if len(t.strip()) >= 5 else t.strip()
    cut = c.completions.create(
        model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == t[: t.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(
        model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed if x.choices) == t
    assert [m.id for m in c.models.list()] == [MODEL]


def test_anthropic_messages_and_count_tokens(server):
    a = _ant(server)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    m = a.messages.create(model=MODEL, max_tokens=12, messages=msgs, extra_body=GREEDY)
    same = _chat(server, "Why is the sky blue?", 12)  # the same chat template, the same greedy tokens
    assert m.content[0].text == same.choices[0].message.content
    assert (
        m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens == same.usage.completion_tokens
    )
    assert a.messages.count_tokens(model=MODEL, messages=msgs).input_tokens == m.usage.input_tokens
    with a.messages.stream(model=MODEL, max_tokens=12, messages=msgs, extra_body=GREEDY) as s:
        kinds = [e.type for e in s if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]  # fmt: skip
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                    "message_delta", "message_stop"]  # fmt: skip
    status, raw = _post(
        server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": msgs, "stream": True}
    )
    assert status == 200 and "event: ping" in raw and raw.rstrip().endswith('data: {"type": "message_stop"}')
    text = m.content[0].text
    if len(text.strip()) >= 4:
        stop = text.strip()[1:4]
        cut = a.messages.create(
            model=MODEL, max_tokens=12, messages=msgs, extra_body=GREEDY, stop_sequences=[stop]
        )
        assert cut.content[0].text == text[: text.index(stop)]
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    sysm = a.messages.create(model=MODEL, max_tokens=3, messages=msgs, system="Be brief.", extra_body=GREEDY)
    assert sysm.usage.input_tokens > m.usage.input_tokens


def test_thinking_through_the_sdks(server):
    """Thinking asked for: the prompt ends inside `<think>`; the reasoning comes back apart from the answer
    (OpenAI `reasoning_content`, Anthropic a `thinking` block, streamed as thinking_delta); Anthropic's
    budget_tokens feeds `</think>` after that many tokens. Both APIs render the same prompt: same reasoning."""
    c, a = _oai(server), _ant(server)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, reasoning_effort="high")
    reasoning = r.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and r.choices[0].message.content == ""
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": True}}))  # fmt: skip
    assert "".join((x.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for x in chunks if x.choices) == reasoning  # fmt: skip
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    think = {"type": "enabled", "budget_tokens": 5}
    m = a.messages.create(model=MODEL, max_tokens=12, messages=msgs, thinking=think, extra_body=GREEDY)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == reasoning
    assert m.usage.output_tokens <= 12 and m.stop_reason in ("max_tokens", "end_turn")
    with a.messages.stream(model=MODEL, max_tokens=12, messages=msgs, thinking=think, extra_body=GREEDY) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in m.content]  # fmt: skip
    assert deltas[0] == "thinking_delta" and "text_delta" in deltas
    n = a.messages.count_tokens(model=MODEL, messages=msgs, thinking=think).input_tokens
    assert n == m.usage.input_tokens == a.messages.count_tokens(model=MODEL, messages=msgs).input_tokens + 1
    for body, field in (({"thinking": {"type": "enabled", "budget_tokens": 12}}, "budget_tokens"),
                        ({"thinking": {"type": "on"}}, "thinking"),
                        ({"thinking": think, "tools": [{"name": "f"}], "tool_choice": {"type": "any"}}, "thinking")):  # fmt: skip
        status, raw = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 12, "messages": msgs, **body})
        assert status == 400 and field in json.loads(raw)["error"]["message"], raw
    status, raw = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "reasoning_effort": "max"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "reasoning_effort"


def test_prefix_cache_hit_equals_cold_run(server):
    """The server runs with the prefix cache on (default 256 MiB): a repeated long prompt resumes from its
    snapshots (hits counted in /metrics) and gives the cold run's text (the engine's tests prove the tokens)."""
    long = "You are a careful assistant who answers briefly and precisely. " * 4 + "Why is the sky blue?"
    hits, saved = _metric(server, "glm53_prefix_hits_total"), _metric(server, "glm53_prefix_hit_tokens_total")
    cold = _chat(server, long, 8).choices[0].message.content
    warm = _chat(server, long, 8).choices[0].message.content
    assert warm == cold and _metric(server, "glm53_prefix_hits_total") == hits + 1
    assert _metric(server, "glm53_prefix_hit_tokens_total") >= saved + 32
    assert 0 < _metric(server, "glm53_prefix_cache_hit_rate") <= 1


PROMPTS = ["Hello!", "Write a poem about the sea.", "def add(a, b):", "What is 2 + 2?", "Tell me a story",
           "import numpy as np", "Why?", "List three colors.", "class Stack:", "for i in range(10):",
           "Explain recursion in one line.", "x = [1, 2, 3]", "What is a closure?", "def main():",
           "Name a prime number.", "import os, sys"]  # fmt: skip


def test_concurrent_streams_equal_each_alone(server):
    kws = [
        dict(max_tokens=4 + 2 * i, temperature=0.8 if i % 3 == 2 else 0, seed=i) for i in range(len(PROMPTS))
    ]

    def run(i, stream):
        msgs = [{"role": "user", "content": PROMPTS[i]}]
        if i % 2:  # Anthropic has no seed: greedy only
            kw = {"max_tokens": kws[i]["max_tokens"], "extra_body": GREEDY}
            if not stream:
                return _ant(server).messages.create(model=MODEL, messages=msgs, **kw).content[0].text
            with _ant(server).messages.stream(model=MODEL, messages=msgs, **kw) as s:
                return "".join(s.text_stream)
        r = _oai(server).chat.completions.create(model=MODEL, messages=msgs, stream=stream, **kws[i])
        if not stream:
            return r.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)

    alone = [run(i, False) for i in range(len(PROMPTS))]
    together = [None] * len(PROMPTS)

    def worker(i):
        together[i] = run(i, True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone  # 16 streams over 4 slots (the rest waiting): joins, leaves, nothing lost or mixed
    assert len(set(alone)) > 1


def test_disconnect_frees_the_slot_and_a_full_queue_refuses(server):
    cancelled = _metric(server, "glm53_requests_cancelled_total")
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 100,
            "stream": True, "temperature": 0}  # fmt: skip
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"authorization": f"Bearer {KEY}",
                                                                   "content-type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    assert r.status == 200 and r.read(6) == b"data: "
    conn.close()  # mid-stream
    deadline = time.time() + 30
    while _metric(server, "glm53_requests_cancelled_total") < cancelled + 1:
        assert time.time() < deadline, "the disconnected stream was not cancelled"
        time.sleep(0.2)
    assert json.loads(_get(server, "/health")[1])["busy_slots"] == 0
    # 32 requests at once: 4 slots + 16 waiting; the rest are refused with 429 in the API's error shape.
    statuses = []

    def one(i):
        path, b = (("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
                   if i % 2 else ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8}))  # fmt: skip
        statuses.append(_post(server, path, b))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(s for s, _ in statuses)
    assert set(codes) == {200, 429} and codes.count(200) >= 4, codes
    refused = [json.loads(d) for s, d in statuses if s == 429]
    assert all(e.get("error", {}).get("type") == "rate_limit_error" for e in refused)
    assert _get(server, "/health")[0] == 200


def test_auth_and_bad_requests(server):
    with pytest.raises(openai.AuthenticationError):
        _oai(server, key="wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError):
        _ant(server, key="wrong").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    status, data = _get(server, "/v1/models")  # no key
    assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        _oai(server).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    user = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "bogus": 1}, "bogus"),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "max_tokens": 1000}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, "prompt"),
        ("/v1/messages", {"model": MODEL, "messages": user}, "max_tokens"),
        (
            "/v1/messages",
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}], "max_tokens": 2},
            "role",
        ),
    ]
    for path, body, field in cases:
        status, data = _post(server, path, body)
        err = json.loads(data)
        assert status == 400, (body, data)
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert field in err["error"]["message"]
        else:
            assert field in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    status, data = _post(server, "/v1/messages", None, raw="{not json")
    assert status == 400 and "JSON" in json.loads(data)["error"]["message"]
    assert _oversized_status(server, "/v1/completions", 2 << 20) == 413


_USER = [{"role": "user", "content": "hi"}]
_FIELDS = {
    "messages": st.one_of(st.just(_USER), st.lists(st.dictionaries(
        st.sampled_from(["role", "content", "x"]), st.one_of(st.sampled_from(["user", "assistant", "robot"]),
                                                             st.text(max_size=5), st.integers(), st.none())), max_size=2)),
    "prompt": st.one_of(st.text(max_size=8), st.lists(st.integers(-5, 5000), max_size=4)),
    "max_tokens": st.one_of(st.integers(-2, 4), st.integers(), st.text(max_size=2), st.none()),
    "temperature": st.one_of(st.floats(allow_nan=True), st.integers(-1, 3)),
    "top_p": st.floats(-1, 2),
    "top_k": st.integers(-2, 50),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), st.integers()),
    "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
    "stream": st.booleans(),
    "seed": st.one_of(st.integers(), st.text(max_size=2)),
    "system": st.one_of(st.text(max_size=5), st.integers()),
    "bogus": st.integers(),
    "tools": st.one_of(st.integers(), st.lists(st.one_of(st.sampled_from([
        {"type": "function", "function": {"name": "f"}}, {"name": "f", "input_schema": {}}]),
        st.dictionaries(st.sampled_from(["type", "function", "name"]), st.one_of(st.text(max_size=3), st.just({}),
                                                                                 st.integers()))), max_size=2)),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any", {"type": "any"}, {"type": "tool", "name": "f"},
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": "f"}]),
        st.text(max_size=3), st.integers(), st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
}  # fmt: skip
_SEEN: set = set()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]),
       model=st.sampled_from([MODEL, MODEL, MODEL, "other", 3]),
       base=st.sampled_from([{"messages": _USER, "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2}, {}]),
       body=st.fixed_dictionaries({}, optional=_FIELDS))  # fmt: skip
def test_fuzzed_bodies_get_4xx_or_a_valid_answer(server, path, model, base, body):
    body = {"model": model, **base, **body}
    try:
        raw = json.dumps(body, allow_nan=True)
    except ValueError:
        return
    status, data = _post(server, path, None, raw=raw)
    assert status in (200, 400, 404, 413, 429), (status, data)
    _SEEN.add(status)
    if status != 200:
        err = json.loads(data)
        assert err["error"]["message"] if "error" in err else False
    elif body.get("stream") and not path.endswith("count_tokens"):
        assert data.rstrip().endswith(("data: [DONE]", 'data: {"type": "message_stop"}')), data[-200:]
    else:
        out = json.loads(data)
        assert "choices" in out or out.get("type") == "message" or "input_tokens" in out
    assert _get(server, "/health")[0] == 200


def test_fuzz_reached_both_outcomes():
    assert {200, 400} <= _SEEN, _SEEN  # runs after the fuzz test (file order)


def test_entry_point_usage_errors():
    for args, flag in ((["experiments.serve", "--buckets=4,8"], "--buckets"),
                       (["experiments.bench_serve", "--streams=0"], "--streams")):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]


# ------------------------------------------------------------------------------------------------ tool calls
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _n_tokens(text: str) -> int:
    """An independent count: the `tokenizers` library on the shipped tokenizer.json."""
    import tokenizers  # only this test needs it

    t = tokenizers.Tokenizer.from_file(os.path.join(ROOT, "glm53", "assets", "mini", "tokenizer.json"))
    return len(t.encode(text, add_special_tokens=False).ids)


def _expected_prompt(result: str | None) -> tuple[str, str]:
    """(the chat text, the forced prefix) the GLM tool format gives for the weather conversation."""
    from glm53.serving import tools as T  # the format's definition; the conversation is assembled here

    system = T.render_tools([T.Tool("get_weather", "Current weather.", WEATHER)])
    text = f"[gMASK]<sop><|system|>{system}<|user|>Weather in Paris?<|assistant|>"
    if result is not None:
        text += ('<tool_call>get_weather\n{"city": "Paris"}</tool_call><|observation|>'
                 f"<tool_response>{result}</tool_response><|assistant|>")  # fmt: skip
    return text, "<tool_call>get_weather\n"


def test_tool_calls_round_trip_through_the_sdks(server):
    """A forced call (tool_choice naming the function) comes back as a parsed call through both SDKs, stream
    and not; its result goes back as a `tool` message / `tool_result` block and the model answers. Both APIs
    render the same conversation (same prompt tokens, same greedy answer), counted independently."""
    c, a = _oai(server), _ant(server)
    otools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                                "parameters": WEATHER}}]  # fmt: skip
    atools = [{"name": "get_weather", "description": "Current weather.", "input_schema": WEATHER}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    force = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=otools, tool_choice=force, max_tokens=16,
                                  temperature=0)  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments), dict)  # a JSON object, always
    # Decoded under the JSON constraint (glm53.serving.constrain: the schema's keys, a string for "city"), the mini
    # model writes {"city": "..."} (unconstrained, its arguments were not JSON and fell back to {}).
    args = json.loads(call.function.arguments)
    assert list(args) == ["city"] and isinstance(args["city"], str)
    text, prefix = _expected_prompt(None)
    assert r.usage.prompt_tokens == _n_tokens(text) + _n_tokens(prefix)
    # Streaming: the name first, then the arguments; the same call.
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=otools, tool_choice=force,
                                            max_tokens=16, temperature=0, stream=True))  # fmt: skip
    deltas = [tc for x in chunks if x.choices for tc in (x.choices[0].delta.tool_calls or ())]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Anthropic, forced by {"type": "tool"}: the same prompt, the same arguments.
    m = a.messages.create(model=MODEL, max_tokens=16, messages=msgs, tools=atools,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)  # fmt: skip
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(use) == 1 and use[0].name == "get_weather"
    assert (
        use[0].input == json.loads(call.function.arguments) and m.usage.input_tokens == r.usage.prompt_tokens
    )
    with a.messages.stream(model=MODEL, max_tokens=16, messages=msgs, tools=atools, extra_body=GREEDY,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:  # fmt: skip
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == use[0].input
    # The round trip: the call (with fixed arguments) and its result go back; a text answer comes.
    oai_msgs = msgs + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    back = c.chat.completions.create(
        model=MODEL, messages=oai_msgs, tools=otools, max_tokens=8, temperature=0
    )
    text, _ = _expected_prompt("sunny, 21 C")
    assert back.usage.prompt_tokens == _n_tokens(text)
    ant_msgs = msgs + [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },  # fmt: skip
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}],
        },
    ]
    aback = a.messages.create(model=MODEL, max_tokens=8, messages=ant_msgs, tools=atools, extra_body=GREEDY)
    assert aback.usage.input_tokens == back.usage.prompt_tokens
    assert a.messages.count_tokens(model=MODEL, messages=ant_msgs, tools=atools).input_tokens == _n_tokens(
        text
    )
    btext = back.choices[0].message.content or ""
    atext = "".join(b.text for b in aback.content if b.type == "text")
    assert btext == atext and (back.choices[0].message.tool_calls is None) == (
        aback.stop_reason != "tool_use"
    )
    # Bad tool requests: 400 naming the field.
    status, raw = _post(
        server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "tool_choice": force}
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice"
    status, raw = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": msgs,
                                                 "tools": atools, "tool_choice": {"type": "tool", "name": "x"}})  # fmt: skip
    assert status == 400 and "tool_choice" in json.loads(raw)["error"]["message"]


def test_tool_call_parsing_and_streamed_content():
    """The parser and the streaming splitter on hand-written generations (no model needed)."""
    from glm53.serving import tools as T  # the module under test (kept out of the server tests' imports)

    mode = T.ToolMode([T.Tool("f"), T.Tool("g")])
    gen = 'Let me check. <tool_call>f\n{"x": 1}</tool_call>\n<tool_call>g\nnot json</tool_call>'
    content, calls = T.parse(gen, mode)
    assert content == "Let me check." and [(k.name, k.arguments) for k in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert T.parse("no calls <tool_call>unknown\n{}</tool_call>", mode)[1] == []
    assert T.parse("plain <tool", mode) == ("plain <tool", [])
    forced = T.ToolMode(mode.tools, "g")
    assert forced.forced_prefix == "<tool_call>g\n"
    assert [(k.name, k.arguments) for k in T.parse('{"a": [1]}', forced)[1]] == [("g", {"a": [1]})]
    assert T.parse("[1, 2]", forced)[1][0].arguments == {}  # not an object: the fall-back
    assert T.parse('{"a": 1});\n', forced)[1][0].arguments == {"a": 1}  # the object the text begins with
    done = ['{"a": 1}', '{"a": {"b": "}"}}', "x", " (", '{"s": "\\"}"}']
    more = ["", "  ", "{", '{"a": "}', '{"a": {"b": 1}', '{"s": "\\"}']
    assert all(T.arguments_done(t) for t in done) and not any(T.arguments_done(t) for t in more)
    some = T.ToolMode(
        mode.tools, ""
    )  # "required" with two tools: the name is generated, unknown -> the first
    assert [k.name for k in T.parse("g\n{}", some)[1]] == ["g"] and T.parse("h\n{}", some)[1][0].name == "f"
    s = T.ContentStream(mode)
    sent = "".join(s.push(gen[i : i + 3]) for i in range(0, len(gen), 3))
    assert sent == "Let me check. " and not s.push("more")
    rest, calls = s.finish()
    assert rest == "" and [k.name for k in calls] == ["f", "g"]
    s = T.ContentStream(mode)
    assert s.push("a <tool") == "a " and s.push("s") == "<tools" and s.finish() == ("", [])
    assert (
        T.openai_tools(None, "none") is None and T.anthropic_tools([{"name": "f"}], {"type": "none"}) is None
    )
    assert T.anthropic_tools([{"name": "f"}], {"type": "any"}).force == "f"


def test_an_unrepresentable_parameter_hurts_no_one_else(server):
    """The report's attack (top_k = 2**31 passed validation, then failed every request in flight): now a 400
    naming top_k on both APIs, while a concurrent greedy stream gives exactly its solo text; and the openai SDK's
    `models.retrieve` finds the model (404 in the API's shape for another)."""
    alone = "".join(c.choices[0].delta.content or "" for c in _chat(server, "Count to ten.", 24, stream=True) if c.choices)
    victim = {}

    def stream():
        victim["text"] = "".join(
            c.choices[0].delta.content or "" for c in _chat(server, "Count to ten.", 24, stream=True) if c.choices
        )

    t = threading.Thread(target=stream)
    t.start()
    bad = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 1, "top_k": 2**31}
    for path in ("/v1/chat/completions", "/v1/messages"):
        for _ in range(3):
            status, body = _post(server, path, {"model": MODEL, **bad})
            assert status == 400 and "top_k" in body, (path, status, body)
    t.join(120)
    assert victim["text"] == alone
    c = _oai(server)
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
