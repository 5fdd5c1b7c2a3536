"""Pure-jnp KDA (Kimi Delta Attention: gated delta rule, per-channel decay): chunked WY form and recurrence.

Recurrence per head (state S [dk, dv], f32), for token t with log-decay g_t [dk] (<= 0), beta_t, scaled q_t:

    S   <- diag(exp(g_t)) S
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t  = S^T q_t

Chunked form (chunk C = 64). Inside a chunk, with G_i = sum_{s<=i} g_s (cumulative log-decay, per channel) and
S0 the state at the chunk start, the delta-rule corrections delta_j = beta_j (v_j - k_j^T diag(exp(G_j)) S0
- sum_{m<j} [k_j . exp(G_j - G_m) . k_m] delta_m) satisfy a unit lower-triangular system:

    (I + diag(beta) Akk) delta = diag(beta) (V - (exp(G) * K) S0)
    =>  delta = U - W S0,   U = (I + diag(beta) Akk)^-1 diag(beta) V,   W = (...)^-1 diag(beta) (exp(G) * K)
    O   = (exp(G) * Q) S0 + Aqk delta
    S_C = diag(exp(G_C)) S0 + (exp(G_C - G) * K)^T delta
    Akk[j, m] = sum_c k_jc k_mc exp(G_jc - G_mc), m < j;  Aqk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc), j <= i

U, W and Aqk depend only on the chunk, so they are computed for all chunks at once; only the state carry is a
sequential scan over chunks.

Numerical safety (f32). G falls by up to |g_min| per token: with the checkpoint's lower bound -5 a chunk of 64
reaches G = -320, so factorising exp(G_i - G_j) = exp(G_i) * exp(-G_j) would overflow (exp(320) = inf in f32).
Two rules keep every factor finite and accurate, for any decay magnitude (given g <= 0):
  1. exp only ever sees arguments <= 0.
     * inter-chunk factors exp(G_i), exp(G_C - G_j), exp(G_C) are decays from an earlier point (<= 1);
     * intra-chunk products are split into sub-chunks of `sub_chunk` (16) tokens. A query in sub-chunk a
       against a key in an earlier sub-chunk b: exp(G_i - G_j) is the product of the decays from the start of
       a to i, across the sub-chunks between b and a, and from j to the end of b, all <= 1, so the block is
       a plain matmul of rescaled q and k;
     * inside a sub-chunk (the diagonal blocks) the relative decay is formed per channel, one sub-diagonal at
       a time, and masked to -inf outside the block BEFORE exp.
     A factor that underflows to 0 stands for a true value below ~1e-38 times a bounded product: harmless.
  2. Relative decays are direct sums of the g between the two tokens (cumsums of same-sign terms), never the
     difference G_i - G_j of two prefix sums: that difference loses eps * |G_i| (~2e-5 at G = -320) to
     cancellation, which is the dominant error of the textbook chunk form (fla's naive_chunk_kda shows ~5e-6
     relative error in f32; this formulation ~2e-7, the same as the f32 recurrence).
All products use f32 with precision=HIGHEST (full f32 matmuls on TPU as well).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_HI = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *xs: jnp.ndarray) -> jnp.ndarray:
    return jnp.einsum(spec, *xs, precision=_HI)


def live_state(s: jnp.ndarray, live: jnp.ndarray | None) -> jnp.ndarray:
    """The state [B, H, dk, dv] with the streams that are not `live` (bool [B]) zeroed; `s` when live is None."""
    return s if live is None else jnp.where(live[:, None, None, None], s, 0.0)


def _state0(initial_state: jnp.ndarray | None, shape: tuple[int, ...]) -> jnp.ndarray:
    """The starting state [B, H, dk, dv] in f32 (zeros when None)."""
    return jnp.zeros(shape, jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)


def _suffix_sum(g: jnp.ndarray, axis: int) -> jnp.ndarray:
    """out_j = sum_{s > j} g_s along `axis` (exclusive reverse cumsum, summed directly)."""
    incl = jax.lax.cumsum(g, axis=axis % g.ndim, reverse=True)
    zero = jnp.zeros_like(jax.lax.slice_in_dim(g, 0, 1, axis=axis))
    return jnp.concatenate([jax.lax.slice_in_dim(incl, 1, None, axis=axis), zero], axis=axis)


def _intra_chunk_scores(
    q: jnp.ndarray, k: jnp.ndarray, g: jnp.ndarray, *, sub_chunk: int
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Decay-weighted score matrices of one chunk: (Akk, Aqk), each [..., C, C] f32.

    Akk[i, j] = sum_c k_ic k_jc exp(sum_{j<s<=i} g_sc) for j < i (0 on and above the diagonal);
    Aqk[i, j] = sum_c q_ic k_jc exp(sum_{j<s<=i} g_sc) for j <= i (0 above). q, k, g [..., C, dk].
    Never evaluates exp of a positive number; every exponent is a direct sum of same-sign terms.
    """
    *lead, C, dk = q.shape
    S = sub_chunk
    ns = C // S
    pos = jnp.arange(C)

    # Diagonal blocks, one sub-diagonal (offset d = i - j < S) per loop step, so memory stays O(C * dk):
    # rel[i] = sum_{i-d<s<=i} g_s gains one term per step; it is masked to -inf before exp where token j = i - d
    # is not in the sub-chunk of token i.
    def shift(x, m):  # out[..., i, :] = x[..., i - m, :], zeros for i < m (m may be traced)
        return jnp.where((pos >= m)[:, None], jnp.roll(x, m, axis=-2), 0.0)

    def band_step(d, carry):
        rel, Akk, Aqk = carry
        same_sub = (pos % S >= d)[:, None]  # [C, 1]
        kj = shift(k, d) * jnp.exp(jnp.where(same_sub, rel, -jnp.inf))  # k_{i-d} decayed to token i
        band = ((pos[:, None] - pos[None, :]) == d) & same_sub  # [C(i), C(j)]
        Aqk = Aqk + jnp.where(band, jnp.sum(q * kj, axis=-1)[..., :, None], 0.0)
        Akk = Akk + jnp.where(band & (d > 0), jnp.sum(k * kj, axis=-1)[..., :, None], 0.0)
        return rel + shift(g, d), Akk, Aqk

    zeros_cc = jnp.zeros((*lead, C, C), jnp.float32)
    _, Akk, Aqk = jax.lax.fori_loop(0, S, band_step, (jnp.zeros_like(g), zeros_cc, zeros_cc))
    if ns == 1:
        return Akk, Aqk

    # Off-diagonal blocks, query sub-chunk a vs key sub-chunk b < a, factorised at the sub-chunk borders:
    # exp(sum_{j<s<=i} g) = exp(sum_{aS<=s<=i} g) * exp(sum of sub-chunks b+1..a-1) * exp(sum_{j<s<(b+1)S} g),
    # three factors <= 1, so each block is a matmul of rescaled q (or k) rows and k columns.
    qs, ks, gs = (x.reshape(*lead, ns, S, dk) for x in (q, k, g))
    pa, pb = np.tril_indices(ns, -1)  # the P = ns (ns - 1) / 2 block pairs (a, b), b < a
    between = ((np.arange(ns) > pb[:, None]) & (np.arange(ns) < pa[:, None])).astype(np.float32)  # [P, ns]
    mid = _einsum("pn,...nc->...pc", between, jnp.sum(gs, axis=-2))  # [..., P, dk]: sums of same-sign terms
    to_row = jnp.exp(jnp.cumsum(gs, axis=-2))  # [..., ns, S, dk]: decay from the sub-chunk start to token i
    rows = jnp.stack([qs, ks], axis=-4) * to_row[..., None, :, :, :]  # [..., 2, ns, S, dk]: q | k rows
    rows = rows[..., pa, :, :] * jnp.exp(mid)[..., None, :, None, :]  # [..., 2, P, S, dk]
    cols = (ks * jnp.exp(_suffix_sum(gs, axis=-2)))[..., pb, :, :]  # [..., P, S, dk]: k_j to its block end
    blocks = _einsum("...xpic,...pjc->...xpij", rows, cols)  # [..., 2, P, S, S]
    place = np.zeros((len(pa), ns, ns), np.float32)
    place[np.arange(len(pa)), pa, pb] = 1.0
    off = _einsum("...xpij,pab->...xaibj", blocks, place).reshape(*lead, 2, C, C)
    return Akk + off[..., 1, :, :], Aqk + off[..., 0, :, :]


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
    sub_chunk: int = 16,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Chunked KDA. q, k, g [B, T, H, dk]; v [B, T, H, dv]; beta [B, T, H]; state [B, H, dk, dv].

    Returns (o [B, T, H, dv] in v.dtype, final_state [B, H, dk, dv] f32). T is arbitrary: the last chunk is
    padded with tokens of beta = 0, g = 0, k = 0, which leave the state unchanged. Temporary memory is about
    4x the f32 q/k/v/g inputs (XLA's estimate for T=4096, H=64, d=128, B=1: 2.0 GB).
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    C = chunk_size
    S = math.gcd(C, sub_chunk)  # sub-chunk size dividing C
    out_dtype = v.dtype
    pad = (-T) % C
    N = (T + pad) // C

    def prep(x):  # [B, T, H, ...] -> [B, H, N, C, ...] f32, zero padded
        x = x.astype(jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))  # beta [B, H, N, C]
    q = q * scale
    G = jnp.cumsum(g, axis=-2)  # [B, H, N, C, dk]: decay from the chunk start through token i (<= 0)

    Akk, Aqk = _intra_chunk_scores(q, k, g, sub_chunk=S)  # [B, H, N, C, C] each
    eye = jnp.eye(C, dtype=jnp.float32)
    lhs = eye + beta[..., :, None] * Akk  # unit lower triangular
    rhs = beta[..., None] * jnp.concatenate([v, jnp.exp(G) * k], axis=-1)  # [B, H, N, C, dv + dk]
    sol = jax.lax.linalg.triangular_solve(lhs, rhs, left_side=True, lower=True, unit_diagonal=True)
    U, W = sol[..., :dv], sol[..., dv:]

    qg = q * jnp.exp(G)  # [B, H, N, C, dk]
    kd = k * jnp.exp(_suffix_sum(g, axis=-2))  # decay from token j to the chunk end
    gl = jnp.exp(G[..., -1, :])  # [B, H, N, dk]

    s0 = _state0(initial_state, (B, H, dk, dv))

    def step(s, xs):  # s [B, H, dk, dv]
        U_n, W_n, qg_n, kd_n, gl_n, A_n = xs
        delta = U_n - _einsum("bhck,bhkv->bhcv", W_n, s)
        o_n = _einsum("bhck,bhkv->bhcv", qg_n, s) + _einsum("bhij,bhjv->bhiv", A_n, delta)
        s = gl_n[..., None] * s + _einsum("bhck,bhcv->bhkv", kd_n, delta)
        return s, o_n

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (U, W, qg, kd, gl, Aqk))  # chunk axis first
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
    """Token-by-token KDA (decode; also the oracle). Shapes and dtypes as `chunk_kda`; live: bool [B] or None,
    the streams whose initial_state is used (the others start from zeros)."""
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, g, beta = (jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))
    q = q * scale
    s0 = live_state(_state0(initial_state, (B, H, dk, dv)), live)

    def step(s, xs):  # s [B, H, dk, dv]
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, dk] / [B, H, dv] / [B, H]
        s = s * jnp.exp(g_t)[..., None]
        delta = b_t[..., None] * (v_t - _einsum("bhk,bhkv->bhv", k_t, s))
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, _einsum("bhk,bhkv->bhv", q_t, s)

    s_final, o = jax.lax.scan(step, s0, (q, k, v, g, beta))  # o [T, B, H, dv]
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), s_final
