"""Values recorded during a forward pass (the routers' choices for the training losses): a thread-local dict that
`recording()` opens, `record(name, value)` writes while it is open, and a scanned `LayerStack` carries out of
its scan body (`scan_records` inside the body, `add_records` after the scan: each value gains a leading repeat
axis). Recording is Python-side bookkeeping at trace time, so it works under jit and grad."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_ACTIVE = threading.local()


def active() -> dict | None:
    return getattr(_ACTIVE, "records", None)


def record(name: str, value: Any) -> None:
    """Stores `value` under `name` when a `recording()` block is open (else nothing)."""
    rec = active()
    if rec is not None:
        rec[name] = value


@contextlib.contextmanager
def recording() -> Iterator[dict[str, Any]]:
    """{name: value} of every `record` call made in the block."""
    prev = active()
    _ACTIVE.records = {}
    try:
        yield _ACTIVE.records
    finally:
        _ACTIVE.records = prev


@contextlib.contextmanager
def scan_records() -> Iterator[dict[str, Any]]:
    """Inside a scan body: a fresh record dict when recording is on (the body returns it as a scan output),
    an empty dict that stays empty otherwise."""
    if active() is None:
        yield {}
        return
    with recording() as rec:
        yield rec


def add_records(stacked: dict[str, Any]) -> None:
    """After a scan: its stacked body records join the open recording (values with a leading repeat axis)."""
    rec = active()
    if rec is not None:
        rec.update(stacked)
