"""KDA op api: `chunk_kda` (prefill) and `recurrent_kda` (decode), dispatched by `implementation=`.

Inputs (all backends): q, k [B, T, H, dk] already L2-normalised; v [B, T, H, dv]; g [B, T, H, dk]
log-decay per key channel (<= 0); beta [B, T, H]; `scale` multiplies q inside the op; initial_state
[B, H, dk, dv] (None = zeros). Both return (o [B, T, H, dv] in v.dtype, final_state [B, H, dk, dv] float32).
Any T >= 1.
Implementations: "reference" (pure jnp, the oracle), "xla_cpu" (small chunks and batched intra-chunk products,
shaped for XLA:CPU: kernels/kda/xla_cpu.py) and "auto" (the backend's choice in `_AUTO`: xla_cpu on CPU,
reference where it names none). A named implementation that cannot take the inputs raises NotImplementedError; only
"auto" falls back to "reference" (`kernels.dispatch`).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels import dispatch
from kernels.kda import reference, xla_cpu
from kernels.kda.reference import live_state  # noqa: F401 (re-exported: layers zero fresh streams' state)

# A backend registers in both tables under one name.
_CHUNK = {"reference": reference.chunk_kda, "xla_cpu": xla_cpu.chunk_kda}
_RECURRENT = {"reference": reference.recurrent_kda, "xla_cpu": xla_cpu.recurrent_kda}
_AUTO: dict[str, str] = {"cpu": "xla_cpu"}  # backend -> implementation "auto" runs
AUTO_BY_BACKEND = _AUTO  # public: what "auto" picks per backend (glm53.config.kernels, the entry points' start-up block)
IMPLEMENTATIONS = (dispatch.AUTO, *_CHUNK)


def _check(op: str, q, k, v, g, beta, initial_state) -> None:
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [B, T, H, dk], got shape {q.shape}")
    B, T, H, dk = q.shape
    if T < 1:
        raise ValueError(f"{op}: q has T = {T}; need at least one token")
    if k.shape != q.shape:
        raise ValueError(f"{op}: k shape {k.shape} != q shape {q.shape}")
    if g.shape != q.shape:
        raise ValueError(f"{op}: g (log-decay per key channel) shape {g.shape} != q shape {q.shape}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"{op}: v must be [B={B}, T={T}, H={H}, dv], got shape {v.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"{op}: beta must be [B={B}, T={T}, H={H}], got shape {beta.shape}")
    want = (B, H, dk, v.shape[-1])
    if initial_state is not None and initial_state.shape != want:
        got = initial_state.shape
        raise ValueError(f"{op}: initial_state must be {list(want)} = [B, H, dk, dv], got {got}")


def chunk_kda(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    g: jnp.ndarray,
    beta: jnp.ndarray,
    *,
    scale: float,
    initial_state: jnp.ndarray | None = None,
    chunk_size: int = 64,
    implementation: str = "reference",
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Chunked (WY-form) KDA over a sequence; returns (o, final_state). Shapes: see the module docstring."""
    _check("chunk_kda", q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_kda: chunk_size must be positive, got {chunk_size}")
    kw = dict(scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    return dispatch.call("chunk_kda", implementation, _CHUNK, _AUTO, q, k, v, g, beta, **kw)


def recurrent_kda(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    g: jnp.ndarray,
    beta: jnp.ndarray,
    *,
    scale: float,
    initial_state: jnp.ndarray | None = None,
    live: jnp.ndarray | None = None,
    implementation: str = "reference",
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Token-by-token KDA (decode); returns (o, final_state). See the module docstring for shapes. live: bool [B]
    or None: the streams whose initial_state is used (the others start from zeros, whatever it holds)."""
    _check("recurrent_kda", q, k, v, g, beta, initial_state)
    if live is not None and live.shape != (q.shape[0],):
        raise ValueError(f"recurrent_kda: live must be [B={q.shape[0]}], got {live.shape}")
    kw = dict(scale=scale, initial_state=initial_state, live=live)
    return dispatch.call("recurrent_kda", implementation, _RECURRENT, _AUTO, q, k, v, g, beta, **kw)
