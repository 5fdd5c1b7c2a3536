"""Writing GLM-5.3 GGUF files that llama.cpp loads, and re-quantizing their routed experts.

* `write_gguf(path, cfg, params)`: a model's parameters -> one GGUF with the metadata, tensor names and layouts
  llama.cpp's own converter (``convert_hf_to_gguf.py``, class Glm5NextModel) writes, tokenizer model "none"
  (llama.cpp then makes dummy tokens; feed token ids). Non-expert matrices in `dense_type`, routed experts
  per an `ExpertMix`; vectors and the small gating / mHC tensors always F32, as the converter keeps them.
* `convert_hf_to_gguf(hf_dir, path)`: the same from an HF folder (read with glm53's HF loader, so bf16 / FP8
  folders work). It holds the whole model in host memory: meant for test and research-size models.
* `quantize_experts(src, dst, mix)`: copies a GGUF, re-quantizing its routed-expert tensors to the types of
  `mix` with llama.cpp's quantizer (``ggml_quantize_chunk`` via `glm53.quant.ggml`; the i-quants that need an
  importance matrix get an all-ones one). Every other tensor and every metadata key is copied unchanged.

Mixes (`parse_mix`): the specs of `glm53.quant.mixes.parse_mix`, a single type ("Q4_K"),
"gate=IQ2_S,up=IQ2_S,down=IQ3_S" or "UD-IQ3_XXS" (Unsloth's release scaled to the model's MoE layers; its
MTP-block types are not reproduced), each optionally followed by ",N.matrix=TYPE" overrides of block N.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType

from glm53.checkpoint import gguf_rules as rules
from glm53.checkpoint import scan
from glm53.checkpoint.gguf import decode_tensor, open_gguf_model
from glm53.checkpoint.hf import load_hf_checkpoint
from glm53.config import ModelConfig, load_hf_config
from glm53.errors import ConfigError
from glm53.quant import ggml, mixes
from glm53.quant.formats import get_format
from glm53.quant.mixes import ExpertMix

Path = rules.Path
DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0")
EXPERT_NAME = re.compile(rf"blk\.(?P<block>\d+)\.ffn_(?P<matrix>{'|'.join(mixes.MATRICES)})_exps\.weight")
# llama.cpp's general.file_type (LLAMA_FTYPE_*) for a file whose large matrices are of one type.
_FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}


def parse_mix(spec: str | ExpertMix, moe_layers=None) -> ExpertMix:
    """The ExpertMix of a spec (`glm53.quant.mixes.parse_mix`) for a model whose MoE blocks are `moe_layers`
    (default: the release's, 3..44), so that `.format(block, matrix)` answers for every block."""
    mix = mixes.parse_mix(spec, "experts")
    if mix is None:
        raise ConfigError(f"experts: {spec!r} is no GGUF type; the writer needs one for every expert matrix")
    return mix.resolve(mixes.RELEASE_MOE_LAYERS if moe_layers is None else moe_layers)


# ------------------------------------------------------------------------------------------------ encoding
def encode(
    a: np.ndarray, fmt: str, imatrix: np.ndarray | None = None
) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """f32 values (numpy order) -> (array for GGUFWriter.add_tensor, raw GGML type or None for F32 / F16).

    imatrix: importance per matrix and input column [n_matrices, k] of a stacked [n_matrices, rows, k] tensor
    (routed experts: one row per expert, as llama-quantize passes them) or [k]; ignored by F32 / F16 / BF16.
    """
    f = get_format(fmt)
    a = np.ascontiguousarray(a, np.float32)
    if f.name == "F32":
        return a, None
    if f.name == "F16":
        return a.astype(np.float16), None
    if f.name == "BF16":
        return a.astype(ml_dtypes.bfloat16).view(np.uint8), GGMLQuantizationType.BF16
    if imatrix is None:
        data = np.frombuffer(ggml.quantize(a.reshape(-1, a.shape[-1]), f), np.uint8)
    else:
        im = np.asarray(imatrix, np.float32).reshape(-1, a.shape[-1])
        mats = a.reshape(len(im), -1, a.shape[-1])
        data = np.frombuffer(b"".join(ggml.quantize(m, f, i) for m, i in zip(mats, im)), np.uint8)
    return data.reshape(*a.shape[:-1], -1), GGMLQuantizationType(f.ggml_type)


def _dense_format(name: str, a: np.ndarray, dense_type: str) -> str:
    if rules.keep_f32(name, a.ndim) or "ssm_conv1d" in name:
        return "F32"
    if a.shape[-1] % get_format(dense_type).block_size:
        return "F16"  # the converter's fallback for rows that do not fill Q8_0 blocks
    return dense_type


def model_params(model: nnx.Module) -> dict[Path, np.ndarray]:
    """Every Param of a (concrete) model as host f32 numpy, keyed by per-layer path (a scanned model's stacked
    parameters sliced per layer, `glm53.checkpoint.scan`: the same dict as the unrolled model's)."""
    return {p: np.asarray(v, np.float32) for p, v in scan.per_layer_values(model)}


def write_gguf(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: Mapping[Path, np.ndarray],
    *,
    arch: str = rules.DEFAULT_ARCH,
    dense_type: str = "F32",
    experts: ExpertMix | str | None = None,
    name: str = "GLM-5.3",
    imatrix: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Writes `params` (our per-layer paths and layouts, e.g. `model_params(model)`, whatever the model's
    scan_layers) as a GGUF llama.cpp can load.

    The MTP block is written when `params` has it. dense_type: F32 / F16 / BF16 / Q8_0 for the non-expert
    matrices; experts: an ExpertMix / mix spec for the routed experts (default: dense_type); imatrix: {GGUF
    expert tensor name: importance [n_expert, k]} for the experts' quantizer (`encode`; others get none).
    """
    if arch not in rules.ARCHITECTURES:
        raise ValueError(f"arch {arch!r}: expected one of {list(rules.ARCHITECTURES)}")
    dense_type = get_format(dense_type).name
    if dense_type not in DENSE_TYPES:
        raise ValueError(f"dense_type {dense_type!r}: expected one of {list(DENSE_TYPES)}")
    moe = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
    mix = parse_mix(experts, moe) if experts is not None else ExpertMix(dense_type, dense_type, dense_type)
    with_mtp = any(p[0] == "mtp" for p in params)
    for p in params:
        scan.check_path(p, "write_gguf")
    w = GGUFWriter(os.fspath(path), arch)
    w.add_type("model")
    w.add_name(name)
    for key, value, vtype in rules.metadata_from_config(cfg, with_mtp=with_mtp):
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(f"{arch}.{key}", value, vtype, GGUFValueType.get_type(value[0]))
        else:
            w.add_key_value(f"{arch}.{key}", value, vtype)
    w.add_file_type(_FILE_TYPE[dense_type])
    w.add_quantization_version(2)
    w.add_tokenizer_model("none")
    for p in sorted(params, key=lambda p: tuple(map(str, p))):
        t = rules.target_for(p, tuple(np.shape(params[p])), cfg)
        for tname, a in zip(t.names, rules.to_gguf(t.kind, params[p], cfg)):
            im = None
            if t.is_expert:
                fmt = mix.format(int(tname.split(".")[1]), t.matrix)
                im = (imatrix or {}).get(tname)
            else:
                fmt = _dense_format(tname, a, dense_type)
            data, raw = encode(a, fmt, im)
            w.add_tensor(tname, data, raw_dtype=raw)
    _write(w)


def _write(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert_hf_to_gguf(
    hf_dir: str | os.PathLike, path: str | os.PathLike, *, with_mtp: bool | None = None, **kw
) -> ModelConfig:
    """Converts an HF GLM-5.3 folder into one GGUF (see `write_gguf` for the keyword arguments); returns its cfg.
    with_mtp: as `glm53.checkpoint.hf.mtp_choice` (None: the MTP block when the folder has one)."""
    cfg = load_hf_config(hf_dir)
    model, _ = load_hf_checkpoint(hf_dir, cfg, dtype=jnp.float32, with_mtp=with_mtp)
    write_gguf(path, cfg, model_params(model), **kw)
    return cfg


def quantize_experts(src: str | os.PathLike, dst: str | os.PathLike, mix: ExpertMix | str) -> dict[str, str]:
    """Copies the GGUF `src` to `dst` with every routed-expert tensor re-quantized per `mix`.

    Source experts of any type glm53 decodes are first decoded to f32. Returns {tensor name: new type}.
    """
    changed = {}
    with open_gguf_model(src) as g:
        if len(g.shards) != 1:
            raise ValueError(
                f"{g.name}: split GGUFs are not supported by quantize_experts (merge them first)"
            )
        arch = g.get("general.architecture")
        trunk = int(g.get(f"{arch}.block_count", 0)) - int(g.get(f"{arch}.nextn_predict_layers", 0))
        blocks = {int(m["block"]) for m in map(EXPERT_NAME.fullmatch, g.tensors) if m}
        mix = parse_mix(mix, sorted(b for b in blocks if b < trunk))
        w = GGUFWriter(os.fspath(dst), arch)
        for key, v in g.metadata.items():
            if key == "general.architecture":
                continue
            if key == "general.alignment":
                w.add_custom_alignment(int(v.value))
                continue
            w.add_key_value(key, v.to_python(), v.type, v.item_type)
        for info in g:
            m = EXPERT_NAME.fullmatch(info.name)
            if m is None:
                data = g.read_tensor_bytes(info.name)
                w.add_tensor(info.name, data.reshape(*info.shape[:-1], -1),
                             raw_dtype=GGMLQuantizationType(info.ggml_type))  # fmt: skip
                continue
            fmt = mix.format(int(m["block"]), m["matrix"])
            if info.format is None:
                raise ValueError(
                    f"{g.name}: {info.name} has GGUF type {info.type_name}, which glm53 cannot decode"
                )
            data, raw = encode(decode_tensor(g, info), fmt)
            w.add_tensor(info.name, data, raw_dtype=raw)
            changed[info.name] = fmt
        _write(w)
    return changed
