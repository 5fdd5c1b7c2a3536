"""Serve a model over HTTP: the OpenAI and Anthropic APIs on a continuous-batching engine (glm53.serving).

  python -m experiments.serve                                   # the shipped model on 127.0.0.1:8000
  python -m experiments.serve --weights=HF_DIR --slots=8 --port=8080 --api_key=secret
  python -m experiments.serve --config=configs/tiny.py --port=0  # a random tiny model (tests); port 0: any free

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens; GET /v1/models,
/health (503 until every program is compiled), /metrics (Prometheus). Prints ``listening on http://HOST:PORT``
once the socket is bound. Compiled programs persist in JAX's compilation cache (--compilation_cache, "off" = none; on by default, see docs/workbench.md),
so a second start reads every XLA executable from it (tracing and lowering remain). Once every program is compiled one line gives the start-up split:
``start-up: load L s, compile C s (N programs; tracing and lowering T s, XLA or the cache X s, H executables from
the compilation cache), warm-up W s; compilation cache: DIR`` (load: from main's start to the model, tokenizer and engine built;
compile: JAX's tracing, lowering and XLA compiling, or reading the persistent cache instead of XLA, during the
engine's warm-up; warm-up: the rest of it, each program's first run). The engine's prefill chunk sizes are
--buckets (must include 1).
SIGINT / SIGTERM drain the server (glm53.serving.http.Shutdown): new requests get 503 + Retry-After, running
ones may finish within --shutdown_grace_s, then end with the API's error event; exit status 0 (a second signal
skips the rest of the grace). What the server reads and how long it waits: one flag per field of
glm53.serving.limits.Limits (--max_body_bytes, --header_timeout_s, ...), for the HTTP layer and the engine.
Several processes (``--coordinator ...``, e.g. under ``python -m experiments.launch``): the model on the config's
mesh over every process's devices, HTTP and the scheduler on process 0, whose program calls the others replay
(glm53.serving.multihost; the prefix cache must be off); on SIGINT / SIGTERM process 0 releases the others,
and every process exits 0.
Tool calls (OpenAI `tools` / `tool_choice`, Anthropic `tools` / `tool_use` / `tool_result`) use the GLM tool-call
format of glm53.serving.tools; a call forced by name is answered with that call, arguments always a JSON object.
"""

import contextlib
import dataclasses
import os
import signal
import socket
import threading
import time

import uvicorn
from absl import app, flags
from jax import monitoring
from ml_collections import config_flags

from experiments import cli, startup
from glm53 import assets, build, tokenizer
from glm53.config import model_config_from_dict
from glm53.parallel import distributed
from glm53.serving import multihost
from glm53.serving.app import make_app
from glm53.serving.engine import Engine
from glm53.serving.http import server_config
from glm53.serving.limits import Limits
from glm53.serving.reasoning import THINK_CLOSE, THINK_OPEN
from glm53.serving.text import detokenizer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant]): its random model", lock_config=True
)
_WEIGHTS = flags.DEFINE_string("weights", None, "HF / Orbax / GGUF weights (default: the shipped glm53-mini)")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "interface to bind")
_PORT = flags.DEFINE_integer("port", 8000, "TCP port (0: a free one)")
_SLOTS = flags.DEFINE_integer("slots", 4, "streams decoded together (slots of the batched step)")
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 0, "most tokens (prompt + max_tokens) of one request; 0: on pages the model's context "
    "(max_position_embeddings), contiguous 2048 per slot")
_CACHE_TOKENS = flags.DEFINE_integer(
    "cache_tokens", 65536, "paged DSA caches: tokens of cache shared by every stream (a request grows while pages "
    "last, waits when none are free); 0: contiguous caches, every slot owns --max_len positions")
