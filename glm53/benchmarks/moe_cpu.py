"""Per-layer routed-expert times on the CPU, dense and UD-IQ3_XXS experts, timed together in one process.

Entry point: `python -m experiments.bench_moe_cpu` (flags and output there). Default shape: configs/tiny.py:small's
MoE layer (hidden 1024, expert width 256, 32 experts, top-4), uniform routing (seeded). Weights: "dense" f32
kernels, "split": the same kernels as per-expert views (`kernels.moe.expert_list.ExpertList`, what
the serving engine decodes with on CPU; timed only where the xla_cpu decode form runs), or the UD-IQ3_XXS
common layer (IQ2_S gate/up, IQ3_S down) as QuantizedExperts in the "planes" or "reencoded" layout. "mlp" is the dense SwiGLU MLP of width top_k * expert width (the routed experts' active FLOPs;
its weights do not depend on the experts' kind). An implementation with a form (xla_cpu) runs its decode form
for T*K <= 64 slots, else its prefill form, as "auto" does.

For each token count every (weights, impl) pair is timed by one `harness.time_calls` (interleaved rounds, so load
falls on all alike). Each record: weights, tokens, impl, runs (the form that ran), kernel (what that form ran on
these weights, `moe_kernel`: for xla_cpu_decode the C++ kernel "cpu_ffi" or the plain-XLA path and why),
distinct_experts, median_s, min_s, max_s, samples_s, and the slowdowns measured in this process: vs_dense =
median / the same impl's median on dense weights at the same tokens (the quantized-decode target is <= 1.5),
vs_mlp = median / the dense MLP's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm53.benchmarks import harness
from glm53.quant.qweight import QuantizedExperts
from kernels.matmul import streamed
from kernels.matmul.streamed import StreamedKernel
from kernels.moe import api, expert_list, xla_cpu

LIMIT = 10.0
UD = {"gate": "IQ2_S", "up": "IQ2_S", "down": "IQ3_S"}
KINDS = ("dense", "split", "planes", "reencoded")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer: experts, hidden size, expert width, routed experts per token."""

    experts: int = 32
    hidden: int = 1024
    width: int = 256
    top_k: int = 4

    def __post_init__(self):
        for name in ("experts", "hidden", "width", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= experts ({self.experts})")
        for name in ("hidden", "width"):
            if getattr(self, name) % 256:
                raise ValueError(
                    f"{name} must be a multiple of 256 (the IQ2_S / IQ3_S block), got {getattr(self, name)}"
                )

    def kernels(self) -> dict[str, tuple[int, int, int]]:
        e, d, f = self.experts, self.hidden, self.width
        return {"gate": (e, d, f), "up": (e, d, f), "down": (e, f, d)}


def make_weights(kind: str, shape: Shape = Shape()) -> dict:
    """gate / up / down kernels of `kind` ("dense" f32, or UD-IQ3_XXS in the "planes" / "reencoded" layout)."""
    if kind not in KINDS:
        raise ValueError(f"weights: unknown kind {kind!r}; choose from {list(KINDS)}")
    kernels = shape.kernels()
    keys = jax.random.split(jax.random.key(0), 3)
    if kind in ("dense", "split"):
        w = {m: 0.02 * jax.random.normal(k, kernels[m], jnp.float32) for m, k in zip(kernels, keys)}
        return {m: expert_list.split_experts(v) for m, v in w.items()} if kind == "split" else w
    rnd = jax.jit(QuantizedExperts.random, static_argnums=(1, 2, 3))
    return {m: rnd(k, kernels[m], UD[m], kind) for m, k in zip(kernels, keys)}


def make_routing(tokens: int, shape: Shape = Shape(), seed: int = 0):
    """x [T, D] f32, top-k ids [T, K] (distinct per token, uniform) and routing weights [T, K]."""
    rng = np.random.default_rng([seed, tokens])
    ids = np.argsort(rng.random((tokens, shape.experts)), axis=1)[:, : shape.top_k].astype(np.int32)
    w = rng.random((tokens, shape.top_k)).astype(np.float32)
    x = rng.standard_normal((tokens, shape.hidden)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)


def _mlp(x, shape: Shape):
    """The dense SwiGLU MLP of width top_k * width on x, as a no-argument call."""
    d, f = shape.hidden, shape.top_k * shape.width
    ks = jax.random.split(jax.random.key(1), 3)
    w = [0.02 * jax.random.normal(k, s) for k, s in zip(ks, [(d, f), (d, f), (f, d)])]
    hp = jax.lax.Precision.HIGHEST

    def mlp(x, a, b, c):
        return jnp.dot(
            jax.nn.silu(jnp.dot(x, a, precision=hp)) * jnp.dot(x, b, precision=hp), c, precision=hp
        )

    return functools.partial(jax.jit(mlp), x, *w)


def moe_kernel(
    impl: str,
    n_slots: int,
    ws,
    backend: str | None = None,
    decode_max_slots: int = api.DEFAULT_DECODE_MAX_SLOTS,
    tokens: int = 1,
    x_dtype=jnp.float32,
) -> str:
    """What `moe_experts(implementation=impl)` runs for `n_slots` routed slots on gate / up / down `ws`: the
    concrete implementation (`api.select_implementation`), and for the xla_cpu decode form on the CPU backend
    whether the C++ kernel ("cpu_ffi", kernels/moe/cpu_ffi.py; for decode_state's dense kernels the row matmul)
    or the plain-XLA path runs, with the reason; `tokens` rows of `x_dtype` activations."""
    backend = backend or jax.default_backend()
    name = api.select_implementation(impl, n_slots, decode_max_slots, backend=backend)
    if name == "xla_cpu_xla_decode":
        return f"{name}: XLA"
    if name not in ("xla_cpu_decode", "xla_cpu_ffi_decode"):
        return name
    if backend != "cpu":
        return f"{name}: XLA (the C++ kernel runs on the cpu backend only)"
    if all(isinstance(w, StreamedKernel) for w in ws):  # decode_state's dense kernels (`tokens` rows of x_dtype)
        x = jax.ShapeDtypeStruct((tokens, ws[0].shape[1]), x_dtype)
        ok = streamed.usable(x, ws[0].unwrap(), tokens)
        return f"{name}: {'C++ row matmul (kernels/matmul)' if ok else 'XLA (dense weights)'}"
    if not all(isinstance(w, QuantizedExperts) for w in ws):
        views = all(isinstance(w, expert_list.ExpertList) for w in ws)
        return f"{name}: XLA (dense weights{', per-expert views' if views else ''})"
    reason = xla_cpu._ffi_unsupported(ws)  # the test moe_experts_decode makes
    return f"{name}: cpu_ffi (C++)" if reason is None else f"{name}: XLA ({reason})"


def check_names(impls, kinds) -> None:
    """ValueError naming the argument for an unknown implementation or weight kind."""
    bad = [i for i in impls if i != "mlp" and i not in api.IMPLEMENTATIONS]
    if bad:
        raise ValueError(f"impls: unknown {bad}; choose from {list(api.IMPLEMENTATIONS)} or mlp")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"weights: unknown {bad}; choose from {list(KINDS)}")


