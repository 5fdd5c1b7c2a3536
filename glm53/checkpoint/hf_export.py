"""Writing a glm53 model as an HF folder that transformers and glm53 both load.

    folder/
      config.json             model_type glm5_next: the text config (`glm53.config.as_hf_text_config`) and a
                              placeholder vision config (see below)
      model.safetensors       the trunk: every tensor of transformers' text model, release / save_pretrained names
      model-mtp.safetensors   the MTP block (layer num_hidden_layers), when the model has one
      generation_config.json  eos / pad ids of the config
      + extra files (e.g. the tokenizer's), copied

Names and layouts are not a second table: they come from the one HF -> glm53 map, `hf_rules`, run backwards.
Each rule's pattern is expanded into the key spellings it accepts (first alternative first: the release /
``save_pretrained`` spelling), the rule's target names the parameter it fills, and the inverse of its transform
(Linear / depthwise conv / per-expert slice; the fused spellings are read-only) gives the HF layout. Every
tensor written is checked by running it through `hf_rules.classify` + the forward transform: it must land on
the parameter it came from with the identical value.

Text-only: `Glm5NextForConditionalGeneration` always builds a vision tower from ``vision_config``, and no vision
weights exist for a text model. The config holds the smallest tower transformers accepts (one block of width 32,
`PLACEHOLDER_VISION`) and the folder holds no vision tensors: transformers initializes that placeholder and lists
its ``model.visual.*`` keys as MISSING in its load report (glm53 ignores vision keys). Writing made-up vision
weights instead would silence the report but ship weights nobody trained. Image / video inputs are unsupported.

The MTP block sits in its own file (as tests/gguf_fixtures.py does, named ``model-*`` so that llama.cpp's converter
reads it too): transformers' model has no MTP block and loads only ``model.safetensors``, so it loads the folder
without UNEXPECTED keys (its ignore list names the release's layer 45 only), while glm53 reads every
``*.safetensors`` of a folder without an index and gets the block (speculative decoding).

A scanned model (`ModelConfig.scan_layers`) writes its per-layer view (`glm53.checkpoint.scan`): the same files
as the unrolled model.

Parameters that glm53 keeps in float32 whatever the model dtype (conv weights, mHC base / scale, A_log, router)
are written float32; the others in `dtype`. The folder is written under a temporary name next to the target and
renamed at the end: a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from re import _parser as sre  # the regex parser: hf_rules' patterns are expanded back into key spellings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from glm53.checkpoint import hf_rules, scan
from glm53.checkpoint.hf_rules import LAYER_RULES, MODEL_RULES, Mapped, Rule, parse_path
from glm53.config import ModelConfig, as_hf_text_config
from glm53.files import atomic_write, follow_umask, write_json
from glm53.io.safetensors import DTYPES
from glm53.layers.param import Path, path_str
from glm53.model import Glm53Model

EXPORT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                 "float32": np.dtype(np.float32)}  # fmt: skip
TRUNK_FILE, MTP_FILE = "model.safetensors", "model-mtp.safetensors"
# transformers' module layout: the text model under model.language_model., the head at the top.
TEXT_PREFIX, TOP_LEVEL = "model.language_model.", ("lm_head",)
PLACEHOLDER_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, projection_intermediate_size=32,
                          in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                          attention_bias=True)  # fmt: skip
_ST_NAME = {v: k for k, v in DTYPES.items()}
_DIGITS = "\0"  # stands for the expert number in an expanded pattern


# ------------------------------------------------------------------------------------------------ the map, inverted
def _expand(pattern: re.Pattern) -> list[tuple[str, dict[str, str]]]:
    """Every string `pattern` matches, first alternatives first, with its named groups; a ``\\d+`` run is
    `_DIGITS`. Only the regex forms hf_rules uses are handled (AssertionError otherwise: a new rule form)."""
    tree = sre.parse(pattern.pattern)
    names = {i: n for n, i in tree.state.groupdict.items()}

    def seq(items) -> list[tuple[str, dict]]:
        out = [("", {})]
        for op, av in items:
            alts = one(op, av)
            out = [(s + t, {**g, **h}) for (s, g), (t, h) in itertools.product(out, alts)]
        return out

    def one(op, av) -> list[tuple[str, dict]]:
        if op is sre.LITERAL:
            return [(chr(av), {})]
        if op is sre.SUBPATTERN:
            gid, _, _, sub = av
            return [(s, {**g, names[gid]: s} if gid in names else g) for s, g in seq(sub)]
        if op is sre.BRANCH:
            return [x for alt in av[1] for x in seq(alt)]
        if op is sre.IN and all(o is sre.LITERAL for o, _ in av):
            return [(chr(c), {}) for _, c in av]
        digits = [(sre.IN, [(sre.CATEGORY, sre.CATEGORY_DIGIT)])]
        if op is sre.MAX_REPEAT and av[0] == 1 and av[1] == sre.MAXREPEAT and list(av[2]) == digits:
            return [(_DIGITS, {})]
        if op is sre.MAX_REPEAT and av[:2] == (0, 1):
            return [("", {})] + seq(av[2])
        raise AssertionError(f"hf_rules pattern {pattern.pattern!r}: cannot invert {op} {av}")

    return seq(tree)


def _inv_linear(a):
    return a.T


def _inv_conv(a):
    return a.T[:, None, :]  # [K, C] -> [C, 1, K]


# The inverse of each forward transform of hf_rules (the fused ones have none: they are alternative spellings).
_INVERSE = {hf_rules.t_identity: lambda a: a, hf_rules.t_linear: _inv_linear, hf_rules.t_conv: _inv_conv,
            hf_rules.t_expert: _inv_linear}  # fmt: skip


def _table(rules: tuple[Rule, ...], mtp: bool) -> dict[Path, tuple[str, Rule]]:
    """{parameter path relative to its base: (HF key suffix, rule)}, first spelling wins."""
    out: dict[Path, tuple[str, Rule]] = {}
    for rule in rules:
        if rule.transform not in _INVERSE or (rule.mtp_only and not mtp):
            continue
        for text, groups in _expand(rule.pattern):
            g = {k.rstrip("2"): v for k, v in groups.items()}  # as hf_rules.Mapped does
            out.setdefault(parse_path(rule.target.format(**g)), (text, rule))
    return out


_TABLES = {
    "model": _table(MODEL_RULES, False),
    "layer": _table(LAYER_RULES, False),
    "mtp": _table(LAYER_RULES, True),
}


def hf_tensors(path: Path, value: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """The HF (key, tensor) pairs of one glm53 parameter (per-layer path); ValueError naming it when no rule maps
    onto it."""
    scan.check_path(path, "HF export")
    if path[:1] == ("layers",) and len(path) > 2 and isinstance(path[1], int):
        table, rel, prefix = _TABLES["layer"], path[2:], f"{TEXT_PREFIX}layers.{path[1]}."
    elif path[:1] == ("mtp",):
        table, rel, prefix = _TABLES["mtp"], path[1:], f"{TEXT_PREFIX}layers.{cfg.num_hidden_layers}."
    else:
        table, rel = _TABLES["model"], path
        prefix = "" if path[0] in TOP_LEVEL else TEXT_PREFIX
    if rel not in table:
        raise ValueError(f"model: parameter '{path_str(path)}' has no HF name (no rule of "
                         "glm53.checkpoint.hf_rules maps onto it)")  # fmt: skip
    suffix, rule = table[rel]
    inv = _INVERSE[rule.transform]
    if _DIGITS in suffix:  # per-expert tensors of a stacked [E, ...] parameter
        return [(prefix + suffix.replace(_DIGITS, str(e)), inv(value[e])) for e in range(value.shape[0])]
    return [(prefix + suffix, inv(value))]


def _check_roundtrip(key: str, tensor: np.ndarray, path: Path, value: np.ndarray, cfg: ModelConfig) -> None:
    """The forward map must put `tensor` back onto `path` with the identical value (a guard on the inversion)."""
    c = hf_rules.classify(key, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    if not isinstance(c, Mapped):
        raise AssertionError(f"export: {key} ({path_str(path)}) does not map back: {c}")
    for p in c.apply(tensor):
        back = value if p.expert is None else value[p.expert]
        if p.path != path or p.value.shape != back.shape or not np.array_equal(p.value, back):
            raise AssertionError(f"export: {key} maps back onto '{path_str(p.path)}', not '{path_str(path)}'")


# ------------------------------------------------------------------------------------------------ files
def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
):
    """A safetensors file of host arrays (bf16 / f16 / f32 ...), written atomically."""
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, a in tensors.items():
        if a.dtype not in _ST_NAME:
            raise ValueError(f"tensor {name}: dtype {a.dtype} has no safetensors name")
        header[name] = dict(
            dtype=_ST_NAME[a.dtype], shape=list(a.shape), data_offsets=[offset, offset + a.nbytes]
        )
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_write(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())  # little-endian hosts only (as the reader)


def hf_config_dict(cfg: ModelConfig, dtype: str) -> dict:
    """config.json: composite glm5_next with the text config and the placeholder vision tower."""
    text = as_hf_text_config(cfg)
    text.update(index_kpool=cfg.index_kpool, hidden_act="silu", attention_bias=False, dtype=dtype)
    vision = dict(PLACEHOLDER_VISION, out_hidden_size=cfg.hidden_size, model_type="glm5_next_vision")
    return dict(architectures=["Glm5NextForConditionalGeneration"], model_type="glm5_next", dtype=dtype,
                text_config=text, vision_config=vision, tie_word_embeddings=cfg.tie_word_embeddings)  # fmt: skip


def generation_config_dict(cfg: ModelConfig) -> dict:
    out: dict = dict(eos_token_id=list(cfg.eos_token_ids))
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """An empty temporary folder next to `folder` that becomes `folder` when the block succeeds (an existing
    `folder` is replaced only with `overwrite`); on any error it is removed and `folder` is untouched."""
    folder = os.path.abspath(os.fspath(folder))
    parent = os.path.dirname(folder)
    if os.path.exists(folder) and not overwrite:
        raise ValueError(f"folder {folder} already exists (pass overwrite=True / --overwrite to replace it)")
    if not os.path.isdir(parent):
        raise ValueError(f"folder {folder}: its parent {parent} does not exist")
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", suffix=".partial", dir=parent)
    try:
        yield tmp
        follow_umask(tmp)  # mkstemp / mkdtemp make private files
        if os.path.exists(folder):
            old = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", suffix=".old", dir=parent)
            os.rename(folder, os.path.join(old, "x"))
            os.rename(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_params(model: nnx.Module) -> dict[Path, np.ndarray]:
    """{per-layer path: host array} of every Param of `model` (a scanned model's stacked parameters sliced per
    layer, `glm53.checkpoint.scan`); ValueError for a value that is no plain float array."""
    out = {}
    for path, x in scan.per_layer_values(model, nnx.Param):
        if not isinstance(x, (jax.Array, np.ndarray)) or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"model: parameter '{path_str(tuple(path))}' is {type(x).__name__} "
                             f"{getattr(x, 'dtype', '')}, not a float array (int8 / abstract models cannot be exported)")  # fmt: skip
        out[tuple(path)] = np.asarray(jax.device_get(x))
    return out


def _f32_params(cfg: ModelConfig, with_mtp: bool) -> set[Path]:
    """The parameters glm53 keeps float32 in a bfloat16 model."""
    abstract = nnx.eval_shape(
        lambda: Glm53Model(
            scan.per_layer_config(cfg), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, with_mtp=with_mtp
        )
    )
    return {tuple(p) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
            if v.get_value().dtype == jnp.float32}  # fmt: skip


def write_hf_files(
    model: nnx.Module,
    cfg: ModelConfig,
    folder: str,
    *,
    dtype: str = "bfloat16",
    extra_files: Mapping[str, str | os.PathLike] | None = None,
) -> dict:
    """Writes the folder's files into the existing `folder` (no staging; `export_hf` stages). Returns a summary
    {files, tensors, params, bytes}."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a glm53 ModelConfig, got {type(cfg).__name__}")
    extra = {str(k): os.fspath(v) for k, v in (extra_files or {}).items()}
    for name, src in extra.items():
        if os.path.basename(name) != name or name in (
            TRUNK_FILE,
            MTP_FILE,
            "config.json",
            "generation_config.json",
        ):
            raise ValueError(
                f"extra_files: {name!r} must be a plain file name other than the model's own files"
            )
        if not os.path.isfile(src):
            raise ValueError(f"extra_files: {name!r} -> {src}: no such file")
    params = model_params(model)
    with_mtp = any(p[0] == "mtp" for p in params)
    if with_mtp and not cfg.num_nextn_predict_layers:
        raise ValueError("model has an MTP block but cfg.num_nextn_predict_layers is 0")
    keep_f32 = _f32_params(cfg, with_mtp)
    target = EXPORT_DTYPES[dtype]
    trunk: dict[str, np.ndarray] = {}
    mtp: dict[str, np.ndarray] = {}
    for path, value in params.items():
        stored = value.astype(np.float32 if path in keep_f32 else target)
        for key, t in hf_tensors(path, stored, cfg):
            t = np.ascontiguousarray(t)
            _check_roundtrip(key, t, path, stored, cfg)
            (mtp if path[0] == "mtp" else trunk)[key] = t
    meta = {"format": "pt"}
    write_safetensors(os.path.join(folder, TRUNK_FILE), dict(sorted(trunk.items())), meta)
    files = [TRUNK_FILE]
    if mtp:
        write_safetensors(os.path.join(folder, MTP_FILE), dict(sorted(mtp.items())), meta)
        files.append(MTP_FILE)
    write_json(os.path.join(folder, "config.json"), hf_config_dict(cfg, dtype), indent=2)
    write_json(os.path.join(folder, "generation_config.json"), generation_config_dict(cfg), indent=2)
    for name, src in extra.items():
        shutil.copyfile(src, os.path.join(folder, name))
    files += ["config.json", "generation_config.json", *extra]
    return dict(files=files, tensors=len(trunk) + len(mtp), params=int(sum(v.size for v in params.values())),
                bytes=int(sum(t.nbytes for d in (trunk, mtp) for t in d.values())))  # fmt: skip


def export_hf(
    model: nnx.Module,
    cfg: ModelConfig,
    folder: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    extra_files: Mapping[str, str | os.PathLike] | None = None,
    overwrite: bool = False,
) -> dict:
    """Writes `model` (a `Glm53Model` of `cfg`, concrete float parameters) as the HF folder `folder` (module
    docstring): tensors in `dtype` ("bfloat16", "float16" or "float32"; glm53's float32 parameters stay float32),
    `extra_files` {name in the folder: source path} copied in. Written under a temporary name and renamed; an
    existing `folder` is replaced only with `overwrite`. Bad input: ValueError naming the argument."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    with staged_folder(folder, overwrite=overwrite) as tmp:
        return write_hf_files(model, cfg, tmp, dtype=dtype, extra_files=extra_files)
