"""The HTTP server (FastAPI): OpenAI and Anthropic APIs over one `Engine` that runs in a background thread.

The engine thread compiles every program (`/health` answers 503 until then), then steps forever; request
handlers talk to it through thread-safe queues (`Engine.submit` / `Engine.cancel`, each request's events come
back through `loop.call_soon_threadsafe` onto an asyncio queue). A client that disconnects mid-stream cancels its
request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily

from glm53.serving import protocol as P
from glm53.serving import tools as T
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
                               ("glm53_decode_steps", "steps", "batched decode steps"),
                               ("glm53_requests", "requests", "requests accepted"),
                               ("glm53_requests_refused", "refused", "requests refused (queue full)"),
                               ("glm53_requests_finished", "finished", "requests finished"),
                               ("glm53_requests_cancelled", "finish_cancelled", "requests cancelled")):  # fmt: skip
            c = CounterMetricFamily(name, doc)
            c.add_metric([], s[key])
            yield c


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

    async def collect(rid, q) -> tuple[str, Event]:
        text = []
        async for ev in events(rid, q):
            text.append(ev.text)
        if ev.finish_reason == "error":
            raise P.ApiError(500, f"generation failed: {ev.error}", None, "api_error")
        return "".join(text), ev

    def sse(data) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

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

    def openai_usage(ev: Event) -> dict:
        return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens}  # fmt: skip

    def finish(ev: Event) -> str:
        return "length" if ev.finish_reason == "length" else "stop"

    async def openai_answer(gen: P.Generation, chat: bool):
        rid, q = submit(gen)
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if not gen.stream:
            text, ev = await collect(rid, q)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
                      if chat else {"index": 0, "text": text, "logprobs": None})  # fmt: skip
            choice["finish_reason"] = finish(ev)
            if gen.tools is not None:
                content, calls = T.parse(text, gen.tools)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content or None, "tool_calls": [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]}  # fmt: skip
                    choice["finish_reason"] = "tool_calls"
            return {"id": oid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                    "usage": openai_usage(ev)}  # fmt: skip

        def chunk(delta_or_text, reason=None):
            c = {"index": 0, "finish_reason": reason, "logprobs": None}
            c.update({"delta": delta_or_text} if chat else {"text": delta_or_text})
            d = {"id": oid, "object": obj + ".chunk" if chat else obj, "created": created, "model": model_name,
                 "choices": [c]}  # fmt: skip
            if gen.include_usage:
                d["usage"] = None
            return sse(d)

        async def body():
            mode = gen.tools if chat else None
            split = T.ContentStream(mode)
            forced = mode is not None and mode.force
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            if forced:  # the name is known before the arguments are generated
                call = T.ToolCall(mode.force, {})
                yield chunk({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]})  # fmt: skip
            async for ev in events(rid, q):
                text = split.push(ev.text) if chat else ev.text
                if text:
                    yield chunk({"content": text} if chat else text)
                if ev.finish_reason is not None:
                    reason = finish(ev)
                    if mode is not None:
                        rest, calls = split.finish()
                        if rest:
                            yield chunk({"content": rest})
                        for k, c in enumerate(calls):
                            d = {"index": k, "function": {"arguments": c.arguments_json}}
                            if not forced:
                                d.update(id=c.id, type="function")
                                d["function"]["name"] = c.name
                            yield chunk({"tool_calls": [d]})
                        reason = "tool_calls" if calls else reason
                    yield chunk({} if chat else "", reason)
                    if gen.include_usage:
                        yield sse({"id": oid, "object": obj + ".chunk" if chat else obj, "created": created,
                                   "model": model_name, "choices": [], "usage": openai_usage(ev)})  # fmt: skip
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(r: P.ChatRequest):
        check_model(r.model)
        return await openai_answer(P.openai_chat(r, tok, engine.max_len), chat=True)

    @app.post("/v1/completions")
    async def completions(r: P.CompletionRequest):
        check_model(r.model)
        return await openai_answer(P.openai_completion(r, tok, engine.cfg.vocab_size), chat=False)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(r: P.CountTokensRequest):
        check_model(r.model)
        return {"input_tokens": P.anthropic_count(r, tok)}

    @app.post("/v1/messages")
    async def messages(r: P.MessagesRequest):
        check_model(r.model)
        gen = P.anthropic_messages(r, tok)
        rid, q = submit(gen)
        mid = "msg_" + uuid.uuid4().hex[:24]
        n_in = len(gen.request.prompt)
        if not gen.stream:
            text, ev = await collect(rid, q)
            reason = "stop_sequence" if ev.stop_sequence else P.STOP_REASONS[ev.finish_reason]
            content = [{"type": "text", "text": text}]
            if gen.tools is not None:
                text, calls = T.parse(text, gen.tools)
                if calls:
                    content = [{"type": "text", "text": text}] if text else []
                    content += [{"type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name,
                                 "input": c.arguments} for c in calls]  # fmt: skip
                    reason = "tool_use"
            return {"id": mid, "type": "message", "role": "assistant", "model": model_name,
                    "content": content, "stop_reason": reason,
                    "stop_sequence": None if reason == "tool_use" else ev.stop_sequence,
                    "usage": {"input_tokens": n_in, "output_tokens": ev.completion_tokens}}  # fmt: skip

        def event(name, data):
            return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"

        async def body():
            yield event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": model_name, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": 0}}})  # fmt: skip
            mode = gen.tools
            split = T.ContentStream(mode)
            forced = mode is not None and mode.force
            if forced:  # the name is known before the arguments are generated: a tool_use block at once
                block = {
                    "type": "tool_use",
                    "id": "toolu_" + uuid.uuid4().hex[:24],
                    "name": mode.force,
                    "input": {},
                }
            else:
                block = {"type": "text", "text": ""}
            yield event("content_block_start", {"index": 0, "content_block": block})
            yield event("ping", {})
            async for ev in events(rid, q):
                text = split.push(ev.text)
                if text:
                    yield event(
                        "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}
                    )
                if ev.finish_reason is not None:
                    reason = "stop_sequence" if ev.stop_sequence else P.STOP_REASONS[ev.finish_reason]
                    stop_seq = ev.stop_sequence
                    rest, calls = split.finish()
                    if rest:
                        yield event(
                            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}}
                        )
                    for k, c in enumerate(calls):
                        if not forced or k:
                            yield event("content_block_stop", {"index": k})
                            yield event("content_block_start", {"index": k + 1, "content_block": {
                                "type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name, "input": {}}})  # fmt: skip
                        i = k if forced else k + 1
                        yield event("content_block_delta", {"index": i, "delta": {
                            "type": "input_json_delta", "partial_json": c.arguments_json}})  # fmt: skip
                    if calls:
                        reason, stop_seq = "tool_use", None
                    yield event("content_block_stop", {"index": len(calls) - (1 if forced else 0)})
                    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                                                  "usage": {"output_tokens": ev.completion_tokens}})  # fmt: skip
                    yield event("message_stop", {})

        return StreamingResponse(body(), media_type="text/event-stream")

    app.state.engine = engine
    return app
