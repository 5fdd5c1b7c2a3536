"""Dequantization speed per GGUF type (glm53 vs gguf-py vs ggml); the impls and fields: glm53/benchmarks/dequant.py.

python -m experiments.bench_dequant [--types=IQ2_S,Q4_K] [--rows=4096] [--cols=2048] [--repeats=5]
                                    [--out=bench_dequant.json]

Prints a table (min / median / max time, weights/s from the median and speedups vs gguf-py and ggml per type and
impl: the impl is the decoder that ran) and writes the JSON list
of records, the machine record last.
"""

from __future__ import annotations

from absl import flags

from experiments import cli, startup
from glm53.benchmarks import dequant
from glm53.quant.formats import I_QUANTS, K_QUANTS

_TYPES = flags.DEFINE_list("types", list(I_QUANTS + K_QUANTS + ("Q8_0",)), "GGUF types to benchmark.")
_ROWS = flags.DEFINE_integer("rows", 4096, "Matrix rows (outputs).")
_COLS = flags.DEFINE_integer("cols", 2048, "Matrix columns (inputs); a multiple of the block size.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per impl (after one warm-up call).")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path ('' to skip writing; default: bench_dequant.json in a new run folder)"
)
_QUANT_ROWS = flags.DEFINE_integer(
    "quant_rows", 256, "Rows actually quantized by llama.cpp, tiled to --rows."
)
_IMPLS = flags.DEFINE_list("impls", [], "Only these impls (default: all available).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the Gaussian test rows.")


def main(argv):
    del argv
    records = dequant.run(
        _TYPES.value, _ROWS.value, _COLS.value, _REPEATS.value, _QUANT_ROWS.value, _IMPLS.value, _SEED.value
    )
    print(dequant.format_table(records))
    out = _OUT.value if _OUT.value is not None else startup.output_path(None, "bench_dequant.json")
    cli.write_result(out, records)


if __name__ == "__main__":
    cli.run(main)
