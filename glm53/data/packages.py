"""Installed packages as corpus sources: the pure-Python files of a distribution's requirements.

`requirement_closure(name)` walks the installed distribution `name`'s requirements (``Requires-Dist`` without
extras, environment markers evaluated for this interpreter) and theirs, transitively, and returns every installed
distribution reached, `name` itself excluded: for ``glm53`` that is what ``pip install -e .`` brings (jax,
jaxlib, numpy, scipy, flax, optax, orbax, jinja2, ...), not the test / serve extras. `python_files(dist)` lists a
distribution's ``.py`` files from its RECORD (the files pip installed; compiled extensions are not ``.py``), as
(path relative to the install folder, absolute path). Names are normalized as PEP 503 does (``Jinja2`` ->
``jinja2``, ``ml_collections`` -> ``ml-collections``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import re

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement

from glm53.errors import DataError


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class Package:
    name: str  # normalized
    version: str
    files: tuple[tuple[str, str], ...]  # (RECORD path, absolute path) of each .py file, sorted


def _distribution(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def requirement_closure(name: str) -> list[str]:
    """The normalized names of the installed distributions `name` requires, transitively (module docstring),
    sorted. DataError when `name` is not installed; requirements that are not installed are skipped."""
    root = _distribution(name)
    if root is None:
        raise DataError(f"config field 'data.requirements_of': distribution {name!r} is not installed")
    env = dict(default_environment(), extra="")
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        d = todo.pop()
        for spec in d.requires or []:
            try:
                req = Requirement(spec)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # an extra's requirement, or another platform's
            key = normalize(req.name)
            if key in seen or key == normalize(name):
                continue
            dep = _distribution(req.name)
            if dep is not None:
                seen[key] = dep
                todo.append(dep)
    return sorted(seen)


def package(name: str) -> Package:
    """The installed distribution `name` with its ``.py`` files; DataError when it is not installed."""
    d = _distribution(name)
    if d is None:
        raise DataError(f"distribution {name!r} is not installed")
    files = []
    for f in d.files or []:
        rel = str(f).replace("\\", "/")
        if rel.endswith(".py") and not rel.startswith("../") and "/__pycache__/" not in f"/{rel}":
            files.append((rel, str(d.locate_file(f))))
    return Package(normalize(d.metadata["Name"] or name), d.version, tuple(sorted(files)))
