"""KDA shaped for XLA:CPU: no LAPACK call, no per-token loop, small chunks, a short state scan.

The CPU path of `kernels.kda.api` ("xla_cpu"; what "auto" runs on CPU). Same chunked WY form as
`kernels.kda.reference` (whose docstring derives it) and the same numerical-safety rules, organised for a CPU:

- The reference's `triangular_solve` becomes a LAPACK trsm call per (batch, head, chunk) on XLA:CPU, whose
  threads cost 10-200 ms per call for tiny matrices on a loaded 2-core machine. Here the inverse of the unit
  lower-triangular I + diag(beta) Akk is built by block merging (`_wy_blocks`), in batched matmuls.
- The intra-chunk scores Aqk, Akk are built bottom-up over aligned blocks of 1, 2, 4, ... tokens: a merge's new
  lower-left block is one matmul of rows and columns rescaled by in-block decays, so the exp count is
  O(T dk log C) (the reference's band loop evaluates O(T dk S) exps in 16 sequential steps).
- Chunks are small (16 tokens by default, `max_chunk`): the scan over chunks is cheap on CPU and the C^2 work
  shrinks. Everything that does not depend on the carried state is formed for all chunks at once:
      o_n = Aqk U_n + (exp(G) * Q - Aqk W_n) S_n,   S_{n+1} = diag(exp(G_C)) S_n + (exp(G_C - G) * K)^T (U_n - W_n S_n)
  so a scan step is two batched matmuls: [W_n; Qeff_n] S_n and the state update.

Numerical safety, as in the reference: exp only sees arguments <= 0 (decays from a block's start to a token
and from a token to its block's end, the chunk total), and every relative decay is a direct sum of same-sign
terms (a merged block's sums add the neighbour's total; nothing is ever subtracted), never a difference of
prefix sums. f32 throughout, precision=HIGHEST. `recurrent_kda` is the reference recurrence without a loop when
T = 1 (decode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.kda import cpu_ffi, reference

_HI = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *xs: jnp.ndarray) -> jnp.ndarray:
    return jnp.einsum(spec, *xs, precision=_HI)


def _wy_blocks(q, k, g, beta):
    """Scores, WY inverse and in-chunk decays of chunks q, k, g [..., C, dk], beta [..., C]; C a power of two.

    Returns (Aqk [..., C, C], Linv [..., C, C] = (I + diag(beta) Akk)^-1, G [..., C, dk] = sum_{s<=i} g_s,
    suffix [..., C, dk] = sum_{s>j} g_s). Built bottom-up over aligned blocks of h = 1, 2, 4, ... tokens: two
    neighbouring blocks (first | second) merge into one of 2h, whose new lower-left part is a matmul
        cross[i, j] = sum_c x_ic exp(cum_ic) * k_jc exp(suf_jc),   x = q (Aqk) or k (Akk)
    with cum_i = sum of g from the second block's start through i and suf_j = sum of g after j to the first
    block's end (both direct sums <= 0, exp(cum + suf) = the decay between j and i). Merged sums stay direct:
    the second block's cum gains the first block's total, the first block's suffix the second's total. The
    inverse of the unit lower-triangular I + diag(beta) Akk merges alike: [[A, 0], [X, D]]^-1 =
    [[A^-1, 0], [-D^-1 X A^-1, D^-1]] with X = diag(beta_second) cross_kk.
    """
    *lead, C, dk = q.shape
    cum, suf = g, jnp.zeros_like(g)  # per block of h = 1 token
    aqk = jnp.sum(q * k, axis=-1)[..., :, None, None]  # [..., C / h, h, h]: per-block Aqk (its diagonal)
    linv = jnp.ones((*lead, C, 1, 1), jnp.float32)  # per-block inverse
    h = 1
    while h < C:
        n2 = C // (2 * h)

        def halves(x, n2=n2, h=h):  # [..., C, c] -> first, second halves [..., n2, h, c] of each 2h block
            x = x.reshape(*lead, n2, 2, h, x.shape[-1])
            return x[..., 0, :, :], x[..., 1, :, :]

        (cum1, cum2), (suf1, suf2) = halves(cum), halves(suf)
        (_, q2), (k1, k2) = halves(q), halves(k)
        rows = jnp.stack([q2, k2], axis=-4) * jnp.exp(cum2)[..., None, :, :, :]  # [..., 2, n2, h, dk]
        cols = k1 * jnp.exp(suf1)  # [..., n2, h, dk]
        cross = _einsum("...xnic,...njc->...xnij", rows, cols)  # [..., 2, n2, h, h]
        cross_q, cross_k = cross[..., 0, :, :, :], cross[..., 1, :, :, :]

        def merge(blocks, lower, n2=n2, h=h):  # per-h blocks [..., 2 n2, h, h] -> [..., n2, 2h, 2h]
            b = blocks.reshape(*lead, n2, 2, h, h)
            top = jnp.concatenate([b[..., 0, :, :], jnp.zeros_like(lower)], axis=-1)
            bottom = jnp.concatenate([lower, b[..., 1, :, :]], axis=-1)
            return jnp.concatenate([top, bottom], axis=-2)

        li = linv.reshape(*lead, n2, 2, h, h)
        ainv, dinv = li[..., 0, :, :], li[..., 1, :, :]
        x = beta.reshape(*lead, n2, 2, h)[..., 1, :, None] * cross_k
        lower_inv = -_einsum("...ij,...jk,...kl->...il", dinv, x, ainv)
        aqk, linv = merge(aqk, cross_q), merge(linv, lower_inv)
        tot1, tot2 = cum1[..., -1:, :], cum2[..., -1:, :]  # the blocks' total decays
        cum = jnp.concatenate([cum1, cum2 + tot1], axis=-2).reshape(*lead, C, dk)
        suf = jnp.concatenate([suf1 + tot2, suf2], axis=-2).reshape(*lead, C, dk)
        h *= 2
    return aqk[..., 0, :, :], linv[..., 0, :, :], cum, suf


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
    max_chunk: int = 16,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Chunked KDA; shapes, dtypes and padding as `reference.chunk_kda`. The chunk C is the smallest of: the
    largest power of two dividing `chunk_size`, `max_chunk` (a power of two; 16 is fastest on CPU for
    H = 8, d = 64 at T = 64 and 512: the scan's steps cost less than larger chunks' C^2 work) and the power
    of two >= T."""
    if max_chunk < 1 or max_chunk & (max_chunk - 1):
        raise ValueError(f"chunk_kda: max_chunk must be a power of two, got {max_chunk}")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    C = min(chunk_size & -chunk_size, max_chunk, 1 << (T - 1).bit_length())
    out_dtype = v.dtype
    pad = (-T) % C
    N = (T + pad) // C

    def prep(x):  # [B, T, H, ...] -> [B, H, N, C, ...] f32, zero padded (beta = g = k = 0: state unchanged)
        x = x.astype(jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))
    q = q * scale
    Aqk, linv, G, suffix = _wy_blocks(q, k, g, beta)  # [B, H, N, C, C] / [B, H, N, C, dk]
    eG = jnp.exp(G)
    rhs = beta[..., None] * jnp.concatenate([v, eG * k], axis=-1)  # [B, H, N, C, dv + dk]
    sol = _einsum("...ij,...jc->...ic", linv, rhs)
    U, W = sol[..., :dv], sol[..., dv:]
    Ou = _einsum("...ij,...jv->...iv", Aqk, U)  # the output of the chunk's own corrections (state-free part)
    Qeff = q * eG - _einsum("...ij,...jk->...ik", Aqk, W)  # o_n = Ou + Qeff S_n
    WQ = jnp.concatenate([W, Qeff], axis=-2)  # [B, H, N, 2C, dk]
    kd = k * jnp.exp(suffix)  # k_j decayed to the chunk end
    gl = jnp.exp(G[..., -1, :])  # [B, H, N, dk]: the whole chunk's decay

    s0 = reference._state0(initial_state, (B, H, dk, dv))

    def step(s, xs):  # s [B, H, dk, dv]
        U_n, WQ_n, Ou_n, kd_n, gl_n = xs
        x = _einsum("bhck,bhkv->bhcv", WQ_n, s)  # [B, H, 2C, dv]: W_n S | Qeff_n S
        delta = U_n - x[:, :, :C]
        s = gl_n[..., None] * s + _einsum("bhck,bhcv->bhkv", kd_n, delta)
        return s, Ou_n + x[:, :, C:]

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (U, WQ, Ou, kd, gl))  # chunk axis first
    s_final, o = jax.lax.scan(step, s0, xs)  # o [N, B, H, C, dv]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, H, dv)[:, :T]
    return o.astype(out_dtype), s_final


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
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Token-by-token KDA; the reference recurrence, without a loop for a single token (decode): on the CPU the C++
    step of `kernels.kda.cpu_ffi` when it is available."""
    if q.shape[1] != 1:
        return reference.recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, live=live)
    B, _, H, dk = q.shape
    dv, out_dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = (x[:, 0].astype(jnp.float32) for x in (q, k, v, g, beta))  # [B, H, ...]
    s0 = reference._state0(initial_state, (B, H, dk, dv))
    live_b = jnp.ones((B,), bool) if live is None else live  # the kernel's operand

    def xla(q, k, v, g, beta, live_b, s):
        del live_b  # `live` itself: no select at all when it is None
        s = reference.live_state(s, live) * jnp.exp(g)[..., None]
        delta = beta[..., None] * (v - _einsum("bhk,bhkv->bhv", k, s))
        s = s + k[..., :, None] * delta[..., None, :]
        return _einsum("bhk,bhkv->bhv", q * scale, s), s

    args = (q, k, v, g, beta, live_b, s0)
    if cpu_ffi.available():
        o, s = jax.lax.platform_dependent(*args, cpu=functools.partial(cpu_ffi.step, scale=scale), default=xla)
    else:
        o, s = xla(*args)
    return o[:, None].astype(out_dtype), s
