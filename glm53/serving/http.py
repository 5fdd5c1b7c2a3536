"""The HTTP layer's guards (glm53.serving.app): what is read from a client, who may ask, and how errors look.

`Guard` is a pure ASGI middleware around the FastAPI app. Every response carries `x-request-id` (one id per HTTP
request, also the engine request's id, so log lines correlate). On `/v1/*` it checks the API key (constant-time
`hmac.compare_digest`; `Authorization: Bearer KEY` or `x-api-key: KEY`, on both APIs), refuses new requests
while the server drains (503 + Retry-After), and reads the whole body itself before the app sees it: counted as
it arrives (chunked or not; a Content-Length above the limit is refused before reading), within
`Limits.body_timeout_s` (408), valid UTF-8, JSON nested at most `Limits.max_json_depth` (checked on the bytes,
before any parser recurses), `Content-Type: application/json` (or none). `/health` and `/metrics` stay open
without a key (load balancers, Prometheus); `/docs`, `/redoc` and `/openapi.json` exist only when no key is set.
Every error is in the calling API's shape (Anthropic's for `/v1/messages*`, OpenAI's elsewhere); every 5xx is
logged once (logger "glm53.serving") with its request id.

`header_timeout_protocol`: uvicorn's h11 protocol, except that a connection that has not sent a whole request
head within `Limits.header_timeout_s` (from its start, or from the end of its previous response) is closed.
`Shutdown`: SIGTERM / SIGINT drain (see its docstring).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable

import anyio
import numpy as np
import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from glm53.serving.errors import ApiError, error_body
from glm53.serving.limits import Limits

log = logging.getLogger("glm53.serving")
ANTHROPIC_PATHS = ("/v1/messages",)
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
# a JSON string, or an unterminated one to the end of the text: every match is linear and they never overlap
_STRING = re.compile(rb'"(?:[^"\\]|\\.?)*+(?:"|\Z)', re.DOTALL)
_DELTA = np.zeros(256, np.int32)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1


def api_of(path: str) -> str:
    return "anthropic" if path.startswith(ANTHROPIC_PATHS) else "openai"


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex[:24]


def json_depth(body: bytes) -> int:
    """The deepest nesting of objects and arrays in a JSON text (brackets inside strings do not count); linear
    time, no recursion (a malformed text gives some number: its parser refuses it later)."""
    if not body:
        return 0
    ops = np.frombuffer(_STRING.sub(b"", body), np.uint8)
    return int(max(np.cumsum(_DELTA[ops]).max(initial=0), 0))


def error_response(api: str, e: ApiError, rid: str | None, retry_after: int | None = None,
                   close: bool = False) -> tuple[int, list[tuple[bytes, bytes]], bytes]:  # fmt: skip
    """(status, headers, body) of an error in the API's shape; a 5xx is logged once with the request id."""
    if e.status >= 500 and not getattr(e, "logged", False):
        log.error("request %s: %d %s", rid, e.status, e.message)
    body = json.dumps(error_body(api, e), ensure_ascii=False).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None and e.status in (429, 503):
        headers.append((b"retry-after", str(retry_after).encode()))
    if close:
        headers.append((b"connection", b"close"))
    return e.status, headers, body


class _BodyError(Exception):
    def __init__(self, error: ApiError, close: bool = False):
        self.error, self.close = error, close