_PAGE_TOKENS = flags.DEFINE_integer("page_tokens", 0, "paged caches: tokens per page (0: --prefix_block)")
_QUEUE = flags.DEFINE_integer("max_queue", 64, "requests waiting for a slot before new ones get 429")
_BUCKETS = flags.DEFINE_list(
    "buckets", ["1", "4", "16", "64", "256"], "prefill chunk sizes (compiled shapes)"
)
_API_KEY = flags.DEFINE_string("api_key", None, "require this key (Authorization: Bearer / x-api-key)")
_NAME = flags.DEFINE_string("model_name", None, "the model's id in the APIs (default: the folder's name)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(build.DTYPES), "parameter dtype when loading --weights")


_PREFIX_MB = flags.DEFINE_integer("prefix_cache_mb", 256, "prefix cache budget in MiB (0: off)")
_PREFIX_BLOCK = flags.DEFINE_integer("prefix_block", 16, "prefix cache block: tokens per snapshot boundary")
_SPEC = flags.DEFINE_bool(
    "speculative",
    False,
    "MTP speculative decoding in the batched step (needs the MTP block; greedy requests)",
)
_NARROW = flags.DEFINE_bool(
    "narrow",
    True,
    "decode steps compiled for 1, 2, 4, ... slots too: idle slots cost nothing (more programs to compile)",
)
_PREFILL_BATCH = flags.DEFINE_integer(
    "prefill_batch", 1,
    "the most waiting requests prefilled together, one program per chunk (1: one at a time; 0: min(slots, 8), "
    "1 with several processes); each width compiles its own prefill programs at start-up",
)  # fmt: skip
_PREFILL_BATCH_CHUNK = flags.DEFINE_integer(
    "prefill_batch_chunk", 64, "batched prefill only for prompts whose chunks are all at most this long"
)
_HEARTBEAT = flags.DEFINE_float(
    "heartbeat", multihost.HEARTBEAT_S,
    "several processes: an idle process 0 sends the others a no-op at least this often, in seconds (their "
    "collectives time out when idle for long; 0: never)",
)  # fmt: skip
_MOE_IMPL = cli.define_moe_impl_flag()
_LIMIT_HELP = {
    "max_body_bytes": "request body bytes read (chunked or not) before a 413",
    "max_json_depth": "nesting of a body's JSON (objects and arrays) before a 400",
    "header_timeout_s": "seconds a connection has to send its request line and headers (then it is closed)",
    "body_timeout_s": "seconds a request has to send its whole body (then 408)",
    "keep_alive_s": "seconds an idle keep-alive connection stays open",
    "max_stop": "stop strings per request",
    "max_stop_chars": "characters of a stop string",
    "max_tools": "tools per request",
    "max_schema_depth": "nesting of a tool's JSON schema",
    "max_name_chars": "characters of a model or tool name",
    "tokenize_threads": "prompts rendered and tokenized at once, off the event loop",
    "shutdown_grace_s": "on SIGTERM / SIGINT, seconds running requests may finish before they end with an error",
    "retry_after_s": "Retry-After (seconds) of a 429 (queue full) and a 503 (compiling, shutting down)",
}
_LIMITS = {
    f.name: (flags.DEFINE_integer if f.type == "int" else flags.DEFINE_float)(
        f.name, getattr(Limits(), f.name), f"{_LIMIT_HELP.get(f.name, f.name)} (Limits.{f.name})"
    )
    for f in dataclasses.fields(Limits)
}
ENGINE_THREAD = "glm53-engine"  # the engine's thread in glm53.serving.app


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT / SIGTERM only end `run` (uvicorn raises them again afterwards, which
    would end this process before the engine thread and the other processes are stopped), once the app has
    drained (`shutdown.start(then)`, glm53.serving.http.Shutdown: `then` ends `run`; None: at once). Signals
    from its creation on count (those before `run` stop it once it has started)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, config, shutdown=None):
        super().__init__(config)
        self.drainer = shutdown
        self._early: list[int] = []
        self._old = {s: signal.signal(s, lambda sig, _: self._early.append(sig)) for s in self.SIGNALS}

    def handle_exit(self, sig, frame):
        if self.drainer is None:
            return super().handle_exit(sig, frame)
        self.drainer.start(lambda: setattr(self, "should_exit", True))

    @contextlib.contextmanager
    def capture_signals(self):
        for s in self.SIGNALS:
            signal.signal(s, self.handle_exit)
        for s in self._early:
            self.handle_exit(s, None)
        try:
            yield
        finally:
            for s, h in self._old.items():
                signal.signal(s, h)


