"""Routed experts as a blocked grouped matmul in plain XLA: dropless, static shapes, differentiable.

The training path (`glm53.train` runs it). Routed slots are sorted by expert and each expert's rows are placed
at a block-aligned offset, so every block of `block_rows` rows belongs to one expert; each block is then one
batched matmul against its expert's matrices (gathered per block). Work = the real group sizes rounded up to
whole blocks (at most one partly empty block per routed expert), with no dynamic shapes and no loops, so
`jax.grad` goes through it (the gradient of the per-block weight gather is a scatter-add into [E, ...]).

`jax.lax.ragged_dot` (kernels.moe.reference) computes the same sum, but XLA:CPU lowers it to work on the order of
every expert on every row, and the distinct-expert loops of kernels.moe.xla_cpu have a dynamic trip count,
which reverse-mode autodiff cannot go through.

Math and precision follow `kernels.moe.reference` (the tests' oracle): weights cast to x's dtype, f32
accumulation at HIGHEST precision, the SwiGLU output cast to x's dtype, routing weights applied in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from glm53.quant.qweight import QuantizedExperts
from kernels.moe import routing
from kernels.moe.reference import clamped_swiglu

_HIGHEST = lax.Precision.HIGHEST


def default_block_rows(n_slots: int, n_experts: int) -> int:
    """Rows per block: a quarter of the mean rows per expert, as a power of two in [8, 128] (at most 1/4 of a block
    of padding per expert on average, blocks as large as that allows). At a training step of 4096 tokens x top-4
    of 32 experts that is 128: forward + backward of one layer took 1.0 s instead of 2.1 s with 64-row blocks
    (fewer blocks: fewer per-block weight copies and weight-gradient sums) and 1.2 s with 256 (more padding)."""
    quarter = max(n_slots // max(4 * n_experts, 1), 1)
    return int(min(max(1 << (quarter.bit_length() - 1), 8), 128))


def block_layout(topk_ids_tk: jax.Array, n_experts: int, block_rows: int):
    """Where each routed slot goes in the block-aligned layout.

    Returns (dest [T*K]: row of each sorted slot in the layout, n_rows (out of range) for empty slots; order [T*K]:
    the sort of the slots by expert; block_expert [n_blocks]: the expert of each block (E for unused blocks);
    n_blocks: static, ceil(T*K / block_rows) + min(E, T*K), enough for any routing).
    """
    t, k = topk_ids_tk.shape
    n = t * k
    n_blocks = -(-n // block_rows) + min(n_experts, n)
    flat, order, sizes, starts = routing.sort_by_expert(topk_ids_tk, n_experts)
    padded = (sizes + block_rows - 1) // block_rows * block_rows
    ends = jnp.cumsum(padded)
    pstarts = ends - padded
    ex = flat[order]  # expert of each sorted slot, E for empty slots (sorted last)
    ex_c = jnp.minimum(ex, n_experts - 1)
    rank = jnp.arange(n, dtype=jnp.int32) - starts[ex_c]
    dest = jnp.where(ex < n_experts, pstarts[ex_c] + rank, n_blocks * block_rows)
    block_expert = jnp.searchsorted(ends, jnp.arange(n_blocks, dtype=jnp.int32) * block_rows, side="right")
    return dest.astype(jnp.int32), order, block_expert.astype(jnp.int32), n_blocks


def moe_experts_blocked(
    x_td: jnp.ndarray,
    topk_ids_tk: jnp.ndarray,
    topk_w_tk: jnp.ndarray,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: float,
    *,
    block_rows: int | None = None,
) -> jnp.ndarray:
    """sum_k w[t,k] * Expert_{ids[t,k]}(x[t]) as a blocked grouped matmul (module docstring); [T, D] in x's dtype.
    `block_rows`: rows per block (None: `default_block_rows`)."""
    ws = (w_gate, w_up, w_down)
    if any(isinstance(w, QuantizedExperts) for w in ws):
        raise NotImplementedError(
            "the blocked implementation takes dense expert kernels, not QuantizedExperts"
        )
    t, k = topk_ids_tk.shape
    e, d = w_gate.shape[0], x_td.shape[1]
    block_rows = block_rows or default_block_rows(t * k, e)
    dest, order, block_expert, n_blocks = block_layout(topk_ids_tk, e, block_rows)
    bex = jnp.minimum(block_expert, e - 1)  # unused blocks hold zero rows: any expert will do
    tok = (order // k).astype(jnp.int32)
    rows = n_blocks * block_rows
    xs = jnp.zeros((rows, d), x_td.dtype).at[dest].set(x_td[tok], mode="drop")
    xb = xs.reshape(n_blocks, block_rows, d)

    def mm(spec, a, w):
        return jnp.einsum(
            spec, a, w[bex].astype(a.dtype), precision=_HIGHEST, preferred_element_type=jnp.float32
        )

    h = clamped_swiglu(mm("bnd,bdf->bnf", xb, w_gate), mm("bnd,bdf->bnf", xb, w_up), swiglu_limit)
    o = mm("bnf,bfd->bnd", h.astype(x_td.dtype), w_down).reshape(rows, d)  # f32
    o_slot = o.at[dest].get(mode="fill", fill_value=0.0)  # [T*K, D]; empty slots read 0
    w_sorted = topk_w_tk.reshape(t * k).astype(jnp.float32)[order]
    y = jax.ops.segment_sum(o_slot * w_sorted[:, None], tok, num_segments=t)
    return y.astype(x_td.dtype)
