"""Test helpers for GGUF models: tiny HF folders with an MTP block, llama.cpp's logits (llama-cpp-python), the
exact oracle (transformers with every routed expert replaced by gguf-py's dequantization of the GGUF tensor),
llama.cpp's own HF -> GGUF converter (from the llama-cpp-python sdist) and GGUF rewriting with gguf-py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tarfile
import tempfile

import numpy as np
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from hf_reference import tiny_hf_model
from safetensors.torch import load_file, save_file

from glm53.config import ModelConfig

P = "model.language_model.layers."
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SRC_ENV = "GLM53_LLAMA_CPP_SRC"  # a llama.cpp tree holding convert_hf_to_gguf.py, conversion/ and gguf-py/


# ------------------------------------------------------------------------------------------------ HF folders
def make_hf_folder(folder: str, cfg: ModelConfig, seed: int):
    """transformers' randomized tiny model saved to `folder`, plus a random MTP block (layer num_hidden_layers,
    release names, in ``model-mtp.safetensors``) when cfg has one. Returns the torch model."""
    model = tiny_hf_model(cfg, seed)
    model.save_pretrained(folder)
    if cfg.num_nextn_predict_layers:
        saved = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                saved.update(load_file(os.path.join(folder, f)))  # release names (per-expert, unfused)
        g = torch.Generator().manual_seed(seed + 1)
        src = next(i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe" and cfg.layer_types[i] == "dsa")
        n, d = cfg.num_hidden_layers, cfg.hidden_size
        out = {}
        for k, t in saved.items():
            rest = k.removeprefix(f"{P}{src}.")
            if rest != k and not rest.startswith("hc_"):  # the DSA + MoE tensors of a trunk layer, perturbed
                out[f"{P}{n}.{rest}"] = t + 0.02 * torch.randn(t.shape, generator=g)
        out[f"{P}{n}.eh_proj.weight"] = 0.05 * torch.randn(d, 2 * d, generator=g)
        for name in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{P}{n}.{name}.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        # "model-*" so that llama.cpp's converter picks the file up too.
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(folder, "model-mtp.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
    return model


# ------------------------------------------------------------------------------------------------ llama.cpp
def llama_logits(path: str, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits [T, V] for every position of one sequence (llama-cpp-python, CPU).

    The KV cache is F32: llama.cpp's default F16 cache (type_k / type_v) also holds this arch's MLA latents and
    indexer keys, and rounding them to f16 moves F32-GGUF logits by ~2e-4 and can flip near-tied pool choices."""
    from llama_cpp import GGML_TYPE_F32, Llama

    t = len(tokens)
    llm = Llama(model_path=path, n_ctx=max(64, t), n_batch=t, n_ubatch=t, logits_all=True, use_extra_bufts=False,
                verbose=False, n_threads=2, seed=0, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)  # fmt: skip
    try:
        llm.eval(list(tokens))
        return np.array(llm.scores[:t], np.float32)
    finally:
        llm.close()


def indexer_margins(model, tokens: list[int]) -> np.ndarray:
    """Selection margins of glm53's own KPool indexers on one sequence (an eager forward): for every DSA layer
    with an indexer and every query that has more candidate pools than it selects, the score gap between the
    last selected and the first dropped pool. float64 [N] (N = such (layer, query) pairs)."""
    import jax.numpy as jnp

    from glm53.layers import indexer

    select, seen = indexer.select_pools_blocked, []

    def spy(iq, w, pooled, q_pos_bt, *, kpool, num_select, **kw):
        scores = indexer.pool_scores(iq, w, pooled)  # every pool's score, as the blocks see them
        seen.append((np.asarray(scores), np.asarray(q_pos_bt), kpool, min(num_select, pooled.shape[1])))
        return select(iq, w, pooled, q_pos_bt, kpool=kpool, num_select=num_select, **kw)

    indexer.select_pools_blocked = spy
    try:
        model(jnp.asarray([tokens], jnp.int32))
    finally:
        indexer.select_pools_blocked = select
    gaps = []
    for scores_btp, q_pos_bt, kpool, k in seen:
        for s_p, q in zip(scores_btp[0], q_pos_bt[0]):
            n = (int(q) + 1) // kpool  # complete pools = candidates
            if n > k:
                top = np.sort(s_p[:n].astype(np.float64))[::-1]
                gaps.append(top[k - 1] - top[k])
    return np.asarray(gaps)


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """max / mean abs difference, max abs relative to max |b|, and top-1 agreement of two [T, V] logit arrays."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max": float(d.max()), "mean": float(d.mean()), "rel": float(d.max() / np.abs(b).max()),
            "top1": float(np.mean(a.argmax(-1) == b.argmax(-1)))}  # fmt: skip


# ------------------------------------------------------------------------------------------------ exact oracle
def gguf_py_experts(path: str) -> dict[tuple[int, str], np.ndarray]:
    """(block, "gate"/"up"/"down") -> gguf-py's dequantization of that expert tensor, f32 [E, out, in]."""
    out = {}
    for t in GGUFReader(path).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            w = gguf_dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
            out[int(parts[1]), parts[2].split("_")[1]] = w.reshape(tuple(int(x) for x in reversed(t.shape)))
    return out


