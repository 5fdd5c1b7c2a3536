"""Where a forward's time goes: each sublayer of each layer jitted alone, timed interleaved with the whole forward
(glm53.benchmarks.layers), per phase: prefill of P tokens, decode of B streams after --context tokens.

  python -m experiments.bench_layers                                  # configs/tiny.py:small, random f32 weights
  python -m experiments.bench_layers --phases=decode_b1 --top=12 --out=layers.json
  python -m experiments.bench_peer --formats=UD-IQ3_XXS --files=/tmp/peer   # keep bench_peer's GGUF files, then
  python -m experiments.bench_layers --gguf=/tmp/peer/UD-IQ3_XXS.gguf --format=UD-IQ3_XXS

Per phase: the whole forward's min / median / max (one program, as generation runs it), the sum of the pieces'
medians and the --top largest (layer kind, piece) groups (sums of their pieces' min / median / max) with their
share of that sum and the kernel implementation each runs (e.g. "moe xla_cpu_decode: cpu_ffi (C++)"). Pieces: embed, attn_hc, attention,
attn_expand, ffn_hc, ffn, ffn_expand, head (glm53/benchmarks/layers.py says what each holds). With --gguf the
model is bench_peer's glm53 side of that file (f32, routed experts kept in --format, --layout).
"""

from __future__ import annotations

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from glm53 import build
from glm53.benchmarks import harness, peer
from glm53.benchmarks import layers as L
from glm53.config import model_config_from_dict
from glm53.quant.mixes import LAYOUTS

DEFAULT_CONFIG = "configs/tiny.py:small"
_CONFIG = config_flags.DEFINE_config_file(
    "config", DEFAULT_CONFIG, "experiment config: its random model (f32)", lock_config=True
)
_GGUF = flags.DEFINE_string(
    "gguf", None, "a GGUF file instead (e.g. bench_peer --files=DIR): glm53's model of it"
)
_FORMAT = flags.DEFINE_enum(
    "format", "F32", list(peer.FORMATS), "with --gguf: the file's routed-expert format"
)
_LAYOUT = flags.DEFINE_enum("layout", "reencoded", list(LAYOUTS), "with --gguf: the routed experts' layout")
_PHASES = flags.DEFINE_list(
    "phases",
    ["prefill_64", "prefill_512", "decode_b1", "decode_b8"],
    "prefill_P (P tokens) / decode_bB (B streams)",
)
_CONTEXT = flags.DEFINE_integer("context", 64, "decode: tokens already in the cache")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed rounds (medians are reported)")
_TOP = flags.DEFINE_integer("top", 8, "groups listed per phase")
_SEED = flags.DEFINE_integer("seed", 0, "token seed")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")


def _phase(name: str) -> tuple[int, int]:
    """(streams, tokens) of "prefill_P" / "decode_bB"."""
    kind, _, n = name.partition("_")
    try:
        if kind == "prefill" and int(n) >= 1:
            return 1, int(n)
        if kind == "decode" and n.startswith("b") and int(n[1:]) >= 1:
            return int(n[1:]), 1
    except ValueError:
        pass
    raise app.UsageError(f"--phases: {name!r} is neither prefill_P nor decode_bB (P, B >= 1)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    phases = {name: _phase(name) for name in _PHASES.value}
    for flag, lo in ((_CONTEXT, 0), (_REPEATS, 1), (_TOP, 1)):
        if flag.value < lo:
            raise app.UsageError(f"--{flag.name}={flag.value}: must be >= {lo}")
    if _GGUF.value:
        model = peer.load_glm53(_GGUF.value, _FORMAT.value, _LAYOUT.value)
        what = f"{_GGUF.value} ({_FORMAT.value}, {_LAYOUT.value})"
    else:
        cfg = model_config_from_dict(_CONFIG.value.model)
        kernels = build.kernels_from_experiment_config(_CONFIG.value)
        model = build.random_model(cfg, seed=_CONFIG.value.seed, kernels=kernels)
        what = f"config {cli.config_name('config') or DEFAULT_CONFIG} (random f32 weights)"
    result = dict(machine=harness.machine(), model=what, phases={})
    print(f"{what}; {harness.describe(result['machine'])}", flush=True)
    rng = np.random.default_rng(_SEED.value)
    for name, (b, t) in phases.items():
        tokens = rng.integers(1, model.cfg.vocab_size, (b, t), dtype=np.int32)
        r = L.forward_parts(
            model, tokens, _CONTEXT.value if t == 1 else 0, repeats=_REPEATS.value, seed=_SEED.value
        )
        result["phases"][name] = r
        whole, total = harness.spread_ms(r["whole"], 0, 2), r["sum_median_s"] * 1e3
        print(f"{name}: whole forward {whole} ms (min / median / max), pieces alone {total:.2f} ms (medians); "
              f"top pieces (sums of min / median / max):")  # fmt: skip
        for k, v in list(r["by_kind"].items())[: _TOP.value]:
            print(f"  {k:28s} {harness.spread_ms(v, 8, 2)} ms  {100 * v['share']:5.1f}%  {v['kernel']}")
    cli.write_result(_OUT.value, result)


if __name__ == "__main__":
    cli.run(main)
