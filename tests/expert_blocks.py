"""Random GGUF blocks drawn as real files hold them, for the expert-format tests.

Codes are uniform random bytes; every f16 scale field (`d`, `dmin`) takes a random sign (ggml writes a negative
`d` for IQ4_XS, and `dmin` is signed in every K-quant) and a quarter of them are f16 subnormals; the first four
blocks of a tensor are forced to +normal, -normal, +subnormal, -subnormal so that every matrix holds each kind.
Float formats hold N(0, 0.05^2) values of both signs (F16: a quarter of them f16 subnormals; BF16 / F32 none:
an f32 subnormal is flushed by XLA:CPU, which would compare a flushing backend against a non-flushing oracle).
The oracle is gguf-py's `gguf.quants.dequantize` of the same bytes.
"""

from __future__ import annotations

import numpy as np
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.quant.formats import get_format

SCALE_FIELDS = ("d", "dmin")
F16_SUBNORMAL = 2.0**-14  # f16 values below this (in magnitude) are subnormal


def f16_scales(n: int, rng: np.random.Generator, magnitude: float = 1e-3) -> np.ndarray:
    """float16 [n]: random signs, a quarter subnormal, the rest normal within 4x of `magnitude`; the first four
    are +normal, -normal, +subnormal, -subnormal."""
    v = (magnitude * np.exp2(rng.uniform(-2.0, 2.0, n))).astype(np.float16)
    sub = rng.random(n) < 0.25
    v[sub] = (rng.integers(1, 1024, int(sub.sum())) * 2.0**-24).astype(np.float16)
    v = np.where(rng.random(n) < 0.5, -v, v)
    head = np.array([magnitude, -magnitude, 3 * 2.0**-24, -1000 * 2.0**-24], np.float16)[: min(n, 4)]
    v[: len(head)] = head
    return v.astype(np.float16)


def draw_gguf(name: str, n_weights: int, rng: np.random.Generator, magnitude: float = 1e-3) -> np.ndarray:
    """uint8 [n_blocks * type_size]: `n_weights` weights of GGUF format `name`, drawn as described above."""
    f = get_format(name)
    n_blocks = n_weights // f.block_size
    if f.block_size == 1:
        v = (0.05 * rng.standard_normal(n_blocks)).astype(np.float32)
        if name == "F32":
            return v.view(np.uint8)
        if name == "F16":
            h = v.astype(np.float16)
            sub = rng.random(n_blocks) < 0.25
            h[sub] = (rng.integers(-1023, 1024, int(sub.sum())) * 2.0**-24).astype(np.float16)
            return h.view(np.uint8)
        return (v.view(np.uint32) >> 16).astype("<u2").view(np.uint8)  # BF16
    raw = rng.integers(0, 256, size=(n_blocks, f.type_size), dtype=np.uint8)
    for fd in f.fields:
        if fd.name in SCALE_FIELDS:
            s = f16_scales(n_blocks, rng, magnitude).astype("<f2")
            raw[:, fd.offset : fd.offset + 2] = s.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def scales_of(raw: np.ndarray, name: str, field: str = "d") -> np.ndarray:
    """float16 [n_blocks]: the f16 scale `field` of every block of GGUF bytes `raw`."""
    f = get_format(name)
    fd = f.field(field)
    blocks = np.asarray(raw, np.uint8).reshape(-1, f.type_size)
    return np.ascontiguousarray(blocks[:, fd.offset : fd.offset + 2]).view("<f2").reshape(-1)


def oracle(raw: np.ndarray, name: str, shape) -> np.ndarray:
    """gguf-py's dequantization of `raw` (GGUF format `name`) as f32 `shape`."""
    return gq.dequantize(np.asarray(raw, np.uint8), GGMLQuantizationType[name]).reshape(shape)