class _StartUp:
    """The start-up split (module docstring): `loaded()` once the engine is built; `timed(engine)` makes its
    warm-up measure what JAX spends compiling (its duration events) and print the line when it is done."""

    COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                      "/jax/core/compile/backend_compile_duration")  # the last includes reading the cache  # fmt: skip

    def __init__(self):
        self.t0, self.load_s, self.compile_s, self.xla_s, self.hits = time.perf_counter(), 0.0, 0.0, 0.0, 0

    def loaded(self) -> None:
        self.load_s = time.perf_counter() - self.t0

    def _duration(self, event: str, secs: float, **_) -> None:
        if event in self.COMPILE_EVENTS:
            self.compile_s += secs
            self.xla_s += secs if event == self.COMPILE_EVENTS[-1] else 0.0

    def _event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def line(self, warm_s: float, programs: int) -> str:
        cache = startup.run_record().get("compilation_cache") or "off"
        return (f"start-up: load {self.load_s:.1f} s, compile {self.compile_s:.1f} s ({programs} programs; tracing "
                f"and lowering {self.compile_s - self.xla_s:.1f} s, XLA or the cache {self.xla_s:.1f} s, {self.hits} "
                f"executables from the compilation cache), warm-up {max(warm_s - self.compile_s, 0.0):.1f} s; "
                f"compilation cache: {cache}")  # fmt: skip

    def timed(self, engine: Engine) -> None:
        warmup = engine.warmup

        def timed_warmup(log=None) -> float:
            monitoring.register_event_duration_secs_listener(self._duration)
            monitoring.register_event_listener(self._event)
            try:
                dt = warmup(log)
            finally:
                monitoring.unregister_event_duration_listener(self._duration)
                monitoring.unregister_event_listener(self._event)
            print(self.line(dt, engine.compiled_programs()), flush=True)
            return dt

        engine.warmup = timed_warmup  # the app's engine thread calls it (glm53.serving.app.make_app)


def _join_engine_thread() -> None:
    """Waits for the engine thread, stopped by the app's shutdown (it may be compiling: it stops after that)."""
    for t in threading.enumerate():
        if t.name == ENGINE_THREAD:
            t.join()