@torch.no_grad()
def exact_oracle(model, path: str):
    """A copy of the transformers model whose routed experts are gguf-py's dequantization of `path`'s."""
    oracle = copy.deepcopy(model)
    experts = gguf_py_experts(path)
    for i, layer in enumerate(oracle.model.language_model.layers):
        if (i, "gate") not in experts:
            continue
        e = layer.mlp.experts
        gate_up = np.concatenate(
            [experts[i, "gate"], experts[i, "up"]], axis=1
        )  # [E, 2F, D], gate rows first
        e.gate_up_proj.copy_(torch.from_numpy(gate_up))
        e.down_proj.copy_(torch.from_numpy(experts[i, "down"]))  # [E, D, F]
    return oracle.eval()


def tensor_types(path: str) -> dict[str, str]:
    """GGUF tensor name -> type name, read with gguf-py."""
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


# ------------------------------------------------------------------------------------------------ rewriting
def rewrite_gguf(
    src: str, dst: str, *, drop=(), replace=None, add=None, metadata=None, drop_keys=(), rename=None
):
    """Copies a GGUF with gguf-py, dropping tensors, replacing / adding tensors (name -> f32 array, numpy order),
    changing metadata values (key -> value, same type), dropping keys and renaming key prefixes (old, new);
    general.architecture may be changed."""
    r = GGUFReader(src)
    metadata, replace, add = dict(metadata or {}), dict(replace or {}), dict(add or {})
    arch = metadata.pop("general.architecture", None) or _field(r, "general.architecture")[0]
    w = GGUFWriter(dst, arch)
    for key in r.fields:
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        value, vtype, sub = _field(r, key)
        value = metadata.get(key, value)
        if rename and key.startswith(rename[0]):
            key = rename[1] + key[len(rename[0]) :]
        w.add_key_value(key, value, vtype, sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in replace:
            w.add_tensor(t.name, np.ascontiguousarray(replace[t.name], np.float32))
            continue
        data = np.asarray(t.data)
        raw = None if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else t.tensor_type
        w.add_tensor(t.name, data, raw_dtype=raw)
    for name, a in add.items():
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _field(r: GGUFReader, key: str):
    f = r.fields[key]
    vtype = GGUFValueType(f.types[0])
    if vtype == GGUFValueType.ARRAY:
        sub = GGUFValueType(f.types[1])
        return list(f.contents()), vtype, sub
    return f.contents(), vtype, None


# ------------------------------------------------------------------------------------------------ converter
def llama_cpp_source() -> str:
    """A llama.cpp tree with its HF converter: $GLM53_LLAMA_CPP_SRC, else the llama-cpp-python 0.3.36 sdist
    (fetched once with pip into ~/.cache/glm53 and partly unpacked)."""
    env = os.environ.get(SRC_ENV)
    if env:
        return env
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "glm53")
    src = os.path.join(cache, "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
    if os.path.exists(os.path.join(src, "convert_hf_to_gguf.py")):
        return src
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_PYTHON, "-d", tmp], check=True, capture_output=True)  # fmt: skip
        (sdist,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        keep = ("/vendor/llama.cpp/convert_hf_to_gguf.py", "/vendor/llama.cpp/conversion/",
                "/vendor/llama.cpp/gguf-py/")  # fmt: skip
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if any(k in m.name for k in keep)]
            tf.extractall(tmp, members=members, filter="data")
        try:
            os.replace(
                os.path.join(tmp, "llama_cpp_python-0.3.36"), os.path.join(cache, "llama_cpp_python-0.3.36")
            )
        except OSError:  # another process unpacked it first
            if not os.path.exists(os.path.join(src, "convert_hf_to_gguf.py")):
                raise
    return src


# Runs convert_hf_to_gguf.py in a subprocess with the sdist's own gguf-py (PyPI gguf lacks GLM5_NEXT), writing
# tokenizer model "none" because the test folders have no tokenizer.
_DRIVER = """
import sys
src, hf, out = sys.argv[1:4]
sys.path[:0] = [src + "/gguf-py", src]
import conversion.glm as glm
glm.Glm5NextModel.set_vocab = lambda self: self._set_vocab_none()
import convert_hf_to_gguf as c
sys.argv = ["convert_hf_to_gguf.py", hf, "--outfile", out, "--outtype", "f32"]
c.main()
"""


def run_llama_cpp_converter(hf_dir: str, out: str) -> None:
    """llama.cpp's own HF -> GGUF (F32) conversion of `hf_dir`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", _DRIVER, llama_cpp_source(), hf_dir, out], env=env,
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode:
        raise RuntimeError(f"llama.cpp converter failed:\n{p.stderr[-4000:]}")
