"""Shared by the serving tests: driving an engine through a staggered batch of requests."""

from __future__ import annotations


def run_staggered(eng, reqs, late: int = 2, after: int = 3):
    """Submits all but the last `late` requests, steps `after` times, submits the rest, runs to the end; returns
    (tokens, last event) per request."""
    ev = {}
    sink = lambda e: ev.setdefault(e.request_id, []).append(e)  # noqa: E731
    for r in reqs[: len(reqs) - late]:
        eng.submit(r, sink)
    for _ in range(after):
        eng.step()
    for r in reqs[len(reqs) - late :]:
        eng.submit(r, sink)
    eng.run_until_idle()
    return [[t for e in ev[r.id] for t in e.token_ids] for r in reqs], [ev[r.id][-1] for r in reqs]
