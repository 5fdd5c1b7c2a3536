"""What every benchmark shares: one timer, one machine record and one JSON result writer.

Times are wall-clock seconds of whole calls, each waited for with `jax.block_until_ready`. Speeds are reported
as ratios against a reference timed in the same process (`speedup`), so that the machine's load and clock
largely cancel; absolute times are kept for the record. Every printed row shows the fastest, median and slowest
call (`spread_ms`): a median alone hides a spread that a loaded machine makes wide.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from glm53 import files


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of the timed calls of one function and of its untimed warm-up calls; its last output."""

    samples_s: tuple[float, ...]
    warmup_s: tuple[float, ...] = ()
    result: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    def to_dict(self) -> dict:
        """{"median_s", "min_s", "max_s", "samples_s"}: the JSON fields of a timing."""
        return {
            "median_s": self.median_s,
            "min_s": self.min_s,
            "max_s": self.max_s,
            "samples_s": list(self.samples_s),
        }


SPREAD_HEADER = "min / median / max ms"


def spread_ms(t: Timing | Mapping[str, Any], width: int = 8, decimals: int = 3) -> str:
    """"min / median / max" of a Timing (or its `to_dict()`) in milliseconds, each right-aligned to `width`."""
    d = t.to_dict() if isinstance(t, Timing) else t
    lo, mid, hi = (d[k] * 1e3 for k in ("min_s", "median_s", "max_s"))
    return " / ".join(f"{v:{width}.{decimals}f}" for v in (lo, mid, hi))


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (why a row was not timed)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def time_calls(
    fns: Mapping[str, Callable[..., Any]],
    *,
    warmup: int = 1,
    repeats: int = 5,
    setup: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, Timing]:
    """Times each of `fns`: `warmup` untimed calls each, then `repeats` (at least one) timed rounds.

    A round calls every function once, in turn, so a noisy neighbour's load falls on all of them alike. Every
    call is waited for with `jax.block_until_ready`. With `setup`, a call of fns[k] is fns[k](setup[k]()) and
    the setup is not timed: fresh inputs for a call that consumes them, such as a donated cache.
    """
    setup = setup or {}

    def call(k: str) -> tuple[float, Any]:
        args = (jax.block_until_ready(setup[k]()),) if k in setup else ()
        t0 = time.perf_counter()
        out = jax.block_until_ready(fns[k](*args))
        return time.perf_counter() - t0, out

    warm: dict[str, list[float]] = {k: [] for k in fns}
    timed: dict[str, list[float]] = {k: [] for k in fns}
    last: dict[str, Any] = {}
    for times, n in ((warm, warmup), (timed, max(1, repeats))):
        for _ in range(n):
            for k in fns:
                dt, last[k] = call(k)
                times[k].append(dt)
    return {k: Timing(tuple(timed[k]), tuple(warm[k]), last[k]) for k in fns}


def time_call(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5) -> Timing:
    """`time_calls` of one function."""
    return time_calls({"fn": fn}, warmup=warmup, repeats=repeats)["fn"]


def speedup(reference: Timing, timing: Timing) -> float:
    """reference median / timing median: > 1 when `timing` is faster than the reference."""
    return reference.median_s / timing.median_s


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(packages: tuple[str, ...] = (), **extra: Any) -> dict:
    """This process's machine: platform, python, processor, cores, load, JAX backend and devices, XLA_FLAGS, and
    the versions of jax, jaxlib and `packages` (distribution names; None where not installed); plus `extra`."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "load_average": list(os.getloadavg()),
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", *packages)},
        **extra,
    }


def describe(m: Mapping[str, Any]) -> str:
    """One line of a machine record: backend, devices, cores, load and versions."""
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    return (
        f"backend {m['backend']} ({len(m['devices'])} x {m['devices'][0]}), {m['cpu_count']} CPUs "
        f"({m['cpu_usable']} usable), load {' '.join(f'{x:.1f}' for x in m['load_average'])}; {versions}"
    )


def write_result(path: str | os.PathLike, result: Any) -> None:
    """A benchmark result as JSON at `path`, written atomically (the folder must exist)."""
    files.write_json(path, result)
