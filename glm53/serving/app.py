"""The HTTP server (FastAPI): OpenAI and Anthropic APIs over one `Engine` that runs in a background thread.

The engine thread compiles every program (`/health` answers 503 until then), then steps forever; request
handlers talk to it through thread-safe queues (`Engine.submit` / `Engine.cancel`, each request's events come
back through `loop.call_soon_threadsafe` onto an asyncio queue). A client that disconnects mid-stream cancels its
request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from glm53.serving import protocol as P
from glm53.serving import responses as R
from glm53.serving.engine import Engine, Event, QueueFull

ANTHROPIC_PATHS = ("/v1/messages",)


def _api(path: str) -> str:
    return "anthropic" if path.startswith(ANTHROPIC_PATHS) else "openai"


def _error(api: str, e: P.ApiError) -> JSONResponse:
    return JSONResponse(P.error_body(api, e), status_code=e.status)


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


def make_app(engine: Engine, tok, model_name: str, *, api_key: str | None = None,
             max_body: int = 1 << 20, log=print) -> FastAPI:  # fmt: skip
    stop = threading.Event()
    started = time.time()

    def engine_thread():
        engine.warmup(log)
        engine.run(stop)

    thread = threading.Thread(target=engine_thread, name="glm53-engine", daemon=True)

    async def lifespan(app):
        thread.start()
        yield
        stop.set()
        thread.join(timeout=10)

    app = FastAPI(title="glm53", lifespan=lifespan)
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

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _error(_api(request.url.path), P.validation_error(list(exc.errors())))

    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, exc: P.ApiError):
        return _error(_api(request.url.path), exc)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        api = _api(request.url.path)
        if request.url.path.startswith("/v1/"):
            if api_key is not None:
                given = request.headers.get("x-api-key") if api == "anthropic" else None
                auth = request.headers.get("authorization", "")
                if auth.lower().startswith("bearer "):
                    given = given or auth[7:].strip()
                if given != api_key:
                    return _error(
                        api, P.ApiError(401, "invalid or missing API key", None, "authentication_error")
                    )
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > max_body:
                return _error(api, P.ApiError(413, f"body: larger than {max_body} bytes", "body"))
        try:
            return await call_next(request)
        except Exception as e:  # noqa: BLE001 - never a bare 500 page: the API's error shape instead
            return _error(api, P.ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "api_error"))

    def check_model(model: str) -> None:
        if model != model_name:
            raise P.ApiError(404, f"model: unknown model {model!r}; this server runs {model_name!r}", "model",
                             "not_found_error")  # fmt: skip

    def submit(gen: P.Generation):
        """Submits to the engine; an asyncio queue of its events."""
        if not engine.warm:
            raise P.ApiError(503, "the engine is still compiling; retry shortly", None, "service_unavailable")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        try:
            rid = engine.submit(gen.request, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        except QueueFull as e:
            raise P.ApiError(429, str(e), None, "rate_limit_error") from None
        except ValueError as e:
            raise P.ApiError(400, str(e), str(e).split(":")[0].split("=")[0]) from None
        return rid, q

    async def events(rid: str, q: asyncio.Queue):
        """The request's events; cancels it when the consumer goes away (disconnect) before the end."""
        done = False
        try:
            while True:
                ev: Event = await q.get()
                done = ev.finish_reason is not None
                yield ev
                if done:
                    return
        finally:
            if not done:
                engine.cancel(rid)

    # ---------------------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        if not engine.warm:
            return JSONResponse({"status": "compiling"}, status_code=503)
        return {"status": "ok", "slots": engine.slots, "busy_slots": engine.busy_slots,
                "queue_depth": engine.queue_depth}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                            "owned_by": "glm53"}]}  # fmt: skip

    async def answer(gen: P.Generation, api: str, chat: bool = True):
        rid, q = submit(gen)
        ev = events(rid, q)
        if api == "anthropic":
            if not gen.stream:
                return await R.anthropic_body(gen, ev, model_name)
            return StreamingResponse(R.anthropic_stream(gen, ev, model_name), media_type="text/event-stream")
        if not gen.stream:
            return await R.openai_body(gen, ev, model_name, chat)
        return StreamingResponse(R.openai_stream(gen, ev, model_name, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(r: P.ChatRequest):
        check_model(r.model)
        return await answer(P.openai_chat(r, tok, engine.max_len), "openai")

    @app.post("/v1/completions")
    async def completions(r: P.CompletionRequest):
        check_model(r.model)
        return await answer(P.openai_completion(r, tok, engine.cfg.vocab_size), "openai", chat=False)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(r: P.CountTokensRequest):
        check_model(r.model)
        return {"input_tokens": P.anthropic_count(r, tok)}

    @app.post("/v1/messages")
    async def messages(r: P.MessagesRequest):
        check_model(r.model)
        return await answer(P.anthropic_messages(r, tok), "anthropic")

    app.state.engine = engine
    return app
