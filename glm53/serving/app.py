"""The HTTP server (FastAPI): OpenAI and Anthropic APIs over one `Engine` that runs in a background thread.

The engine thread compiles every program (`/health` answers 503 until then), then steps forever; request
handlers talk to it through thread-safe queues (`Engine.submit` / `Engine.cancel`, each request's events come
back through `loop.call_soon_threadsafe` onto an asyncio queue). Prompts are rendered and tokenized off the event
loop (at most `Limits.tokenize_threads` at once). A client that disconnects (streaming or not) cancels its
request, which frees its slot. Every failure is said: a failed generation ends a stream with the API's error
event (OpenAI `data: {"error": ...}` then `data: [DONE]`, Anthropic `event: error`) and a non-streaming request
with a 500 in the API's shape; 429 and 503 carry Retry-After. What is read from a client, authentication
(`/health` and `/metrics` stay open without the key; the docs are off when a key is set), request ids and
shutdown are glm53.serving.http's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm53.serving import http as H
from glm53.serving import protocol as P
from glm53.serving import responses as R
from glm53.serving.engine import Closed, Engine, Event, QueueFull
from glm53.serving.limits import Limits


class _Stats:
    """Prometheus collector reading the engine's counters at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        for name, key, doc in (("glm53_generated_tokens", "tokens", "tokens generated"),
                               ("glm53_prefill_tokens", "prefill_tokens", "prompt tokens prefilled"),
                               ("glm53_prefill_groups", "prefill_groups", "groups of requests prefilled together"),
                               ("glm53_decode_steps", "steps", "batched decode steps"),
                               ("glm53_requests", "requests", "requests accepted"),
                               ("glm53_requests_refused", "refused", "requests refused (queue full)"),
                               ("glm53_requests_finished", "finished", "requests finished"),
                               ("glm53_requests_cancelled", "finish_cancelled", "requests cancelled"),
                               ("glm53_prefix_lookups", "prefix_lookups", "prefix-cache lookups"),
                               ("glm53_prefix_hits", "prefix_hits", "prefix-cache hits"),
                               ("glm53_prefix_hit_tokens", "prefix_hit_tokens", "prompt tokens not prefilled (hits)"),
                               ("glm53_mtp_drafted", "mtp_drafted", "MTP draft tokens verified"),
                               ("glm53_mtp_accepted", "mtp_accepted", "MTP draft tokens accepted")):  # fmt: skip
            c = CounterMetricFamily(name, doc)
            c.add_metric([], s.get(key, 0))
            yield c
        for name, num, den, doc in (
            ("glm53_prefix_cache_hit_rate", "prefix_hits", "prefix_lookups", "prefix-cache hits / lookups"),
            ("glm53_mtp_acceptance", "mtp_accepted", "mtp_drafted", "MTP drafts accepted / verified"),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], s.get(num, 0) / s[den] if s.get(den) else 0.0)
            yield g


