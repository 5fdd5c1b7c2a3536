"""One progress style for every loop that reports progress: a tqdm bar on a terminal, plain lines elsewhere.

    with Progress(total=len(units), desc="convert", unit="unit") as bar:
        for u in units:
            ...
            bar.update(1, postfix=u)          # the bar advances; off a terminal, a plain line now and then
            bar.write(f"{u}: done")           # a line printed above the bar (never through it)

    for x in progress(items, desc="ablate", unit="variant"):   # the same around an iterable
        ...

On a terminal (`is_terminal` of the stream, default stderr) the bar is tqdm's. When the stream is not a terminal
(a log file, a pipe, CI) there is no bar and no carriage return: with ``lines=True`` a plain line
``desc: n/total unit (postfix)`` goes to the stream at most every ``min_interval`` seconds and at the end; with
``lines=False`` nothing (a loop whose own log lines are its progress, e.g. training's step lines). `write` prints a
line (through `log`, default print) with the bar cleared and redrawn after, so lines and bar never collide.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tqdm import tqdm

PLAIN_INTERVAL_S = 10.0  # off a terminal: at most one progress line per this many seconds (and one at the end)


def is_terminal(stream=None) -> bool:
    """Whether `stream` (default sys.stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A progress report of `total` steps (module docstring). ``enabled=False``: silent (`write` still prints)."""

    def __init__(self, total: int | None = None, *, desc: str = "", unit: str = "it", initial: int = 0,
                 enabled: bool = True, lines: bool = True, stream=None,
                 min_interval: float = PLAIN_INTERVAL_S):  # fmt: skip
        self.stream = sys.stderr if stream is None else stream
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.postfix = ""
        self.min_interval = min_interval
        self.bar = None
        if enabled and is_terminal(self.stream):
            self.bar = tqdm(total=total, initial=initial, desc=desc or None, unit=unit, file=self.stream,
                            dynamic_ncols=True)  # fmt: skip
        self.lines = enabled and lines and self.bar is None
        self._last = time.monotonic()
        self._printed = initial  # n at the last plain line (the final line only when something moved since)
        self.closed = False

    @property
    def interactive(self) -> bool:
        """Whether a tqdm bar is shown."""
        return self.bar is not None

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """`n` more steps done; `postfix`: a short text shown after the count (e.g. the unit just written)."""
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        if self.bar is not None:
            if postfix is not None:
                self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(n)
        elif self.lines and time.monotonic() - self._last >= self.min_interval:
            self._line()

    def set_total(self, total: int | None) -> None:
        """The number of steps, once known."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def set_postfix(self, postfix: str) -> None:
        self.postfix = postfix
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)

    set_postfix_str = set_postfix  # tqdm's name

    def write(self, text: str, log: Callable[[str], Any] | None = None) -> None:
        """`log(text)` (default: print) with the bar cleared while it prints (tqdm's external write mode)."""
        log = print if log is None else log
        if self.bar is not None:
            with tqdm.external_write_mode(file=sys.stdout):
                log(text)
        else:
            log(text)

    def _line(self) -> None:
        total = f"/{self.total}" if self.total is not None else ""
        post = f" ({self.postfix})" if self.postfix else ""
        head = f"{self.desc}: " if self.desc else ""
        print(f"{head}{self.n}{total} {self.unit}{post}", file=self.stream, flush=True)
        self._last, self._printed = time.monotonic(), self.n

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.lines and self.n != self._printed:
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(iterable: Iterable, *, total: int | None = None, desc: str = "", unit: str = "it",
             postfix: Callable[[Any], str] | None = None, **kw) -> Iterator:
    """Yields the items of `iterable`, advancing a `Progress` (keyword arguments: its own) after each;
    `postfix(item)`: the text shown with the count once the item is done."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, desc=desc, unit=unit, **kw) as bar:
        for item in iterable:
            yield item
            bar.update(1, postfix=postfix(item) if postfix is not None else None)
