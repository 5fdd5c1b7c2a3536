"""glm53.quant.fp8 against torch's float8_e4m3fn and transformers' own FP8 block dequantizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from glm53.quant.fp8 import dequantize_fp8


def _torch_reference(w: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    """Independent f32 computation: every weight times the scale of its 128x128 block (edge blocks trimmed)."""
    rows, cols = w.shape[-2:]
    full = s.float().repeat_interleave(128, dim=-2)[..., :rows, :].repeat_interleave(128, dim=-1)[..., :cols]
    return (w.float() * full).numpy()


@pytest.fixture(scope="module")
def fp8_weight():
    """A [300, 200] e4m3 weight (partial edge blocks on both axes) and random positive block scales [3, 2]."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) * 1e-2 + 1e-4
    return w, s


def test_all_codes_match_torch():
    bits = np.arange(256, dtype=np.uint8).reshape(2, 128)
    got = np.asarray(dequantize_fp8(bits, np.ones((1, 1), np.float32)))
    want = torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(got, want)  # NaN codes (0x7f, 0xff) compare equal as NaN
    assert np.isnan(got).sum() == 2


def test_partial_blocks_bit_exact(fp8_weight):
    w, s = fp8_weight
    want = _torch_reference(w, s)
    for weight in (
        w.view(torch.uint8).numpy(),
        jnp.asarray(w.view(torch.uint8).numpy()).view(jnp.float8_e4m3fn),
    ):
        got = np.asarray(dequantize_fp8(weight, s.numpy()))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    hf = _dequantize_fp8_weight(w.clone(), s, [128, 128], torch.float32).numpy()
    np.testing.assert_array_equal(np.asarray(dequantize_fp8(w.view(torch.uint8).numpy(), s.numpy())), hf)


def test_bf16_output_and_jit(fp8_weight):
    w, s = fp8_weight
    want = torch.from_numpy(_torch_reference(w, s)).to(torch.bfloat16).float().numpy()
    f = jax.jit(lambda a, b: dequantize_fp8(a, b, dtype=jnp.bfloat16))
    got = f(jnp.asarray(w.view(torch.uint8).numpy()), jnp.asarray(s.numpy()))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


def test_stacked_experts():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 130, 260, generator=g) * 10).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, 3, generator=g) + 0.5
    got = np.asarray(dequantize_fp8(w.view(torch.uint8).numpy(), s.numpy()))
    np.testing.assert_array_equal(got, _torch_reference(w, s))


def test_bad_inputs(fp8_weight):
    w, s = fp8_weight
    bits = w.view(torch.uint8).numpy()
    with pytest.raises(ValueError, match=r"blk.0.w: weight_scale_inv shape \(2, 2\).*expected \(3, 2\)"):
        dequantize_fp8(bits, s.numpy()[:2], name="blk.0.w")
    with pytest.raises(ValueError, match="float8_e4m3fn or uint8"):
        dequantize_fp8(bits.astype(np.float32), s.numpy())
    with pytest.raises(ValueError, match="floating point"):
        dequantize_fp8(bits, s.numpy().astype(np.int32))
    with pytest.raises(ValueError, match="at least 2-D"):
        dequantize_fp8(bits[0], s.numpy()[0])
