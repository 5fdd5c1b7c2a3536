"""Pallas GPU routed experts for few tokens (decode): cost follows the distinct experts of the step.

The distinct experts of the step are found in XLA (`routing.expert_combine`: sorted, padded to
min(T K, E) by repeating the last one) and the tokens padded into groups of `token_group` rows. Kernel 1 runs
`pallas_gpu.grouped_matvec` over programs (distinct expert u, token group) x F lane blocks: expert u's gate and
up words are read once per token group and lane block, decoded in registers and applied to the group's tokens,
then the clamped SwiGLU -> h [U, Tp, F]. XLA scales h by the combine weight of (token, expert) (0 where the
token did not route there). Kernel 2 runs the down matrices the same way on h_u, giving per-expert partial
outputs [U, Tp, D] that XLA sums over the valid experts. Programs past the distinct experts do nothing (no
weight read), so the weight bytes read per step are those of the distinct experts (once per token group: at
most 8 tokens a group by default, the whole decode batch of a top-8 model at decode_max_slots 64). From 4
tokens on, bf16 activations whose formats `pallas_gpu_wgmma` decodes take its tensor-core kernel instead (one
64-row tile per distinct expert, its words decoded once into shared memory and fed to wgmma): per weight, a
decode and an MMA rather than a multiply-add per token. Shapes and formats: `kernels.moe.pallas_gpu`.
"""

from __future__ import annotations

import jax.numpy as jnp

from glm53.quant.planes import Planes
from kernels.moe import pallas_gpu as G
from kernels.moe import pallas_gpu_prefill as KP
from kernels.moe import pallas_gpu_wgmma as W
from kernels.moe import routing

__all__ = ["moe_decode", "decode_schedule"]

F32 = jnp.float32


def decode_schedule(uids: jnp.ndarray, nv: jnp.ndarray, n_groups: int):
    """(eid [U * n_groups], xid [U * n_groups], n_valid [1]) of the programs (u, token group), u-major: program
    g = u * n_groups + tg runs expert uids[u] on token group tg; programs g >= nv * n_groups do nothing."""
    u_max = uids.shape[0]
    eid = jnp.repeat(uids, n_groups)
    xid = jnp.tile(jnp.arange(n_groups, dtype=jnp.int32), u_max)
    return eid, xid, (nv * n_groups).astype(jnp.int32).reshape(1)


def moe_decode(
    x_td,
    ids_tk,
    w_tk,
    gate: Planes,
    up: Planes,
    down: Planes,
    swiglu_limit,
    *,
    lane_tile: int = 128,
    token_group: int = 8,
    split_k: int | None = None,
    tensor_cores: bool = True,
    tensor_core_tokens: int = 4,
    interpret=False,
):
    """Routed experts for a few tokens (decode) on the GPU kernels; [T, D] in x's dtype.

    lane_tile: output lanes per program (a multiple of 128); token_group: most tokens per program (f32
    accumulator vectors per matrix; min(token_group, T) are used); interpret: True runs the kernels on CPU
    (Pallas' interpreter); split_k: K splits per kernel (`pallas_gpu.grouped_matvec`; None: `pick_split`).
    tensor_cores: from `tensor_core_tokens` tokens on, bf16 activations whose formats `pallas_gpu_wgmma`
    decodes run its tensor-core kernel (one 64-row tile per distinct expert: each expert chunk decoded once into
    shared memory, wgmma over the tokens) instead of a multiply-add per weight and token on the CUDA cores.
    """
    G.check_supported(gate, up, down, lane_tile)
    t = x_td.shape[0]
    wgmma = tensor_cores and t >= tensor_core_tokens and x_td.dtype == jnp.bfloat16
    if wgmma and W.supports(gate, up, down) is None:
        return KP.prefill_wgmma(x_td, ids_tk, w_tk, gate, up, down, swiglu_limit, interpret)
    d = x_td.shape[1]
    e, f = gate.lead_shape[0], gate.rows
    uids, nv, combine = routing.expert_combine(ids_tk, w_tk, e)  # combine [U, T]
    u_max = uids.shape[0]
    tg = min(token_group, t)  # one step's tokens when fewer: no FMAs on padding rows
    n_groups = -(-t // tg)
    tp = n_groups * tg
    x = jnp.pad(x_td.astype(F32), ((0, tp - t), (0, 0))).reshape(n_groups, tg, d)
    eid, xid, n_valid = decode_schedule(uids, nv, n_groups)
    common = dict(tile=lane_tile, interpret=interpret)

    def split(mats, n_out):
        return split_k or G.pick_split(mats, u_max * n_groups * (n_out // lane_tile))

    h = G.grouped_matvec(
        x,
        eid,
        xid,
        n_valid,
        [gate, up],
        epilogue=G.swiglu_epilogue(swiglu_limit),
        split_k=split([gate, up], f),
        **common,
    )
    valid = (jnp.arange(u_max) < nv[0])[:, None, None]
    comb = jnp.pad(combine, ((0, 0), (0, tp - t)))[:, :, None]  # [U, Tp, 1]
    hs = jnp.where(valid, h.reshape(u_max, tp, f) * comb, 0.0).astype(x_td.dtype).astype(F32)
    g_all = jnp.arange(u_max * n_groups, dtype=jnp.int32)
    parts = G.grouped_matvec(
        hs.reshape(u_max * n_groups, tg, f), eid, g_all, n_valid, [down], split_k=split([down], d), **common
    )
    y = jnp.where(valid, parts.reshape(u_max, tp, d), 0.0).sum(axis=0)
    return y[:t].astype(x_td.dtype)
