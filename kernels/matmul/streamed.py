"""`StreamedKernel`: a weight whose few-row products run in the C++ row-matmul kernel (kernels/matmul/cpu_ffi.py).

Decode programs (`glm53.runtime.weights.decode_state`) wrap the f32 kernels they read, on a single CPU device, in
`StreamedKernel`s: a Linear kernel [K, N] or a stack of routed experts [E, K, N], the same array (no copy).
Layers multiply through `matmul` (`kernels.matmul.api.matmul`) and the xla_cpu MoE decode form through
`row_matmul`; every other expert implementation gets the array (`unwrap`, applied by `kernels.moe.api`).
Anything else reading the weight gets the array (`[...]`, `astype`, `unwrap`). A product with
more than `MAX_ROWS` rows, a non-f32 operand or no kernel is jnp.matmul, so the wrapper never changes what
runs beyond decode; on a non-CPU platform the product is XLA's dot (`lax.platform_dependent`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels.matmul import cpu_ffi

MAX_ROWS = 32  # rows (tokens) up to which a product runs in the kernel: decode steps (slots x 1 or 2 tokens)


@jax.tree_util.register_pytree_node_class
class StreamedKernel:
    """An f32 weight [K, N] or [E, K, N] (one array, a pytree child) whose few-row products stream it once."""

    def __init__(self, w):
        self.w = w

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def ndim(self) -> int:
        return len(self.w.shape)

    @property
    def dtype(self):
        return self.w.dtype

    def __getitem__(self, idx):
        return self.w[idx]

    def astype(self, dtype):
        return self.w.astype(dtype)

    def unwrap(self):
        return self.w

    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children[0])

    def matmul(self, x: jax.Array, *, precision=None) -> jax.Array:
        """x @ w for x [..., K] and a [K, N] weight, as jnp.matmul(x, w.astype(x.dtype)) computes it (`precision`
        goes to jnp.matmul when the kernel does not run; the kernel's f32 fma chains are exact as HIGHEST)."""
        if self.ndim != 2:
            raise ValueError(f"StreamedKernel.matmul: a [K, N] weight, got {self.shape}")
        rows = math.prod(x.shape[:-1])
        if not usable(x, self.w, rows):
            return jnp.matmul(x, self.w.astype(x.dtype), precision=precision)
        k, n = self.shape

        def ffi(x, w):
            ids = jnp.zeros((1,), jnp.int32)
            return cpu_ffi.row_matmul(x.reshape(1, rows, k), ids, w[None]).reshape(*x.shape[:-1], n)

        def xla(x, w):
            return jnp.matmul(x, w, precision=precision)

        return lax.platform_dependent(x, self.w, cpu=ffi, default=xla)


def usable(x, w, rows: int) -> bool:
    """Whether a product of `rows` rows of x with w runs in the kernel."""
    return 0 < rows <= MAX_ROWS and x.dtype == jnp.float32 and w.dtype == jnp.float32 and cpu_ffi.available()