def run(tokens, impls, kinds, repeats: int = 5, shape: Shape = Shape(), log=print) -> dict:
    """{"shape", "records", "not_run", "machine"}: the records of the module docstring, one per (tokens, weights,
    impl) timed; `not_run` the (weights, tokens, impl) left out and why."""
    check_names(impls, kinds)
    if any(int(t) < 1 for t in tokens):
        raise ValueError(f"tokens: every count must be >= 1, got {list(tokens)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    weights = {k: make_weights(k, shape) for k in kinds}
    call = jax.jit(lambda *a, impl: api.moe_experts(*a, LIMIT, implementation=impl), static_argnames="impl")
    records, not_run = [], []
    log(f"{'T':6s} {'weights':9s} {'impl':10s} {harness.SPREAD_HEADER:>36s}{'':17s}  kernel")
    for t in tokens:
        x, ids, w = make_routing(t, shape)
        distinct = int(np.unique(np.asarray(ids)).size)
        fns = {("mlp", "mlp"): _mlp(x, shape)} if "mlp" in impls else {}
        for kind in kinds:
            ws = weights[kind]
            for impl in (i for i in impls if i != "mlp"):
                runs = api.select_implementation(impl, t * shape.top_k)
                if kind == "split" and runs != "xla_cpu_decode":
                    why = f"per-expert views are read by the xla_cpu decode form only ({impl} runs {runs})"
                    not_run.append(dict(weights=kind, tokens=t, impl=impl, why=why))
                    log(f"T={t:<4d} {kind:9s} {impl:10s} not run: {why}")
                    continue
                fns[kind, impl] = functools.partial(
                    call, x, ids, w, ws["gate"], ws["up"], ws["down"], impl=impl
                )
        timings = harness.time_calls(fns, repeats=repeats)
        for (kind, impl), tm in timings.items():
            dense = timings.get(("dense", impl))
            mlp = timings.get(("mlp", "mlp"))
            rec = dict(
                weights=kind,
                tokens=t,
                impl=impl,
                runs=impl if impl == "mlp" else api.select_implementation(impl, t * shape.top_k),
                kernel="dense SwiGLU (XLA)" if impl == "mlp" else moe_kernel(
                    impl, t * shape.top_k, [weights[kind][m] for m in ("gate", "up", "down")]
                ),
                distinct_experts=distinct,
                **tm.to_dict(),
                vs_dense=None if dense is None or impl == "mlp" else tm.median_s / dense.median_s,
                vs_mlp=None if mlp is None else tm.median_s / mlp.median_s,
            )
            records.append(rec)
            vs = "" if rec["vs_dense"] is None else f"  x{rec['vs_dense']:5.2f} of dense"
            log(f"T={t:<4d} {kind:9s} {impl:10s} {harness.spread_ms(tm, 9, 2)} ms{vs:17s}  {rec['kernel']}")
    return {
        "shape": dataclasses.asdict(shape),
        "records": records,
        "not_run": not_run,
        "machine": harness.machine(),
    }
