"""Fuzzing `model_config_from_hf` with hypothesis: the config.json transformers writes for a tiny model, with
keys deleted, set to null, to values of the wrong type, out of range, or to other valid values.

Property: either ConfigError, or a config that transformers' own config class also accepts from the same dict
with the same meaning (every field compared), each missing key named in the one log line. The documented
differences: a missing ``index_kpool`` is 4 (the release's), not transformers' 16; an int where a float is
expected is taken as that float (transformers' strict dataclass refuses it); a missing
``num_nextn_predict_layers`` (no transformers field: transformers has no MTP) is 0, as llama.cpp reads it.
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import transformers
from fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st

from configs import tiny
from glm53.config import (
    ConfigError,
    ModelConfig,
    as_hf_text_config,
    model_config_from_dict,
    model_config_from_hf,
)
from glm53.config.hf import _HF_ATTN, _HF_DIRECT, _LINEAR_ATTN, _SCHEDULE_HINTS, _SCHEDULES, _TEXT_DEFAULTS

FLOAT_FIELDS = {f.name for f in ModelConfig.__dataclass_fields__.values() if f.type == "float"}
# Keys the conversion reads (the fuzzed ones); ignored keys cannot change the model.
READ = sorted(
    {*_HF_DIRECT, *_TEXT_DEFAULTS, *_SCHEDULES, *_SCHEDULE_HINTS, "linear_attn_config", "eos_token_id"}
)
LAC_KEYS = [*_LINEAR_ATTN, "kda_layers", "full_attn_layers", "safe_gate"]


@pytest.fixture(autouse=True, scope="module")
def quiet_transformers():
    """transformers warns on every out-of-vocab pad id the fuzzer writes."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


@functools.cache
def base() -> dict:
    cfg = model_config_from_dict(tiny.get_config("parity").model)
    return transformers.Glm5NextTextConfig(**as_hf_text_config(cfg)).to_dict()


SCALARS = st.sampled_from(
    [None, True, False, 0, 1, 2, 3, 4, 8, 16, 32, 64, 127, 128, 2**31, 2**63, -1, -5, 0.0, 1e-5, 1e-6, 2.0,
     2.5, 64.0, -5.0, -0.5, float("nan"), float("inf"), "1e-5", "64", "silu", "gelu", "", [], {}, [1], [8],
     {"a": 1}]
)  # fmt: skip
NAMES = st.sampled_from(
    ["linear_attention", "indexed_attention", "deepseek_sparse_attention", "full_attention", "dense",
     "sparse", "full", "shared", "mamba", "F", "S"]
)  # fmt: skip


def value(draw, current):
    """A replacement: a scalar of any type, or (for lists) another list of names or ints of any length."""
    if isinstance(current, list) and draw(st.booleans()):
        n = draw(st.sampled_from([0, 1, 7, 8, 9, len(current)]))
        if current and isinstance(current[0], int):
            return draw(st.lists(st.integers(-1, 9), min_size=n, max_size=n))
        return draw(st.lists(NAMES, min_size=n, max_size=n))
    return draw(SCALARS)


@st.composite
def hf_dicts(draw) -> dict:
    d = copy.deepcopy(base())
    for _ in range(draw(st.integers(1, 3))):
        target, keys = d, READ
        if draw(st.integers(0, 5)) == 5 and isinstance(d.get("linear_attn_config"), dict):
            target, keys = d["linear_attn_config"], LAC_KEYS
        key = draw(st.sampled_from(keys))
        op = draw(st.sampled_from(["delete", "delete", "null", "value", "value", "value"]))
        if op == "delete":
            target.pop(key, None)
        elif op == "null":
            target[key] = None
        else:
            target[key] = value(draw, target.get(key))
    if draw(st.integers(0, 7)) == 7:  # the composite spelling
        d = {"model_type": "glm5_next", "text_config": d, "tie_word_embeddings": False}
    return d


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def transformers_config(d: dict):
    """transformers' text config of `d` (ints in float fields as floats; a missing index_kpool as ours, 4)."""
    d = copy.deepcopy(d)
    text = d["text_config"] if "text_config" in d else d
    for k in FLOAT_FIELDS & set(text):
        if type(text[k]) is int:
            text[k] = float(text[k])
    lac = text.get("linear_attn_config")
    if isinstance(lac, dict) and type(lac.get("gate_lower_bound")) is int:
        lac["gate_lower_bound"] = float(lac["gate_lower_bound"])
    text.setdefault("index_kpool", 4)
    if "text_config" in d:
        return transformers.Glm5NextConfig(**d).text_config
    return transformers.Glm5NextTextConfig(**d)


def same_meaning(c: ModelConfig, t) -> None:
    for k in _HF_DIRECT:
        assert getattr(c, k) == getattr(t, k, 0 if k == "num_nextn_predict_layers" else None), k
    assert c.layer_types == tuple(_HF_ATTN[x] for x in t.layer_types)
    assert c.mlp_layer_types == tuple({"dense": "dense", "sparse": "moe"}[x] for x in t.mlp_layer_types)
    assert c.indexer_types == tuple(t.indexer_types)
    eos = t.eos_token_id
    assert c.eos_token_ids == (() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))
    assert t.num_key_value_heads == c.num_attention_heads and t.qk_rope_head_dim == 0
    assert t.hidden_act == "silu" and t.attention_bias is False


@fuzz(800)
@given(d=hf_dicts())
def test_fuzz_hf_config(d):
    log = logging.getLogger("glm53.config.hf")
    lines = Lines()
    log.addHandler(lines)
    try:
        c = model_config_from_hf(copy.deepcopy(d))
    except ConfigError:
        return
    finally:
        log.removeHandler(lines)
    same_meaning(c, transformers_config(d))
    text = d.get("text_config", d)
    lac = text.get("linear_attn_config")
    from_lac = {ours for theirs, ours in _LINEAR_ATTN.items() if isinstance(lac, dict) and theirs in lac}
    missing = [k for k in [*_TEXT_DEFAULTS, "index_kpool"] if k not in text and k not in from_lac]
    if missing:
        assert len(lines.lines) == 1, (missing, lines.lines)
        (line,) = lines.lines
        assert all(f"{k}=" in line for k in missing), (missing, line)


def test_unmutated_base_converts():
    same_meaning(model_config_from_hf(base()), transformers_config(base()))
