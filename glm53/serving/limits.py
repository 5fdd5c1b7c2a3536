"""What the server accepts and how long it waits: one `Limits` for the HTTP layer and the engine.

Every limit is enforced on what is actually read or computed (never on a header's claim) and answered with the
calling API's error shape naming the parameter (413 for the body, 400 for the rest). `experiments.serve` has a
flag per field (the same name); docs/serving.md ("Limits and failure behaviour") lists each with what a client
sees. The defaults are safe for a public endpoint; raise them for trusted clients.
"""

from __future__ import annotations

import dataclasses

INT32_MAX = 2**31 - 1  # the engine's programs take top_k, lengths and counts as int32


@dataclasses.dataclass(frozen=True)
class Limits:
    # the HTTP request
    max_body_bytes: int = 1 << 20  # body bytes read (streamed or chunked alike): 413 past it
    max_json_depth: int = 64  # nesting of the body's JSON (objects and arrays): 400 past it
    header_timeout_s: float = 10.0  # a new connection must send its request line and headers within this
    body_timeout_s: float = 30.0  # ... and then its whole body within this (408 past it; the connection closes)
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    # what a request may ask for
    max_stop: int = 16  # stop strings (OpenAI `stop`, Anthropic `stop_sequences`)
    max_stop_chars: int = 256  # characters of each stop string
    max_tools: int = 128  # tools offered
    max_schema_depth: int = 16  # nesting of a tool's JSON schema
    max_name_chars: int = 256  # a model or tool name (echoed into errors at most this long)
    # work done for a request before it reaches the engine
    tokenize_threads: int = 2  # prompts rendered and tokenized at once, off the event loop
    # shutdown (SIGTERM / SIGINT)
    shutdown_grace_s: float = 10.0  # running requests may finish within this; then they end with an error event
    retry_after_s: int = 1  # Retry-After of a 429 (queue full) and of a 503 (compiling, draining)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{f.name}={v!r}: must be a positive number")
            if f.type == "int" and not isinstance(v, int):
                raise ValueError(f"{f.name}={v!r}: must be an integer")
