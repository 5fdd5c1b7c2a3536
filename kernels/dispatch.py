"""Implementation dispatch shared by every `kernels/<op>/api.py`.

An op keeps a table name -> function with a "reference" entry (pure jnp, the oracle) and, per backend, the
implementation "auto" runs. A named implementation runs as asked: one that cannot take the inputs (a format,
layout, shape or weight type its kernels do not handle) raises NotImplementedError naming it. Only "auto" falls
back to "reference", logging the reason once per (op, implementation, reason).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Collection, Mapping

import jax

AUTO = "auto"
REFERENCE = "reference"

_log = logging.getLogger(__name__)

# Set while a loss is traced for its gradient (`differentiable()`): "auto" then picks an op's differentiable
# implementation where the backend's best has no reverse mode (the CPU experts' loops of dynamic length).
_DIFFERENTIABLE = contextvars.ContextVar("glm53_kernels_differentiable", default=False)


@contextlib.contextmanager
def differentiable():
    """Within it, "auto" resolves to each op's `auto_differentiable` choice (glm53.train's loss traces the model
    inside it): one `auto` default serves inference and training alike."""
    token = _DIFFERENTIABLE.set(True)
    try:
        yield
    finally:
        _DIFFERENTIABLE.reset(token)


def resolve(
    op: str,
    implementation: str,
    valid: Collection[str],
    auto: Mapping[str, str],
    backend: str | None = None,
    auto_differentiable: str | None = None,
) -> str:
    """`implementation` itself, or for "auto" `auto[backend]` (default `jax.default_backend()`; "reference" for
    a backend not in `auto`), or `auto_differentiable` when given and inside `differentiable()`. A name not in
    `valid` raises ValueError."""
    if implementation not in valid:
        raise ValueError(f"{op}: unknown implementation {implementation!r}; valid: {sorted(valid)}")
    if implementation != AUTO:
        return implementation
    if auto_differentiable is not None and _DIFFERENTIABLE.get():
        return auto_differentiable
    return auto.get(backend or jax.default_backend(), REFERENCE)


@functools.cache
def warn_fallback(op: str, name: str, reason: str) -> None:
    _log.warning("%s: %s cannot run these inputs (%s); using reference", op, name, reason)


def run(op: str, implementation: str, name: str, table: Mapping[str, Callable], *args, **kwargs):
    """table[name](*args, **kwargs), `name` being what `implementation` resolved to.

    NotImplementedError from it is re-raised naming `name`, unless `implementation` is "auto": then
    table["reference"] runs instead (the reason logged once).
    """
    try:
        return table[name](*args, **kwargs)
    except NotImplementedError as e:
        if implementation != AUTO or name == REFERENCE:
            raise NotImplementedError(f"{op}: implementation {name!r} cannot run these inputs: {e}") from e
        warn_fallback(op, name, str(e))
        return table[REFERENCE](*args, **kwargs)


def call(
    op: str, implementation: str, table: Mapping[str, Callable], auto: Mapping[str, str], *args, **kwargs
):
    """`run` of the implementation `resolve` picks among "auto" and the names of `table`."""
    name = resolve(op, implementation, (AUTO, *table), auto)
    return run(op, implementation, name, table, *args, **kwargs)
