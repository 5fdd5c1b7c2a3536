"""Shapes and settings of the routed-expert kernel benchmark. Select a set as ``configs/bench_kernels.py:NAME``.

Sets:
  real   GLM-5.3-Flash experts: D 4096, F 2048, 288 experts, top-8; decode at 1, 3, 8, 32, 64 streams (one token
         each), prefill 512 .. 4096 tokens; bf16 activations. For an accelerator.
  cpu    scaled down for a 2-core CPU (about two minutes): D 512, F 256, 64 experts, top-8; f32 activations.
  tiny   the smoke test's set (seconds).

  python -m experiments.bench_kernels --config=configs/bench_kernels.py:cpu --out=bench_kernels.json
Override fields from the command line, e.g. ``--config.layouts=planes --config.repeats=10``.

Fields: experts (a QuantConfig `experts` spec; "ud_iq3_xxs" means its common layer: IQ2_S gate/up, IQ3_S down),
layouts, impls ("reference", "dequant_all", "xla_quant", "xla_cpu", "pallas_tpu", "pallas_gpu"; xla_cpu runs only
on a CPU backend, pallas_tpu only on a TPU one, pallas_gpu only on a GPU one: each set lists them all, so the
implementation "auto" picks is timed on every backend and the others print "not run" with the reason),
streams (decode tokens), prefill_tokens, reference_max_slots (skip the reference above this many routed slots:
on CPU/GPU its ragged_dot runs every expert on every slot), experts_per_step and tile_rows (xla_quant),
warmup / repeats (min / median / max of repeats), dtype (activations), seed.
"""

import ml_collections

_COMMON = dict(
    experts="ud_iq3_xxs",
    layouts="planes,reencoded",
    impls="reference,dequant_all,xla_quant,xla_cpu,pallas_tpu,pallas_gpu",
    experts_per_step=8,
    tile_rows=128,
    warmup=1,
    repeats=5,
    seed=0,
)

SETS = {
    "real": dict(
        n_experts=288, d_model=4096, d_ff=2048, top_k=8, streams="1,3,8,32,64",
        prefill_tokens="512,1024,2048,4096", reference_max_slots=1 << 30, dtype="bfloat16",
    ),
    "cpu": dict(
        n_experts=64, d_model=512, d_ff=256, top_k=8, streams="1,2,4,16", prefill_tokens="64",
        reference_max_slots=128, dtype="float32", repeats=3,
    ),
    "tiny": dict(
        n_experts=8, d_model=256, d_ff=256, top_k=2, streams="1,2", prefill_tokens="8",
        reference_max_slots=64, dtype="float32", layouts="planes", warmup=0, repeats=1,
    ),
}  # fmt: skip


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "cpu"
    if name not in SETS:
        raise ValueError(f"configs/bench_kernels.py: unknown set {name!r}; choose one of {sorted(SETS)}")
    d = dict(_COMMON)
    d.update(SETS[name])
    d["name"] = name
    return ml_collections.ConfigDict(d)
