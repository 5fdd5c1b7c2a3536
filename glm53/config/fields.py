"""Conversion helpers shared by every config dataclass: ConfigDict -> plain containers -> frozen dataclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from glm53.errors import ConfigError


def field_error(field: str, msg: str) -> ConfigError:
    """A ConfigError naming the field."""
    return ConfigError(f"config field '{field}': {msg}")


def to_plain(d: Any) -> Any:
    """ConfigDict / FrozenConfigDict / mapping -> plain python containers."""
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    if isinstance(d, Mapping):
        return {k: to_plain(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [to_plain(v) for v in d]
    return d


def from_dict(cls, d: Any, where: str, nested: Mapping[str, type] | None = None):
    """`cls(**d)` for a frozen config dataclass: `d` a ConfigDict or mapping; unknown keys, a non-mapping and
    constructor type errors are ConfigErrors naming `where`; lists become tuples; keys in `nested` are built
    recursively into their dataclass (None stays None)."""
    d = to_plain(d)
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {d!r}")
    nested = nested or {}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid keys are {sorted(names)}")
    kw = {}
    for k, v in d.items():
        if k in nested:
            kw[k] = None if v is None else from_dict(nested[k], v, f"{where}.{k}")
        elif isinstance(v, list):
            kw[k] = tuple(v)
        else:
            kw[k] = v
    try:
        return cls(**kw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e
