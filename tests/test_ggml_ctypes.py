"""glm53.quant.ggml (ctypes bindings to llama.cpp's ggml) against gguf-py, and its quantizer's round trip."""

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType

from glm53.quant import ggml
from glm53.quant.formats import GGUF_FORMATS, get_format

ROWS, COLS = 8, 512

# Relative Frobenius error of llama.cpp's quantizer on Gaussian rows (no imatrix / all-ones): upper bounds with
# margin over what it gives (e.g. IQ2_S ~0.26, IQ3_S ~0.17, IQ4_XS ~0.08, Q8_0 ~0.005) and lower bounds that
# catch a dequantizer returning the input (every lossy format loses something).
ERROR_BANDS = {
    "IQ2_XXS": (0.2, 0.45),
    "IQ2_XS": (0.2, 0.4),
    "IQ2_S": (0.15, 0.35),
    "IQ3_XXS": (0.12, 0.3),
    "IQ3_S": (0.1, 0.25),
    "IQ4_NL": (0.04, 0.12),
    "IQ4_XS": (0.04, 0.12),
    "Q2_K": (0.15, 0.4),
    "Q3_K": (0.08, 0.25),
    "Q4_K": (0.04, 0.12),
    "Q5_K": (0.02, 0.06),
    "Q6_K": (0.008, 0.03),
    "Q8_0": (0.002, 0.01),
    "Q4_0": (0.04, 0.13),
    "F16": (1e-5, 1e-3),
    "BF16": (1e-4, 5e-3),
    "F32": (0.0, 0.0),
}


@pytest.fixture(scope="module")
def rows():
    return np.random.default_rng(3).standard_normal((ROWS, COLS)).astype(np.float32)


@pytest.fixture(scope="module")
def quantized(rows):
    return {name: ggml.quantize(rows, name) for name in GGUF_FORMATS}


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_ggml_dequantize_matches_gguf_py(name, quantized):
    data = quantized[name]
    assert len(data) == get_format(name).nbytes(ROWS * COLS)
    ours = ggml.dequantize_row(name, data, ROWS * COLS)
    ref = gq.dequantize(np.frombuffer(data, np.uint8).reshape(ROWS, -1), GGMLQuantizationType[name]).reshape(
        -1
    )
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_round_trip_error(name, rows, quantized):
    back = ggml.dequantize_row(name, quantized[name], ROWS * COLS).reshape(ROWS, COLS)
    err = np.linalg.norm(back - rows) / np.linalg.norm(rows)
    lo, hi = ERROR_BANDS[name]
    assert lo <= err <= hi, f"{name}: relative error {err:.4f} outside [{lo}, {hi}]"


def test_threads_and_imatrix(rows):
    """Row-split threading changes nothing; an importance matrix changes the i-quant choice but not validity."""
    one = ggml.quantize(rows, "IQ2_XXS", threads=1)
    assert one == ggml.quantize(rows, "IQ2_XXS", threads=3)
    assert one == ggml.quantize(rows, "IQ2_XXS", imatrix=np.ones(COLS, np.float32))  # the default for IQ2_XXS
    assert ggml.requires_imatrix("IQ2_XXS") and not ggml.requires_imatrix("Q4_K")
    weighted = ggml.quantize(rows, "IQ2_XXS", imatrix=np.linspace(0.1, 10, COLS, dtype=np.float32))
    assert weighted != one
    back = ggml.dequantize_row("IQ2_XXS", weighted, ROWS * COLS).reshape(ROWS, COLS)
    assert np.linalg.norm(back - rows) / np.linalg.norm(rows) < 0.5


def test_bad_inputs(rows, monkeypatch):
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        ggml.quantize(rows[:, :300], "Q4_K")
    with pytest.raises(ValueError, match=r"imatrix must have shape \(512,\)"):
        ggml.quantize(rows, "IQ2_S", imatrix=np.ones(10, np.float32))
    with pytest.raises(ValueError, match="NaN or inf"):
        ggml.quantize(np.where(rows > 2, np.nan, rows), "IQ3_S")
    with pytest.raises(ValueError, match="2-D"):
        ggml.quantize(rows[0], "Q8_0")
    with pytest.raises(ValueError, match="not a GGML type"):
        ggml.quantize(rows, "FP8_E4M3")
    with pytest.raises(ValueError, match="need 288 bytes"):
        ggml.dequantize_row("Q4_K", b"\0" * 100, 512)
    monkeypatch.setenv(ggml.LIB_DIR_ENV, "/nonexistent")
    ggml._lib.cache_clear()
    try:
        with pytest.raises(ggml.GgmlUnavailableError, match="/nonexistent"):
            ggml.requires_imatrix("Q4_K")
        assert not ggml.available()
    finally:
        monkeypatch.delenv(ggml.LIB_DIR_ENV)
        ggml._lib.cache_clear()
    assert ggml.available()