class Guard:
    """The ASGI middleware of the module docstring. `draining()`: whether new requests are refused."""

    def __init__(self, app, *, api_key: str | None, limits: Limits, draining: Callable[[], bool]):
        self.app, self.limits, self.draining = app, limits, draining
        self.key = None if api_key is None else api_key.encode()

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = [headers.get(b"x-api-key", b"")]
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given.append(auth[7:].strip())
        ok = False
        for g in given:  # both compared: the time does not tell which header was tried
            ok |= hmac.compare_digest(g, self.key)
        return ok

    async def _read_body(self, receive, headers: dict[bytes, bytes]) -> bytes:
        lim = self.limits
        size = headers.get(b"content-length")
        if size is not None and size.strip().isdigit() and int(size) > lim.max_body_bytes:
            raise _BodyError(ApiError(413, f"body: larger than {lim.max_body_bytes} bytes", "body"), True)
        chunks, n = [], 0
        try:
            with anyio.fail_after(lim.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise _BodyError(ApiError(400, "body: the client disconnected", "body"), True)
                    part = msg.get("body", b"")
                    n += len(part)
                    if n > lim.max_body_bytes:
                        raise _BodyError(ApiError(413, f"body: larger than {lim.max_body_bytes} bytes", "body"),
                                         True)  # fmt: skip
                    chunks.append(part)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            raise _BodyError(ApiError(408, f"body: not received within {lim.body_timeout_s:g} s", "body",
                                      "timeout_error"), True) from None  # fmt: skip
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _BodyError(ApiError(400, f"body: invalid UTF-8 at byte {e.start}", "body")) from None
        if json_depth(body) > lim.max_json_depth:
            raise _BodyError(ApiError(400, f"body: JSON nested deeper than {lim.max_json_depth} levels", "body"))
        return body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        path, api = scope["path"], api_of(scope["path"])
        started = False

        async def send_with_id(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(msg)

        async def answer(e: ApiError, close: bool = False):
            status, headers, body = error_response(api, e, rid, self.limits.retry_after_s, close)
            await send_with_id({"type": "http.response.start", "status": status, "headers": headers})
            await send_with_id({"type": "http.response.body", "body": body})

        headers = dict(scope.get("headers", []))
        if self.key is not None and (path.startswith("/v1/") or path in DOCS_PATHS):
            if not self._authorized(headers):
                return await answer(ApiError(401, "invalid or missing API key", None, "authentication_error"))
        if path.startswith("/v1/") and scope["method"] == "POST":
            if self.draining():
                return await answer(ApiError(503, "the server is shutting down; retry on another replica",
                                             None, "service_unavailable"))  # fmt: skip
            ctype = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                return await answer(ApiError(415, f"content-type: must be application/json, not "
                                                  f"{ctype[:64].decode('latin-1')!r}", "content-type"))  # fmt: skip
            try:
                body = await self._read_body(receive, headers)
            except _BodyError as b:
                return await answer(b.error, b.close)
            receive = _replay(body, receive)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:  # noqa: BLE001 - never a bare 500 page: the API's error shape instead
            if started and isinstance(e, (OSError, ClientDisconnect)):
                return  # the client went away mid-answer: nobody to tell
            log.error("request %s: %s %s failed", rid, scope["method"], path, exc_info=e)
            if not started:
                err = ApiError(500, f"internal error ({type(e).__name__}); request id {rid}", None, "api_error")
                err.logged = True
                await answer(err)


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then the connection's own messages (http.disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


# ------------------------------------------------------------------------------------------------ connections
def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol class closing a connection whose request head is not complete within `seconds`
    (pass it as `uvicorn.Config(http=...)`)."""

    class H11HeaderTimeout(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._disarm()
            self._head_of = self.cycle  # a new cycle means a new request head was read
            self._head_timer = self.loop.call_later(seconds, self._head_timeout)

        def _disarm(self):
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_timeout(self):
            self._head_timer = None
            if self.cycle is self._head_of and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self):
            super().handle_events()
            if getattr(self, "_head_timer", None) is not None and self.cycle is not self._head_of:
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return H11HeaderTimeout


def server_config(app, limits: Limits, **kw):
    """uvicorn's Config for the app under `limits` (header timeout, keep-alive, graceful-shutdown wait)."""
    kw.setdefault("log_level", "warning")
    return uvicorn.Config(app, http=header_timeout_protocol(limits.header_timeout_s),
                          timeout_keep_alive=limits.keep_alive_s, timeout_graceful_shutdown=5, **kw)  # fmt: skip


# ------------------------------------------------------------------------------------------------ shutdown
class Shutdown:
    """SIGTERM / SIGINT drain, in its own thread (`start(then)`, thread-safe; a second `start` skips the rest of
    the grace): the engine stops admitting (`Engine.drain`: 503 + Retry-After from then on, `draining` is
    set), running requests may finish within `grace_s`; then `Engine.abort_all("server shutting down")` ends
    every one left with an error event (each stream ends with the API's error event, a waiting non-streaming
    client gets an error in the API's shape); after `settle_s` for those answers to be written, `then()` (the
    server's exit: uvicorn closes its listeners, waits for open connections, stops the engine thread)."""

    def __init__(self, engine, grace_s: float, settle_s: float = 0.5, log_line=print):
        self.engine, self.grace_s, self.settle_s, self.log_line = engine, grace_s, settle_s, log_line
        self.draining = threading.Event()
        self.hurry = threading.Event()
        self._lock = threading.Lock()

    def start(self, then: Callable[[], None]) -> None:
        with self._lock:
            if self.draining.is_set():
                self.hurry.set()
                return
            self.draining.set()
        threading.Thread(target=self._run, args=(then,), name="glm53-drain", daemon=True).start()

    def _run(self, then):
        eng = self.engine
        eng.drain()
        live = eng.live_requests
        self.log_line(f"shutting down: {live} requests running, waiting up to {self.grace_s:g} s")
        deadline = time.monotonic() + self.grace_s
        while eng.live_requests and time.monotonic() < deadline and not self.hurry.wait(0.05):
            pass
        n = eng.abort_all("server shutting down") if eng.live_requests else 0
        if n:
            self.log_line(f"shutting down: {n} requests aborted")
        time.sleep(self.settle_s if n else 0.0)
        then()