def make_app(engine: Engine, tok, model_name: str, *, api_key: str | None = None, limits: Limits | None = None,
             log=print) -> FastAPI:  # fmt: skip
    """The app; `app.state.shutdown` (glm53.serving.http.Shutdown) drains it on SIGTERM / SIGINT."""
    limits = Limits() if limits is None else limits
    stop = threading.Event()
    started = time.time()
    tokenizing = anyio.CapacityLimiter(limits.tokenize_threads)
    shutdown = H.Shutdown(engine, limits.shutdown_grace_s, log_line=log)

    def engine_thread():
        engine.warmup(log)
        engine.run(stop)

    thread = threading.Thread(target=engine_thread, name="glm53-engine", daemon=True)

    async def lifespan(app):
        thread.start()
        yield
        stop.set()
        thread.join(timeout=10)

    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="glm53", lifespan=lifespan, **docs)
    registry = CollectorRegistry()
    Gauge("glm53_queue_depth", "requests waiting for a slot", registry=registry).set_function(
        lambda: engine.queue_depth
    )
    Gauge("glm53_busy_slots", "slots decoding or prefilling", registry=registry).set_function(
        lambda: engine.busy_slots
    )
    Gauge("glm53_slots", "slots of the batched decode step", registry=registry).set(engine.slots)
    Gauge(
        "glm53_tokens_per_second", "generated tokens per second since start", registry=registry
    ).set_function(lambda: engine.stats["tokens"] / max(time.time() - started, 1e-9))
    registry.register(_Stats(engine))

    def rid_of(request: Request) -> str:
        return getattr(request.state, "request_id", None) or H.new_request_id()

    def error(request: Request, e: P.ApiError, headers: dict | None = None) -> Response:
        status, hs, body = H.error_response(H.api_of(request.url.path), e, rid_of(request), limits.retry_after_s)
        hs = {k.decode(): v.decode() for k, v in hs} | (headers or {})
        return Response(body, status_code=status, headers=hs)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error(request, P.validation_error(list(exc.errors())))

    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, exc: P.ApiError):
        return error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        if exc.status_code == 404:
            msg = f"no route {P.clip(request.url.path)}"
        elif exc.status_code == 405:
            msg = f"method {P.clip(request.method)} is not allowed on {P.clip(request.url.path)}"
        else:
            msg = P.clip(str(exc.detail), 200)
        headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        return error(request, P.ApiError(exc.status_code, msg, None, kind), headers)

    app.add_middleware(H.Guard, api_key=api_key, limits=limits, draining=shutdown.draining.is_set)

    def check_model(model: str) -> None:
        if model != model_name:
            raise P.ApiError(404, f"model: unknown model {P.clip(repr(model))}; this server runs {model_name!r}",
                             "model", "not_found_error")  # fmt: skip

    async def prepare(fn, *args, **kw):
        """A protocol adapter (renders and tokenizes the prompt) in a worker thread, a few at once."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kw), limiter=tokenizing)

    def submit(gen: P.Generation, rid: str):
        """Submits to the engine as request `rid`; an asyncio queue of its events."""
        if not engine.warm:
            raise P.ApiError(503, "the engine is still compiling; retry shortly", None, "service_unavailable")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        gen.request.id = rid
        try:
            engine.submit(gen.request, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        except QueueFull as e:
            raise P.ApiError(429, str(e), None, "rate_limit_error") from None
        except Closed as e:
            raise P.ApiError(503, str(e), None, "service_unavailable") from None
        except ValueError as e:
            raise P.api_error(gen.api, e) from None
        return q

    async def events(rid: str, q: asyncio.Queue):
        """The request's events; cancels it when the consumer goes away (disconnect) before the end. A failed
        generation (an "error" event) is logged here, once."""
        done = False
        try:
            while True:
                ev: Event = await q.get()
                done = ev.finish_reason is not None
                if ev.finish_reason == "error":
                    H.log.error("request %s: generation failed: %s", rid, ev.error)
                yield ev
                if done:
                    return
        finally:
            if not done:
                engine.cancel(rid)

    async def guarded(stream, ev, api: str, rid: str):
        """A response stream that ends with the API's error event when building it fails; closing it closes the
        request's events (a disconnect cancels the request)."""
        try:
            async for part in stream:
                yield part
        except Exception as e:  # noqa: BLE001 - said to the client as the API's error event
            H.log.error("request %s: stream failed", rid, exc_info=e)
            yield R.error_event(api, f"internal error ({type(e).__name__}); request id {rid}")
        finally:
            await stream.aclose()
            await ev.aclose()
            engine.cancel(rid)  # a stream closed before its end (a no-op once the request ended)

    async def until_disconnect(request: Request, work):
        """`work`'s result, or None when the client disconnects first (`work` is cancelled: so is its request)."""

        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watch.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    # ---------------------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        if not engine.warm:
            return JSONResponse({"status": "compiling"}, status_code=503,
                                headers={"retry-after": str(limits.retry_after_s)})  # fmt: skip
        return {"status": "draining" if shutdown.draining.is_set() else "ok", "slots": engine.slots,
                "busy_slots": engine.busy_slots, "queue_depth": engine.queue_depth}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(started), "owned_by": "glm53"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    async def answer(request: Request, gen: P.Generation, api: str, chat: bool = True):
        rid = rid_of(request)
        ev = events(rid, submit(gen, rid))
        if gen.stream:
            body = (R.anthropic_stream(gen, ev, model_name) if api == "anthropic"
                    else R.openai_stream(gen, ev, model_name, chat))  # fmt: skip
            return StreamingResponse(guarded(body, ev, api, rid), media_type="text/event-stream")
        work = R.anthropic_body(gen, ev, model_name) if api == "anthropic" else R.openai_body(gen, ev, model_name, chat)
        try:
            out = await until_disconnect(request, work)
        finally:
            engine.cancel(rid)  # a no-op once the request ended
        return Response(status_code=499) if out is None else out  # None: nobody to answer

    @app.post("/v1/chat/completions")
    async def chat_completions(r: P.ChatRequest, request: Request):
        check_model(r.model)
        return await answer(request, await prepare(P.openai_chat, r, tok, engine.max_len, limits=limits), "openai")

    @app.post("/v1/completions")
    async def completions(r: P.CompletionRequest, request: Request):
        check_model(r.model)
        gen = await prepare(P.openai_completion, r, tok, engine.cfg.vocab_size, limits=limits)
        return await answer(request, gen, "openai", chat=False)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(r: P.CountTokensRequest):
        check_model(r.model)
        return {"input_tokens": await prepare(P.anthropic_count, r, tok, limits=limits)}

    @app.post("/v1/messages")
    async def messages(r: P.MessagesRequest, request: Request):
        check_model(r.model)
        return await answer(request, await prepare(P.anthropic_messages, r, tok, limits=limits), "anthropic")

    app.state.engine = engine
    app.state.shutdown = shutdown
    return app
