"""Dense routed-expert kernels as E separate arrays, for XLA:CPU decode (`kernels.moe.xla_cpu`).

XLA:CPU cannot feed a slice of an array to a dot: `w[e]` of a stacked [E, in, out] kernel, static or dynamic,
becomes a loop fusion that copies the expert's matrix (1 MiB per matrix at the small config) before its matmul
reads it, and at decode those copies cost more than the matmuls (one MoE layer at T=1: 2.6x the time of the
same matmuls on separate arrays, measured). An `ExpertList` holds each expert's matrix as its own array, so the
decode form picks expert e with a `lax.switch` whose branch e contracts `parts[e]` in place.

`split_experts` makes one without copying on the CPU: the parts are views of the stacked kernel's buffer
(numpy view + `jax.device_put`, which aliases aligned host memory on the CPU backend), so the stacked array and
its list share memory. `glm53.runtime.weights.decode_state` builds decode programs' weights this way; everything
else keeps the stacked kernels. Any implementation other than the xla_cpu decode form gets `unwrap()` (the
stacked copy; `kernels.moe.api` applies it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@jax.tree_util.register_pytree_node_class
class ExpertList:
    """E expert matrices [in, out] (a pytree of E arrays); `shape` / `dtype` are the stacked kernel's."""

    def __init__(self, parts):
        self.parts = tuple(parts)
        if not self.parts:
            raise ValueError("ExpertList: needs at least one expert matrix")
        first = self.parts[0]
        for i, p in enumerate(self.parts):
            if tuple(p.shape) != tuple(first.shape) or p.dtype != first.dtype:
                raise ValueError(f"ExpertList: part {i} is {p.dtype}{tuple(p.shape)}, part 0 "
                                 f"{first.dtype}{tuple(first.shape)}")  # fmt: skip

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def dtype(self):
        return self.parts[0].dtype

    def stacked(self) -> jax.Array:
        """The [E, in, out] kernel (a copy)."""
        return jnp.stack(self.parts)

    def unwrap(self) -> jax.Array:
        """The plain [E, in, out] kernel an implementation other than the xla_cpu decode form reads (a copy:
        `stacked`); `kernels.moe.api` unwraps decode weights for them."""
        return self.stacked()

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children)


def split_experts(w: jax.Array) -> ExpertList:
    """The experts of a concrete stacked kernel [E, in, out] as an ExpertList; on the CPU backend the parts alias
    w's memory (no copy), elsewhere they are copies."""
    if w.ndim != 3:
        raise ValueError(f"split_experts: expected a stacked kernel [E, in, out], got shape {tuple(w.shape)}")
    host = np.asarray(w)  # a read-only view of the buffer on the CPU backend
    return ExpertList(jax.device_put(host[i], w.sharding) for i in range(w.shape[0]))


def for_each_expert(experts: jax.Array, n_u: jax.Array, ws, dtype, process, carry):
    """carry = process(expert id, (gate, up, down) matrices, carry) for experts[0 .. n_u - 1], the matrices
    of ExpertLists `ws` picked by a `lax.switch` over the experts (each branch reads its parts in place)."""
    e = len(ws[0].parts)

    def one(i, carry):
        ex = experts[i]
        branches = [
            lambda c, k=k: process(ex, tuple((w.parts[k].astype(dtype), False) for w in ws), c) for k in range(e)
        ]
        return lax.switch(jnp.clip(ex, 0, e - 1), branches, carry)

    return lax.fori_loop(0, n_u, one, carry)
