"""Pallas GPU routed experts for many tokens (prefill): a ragged grouped matmul over slots sorted by expert.

(token, expert) slots are sorted by expert and each expert's group padded to row tiles of `row_tile` rows
(`routing.prefill_tiles`, XLA). `pallas_gpu.grouped_matvec` then runs over programs (row tile) x
lane blocks: the tile's expert words are read, decoded in registers and applied to the tile's rows (gate + up +
clamped SwiGLU in one kernel, down in a second); XLA applies the routing weights and sums the slots of each
token. Tiles past the real ones do nothing. Each expert's words are read once per row tile of its group (from
L2 after the first tile); the matmuls run on CUDA cores in f32. bf16 activations whose formats
`pallas_gpu_wgmma` decodes (gate and up of one format) take its tensor-core kernel instead: row tiles of 64,
each expert chunk decoded into shared memory and fed to wgmma. Shapes and formats: `kernels.moe.pallas_gpu`.
"""

from __future__ import annotations

import jax.numpy as jnp

from glm53.quant.planes import Planes
from kernels.moe import pallas_gpu as G
from kernels.moe import pallas_gpu_wgmma as W
from kernels.moe import routing

__all__ = ["moe_prefill", "prefill_wgmma"]

F32 = jnp.float32


def moe_prefill(
    x_td,
    ids_tk,
    w_tk,
    gate: Planes,
    up: Planes,
    down: Planes,
    swiglu_limit,
    *,
    row_tile: int = 16,
    lane_tile: int = 128,
    tensor_cores: bool = True,
    interpret=False,
):
    """Routed experts for many tokens (prefill) on the GPU kernels; [T, D] in x's dtype.

    row_tile: slot rows per program; lane_tile and interpret: as in `pallas_gpu_decode.moe_decode` (the
    CUDA-core kernel). tensor_cores: bf16 activations whose matrices `pallas_gpu_wgmma.supports` take the
    tensor-core kernel (row tiles of 64, wgmma) instead.
    """
    G.check_supported(gate, up, down, lane_tile)
    if tensor_cores and x_td.dtype == jnp.bfloat16 and W.supports(gate, up, down) is None:
        return prefill_wgmma(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, interpret)
    t, k = ids_tk.shape
    e, d = gate.lead_shape[0], gate.cols
    meta = routing.prefill_tiles(ids_tk, e, row_tile)
    te, n_tiles, row_token = meta["tile_expert"], meta["n_tiles"], meta["row_token"]
    nt = te.shape[0]
    ok = (row_token >= 0)[:, None]
    rows = jnp.where(ok, x_td[jnp.maximum(row_token, 0)].astype(F32), 0.0).reshape(nt, row_tile, d)
    tiles = jnp.arange(nt, dtype=jnp.int32)
    common = dict(tile=lane_tile, interpret=interpret)
    h = G.grouped_matvec(
        rows, te, tiles, n_tiles, [gate, up], epilogue=G.swiglu_epilogue(swiglu_limit), **common
    )
    h = h.astype(x_td.dtype).astype(F32)  # activations in x's dtype between the matmuls, as the reference
    o = G.grouped_matvec(h, te, tiles, n_tiles, [down], **common).reshape(nt * row_tile, d)
    dest = meta["dest"]  # [T K]
    slot_ok = (dest >= 0)[:, None]
    contrib = jnp.where(slot_ok, o[jnp.maximum(dest, 0)] * w_tk.reshape(-1, 1).astype(F32), 0.0)
    return contrib.reshape(t, k, d).sum(axis=1).astype(x_td.dtype)


def prefill_wgmma(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, interpret=False):
    """The tensor-core form (`pallas_gpu_wgmma`; the caller checked `supports`): slots sorted by expert in
    64-row tiles, gate + up + SwiGLU, then down, combined in XLA."""
    t, k = ids_tk.shape
    e, d = gate.lead_shape[0], gate.cols
    meta = routing.prefill_tiles(ids_tk, e, W.ROWS)
    te, n_tiles, row_token = meta["tile_expert"], meta["n_tiles"], meta["row_token"]
    rows = jnp.where((row_token >= 0)[:, None], x_td[jnp.maximum(row_token, 0)], 0).astype(jnp.bfloat16)
    rows = rows[:, jnp.asarray(W.input_order(gate))]  # gate and up share one format, hence one order
    h = W.grouped_matmul(rows, te, n_tiles, [gate, up], limit=float(swiglu_limit), interpret=interpret)
    hp = h.astype(jnp.bfloat16)[:, jnp.asarray(W.input_order(down))]
    o = W.grouped_matmul(hp, te, n_tiles, [down], interpret=interpret)  # [NT * 64, D] f32
    dest = meta["dest"]
    contrib = jnp.where((dest >= 0)[:, None], o[jnp.maximum(dest, 0)] * w_tk.reshape(-1, 1).astype(F32), 0.0)
    return contrib.reshape(t, k, d).sum(axis=1).astype(x_td.dtype)
