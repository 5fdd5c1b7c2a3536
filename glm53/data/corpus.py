"""The training corpus every machine has: the Python standard library's own ``.py`` sources, optionally with the
pure-Python files of installed packages (`glm53.data.packages`).

`find_sources(root)` walks `root` (default ``sysconfig.get_paths()["stdlib"]``) for ``*.py`` files and keeps each
one that is a regular file, lies outside the excluded folders (default: ``site-packages`` and ``dist-packages``,
i.e. installed third-party code, and ``__pycache__``) and decodes as UTF-8. What it leaves out is listed in
`Corpus.skipped` with the reason (on CPython 3.11: the ~11k files of site-packages and the four test modules
that are deliberately written in other encodings, e.g. ``test/encoded_modules/module_koi8_r.py``).

Package files are named ``pypi/<package>/<path in its RECORD>`` (``pypi/jinja2/jinja2/lexer.py``), kept at their
install location (`Corpus.locations`), with each package's version in `Corpus.versions`. `Corpus.split` puts every
file of a held-out package in the split "heldout" (whole packages never trained on) and the others by hash.

`split_of(rel_path, fractions)` puts a file in "train", "validation" or "test" by a hash of its path relative to
the root (``/``-separated), so the split is the same on every machine and does not move when files are added.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Iterator, Mapping

from glm53.data.packages import normalize, package
from glm53.errors import DataError

SPLITS = ("train", "validation", "test")
HELDOUT = "heldout"  # the split of whole held-out packages
PACKAGE_PREFIX = "pypi/"
DEFAULT_EXCLUDE = ("site-packages", "dist-packages", "__pycache__")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """`files`: sorted relative paths (``/``-separated) of the kept sources; `skipped`: relative path -> reason;
    `locations`: the absolute path of each package file; `versions`: package -> version."""

    root: str
    files: tuple[str, ...]
    skipped: Mapping[str, str]
    locations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    versions: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def path(self, rel: str) -> str:
        return self.locations.get(rel) or os.path.join(self.root, *rel.split("/"))

    def source(self, rel: str) -> str:
        """"stdlib" (the root) or the package a file belongs to."""
        return rel.split("/")[1] if rel.startswith(PACKAGE_PREFIX) else "stdlib"

    def read(self, rel: str) -> str:
        return read_source(self.path(rel))

    def split(self, name: str, fractions: Mapping[str, float], salt: str = "", heldout: tuple[str, ...] = ()
              ) -> tuple[str, ...]:  # fmt: skip
        """The files of split `name`, in sorted order: the held-out packages' files in "heldout", the others by
        `split_of`."""
        if name not in SPLITS + (HELDOUT,):
            raise DataError(f"unknown split {name!r}; expected one of {SPLITS + (HELDOUT,)}")
        held = {normalize(h) for h in heldout}
        if name == HELDOUT:
            return tuple(f for f in self.files if self.source(f) in held)
        return tuple(f for f in self.files if self.source(f) not in held and split_of(f, fractions, salt) == name)

    def skipped_summary(self) -> dict[str, int]:
        """Number of skipped files per reason."""
        out: dict[str, int] = {}
        for reason in self.skipped.values():
            out[reason] = out.get(reason, 0) + 1
        return out


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_source(path: str) -> str:
    """The file's text (UTF-8, newlines as in the file); DataError naming the file when it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({e})") from None


def _walk(root: pathlib.Path, exclude: frozenset[str]) -> Iterator[tuple[str, str | None]]:
    """(relative path, reason to skip or None) for every *.py below root, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        excluded = [d for d in dirnames if d in exclude]
        dirnames[:] = sorted(d for d in dirnames if d not in exclude)
        for d in sorted(excluded):
            for sub, _, names in os.walk(os.path.join(dirpath, d)):
                for n in sorted(names):
                    if n.endswith(".py"):
                        rel = (pathlib.Path(sub).relative_to(root) / n).as_posix()
                        yield rel, f"in an excluded folder ({d})"
        for n in sorted(filenames):
            if n.endswith(".py"):
                yield (rel_dir / n).as_posix(), None


def find_sources(root: str | os.PathLike | None = None, exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                 packages: tuple[str, ...] = ()) -> Corpus:  # fmt: skip
    """The ``.py`` files under `root` and of the installed `packages` (module docstring). DataError when the root
    is missing or holds none, or a package is not installed."""
    root = os.fspath(root) if root is not None else stdlib_root()
    if not os.path.isdir(root):
        raise DataError(f"corpus root {root}: not a directory")
    files, skipped = [], {}
    for rel, reason in _walk(pathlib.Path(root), frozenset(exclude)):
        if reason is None:
            reason = _unreadable(os.path.join(root, *rel.split("/")))
        if reason is None:
            files.append(rel)
        else:
            skipped[rel] = reason
    if not files:
        raise DataError(f"corpus root {root}: no readable UTF-8 .py files (skipped {len(skipped)})")
    locations, versions = {}, {}
    for name in packages:
        p = package(name)
        versions[p.name] = p.version
        for record_path, path in p.files:
            rel = f"{PACKAGE_PREFIX}{p.name}/{record_path}"
            reason = _unreadable(path)
            if reason is None:
                files.append(rel)
                locations[rel] = path
            else:
                skipped[rel] = reason
    return Corpus(root=root, files=tuple(sorted(files)), skipped=skipped, locations=locations, versions=versions)


def _unreadable(path: str) -> str | None:
    """Why a file cannot be in the corpus, or None."""
    if not os.path.isfile(path):
        return "not a regular file"
    try:
        read_source(path)
    except DataError as e:
        return "not UTF-8" if "not UTF-8" in str(e) else "unreadable"
    return None


def check_fractions(fractions: Mapping[str, float]) -> dict[str, float]:
    """{split: fraction} with every split of SPLITS present, non-negative, summing to 1 (DataError otherwise)."""
    if set(fractions) != set(SPLITS):
        raise DataError(
            f"config field 'data.fractions': need exactly the keys {SPLITS}, got {sorted(fractions)}"
        )
    out = {k: float(fractions[k]) for k in SPLITS}
    if any(v < 0 for v in out.values()) or abs(sum(out.values()) - 1.0) > 1e-9:
        raise DataError(f"config field 'data.fractions': need non-negative fractions summing to 1, got {out}")
    return out


def split_of(rel_path: str, fractions: Mapping[str, float], salt: str = "") -> str:
    """ "train" / "validation" / "test" for a relative path: u = first 8 bytes of sha256(salt + path) / 2^64 in
    [0, 1), compared with the cumulative fractions in the order of SPLITS."""
    fr = check_fractions(fractions)
    digest = hashlib.sha256((salt + rel_path.replace(os.sep, "/")).encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    acc = 0.0
    for name in SPLITS:
        acc += fr[name]
        if u < acc:
            return name
    return SPLITS[-1]
