"""KDA attention layer (Kimi Delta Attention, GLM-5.3 checkpoint flavour) and its decode cache.

Per token (docs/architecture.md §6): q/k/v projections -> causal short conv + SiLU -> per-head L2 norm of
q, k (eps 1e-6 inside the sqrt) -> gated delta rule with per-channel forget gate
g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(u)) + dt_bias)) and beta = sigmoid(b_proj(u)) -> per-head
RMSNorm of the output gated by sigmoid(g_b(g_a(u))) (f32) -> o_proj.

The layer is position-free: a stream's history lives entirely in its KDACache (conv inputs + recurrent state).
`start_b` only marks fresh streams: where start_b == 0 the cached state is ignored (treated as zeros), so a
reused cache slot needs no explicit reset. Padding masks are not supported (streams carry their own starts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from glm53 import dims
from glm53.config import ModelConfig
from glm53.layers.conv import ShortConv
from glm53.layers.linear import Linear
from glm53.layers.norm import GatedRMSNorm
from kernels import dispatch
from kernels.kda import api as kda_api

L2NORM_EPS = 1e-6  # hard-coded in every implementation (not rms_norm_eps)


@struct.dataclass
class KDACache:
    """Decode state of one KDA layer for B streams.

    conv_state [B, K-1, 3*H*d]: the last K-1 pre-conv projected inputs, channels q | k | v (activation dtype).
    state      [B, H, dk, dv]:  the recurrent state, float32.
    after_first: speculative decoding's rollback point. When the input cache carries it (any pair of arrays, e.g.
      its own (conv_state, state)), the layer feeds the T tokens one at a time (recurrent kernel) and returns
      here the (conv_state, state) after the FIRST of them; None otherwise (what a stored cache holds).
    """

    conv_state: jnp.ndarray
    state: jnp.ndarray
    after_first: tuple[jnp.ndarray, jnp.ndarray] | None = None

    @classmethod
    def init_cache(cls, cfg: ModelConfig, batch: int, max_len: int = 0, dtype=jnp.float32) -> KDACache:
        """Zero cache for `batch` streams; `max_len` is unused (uniform signature; KDA state is O(1))."""
        del max_len
        H, d, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        return cls(
            conv_state=jnp.zeros((batch, K - 1, 3 * H * d), dtype),
            state=jnp.zeros((batch, H, d, d), jnp.float32),
        )


def init_cache(cfg: ModelConfig, batch: int, max_len: int = 0, dtype=jnp.float32) -> KDACache:
    """Zero KDACache for `batch` streams (same as `KDACache.init_cache`)."""
    return KDACache.init_cache(cfg, batch, max_len, dtype)


def l2_normalize(x: jnp.ndarray, eps: float = L2NORM_EPS) -> jnp.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis, in f32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _dt_bias_init(rngs: nnx.Rngs, n: int) -> jnp.ndarray:
    """inverse-softplus of dt ~ logUniform(1e-3, 1e-1) (FLA's init; the checkpoint overrides it)."""
    u = jax.random.uniform(rngs.params(), (n,), jnp.float32, jnp.log(1e-3), jnp.log(1e-1))
    dt = jnp.maximum(jnp.exp(u), 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


class KDA(nnx.Module):
    """Kimi Delta Attention layer: `y_btd, new_cache = layer(x_btd, cache=cache, start_b=start_b)`.

    Parameter names follow the design contract (the HF loader maps onto them); f32-kept as in transformers:
    the conv weights, dt_bias and A_log. `implementation` selects the kernels.kda backend ("auto": the
    backend's choice, xla_cpu on CPU); a single token (decode) uses the recurrent kernel, longer sequences the
    chunked kernel.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        implementation: str = dispatch.AUTO,
    ):
        self.cfg = cfg
        self.implementation = implementation
        D, H, d = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        HD, r, K = H * d, cfg.kda_gate_rank, cfg.linear_conv_kernel_dim
        E, QKV, RANK = dims.EMBED, dims.KDA_QKV, dims.KDA_RANK

        def lin(i, o, axes):
            return Linear(i, o, axes, rngs=rngs, dtype=dtype)

        self.q_proj = lin(D, HD, (E, QKV))
        self.k_proj = lin(D, HD, (E, QKV))
        self.v_proj = lin(D, HD, (E, QKV))
        self.q_conv = ShortConv(HD, K, QKV, rngs=rngs)
        self.k_conv = ShortConv(HD, K, QKV, rngs=rngs)
        self.v_conv = ShortConv(HD, K, QKV, rngs=rngs)
        self.f_a_proj = lin(D, r, (E, RANK))
        self.f_b_proj = lin(r, HD, (RANK, QKV))
        self.dt_bias = nnx.Param(_dt_bias_init(rngs, HD), logical_axes=(QKV,))
        self.A_log = nnx.Param(jnp.zeros((H,), jnp.float32), logical_axes=(dims.KDA_HEADS,))
        self.b_proj = lin(D, H, (E, dims.KDA_HEADS))
        self.g_a_proj = lin(D, r, (E, RANK))
        self.g_b_proj = lin(r, HD, (RANK, QKV))
        self.o_norm = GatedRMSNorm(d, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
        self.o_proj = lin(HD, D, (QKV, E))

    def forget_gate(self, x_btd: jnp.ndarray) -> jnp.ndarray:
        """Per-channel log-decay g [B, T, H, d] in (lower_bound, 0), f32."""
        B, T, _ = x_btd.shape
        H, d = self.cfg.linear_num_heads, self.cfg.linear_head_dim
        f = self.f_b_proj(self.f_a_proj(x_btd)).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        rate = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]  # [H, 1]
        return self.cfg.linear_lower_bound * jax.nn.sigmoid(rate * f.reshape(B, T, H, d))

    def __call__(
        self,
        x_btd: jnp.ndarray,
        *,
        cache: KDACache | None = None,
        start_b: jnp.ndarray | None = None,
    ) -> tuple[jnp.ndarray, KDACache | None]:
        """x_btd [B, T, D] -> (y_btd [B, T, D], new cache, or None when `cache` is None: a fresh sequence)."""
        B, T, _ = x_btd.shape
        H, d = self.cfg.linear_num_heads, self.cfg.linear_head_dim
        HD = H * d
        fresh = cache is None
        if fresh:
            cache = init_cache(self.cfg, B, T, x_btd.dtype)
        expect = (B, self.cfg.linear_conv_kernel_dim - 1, 3 * HD)
        if cache.conv_state.shape != expect or cache.state.shape != (B, H, d, d):
            raise ValueError(
                f"KDA: cache shapes conv_state {cache.conv_state.shape}, state {cache.state.shape} do not "
                f"match input batch {B} (want conv_state {expect}, state {(B, H, d, d)})"
            )
        conv_state, state, live = cache.conv_state, cache.state.astype(jnp.float32), None
        if start_b is not None:
            if start_b.shape != (B,):
                raise ValueError(f"KDA: start_b must have shape [B={B}], got {start_b.shape}")
            live = start_b > 0  # a stream at position 0 starts from a zero state
            conv_state = jnp.where(live[:, None, None], conv_state, jnp.zeros_like(conv_state))

        cq, ck, cv = jnp.split(conv_state, 3, axis=-1)  # [B, K-1, HD] each
        qp, kp, vp = self.q_proj(x_btd), self.k_proj(x_btd), self.v_proj(x_btd)
        q, cq = self.q_conv(qp, cq)
        k, ck = self.k_conv(kp, ck)
        v, cv = self.v_conv(vp, cv)
        q = l2_normalize(q.reshape(B, T, H, d))
        k = l2_normalize(k.reshape(B, T, H, d))
        v = v.reshape(B, T, H, d)
        g = self.forget_gate(x_btd)
        beta = jax.nn.sigmoid(self.b_proj(x_btd).astype(jnp.float32))  # [B, T, H]

        kw = dict(scale=d**-0.5, implementation=self.implementation)
        first = None
        if cache.after_first is not None:  # token 0, then the rest: keep the state between them
            x0 = jnp.concatenate([qp[:, :1], kp[:, :1], vp[:, :1]], axis=-1).astype(conv_state.dtype)
            conv_1 = jnp.concatenate([conv_state, x0], axis=1)[:, 1:]
            outs, s = [], kda_api.live_state(state, live)
            for i in range(T):
                qi, ki, vi, gi, bi = (a[:, i : i + 1] for a in (q, k, v, g, beta))
                o_i, s = kda_api.recurrent_kda(qi, ki, vi, gi, bi, initial_state=s, **kw)
                outs.append(o_i)
                first = (conv_1.astype(cache.conv_state.dtype), s) if i == 0 else first
            o, new_state = jnp.concatenate(outs, axis=1), s
        elif T == 1:
            o, new_state = kda_api.recurrent_kda(q, k, v, g, beta, initial_state=state, live=live, **kw)
        else:
            o, new_state = kda_api.chunk_kda(q, k, v, g, beta, initial_state=kda_api.live_state(state, live), **kw)  # o [B, T, H, d]

        gate = self.g_b_proj(self.g_a_proj(x_btd)).reshape(B, T, H, d)
        o = self.o_norm(o.astype(x_btd.dtype), gate).reshape(B, T, HD)
        y_btd = self.o_proj(o)
        if fresh:
            return y_btd, None
        new_conv = jnp.concatenate([cq, ck, cv], axis=-1).astype(cache.conv_state.dtype)
        return y_btd, KDACache(conv_state=new_conv, state=new_state, after_first=first)