def _paging(several: bool, cfg) -> bool:
    """Whether the engine runs on paged caches (--cache_tokens > 0): not yet with --speculative and the prefix
    cache together, nor several processes, which then run contiguous caches (a usage error when --cache_tokens was
    given explicitly)."""
    if not _CACHE_TOKENS.value:
        return False
    why = ("--speculative with the prefix cache" if _SPEC.value and _PREFIX_MB.value else
           "several processes" if several else None)  # fmt: skip
    if why is None:
        return True
    if flags.FLAGS["cache_tokens"].present:
        raise app.UsageError(f"--cache_tokens: paged caches do not run with {why} yet; pass --cache_tokens=0")
    print(f"caches: contiguous ({why} runs without pages for now)", flush=True)
    return False


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    started = _StartUp()
    for name, v, lo in (
        ("slots", _SLOTS.value, 1),
        ("max_len", _MAX_LEN.value, 0),
        ("cache_tokens", _CACHE_TOKENS.value, 0),
        ("page_tokens", _PAGE_TOKENS.value, 0),
        ("max_queue", _QUEUE.value, 1),
        ("prefill_batch_chunk", _PREFILL_BATCH_CHUNK.value, 1),
    ):
        if v < lo:
            raise app.UsageError(f"--{name}={v}: must be >= {lo}")
    if not 0 <= _PREFILL_BATCH.value <= _SLOTS.value:
        raise app.UsageError(f"--prefill_batch={_PREFILL_BATCH.value}: must be in [0, --slots={_SLOTS.value}]")
    if _HEARTBEAT.value < 0:
        raise app.UsageError(f"--heartbeat={_HEARTBEAT.value}: must be >= 0 (0: no heartbeat)")
    if _PREFIX_MB.value < 0 or _PREFIX_BLOCK.value < 1:
        raise app.UsageError("--prefix_cache_mb must be >= 0 and --prefix_block >= 1")
    try:
        limits = Limits(**{k: f.value for k, f in _LIMITS.items()})
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None
    if not 0 <= _PORT.value < 65536:
        raise app.UsageError(f"--port={_PORT.value}: must be in [0, 65535]")
    try:
        buckets = sorted({int(b) for b in _BUCKETS.value})
    except ValueError:
        raise app.UsageError(f"--buckets: not a list of integers: {_BUCKETS.value}") from None
    if not buckets or buckets[0] != 1:
        raise app.UsageError(f"--buckets={_BUCKETS.value}: positive sizes including 1")
    weights, label = assets.resolve(_WEIGHTS.value, _CONFIG.value)
    kernels = cli.kernel_config(_CONFIG.value, _MOE_IMPL)
    several = distributed.process_count() > 1
    engine_kw = {}
    if several:
        # Several processes (--coordinator ...): the model on the config's mesh over all processes' devices,
        # one engine driven by process 0 (glm53.serving.multihost); the others replay its program calls.
        if _PREFIX_MB.value:
            raise app.UsageError(
                "--prefix_cache_mb: must be 0 with several processes (not replayed across them)"
            )
        run = build.sharded_model(_CONFIG.value, weights=weights, dtype=build.parse_dtype(_DTYPE.value),
                                  with_mtp=_SPEC.value, kernels=kernels)  # fmt: skip
        cfg, model = run.cfg, run.model
        engine_kw = dict(mesh=run.mesh, rules=run.rules)
    # One process: one device, unsharded: every program's inputs and outputs share one layout (no recompilation).
    elif weights is None:
        cfg = model_config_from_dict(_CONFIG.value.model)
        model = build.random_model(cfg, seed=_CONFIG.value.seed, dtype=build.parse_dtype(_CONFIG.value.param_dtype),
                                   quant=build.quant_from_experiment_config(_CONFIG.value), with_mtp=_SPEC.value,
                                   kernels=kernels)  # fmt: skip
    else:
        cfg, model = build.load_model(weights, dtype=build.parse_dtype(_DTYPE.value), with_mtp=_SPEC.value,
                                      kernels=kernels)  # fmt: skip
    model = build.apply_runtime_fields(model, _CONFIG.value)  # e.g. model.scan_layers: stacks the loaded layers
    if _SPEC.value and model.mtp is None:
        raise app.UsageError("--speculative drafts with the MTP block, and this model has none")
    tok = tokenizer.load_tokenizer(weights, vocab_size=cfg.vocab_size)
    name = _NAME.value or (assets.NAME if label else os.path.basename(os.path.normpath(weights)) if weights
                           else "glm53-random")  # fmt: skip
    print(build.describe_model(model, **engine_kw, config_name=cli.config_name("config"), weights=weights,
                               seed=_CONFIG.value and _CONFIG.value.seed, label=label), flush=True)  # fmt: skip
    paged = _paging(several, cfg)
    max_len = _MAX_LEN.value or (cfg.max_position_embeddings if paged else 2048)
    if paged:
        engine_kw.update(cache_tokens=_CACHE_TOKENS.value, page_tokens=_PAGE_TOKENS.value or _PREFIX_BLOCK.value)
    engine = Engine(model, slots=_SLOTS.value, max_len=max_len, buckets=buckets,
                    eos_ids=cfg.eos_token_ids, max_queue=_QUEUE.value, prefix_cache_bytes=_PREFIX_MB.value << 20,
                    prefix_block=_PREFIX_BLOCK.value, speculative=_SPEC.value,
                    decode_widths=None if _NARROW.value and not several else (_SLOTS.value,),
                    prefill_batch=_PREFILL_BATCH.value or None, prefill_batch_chunk=_PREFILL_BATCH_CHUNK.value,
                    detokenize=detokenizer(tok, keep=(THINK_OPEN, THINK_CLOSE)), limits=limits,
                    **engine_kw)  # fmt: skip
    started.loaded()
    if several and not distributed.is_main_process():
        n = multihost.follow(engine)  # until process 0 stops serving
        print(f"replayed {n.calls} program calls of process 0 ({n.beats} idle heartbeats)", flush=True)
        return
    if several:
        multihost.lead(engine, heartbeat=_HEARTBEAT.value)
    cache = (f"{_SLOTS.value} slots sharing a paged cache of {engine.pool.capacity} pages x {engine.pool.page_tokens} "
             f"tokens, up to {engine.context_limit} tokens per request" if paged
             else f"{_SLOTS.value} slots x {max_len} positions")  # fmt: skip
    print(f"model {name!r}: {cache}, prefill buckets {buckets}, prefix "
          f"cache {_PREFIX_MB.value} MiB (blocks of {_PREFIX_BLOCK.value}), MTP speculative "
          f"{'on' if _SPEC.value else 'off'}", flush=True)  # fmt: skip
    started.timed(engine)
    application = make_app(engine, tok, name, api_key=_API_KEY.value, limits=limits,
                           log=lambda s: print(s, flush=True))  # fmt: skip
    sock = socket.socket(socket.AF_INET6 if ":" in _HOST.value else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((_HOST.value, _PORT.value))
    host, port = sock.getsockname()[:2]
    server = _Server(server_config(application, limits), application.state.shutdown)
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        _join_engine_thread()
        if several:
            multihost.stop(engine)  # the other processes return from multihost.follow
    print("server stopped", flush=True)


if __name__ == "__main__":
    cli.run(main)
