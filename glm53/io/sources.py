"""Byte sources: random access to the bytes of a local file, an in-memory buffer, or an HTTP(S) URL.

A source reads an exact byte range by offset. None maps a file or reads it whole: a local file is read with
`os.pread`, a URL with one HTTP `Range` request per read. Every failure raises `SourceError` naming the source.
"""

from __future__ import annotations

import math
import os
import re
import urllib.error
import urllib.request
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ByteSource",
    "HTTPSource",
    "LocalFileSource",
    "MemorySource",
    "SourceError",
    "is_url",
    "open_source",
    "read_box",
]


class SourceError(OSError):
    """A byte range that cannot be read: missing file, short read, HTTP failure, server without Range support."""


@runtime_checkable
class ByteSource(Protocol):
    """Random-access bytes of one file. `name` is the path or URL used in every error message."""

    name: str
    size: int

    def read(self, offset: int, n: int) -> bytes:
        """Exactly `n` bytes starting at `offset` (0 <= offset, offset + n <= size), else SourceError."""
        ...

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fills the writable byte buffer `out` with the bytes starting at `offset`, else SourceError."""
        ...

    def close(self) -> None: ...


def is_url(s: str | os.PathLike) -> bool:
    return isinstance(s, str) and s.lower().startswith(("http://", "https://"))


class _Source:
    """What every source shares: the range check, and `read` through `read_into`."""

    name: str
    size: int

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise SourceError(
                f"{self.name}: byte range [{offset}, {offset + n}) is outside the file ({self.size} bytes)"
            )

    def _target(self, offset: int, out: memoryview) -> memoryview:
        """`out` as bytes, once [offset, offset + its size) is checked to lie inside the file."""
        out = memoryview(out).cast("B")
        self._check(offset, out.nbytes)
        return out

    def read(self, offset: int, n: int) -> bytes:
        self._check(offset, n)
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def read_into(self, offset: int, out: memoryview) -> None:
        raise NotImplementedError


class LocalFileSource(_Source):
    """A local file read by offset with os.pread (never mapped, never read whole)."""

    def __init__(self, path: str | os.PathLike):
        self.name = os.fspath(path)
        try:
            self._fd: int | None = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise SourceError(f"{self.name}: cannot open: {e.strerror or e}") from e
        try:
            self.size = os.fstat(self._fd).st_size
        except OSError as e:  # pragma: no cover - fstat on an open fd does not fail in practice
            self.close()
            raise SourceError(f"{self.name}: cannot stat: {e}") from e
        self.bytes_read = 0
        self.n_reads = 0

    def _fileno(self) -> int:
        if self._fd is None:
            raise SourceError(f"{self.name}: read after close")
        return self._fd

    def read_into(self, offset: int, out: memoryview) -> None:
        out = self._target(offset, out)
        n = out.nbytes
        fd = self._fileno()
        done = 0
        while done < n:
            try:
                if hasattr(os, "preadv"):  # straight into `out`
                    got = os.preadv(fd, [out[done:]], offset + done)
                else:  # pragma: no cover - platforms without preadv
                    chunk = os.pread(fd, n - done, offset + done)
                    out[done : done + len(chunk)] = chunk
                    got = len(chunk)
            except OSError as e:
                raise SourceError(f"{self.name}: read of {n} bytes at offset {offset} failed: {e}") from e
            if got <= 0:
                raise SourceError(f"{self.name}: file ended at byte {offset + done}; expected {offset + n}")
            done += got
        self.bytes_read += n
        self.n_reads += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MemorySource(_Source):
    """Bytes already in memory (tests, fuzzing), behaving like a file named `name`."""

    def __init__(self, data: bytes | bytearray | memoryview, name: str = "<memory>"):
        self._data = memoryview(bytes(data))
        self.name = name
        self.size = len(self._data)
        self.bytes_read = 0
        self.n_reads = 0

    def read_into(self, offset: int, out: memoryview) -> None:
        out = self._target(offset, out)
        out[:] = self._data[offset : offset + out.nbytes]
        self.bytes_read += out.nbytes
        self.n_reads += 1

    def close(self) -> None:
        pass


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.IGNORECASE)


class HTTPSource(_Source):
    """A remote file read with HTTP Range requests (urllib). `n_requests` counts the requests made.

    The size comes from the Content-Range of the first request, which also returns the first `probe_bytes`
    bytes; they are kept so that a header parse starting at offset 0 costs no extra request.
    A server that answers a Range request with the whole file (status 200) is rejected.
    """

    def __init__(self, url: str, *, timeout: float = 60.0, probe_bytes: int = 1 << 20):
        self.name = url
        self.timeout = timeout
        self.n_requests = 0
        self.bytes_read = 0
        self._head = b""
        status, content_range, body = self._request(0, max(1, probe_bytes) - 1, allow_416=True)
        if status == 416:
            m = _CONTENT_RANGE.match(content_range or "")
            if m is None or m.group(3) in (None, "*") or int(m.group(3)) != 0:
                raise SourceError(f"{url}: server refused the range bytes=0-{probe_bytes - 1} (HTTP 416)")
            self.size = 0
            return
        self.size = self._parse_content_range(content_range, 0)[2]
        self._head = body

    def _parse_content_range(self, header: str | None, want_start: int) -> tuple[int, int, int]:
        m = _CONTENT_RANGE.match(header or "")
        if m is None or m.group(1) is None or m.group(3) == "*":
            raise SourceError(
                f"{self.name}: bad or missing Content-Range header in a 206 response: {header!r}"
            )
        start, last, total = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if start != want_start or last < start or last >= total:
            raise SourceError(
                f"{self.name}: server returned range {header!r}; asked for a range at {want_start}"
            )
        return start, last + 1, total

    def _request(
        self, first: int, last: int, out: memoryview | None = None, allow_416: bool = False
    ) -> tuple[int, str | None, bytes]:
        """One GET for bytes [first, last]: (status, Content-Range, body). With `out`, the body goes there."""
        req = urllib.request.Request(
            self.name, headers={"Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
        )
        self.n_requests += 1
        want = last - first + 1
        body = b""
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                status = resp.status
                if status == 200:
                    raise SourceError(
                        f"{self.name}: server ignored the Range header (HTTP 200 instead of 206); "
                        "reading GGUF files over HTTP needs a server that honours range requests"
                    )
                if status != 206:
                    raise SourceError(f"{self.name}: unexpected HTTP status {status} for a range request")
                content_range = resp.headers.get("Content-Range")
                start, stop, _ = self._parse_content_range(content_range, first)
                expected = stop - start  # may be < want only when the range runs past the end of the file
                if expected > want or (out is not None and expected != want):
                    raise SourceError(
                        f"{self.name}: asked for bytes={first}-{last}, server sent Content-Range {content_range!r}"
                    )
                if out is None:
                    body = resp.read(expected)
                    got = len(body)
                else:
                    got = 0
                    while got < want:
                        k = resp.readinto(out[got:])
                        if not k:
                            break
                        got += k
                if got != expected:
                    raise SourceError(
                        f"{self.name}: short response: {got} of {expected} bytes at offset {first}"
                    )
        except urllib.error.HTTPError as e:
            if e.code == 416 and allow_416:
                return 416, e.headers.get("Content-Range"), b""
            raise SourceError(f"{self.name}: HTTP {e.code} {e.reason} for bytes={first}-{last}") from e
        except urllib.error.URLError as e:
            raise SourceError(f"{self.name}: request failed: {e.reason}") from e
        except SourceError:
            raise
        except (OSError, ValueError) as e:
            raise SourceError(f"{self.name}: request for bytes={first}-{last} failed: {e}") from e
        self.bytes_read += got
        return status, content_range, body

    def read_into(self, offset: int, out: memoryview) -> None:
        out = self._target(offset, out)
        n = out.nbytes
        if n == 0:
            return
        if offset + n <= len(self._head):
            out[:] = self._head[offset : offset + n]
            return
        self._request(offset, offset + n - 1, out=out)

    def close(self) -> None:
        self._head = b""


def open_source(path_or_url: str | os.PathLike, **http_kwargs) -> ByteSource:
    """A LocalFileSource for a path, an HTTPSource for an http(s) URL."""
    if is_url(path_or_url):
        return HTTPSource(str(path_or_url), **http_kwargs)
    return LocalFileSource(path_or_url)


def read_box(read_into, shape: tuple[int, ...], item_nbytes: int, box: tuple[tuple[int, int], ...]):
    """A box of a C-ordered array on disk: its bytes as uint8 [*box shape, item_nbytes], read with exactly the
    box's bytes, one `read_into(offset, memoryview)` per contiguous run (offsets relative to the array's first
    byte). `box`: one (lo, hi) per axis of `shape`, whose items are `item_nbytes` each. The innermost axes the box
    spans whole fold into the run of the first partial axis before them: a box of whole trailing axes over a
    leading range (e.g. experts [a, b) of [E, rows, cols]) is one read."""
    box = tuple((int(lo), int(hi)) for lo, hi in box)
    if len(box) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
        raise ValueError(f"box {box} is not within shape {tuple(shape)}")
    dims = tuple(hi - lo for lo, hi in box)
    out = np.empty((*dims, item_nbytes), np.uint8)
    if out.size == 0:
        return out
    k = len(box) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    if k < 0:  # a scalar
        read_into(0, memoryview(out.reshape(-1)))
        return out
    strides = [math.prod(shape[j + 1 :]) * item_nbytes for j in range(len(shape))]
    flat = out.reshape(-1, dims[k] * strides[k])
    for i, idx in enumerate(np.ndindex(*dims[:k])):
        start = sum((lo + x) * st for (lo, _), x, st in zip(box, idx, strides)) + box[k][0] * strides[k]
        read_into(start, memoryview(flat[i]))
    return out
