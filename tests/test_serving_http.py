"""The HTTP layer (glm53.serving.app, glm53.serving.http) under failures and hostile clients: no request can hurt
another, every failure is said.

In-process: the app over a model-free `FakeEngine` (tests/serving_helpers.py; the byte tokenizer) served by
uvicorn in a thread, as `experiments.serve` configures it. One subprocess (`python -m experiments.serve` on the
tiny random model) for what only a process shows: SIGTERM's drain and exit status.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from glm53.serving import responses as R
from glm53.serving.app import make_app
from glm53.serving.http import json_depth
from glm53.serving.limits import Limits
from glm53.tokenizer import ByteTokenizer
from tests.serving_helpers import FAIL_TOKENS, AppServer, FakeEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "fake"
KEY = "sekrit"
LIMITS = Limits(max_body_bytes=64 << 10, max_json_depth=16, header_timeout_s=1.0, body_timeout_s=1.0,
                keep_alive_s=1.0, shutdown_grace_s=0.5, retry_after_s=7)  # fmt: skip
CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
N_STREAMS = 24


def chat(n, stream=False, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "stream": stream, **kw}


def anth(n, stream=False, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "stream": stream, **kw}


def _serve(engine=None, limits=LIMITS, api_key=None, tok=None):
    engine = engine or FakeEngine()
    app = make_app(engine, tok or ByteTokenizer(engine.cfg.vocab_size), MODEL, api_key=api_key, limits=limits,
                   log=lambda s: None)  # fmt: skip
    s = AppServer(app, limits)
    s.engine, s.app = engine, app
    deadline = time.time() + 10
    while s.request("GET", "/health")[0] != 200 and engine.warm_at_start:
        assert time.time() < deadline
        time.sleep(0.02)
    return s


@pytest.fixture
def srv():
    s = _serve()
    yield s
    s.stop()


def _errors(caplog):
    return [r for r in caplog.records if r.name == "glm53.serving" and r.levelno >= logging.ERROR]


def _openai_error(status, text, code):
    assert status == code, (status, text)
    e = json.loads(text)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    return e


def _anthropic_error(status, text, code):
    assert status == code, (status, text)
    body = json.loads(text)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def _raw(port, data: bytes, timeout=10.0) -> bytes:
    """Sends `data` on a fresh connection and reads until the server closes it (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


# ------------------------------------------------------------------------------------------------ failures said
def test_a_failed_generation_ends_with_the_apis_error(srv, caplog):
    caplog.set_level(logging.ERROR, "glm53.serving")
    status, h, text = srv.request("POST", CHAT, chat(FAIL_TOKENS, stream=True))
    assert status == 200
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "api_error" and "generation failed" in err["message"] and set(err) == {
        "message", "type", "param", "code"}  # fmt: skip
    assert not any('"finish_reason": "stop"' in e or '"finish_reason": "length"' in e for e in events)
    rid = h["x-request-id"]
    assert rid in srv.engine.submitted  # the engine request's id is the HTTP request's
    assert [r for r in _errors(caplog) if rid in r.getMessage()] and len(_errors(caplog)) == 1

    status, h, text = srv.request("POST", MSGS, anth(FAIL_TOKENS, stream=True))
    assert status == 200 and "event: message_stop" not in text and "end_turn" not in text
    last = text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error"
    assert json.loads(last[1][6:]) == {"type": "error", "error": {"type": "api_error",
                                                                  "message": "generation failed: internal error"}}  # fmt: skip

    caplog.clear()
    status, h, text = srv.request("POST", CHAT, chat(FAIL_TOKENS))
    assert _openai_error(status, text, 500)["type"] == "api_error"
    logged = _errors(caplog)
    assert len(logged) == 1 and h["x-request-id"] in logged[0].getMessage()
    status, _, text = srv.request("POST", MSGS, anth(FAIL_TOKENS))
    assert _anthropic_error(status, text, 500)["type"] == "api_error"
    # ... and the others are served as before
    status, h, text = srv.request("POST", CHAT, chat(3))
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "aaa"
    assert h["x-request-id"].startswith("req_") and srv.request("GET", "/health")[1]["x-request-id"] != h["x-request-id"]


def test_a_bug_while_answering_is_said_and_logged_with_the_request_id(srv, caplog, monkeypatch):
    caplog.set_level(logging.ERROR, "glm53.serving")

    async def broken_stream(gen, events, model, chat):
        async for ev in events:
            yield f"data: {json.dumps({'text': ev.text})}\n\n"
            raise RuntimeError("a bug")

    async def broken_body(*a):
        raise RuntimeError("a bug")

    monkeypatch.setattr(R, "openai_stream", broken_stream)
    monkeypatch.setattr(R, "anthropic_body", broken_body)
    status, h, text = srv.request("POST", CHAT, chat(50, stream=True))
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "api_error"
    assert "a bug" not in text and h["x-request-id"] in json.loads(events[-2])["error"]["message"]
    status, h2, text = srv.request("POST", MSGS, anth(50))
    assert _anthropic_error(status, text, 500)["type"] == "api_error" and "a bug" not in text
    logged = _errors(caplog)
    assert len(logged) == 2 and h["x-request-id"] in logged[0].getMessage() and h2["x-request-id"] in logged[1].getMessage()
    deadline = time.time() + 5
    while srv.engine.live_requests:  # both requests were cancelled, their slots free
        assert time.time() < deadline
        time.sleep(0.02)
    assert sorted(srv.engine.cancelled) == sorted(srv.engine.submitted)


def test_errors_in_each_apis_shape_on_every_route(srv):
    e = _openai_error(*srv.request("GET", "/v1/nope")[::2], 404)
    assert e["type"] == "not_found_error"
    _anthropic_error(*srv.request("GET", "/v1/messages/nope")[::2], 404)
    status, h, text = srv.request("GET", CHAT)
    _openai_error(status, text, 405)
    assert "POST" in h["allow"] and "x-request-id" in h
    _anthropic_error(*srv.request("PUT", MSGS, anth(2))[::2], 405)
    assert _openai_error(*srv.request("POST", CHAT, b'{"model": "\xff"}')[::2], 400)["param"] == "body"
    deep = b"[" * 1000 + b"]" * 1000
    assert _openai_error(*srv.request("POST", CHAT, deep)[::2], 400)["param"] == "body"
    assert "nested" in _anthropic_error(*srv.request("POST", MSGS, b'{"a":' * 17 + b"1" + b"}" * 17)[::2], 400)["message"]
    assert srv.request("POST", CHAT, b'{"a":' * 15 + b'"[[[[[[[[[[[[[[[[[[[[[[[["' + b"}" * 15)[0] == 400  # not too deep
    assert _openai_error(*srv.request("POST", CHAT, "x", {"content-type": "text/plain"})[::2], 415)["param"]
    _anthropic_error(*srv.request("POST", MSGS, "x", {"content-type": "text/plain"})[::2], 415)
    # the model: GET /v1/models/{id}; an unknown or huge model name is clipped in the error
    status, _, text = srv.request("GET", f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(text)["id"] == MODEL
    _openai_error(*srv.request("GET", "/v1/models/other")[::2], 404)
    e = _openai_error(*srv.request("POST", CHAT, {**chat(2), "model": "m" * 50_000})[::2], 404)
    assert len(e["message"]) < 300 and e["param"] == "model"
    e = _anthropic_error(*srv.request("POST", MSGS, {**anth(2), "model": "m" * 50_000})[::2], 404)
    assert len(e["message"]) < 300


# ------------------------------------------------------------------------------------------------ what is read
def test_body_limits_are_enforced_on_what_is_read(srv):
    n = LIMITS.max_body_bytes
    big = json.dumps(chat(2, user="x" * n))
    assert "body" in _openai_error(*srv.request("POST", CHAT, big)[::2], 413)["message"]
    _anthropic_error(*srv.request("POST", MSGS, big)[::2], 413)
    # a Content-Length over the limit is refused before anything is read
    head = f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {n + 1}\r\n\r\n"
    assert _raw(srv.port, head.encode()).startswith(b"HTTP/1.1 413")
    # chunked: 20 MB offered, refused once the limit is passed (the rest is never read)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  "transfer-encoding: chunked\r\n\r\n".encode())  # fmt: skip
        chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
        sent = 0
        s.setblocking(False)
        answer = b""
        deadline = time.time() + 20
        while b"\r\n\r\n" not in answer and time.time() < deadline:
            try:
                answer += s.recv(65536)
                continue
            except BlockingIOError:
                pass
            if sent < 20 << 20:
                try:
                    sent += s.send(chunk)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    time.sleep(0.01)
            else:
                time.sleep(0.01)
    assert answer.startswith(b"HTTP/1.1 413") and sent < 20 << 20, (answer[:200], sent)  # before all was sent
    assert srv.engine.submitted == []


def test_json_depth_counts_brackets_outside_strings_in_linear_time():
    assert [json_depth(b) for b in (b"", b"1", b"[]", b'{"a": [1, {"b": []}]}', b'["[[[", "]"]', b'"\\"[[[\\"',
                                    b'{"a": "\\\\"}')] == [0, 0, 1, 4, 1, 0, 1]  # fmt: skip
    start = time.time()
    assert json_depth(b'"' + b'\\"' * 500_000) == 0 and json_depth(b"[" * 500_000) == 500_000
    assert time.time() - start < 5  # unterminated strings: no quadratic rescans


def test_read_timeouts_close_slow_connections(srv):
    t = LIMITS.header_timeout_s
    # headers at a byte every 0.1 s: closed once the header timeout is spent, though bytes keep coming
    start = time.time()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        closed = False
        for b in b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: " + b"y" * 1000:
            try:
                s.sendall(bytes([b]))
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            assert time.time() - start < 3 * t + 2
    assert closed and time.time() - start < 3 * t + 1
    # a body shorter than its Content-Length: 408 in the API's shape, the connection closed
    head = f"POST {MSGS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{"
    start = time.time()
    out = _raw(srv.port, head.encode())
    assert out.startswith(b"HTTP/1.1 408") and time.time() - start < 3 * LIMITS.body_timeout_s + 1
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "timeout_error"
    # an idle keep-alive connection is closed after keep_alive_s
    start = time.time()
    out = _raw(srv.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") and time.time() - start < 3 * LIMITS.keep_alive_s + 1


def test_tokenizing_runs_off_the_event_loop_a_few_at_once():
    class Slow(ByteTokenizer):
        def __init__(self, n):
            super().__init__(n)
            self.now = self.most = 0
            self.threads = set()
            self.lock = threading.Lock()

        def apply_chat_template(self, *a, **kw):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
                self.threads.add(threading.current_thread().name)
            time.sleep(0.3)
            with self.lock:
                self.now -= 1
            return super().apply_chat_template(*a, **kw)

    tok = Slow(1000)
    s = _serve(FakeEngine(slots=8), tok=tok)
    try:
        results = []
        ts = [threading.Thread(target=lambda: results.append(s.request("POST", CHAT, chat(2))[0])) for _ in range(6)]
        for t in ts:
            t.start()
        time.sleep(0.1)
        assert s.request("GET", "/health", timeout=5)[0] == 200  # the loop answers while prompts are tokenized
        for t in ts:
            t.join()
        assert results == [200] * 6 and tok.most == LIMITS.tokenize_threads
        assert threading.main_thread().name not in tok.threads
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------ slots
def test_a_disconnected_non_streaming_client_frees_its_slot(srv):
    body = json.dumps(chat(100_000)).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        deadline = time.time() + 10
        while srv.engine.live_requests != 1:
            assert time.time() < deadline
            time.sleep(0.02)
    deadline = time.time() + 10
    while srv.engine.live_requests:
        assert time.time() < deadline, "the request of a gone client still runs"
        time.sleep(0.02)
    assert srv.engine.cancelled == srv.engine.submitted and len(srv.engine.submitted) == 1


def test_refusals_carry_retry_after():
    s = _serve(FakeEngine(slots=1, max_queue=1))
    try:
        threads = [threading.Thread(target=s.request, args=("POST", CHAT, chat(300, stream=True))) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while s.engine.live_requests < 2:
            assert time.time() < deadline
            time.sleep(0.02)
        status, h, text = s.request("POST", CHAT, chat(2))
        assert _openai_error(status, text, 429)["type"] == "rate_limit_error" and h["retry-after"] == "7"
        status, h, text = s.request("POST", MSGS, anth(2))
        assert _anthropic_error(status, text, 429)["type"] == "rate_limit_error" and h["retry-after"] == "7"
        for t in threads:
            t.join()
    finally:
        s.stop()
    cold = _serve(FakeEngine(warm=False))
    try:
        status, h, text = cold.request("POST", CHAT, chat(2))
        assert _openai_error(status, text, 503) and h["retry-after"] == "7"
        assert cold.request("GET", "/health")[1]["retry-after"] == "7"
    finally:
        cold.stop()


# ------------------------------------------------------------------------------------------------ auth
def test_auth_constant_time_either_header_both_apis():
    s = _serve(api_key=KEY)
    try:
        for path, body in ((CHAT, chat(2)), (MSGS, anth(2))):
            for h in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
                assert s.request("POST", path, body, h)[0] == 200, (path, h)
            for h in ({}, {"authorization": "Bearer nope"}, {"x-api-key": KEY + "x"}, {"authorization": KEY}):
                assert s.request("POST", path, body, h)[0] == 401, (path, h)
        _anthropic_error(*s.request("POST", MSGS, anth(2))[::2], 401)
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert s.request("GET", path)[0] == 401
            assert s.request("GET", path, headers={"x-api-key": KEY})[0] == 404  # off when a key is set
        assert s.request("GET", "/health")[0] == 200 and s.request("GET", "/metrics")[0] == 200
        assert s.request("GET", "/v1/models")[0] == 401
    finally:
        s.stop()
    s = _serve()
    try:
        assert s.request("GET", "/openapi.json")[0] == 200  # no key: the docs are on
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------ shutdown
def _drain(s):
    done = threading.Event()
    s.app.state.shutdown.start(done.set)
    return done


def test_drain_lets_requests_finish_within_the_grace():
    s = _serve(FakeEngine(delay=0.01))
    try:
        out = []
        t = threading.Thread(target=lambda: out.append(s.request("POST", CHAT, chat(10))))
        t.start()
        while s.engine.live_requests != 1:
            time.sleep(0.01)
        done = _drain(s)
        status, h, text = s.request("POST", MSGS, anth(2))
        assert _anthropic_error(status, text, 503)["type"] == "overloaded_error" and h["retry-after"] == "7"
        t.join()
        assert out[0][0] == 200 and json.loads(out[0][2])["choices"][0]["message"]["content"] == "a" * 10
        assert done.wait(5)
    finally:
        s.stop()


def test_drain_aborts_what_outlives_the_grace(caplog):
    caplog.set_level(logging.ERROR, "glm53.serving")
    s = _serve(FakeEngine(delay=0.05))
    try:
        out = {}
        reqs = {"stream": (CHAT, chat(10_000, stream=True)), "body": (CHAT, chat(10_000)),
                "anthropic": (MSGS, anth(10_000, stream=True))}  # fmt: skip
        ts = [threading.Thread(target=lambda k=k, a=a: out.__setitem__(k, s.request("POST", *a))) for k, a in reqs.items()]
        for t in ts:
            t.start()
        while s.engine.live_requests != 3:
            time.sleep(0.01)
        start = time.time()
        done = _drain(s)
        _openai_error(*s.request("POST", CHAT, chat(2))[::2], 503)
        for t in ts:
            t.join(10)
        assert done.wait(5) and time.time() - start < 3 * LIMITS.shutdown_grace_s + 2
        assert out["stream"][2].rstrip().endswith("data: [DONE]") and "server shutting down" in out["stream"][2]
        assert out["anthropic"][2].strip().split("\n\n")[-1].startswith("event: error")
        assert "server shutting down" in _openai_error(out["body"][0], out["body"][2], 500)["message"]
        assert len([r for r in _errors(caplog) if "server shutting down" in r.getMessage()]) == 3
    finally:
        s.stop()


def test_sigterm_drains_and_exits_zero(tmp_path):
    """The real server on the tiny random model: SIGTERM while a stream runs: the stream ends with its error
    event, new requests get 503, the process exits 0 within the grace (+ a few seconds), no traceback logged."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_experimental_ynn_fusion_type="}  # fmt: skip
    args = [sys.executable, "-m", "experiments.serve", "--config=configs/tiny.py", "--port=0", "--slots=1",
            "--max_len=4096", "--max_queue=32", "--buckets=1,16", "--compilation_cache=", "--prefix_cache_mb=0", "--narrow=false",
            "--shutdown_grace_s=1", "--model_name=tiny", "--header_timeout_s=2"]  # fmt: skip
    log = tmp_path / "log.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        port = None
        for line in proc.stdout:
            if line.startswith("listening on"):
                port = int(line.rsplit(":", 1)[1])
                break
        assert port, log.read_text()[-3000:]
        rest = []
        threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True).start()
        s = AppServer.__new__(AppServer)
        s.port = port
        deadline = time.time() + 300
        while True:
            try:
                if s.request("GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        # one slot, a queue of streams (greedy: each runs until the random model's EOS): more work than the grace
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "stream": True, "temperature": 0}
        out = []
        ts = [threading.Thread(target=lambda: out.append(s.request("POST", "/v1/completions", body, timeout=60)))
              for _ in range(N_STREAMS)]  # fmt: skip
        for t in ts:
            t.start()
        time.sleep(1.0)
        proc.terminate()
        start = time.time()
        time.sleep(0.5)  # the signal is handled (the grace is 1 s)
        refused = s.request("POST", "/v1/completions", {**body, "stream": False}, timeout=10)
        assert refused[0] == 503 and refused[1]["retry-after"] == "1", refused
        assert proc.wait(timeout=20) == 0 and time.time() - start < 1 + 10
        for t in ts:
            t.join(10)
        assert len(out) == N_STREAMS
        ends = {"done" if '"finish_reason": "stop"' in t or '"finish_reason": "length"' in t else
                "aborted" if "server shutting down" in t else t[-300:] for _, _, t in out}  # fmt: skip
        assert ends <= {"done", "aborted"} and all(t.rstrip().endswith("data: [DONE]") for _, _, t in out), ends
        assert "aborted" in ends or time.time() - start < 2  # what outlived the grace ended with the error event
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
