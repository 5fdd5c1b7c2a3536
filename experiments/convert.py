"""Convert HF safetensors (+ GGUF routed experts) into a glm53 Orbax checkpoint.

  python -m experiments.convert --hf=HF_DIR --out=CKPT_DIR
  python -m experiments.convert --hf=HF_DIR --gguf=EXPERTS.gguf --out=CKPT_DIR --dtype=bfloat16 --int8
  python -m experiments.convert --hf=HF_DIR --gguf=M-00001-of-00003.gguf --gguf=M-00002-of-00003.gguf ... --out=CKPT_DIR

Non-expert weights come from the HF folder (bf16 / fp32 / FP8, cast to --dtype, or per-channel int8 with --int8);
routed experts from the GGUF (kept as planes of their GGUF formats, --quant_layout), or from the HF folder
(dense) without --gguf. The MTP block is converted when the HF folder has one (--mtp=auto; transformers'
save_pretrained writes none). A progress bar counts units (one per layer and per layer's experts; off a terminal,
a plain line every few seconds and one at the end, no carriage returns: glm53/progress.py). The checkpoint
is written under CKPT_DIR.partial and renamed to CKPT_DIR when complete; rerunning an interrupted conversion with
the same arguments and unchanged source files resumes it. Every tensor's CRC-32 is recorded and checked on load.
Use the result with ``python -m experiments.score --weights=CKPT_DIR``.
"""

from absl import app, flags

from experiments import cli
from glm53 import build
from glm53.checkpoint import convert
from glm53.parallel import distributed

_HF = flags.DEFINE_string("hf", None, "HF safetensors folder (config.json + weights)", required=True)
_GGUF = flags.DEFINE_multi_string("gguf", [], "GGUF file with the routed experts (repeat for split shards)")
_OUT = flags.DEFINE_string("out", None, "output checkpoint directory (must not exist)", required=True)
_DTYPE = flags.DEFINE_enum(
    "dtype", "bfloat16", ["bfloat16", "float32"], "floating parameter dtype (spelled as every entry point spells it)"
)
_INT8 = flags.DEFINE_bool("int8", False, "store large non-expert matrices as per-channel int8")
_INT8_MIN = flags.DEFINE_integer(
    "int8_min_size", 1 << 20, "with --int8: matrices of at least this many weights", lower_bound=1
)
_LAYOUT = flags.DEFINE_enum("quant_layout", "planes", ["planes", "reencoded"], "quantized expert layout")
_MTP = flags.DEFINE_enum(
    "mtp",
    "auto",
    list(build.MTP_CHOICES),
    "convert the MTP block (layer num_hidden_layers; auto: if present)",
)
_CHUNK = flags.DEFINE_integer(
    "chunk_bytes", convert.DEFAULT_CHUNK_BYTES, "Orbax chunk size (sharded-read unit)", lower_bound=1
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    out = convert.convert(
        _HF.value, _OUT.value, gguf=_GGUF.value, dtype=_DTYPE.value, int8=_INT8.value,
        int8_min_size=_INT8_MIN.value, layout=_LAYOUT.value, with_mtp=build.MTP_CHOICES[_MTP.value],
        chunk_bytes=_CHUNK.value,
    )  # fmt: skip
    if distributed.is_main_process():  # several processes: process 0 wrote the checkpoint and reports it
        print(convert.convert_cli_summary(out))


if __name__ == "__main__":
    cli.run(main)
