"""Writing files so that nothing half-written is ever left under the final name.

Every file glm53 writes (JSON results, scores, checkpoint sidecars, GGUF files) goes through `atomic_write`:
a temporary file in the destination folder, flushed and fsynced, then renamed over the destination; on any
error the temporary file is removed and the destination is untouched.

Permissions follow the process's umask, as a plain `open` would give: `tempfile` makes private (0600 / 0700)
files and folders, which a team on a shared filesystem could not read, so everything staged under a temporary
name is opened up to ``0666 & ~umask`` (folders ``0777 & ~umask``) before it takes its final name
(`follow_umask`). Folders written by other libraries (Orbax checkpoints) get the same treatment.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any


def umask() -> int:
    """The process's file-mode creation mask (read from /proc where it is, without changing it; elsewhere set and
    restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Sets `path` (and, for a folder, everything under it) to the mode a plain `open` / `mkdir` would have
    given: files 0666, folders 0777, less the umask; executable files (a compiled kernel) keep their x bits."""
    mask = umask()

    def fix(p: str, folder: bool) -> None:
        mode = os.stat(p).st_mode & 0o777
        want = (0o777 if folder or mode & 0o111 else 0o666) & ~mask
        if mode != want:
            os.chmod(p, want)

    path = os.fspath(path)
    if not os.path.isdir(path):
        fix(path, False)
        return
    fix(path, True)
    for root, dirs, names in os.walk(path):
        for d in dirs:
            fix(os.path.join(root, d), True)
        for n in names:
            fix(os.path.join(root, n), False)


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
        follow_umask(tmp)
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
