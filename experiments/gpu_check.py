"""Correctness of the Pallas GPU expert kernels on a GPU: pallas_gpu (decode and prefill) against the reference.

  python -m experiments.gpu_check            # on a machine whose jax sees a GPU; exit status 1 on any mismatch

Per expert mix (every format the kernels decode, in each matrix role) and token count (decode: 1, 8, 32
streams; prefill: 256 tokens), random QuantizedExperts (`QuantizedExperts.random`) of E experts [D, F] are run
through `api.moe_experts` with implementation pallas_gpu_decode / pallas_gpu_prefill and with "reference"
(every expert dequantized by glm53.quant.dequant, sort + ragged_dot) in f32 and bf16 activations; prints the
relative max error of each and checks that the compiled program holds Mosaic GPU kernels (not the interpreter).
Run by experiments/gpu_check.sh before the benchmark. Fails clearly (exit status 2) when jax sees no GPU.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli
from glm53.quant.qweight import QuantizedExperts
from kernels.moe import api
from kernels.moe import pallas_gpu_wgmma as W

_E = flags.DEFINE_integer("experts", 32, "experts per matrix")
_D = flags.DEFINE_integer("d_model", 1024, "model width D")
_F = flags.DEFINE_integer("d_ff", 512, "expert width F")
_ALLOW_CPU = flags.DEFINE_bool(
    "allow_cpu", False, "dry run of this script on a non-GPU backend (kernels interpreted; use small shapes)"
)

# (gate, up, down, layout): every GPU format in some role; the UD-IQ3_XXS mix in its gather-free layout. bf16
# prefill takes the tensor-core kernel (pallas_gpu_wgmma) where gate and up share a format, else CUDA cores.
MIXES = [
    ("IQ2_S", "IQ2_S", "IQ3_S", "reencoded"),
    ("IQ4_XS", "IQ4_XS", "Q8_0", "planes"),
    ("Q4_K", "Q4_K", "BF16", "planes"),
    ("BF16", "IQ4_XS", "Q4_K", "planes"),
]
DECODE_TOKENS = (1, 8, 32)
PREFILL_TOKENS = 256  # 2048 slots
TOP_K = 8
LIMIT = 10.0
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative to max |y|: f32 FMA order / bf16 rounding


def _rel_err(y, want) -> float:
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    return float(np.abs(y - want).max() / max(np.abs(want).max(), 1e-30))


def _jitted(impl: str):
    return jax.jit(lambda *a: api.moe_experts(*a, LIMIT, implementation=impl))


def main(argv):
    del argv
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not _ALLOW_CPU.value:
        print(f"FAIL: jax sees no GPU (backend {jax.default_backend()!r}, devices {jax.devices()})")
        sys.exit(2)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    e, d, f = _E.value, _D.value, _F.value
    failures = []
    key = jax.random.key(0)
    for gate_f, up_f, down_f, layout in MIXES:
        key, kg, ku, kd = jax.random.split(key, 4)
        ws = [
            QuantizedExperts.random(kg, (e, d, f), gate_f, layout),
            QuantizedExperts.random(ku, (e, d, f), up_f, layout),
            QuantizedExperts.random(kd, (e, f, d), down_f, layout),
        ]
        for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
            path = "prefill" if tokens == PREFILL_TOKENS else "decode"
            rng = np.random.default_rng(tokens)
            ids = np.argsort(rng.random((tokens, e)), axis=1)[:, :TOP_K].astype(np.int32)
            w = rng.uniform(0.05, 1.0, (tokens, TOP_K)).astype(np.float32)
            for dtype in ("float32", "bfloat16"):
                x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)

                args = (x, ids, w, *ws)
                kernel = _jitted(f"pallas_gpu_{path}")
                wgmma = on_gpu and dtype == "bfloat16" and W.supports(*(q.planes for q in ws)) is None
                wgmma = wgmma and (path == "prefill" or tokens >= 4)  # moe_decode's tensor_core_tokens
                form = " (tensor cores)" if wgmma else " (CUDA cores)"
                name = f"{gate_f}/{up_f}/{down_f} ({layout}) {path}{form} T={tokens} {dtype}"
                t0 = time.perf_counter()
                try:
                    got = kernel(*args).block_until_ready()
                except Exception as e:  # a kernel the GPU compiler rejects: report it, check the rest
                    print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
                    failures.append(name)
                    continue
                dt = time.perf_counter() - t0
                hlo = kernel.lower(*args).as_text()
                err = _rel_err(got.astype(jnp.float32), _jitted("reference")(*args).astype(jnp.float32))
                ok = err <= TOLERANCE[dtype] and ("mosaic_gpu" in hlo or not on_gpu)
                print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (first call {dt:.2f} s)")
                if not ok:
                    failures.append(name)
    print(f"{len(failures)} failures" + (": " + "; ".join(failures) if failures else ""))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
