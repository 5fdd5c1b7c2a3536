"""Writing files so that nothing half-written is ever left under the final name.

Every file glm53 writes (JSON results, scores, checkpoint sidecars, GGUF files) goes through `atomic_write`:
a temporary file in the destination folder, flushed and fsynced, then renamed over the destination; on any
error the temporary file is removed and the destination is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A file object for `path` ("w" text or "wb" binary) that appears under `path` only if the block succeeds.

    The destination folder must exist: a missing one raises FileNotFoundError naming it before any work is
    done by the caller's block.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> None:
    """`obj` as JSON at `path`, atomically (see `atomic_write`)."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
