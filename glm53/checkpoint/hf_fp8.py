"""The released FP8 form of an HF GLM-5.3 checkpoint: its ``quantization_config``, the pairing of each
float8_e4m3fn ``X.weight`` with its ``X.weight_scale_inv`` (128x128 block scales), and the host-side block
dequantization (`glm53.quant.fp8`). Modules in ``modules_to_not_convert`` must arrive unquantized.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np

from glm53.checkpoint.hf_rules import ShapeProblem
from glm53.errors import CheckpointError
from glm53.quant.fp8 import dequantize_fp8

SCALE_DTYPES = ("F32", "F16", "BF16")
FP8_DTYPE = "F8_E4M3"
FP8_BLOCK = (128, 128)
_SCALE_SUFFIXES = (("weight_scale_inv", "weight"), ("_scale_inv", ""))
_ACT_SCALE = re.compile(r".*\.(?:input_scale|activation_scale)")


@dataclasses.dataclass(frozen=True)
class QuantInfo:
    """The FP8 part of ``config.json`` (``quantization_config``)."""

    fp8: bool = False
    block: tuple[int, int] = FP8_BLOCK
    not_convert: tuple[str, ...] = ()

    def excluded(self, module: str) -> bool:
        """Whether `module` (an HF module name) matches an entry of ``modules_to_not_convert``."""
        for pat in self.not_convert:
            if module == pat or module.startswith(pat + ".") or module.endswith("." + pat):
                return True
            try:
                if re.fullmatch(pat, module) or re.match(rf"(?:{pat})(?=\.|$)", module):
                    return True
            except re.error:
                continue
        return False


def read_quant_info(folder: str) -> QuantInfo:
    """Reads ``quantization_config`` from ``folder/config.json`` (no file or no section: not quantized)."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        return QuantInfo()
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if not q:
        return QuantInfo()
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"{path}: quantization_config.quant_method {method!r} is not supported (only 'fp8')"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(
            f"{path}: quantization_config.fmt {q.get('fmt')!r} is not supported (only 'e4m3')"
        )
    block = tuple(q.get("weight_block_size") or FP8_BLOCK)
    if len(block) != 2:
        raise CheckpointError(f"{path}: quantization_config.weight_block_size {block} is not [rows, cols]")
    return QuantInfo(True, (int(block[0]), int(block[1])), tuple(q.get("modules_to_not_convert") or ()))


def scale_partner(key: str) -> str | None:
    """For a ``...weight_scale_inv`` / ``..._scale_inv`` key, the key of the weight it scales."""
    for suffix, repl in _SCALE_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)] + repl
    return None


def is_activation_scale(key: str) -> bool:
    """``...input_scale`` / ``...activation_scale``: static activation scales, unused (weights are dequantized)."""
    return _ACT_SCALE.fullmatch(key) is not None


def module_name(key: str) -> str:
    """The HF module a ``X.weight`` key belongs to (``X``)."""
    return key[: -len(".weight")] if key.endswith(".weight") else key


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], key: str) -> np.ndarray:
    """Dequantizes one FP8 tensor [..., rows, cols] with its block scales (via glm53.quant.fp8); f32 result."""
    rows, cols = w.shape[-2:]
    want = w.shape[:-2] + (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ShapeProblem(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match FP8 weight "
                           f"{tuple(w.shape)} with {block[0]}x{block[1]} blocks (expected {want})")  # fmt: skip
    with jax.default_device(_host_device()):
        return np.asarray(dequantize_fp8(w, scale_inv, block=block, dtype=np.float32, name=key))


def _host_device():
    """The CPU device (host-side dequantization), or the default device where jax has no CPU backend."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None
