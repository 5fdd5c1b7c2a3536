#!/usr/bin/env bash
# The GPU check of the Pallas GPU expert kernels (issue 15), in one call on a machine with an NVIDIA GPU:
#
#   bash experiments/gpu_check.sh            # from the repository root; results under $OUT (default out/gpu_check)
#
# 1. Python and jax: $PYTHON (default python3) must import a jax that sees a GPU (checked first; exit 2 with a
#    FAIL line otherwise). Pure-Python packages glm53 needs and the machine lacks (ml_collections, gguf) are
#    installed from wheels in .whl/ when present (pip download --no-deps ... -d .whl; the device tool carries
#    .whl), into /tmp/site, without any index.
# 2. Correctness: python -m experiments.gpu_check (pallas_gpu decode / prefill vs the reference, every GPU
#    format, f32 and bf16 activations) -> gpu_check.log; exit 1 on a mismatch (the benchmarks still run).
# 3. The benchmark: python -m experiments.bench_kernels --config=configs/bench_kernels.py:real (the
#    UD-IQ3_XXS mix, GGUF planes and re-encoded layouts; reference, dequant_all, xla_quant, pallas_gpu; streams
#    1 / 8 / 32, prefill 512 / 4096) ->
#    bench_real.json; then per format (IQ4_XS, Q4_K, Q8_0, BF16 in every matrix) xla_quant vs pallas_gpu at 1 / 8
#    / 32 streams and 512 / 4096 prefill tokens -> bench_<fmt>.json. Logs: bench.log.
# 4. summary.txt: per layout / format, pallas_gpu decode bandwidth as a fraction of a device copy of the same
#    bytes at 1 / 8 / 32 streams, time(32) / time(1) against 1.1 x U(32) / U(1), prefill TFLOP/s at 512 / 4096
#    tokens and its fraction of $PEAK_TFLOPS (default 790: the bf16 matmul rate measured on this H200 kind).
#
# Each step has a time limit (seconds: CHECK_S, REAL_S, FORMAT_S; defaults 150 + 210 + 4 x 45) so the whole fits a
# 10-minute call; the real set runs at the stream / prefill sizes the targets name (1, 8, 32; 512, 4096).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "FAIL: could not install the wheels in .whl/"; exit 2; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

"$PY" - <<'EOF' || exit 2
import sys
try:
    import jax
except ImportError as e:
    sys.exit(f"FAIL: {sys.executable} cannot import jax ({e})")
backend = jax.default_backend()
print(f"python {sys.version.split()[0]}, jax {jax.__version__} (the project pins 0.10.2), backend {backend}")
if backend != "gpu":
    sys.exit(f"FAIL: jax cannot see a GPU (backend {backend!r}, devices {jax.devices()}); is a CUDA jax plugin installed?")
print("devices:", jax.devices())
try:
    import glm53, kernels.moe.api, experiments.bench_kernels  # noqa: F401
except ImportError as e:
    sys.exit(f"FAIL: glm53 does not import here ({e}); carry the missing package as a wheel in .whl/")
EOF

status=0
timeout "${CHECK_S:-150}" "$PY" -m experiments.gpu_check 2>&1 | tee "$OUT/gpu_check.log" || status=1

bench() {  # bench NAME SECONDS [--config.* overrides]
  local name=$1 secs=$2
  shift 2
  echo "== bench $name $*" | tee -a "$OUT/bench.log"
  timeout "$secs" "$PY" -m experiments.bench_kernels --config=configs/bench_kernels.py:real "$@" \
    --out="$OUT/bench_$name.json" 2>&1 | tee -a "$OUT/bench.log" || echo "bench $name: failed or timed out" | tee -a "$OUT/bench.log"
}
bench real "${REAL_S:-210}" --config.streams=1,8,32 --config.prefill_tokens=512,4096
for fmt in iq4_xs q4_k q8_0 bf16; do
  bench "$fmt" "${FORMAT_S:-45}" --config.experts="$fmt" --config.layouts=planes --config.impls=xla_quant,pallas_gpu \
    --config.streams=1,8,32 --config.prefill_tokens=512,4096 --config.repeats=5
done

"$PY" - "$OUT" "${PEAK_TFLOPS:-790}" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, sys
out, peak = sys.argv[1], float(sys.argv[2])
print(f"pallas_gpu on the GPU (copy fraction = bandwidth / a device copy's; prefill vs {peak:.0f} TFLOP/s bf16)")
for path in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
    recs = [r for r in json.load(open(path))["records"] if r["impl"] == "pallas_gpu"]
    for layout in sorted({r["layout"] for r in recs}):
        rs = [r for r in recs if r["layout"] == layout]
        fmts = "/".join(rs[0]["formats"][m].split()[0] for m in ("gate", "up", "down")) if rs else "?"
        dec = {r["tokens"]: r for r in rs if r["op"] == "decode"}
        pre = {r["tokens"]: r for r in rs if r["op"] == "prefill"}
        line = [f"{os.path.basename(path)[6:-5]:7s} {layout:9s} {fmts:20s}"]
        line += [f"copy@{n}={dec[n]['ratio_vs_copy']:.2f}" for n in (1, 8, 32) if n in dec]
        if 1 in dec and 32 in dec:
            t = dec[32]["median_s"] / dec[1]["median_s"]
            u = dec[32]["distinct_experts"] / dec[1]["distinct_experts"]
            line.append(f"t32/t1={t:.2f} (target <= {1.1 * u:.2f})")
        line += [f"prefill@{n}={pre[n]['tflop_per_s']:.1f} TF ({pre[n]['tflop_per_s'] / peak:.1%})" for n in (512, 4096) if n in pre]
        print("  ".join(line))
EOF
exit $status
