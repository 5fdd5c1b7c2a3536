"""glm53.ablation.imatrix: llama.cpp's importance matrix computed by glm53, against a float64 numpy computation
from the activations captured in the same forward; its GGUF file; the quantizer it feeds (llama.cpp's, per expert);
experiments.imatrix end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from configs import tiny
from glm53 import build
from glm53.ablation import imatrix as imx
from glm53.checkpoint.gguf import open_gguf_model
from glm53.checkpoint.gguf_export import model_params, write_gguf
from glm53.config import model_config_from_dict
from glm53.layers.moe import Experts
from glm53.quant import ggml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNKS, T = 2, 24


@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config("default").model)  # hidden 64, 8 experts of width 32, top-2
    model = build.random_model(cfg, seed=0, with_mtp=False)
    chunks = np.random.default_rng(0).integers(0, cfg.vocab_size, (CHUNKS, T))
    im, seen = imx.collect(model, chunks, record=True)
    return cfg, model, chunks, im, seen


def _silu(x):
    return x / (1 + np.exp(-x))


def test_imatrix_matches_numpy_float64(setup):
    cfg, model, _, im, seen = setup
    layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
    assert all(isinstance(model.layers[i].mlp.experts, Experts) for i in layers)  # the capture is undone
    lim = cfg.swiglu_limit
    for i in layers:
        ex = model.layers[i].mlp.experts
        wg, wu = (np.asarray(p[...], np.float64) for p in (ex.gate_proj, ex.up_proj))
        e = cfg.n_routed_experts
        s_in, s_h, cnt = (
            np.zeros((e, cfg.hidden_size)),
            np.zeros((e, cfg.moe_intermediate_size)),
            np.zeros(e, int),
        )
        for layer, x, ids in seen:
            if layer != i:
                continue
            x = x.astype(np.float64)
            for t in range(x.shape[0]):
                for k in range(ids.shape[1]):
                    j = ids[t, k]
                    h = _silu(np.minimum(x[t] @ wg[j], lim)) * np.clip(x[t] @ wu[j], -lim, lim)
                    s_in[j] += x[t] ** 2
                    s_h[j] += h**2
                    cnt[j] += 1
        assert cnt.sum() == CHUNKS * T * cfg.num_experts_per_tok and s_in.max() > 0 and s_h.max() > 0
        for m, ref in (("gate", s_in), ("up", s_in), ("down", s_h)):
            sums, counts = im.entries[imx.tensor_name(i, m)]
            np.testing.assert_array_equal(counts, cnt)
            np.testing.assert_allclose(sums, ref, rtol=2e-5, atol=1e-6)


def test_imatrix_file_and_quantizer(setup, tmp_path):
    cfg, model, _, im, _ = setup
    path = tmp_path / "im.gguf"
    imx.write_imatrix(path, im)
    r = GGUFReader(path)
    assert bytes(r.fields["general.type"].parts[-1]).decode() == "imatrix"
    assert int(r.fields["imatrix.chunk_count"].parts[-1][0]) == CHUNKS
    assert int(r.fields["imatrix.chunk_size"].parts[-1][0]) == T
    t = {x.name: x for x in r.tensors}
    name = imx.tensor_name(3, "down")
    assert list(t[f"{name}.in_sum2"].shape) == [cfg.moe_intermediate_size, cfg.n_routed_experts]  # ggml order
    assert list(t[f"{name}.counts"].shape) == [1, cfg.n_routed_experts]
    imp = imx.read_imatrix(path)
    sums, counts = im.entries[name]
    np.testing.assert_allclose(imp[name], sums / counts[:, None], rtol=1e-6)
    assert (imx.importance(np.full((2, 3), 5.0), np.array([0, 2])) == [[1, 1, 1], [2.5, 2.5, 2.5]]).all()
    # +imatrix: each expert is quantized by ggml with its own row of importances, as llama-quantize does
    out = tmp_path / "q.gguf"
    write_gguf(out, cfg, model_params(model), experts="IQ4_NL", imatrix=imp)
    down = model.layers[3].mlp.experts.down_proj[...]
    w = np.swapaxes(np.asarray(down, np.float32), 1, 2)  # [E, D, F]: GGUF rows
    want = b"".join(ggml.quantize(w[e], "IQ4_NL", imp[name][e]) for e in range(len(w)))
    with open_gguf_model(out) as g:
        got = g.read_tensor_bytes(name).tobytes()
    assert got == want and got != ggml.quantize(w.reshape(-1, w.shape[-1]), "IQ4_NL")


def test_imatrix_entry_point(setup, tmp_path):
    cfg, model, chunks, im, _ = setup
    write_gguf(tmp_path / "base.gguf", cfg, model_params(model))
    (tmp_path / "tokens.json").write_text(json.dumps(chunks.tolist()))
    out = tmp_path / "cli.imatrix.gguf"
    p = subprocess.run(
        [sys.executable, "-m", "experiments.imatrix", f"--weights={tmp_path / 'base.gguf'}",
         f"--tokens={tmp_path / 'tokens.json'}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "2 chunks of 24 tokens; 9 matrices" in p.stdout
    got = imx.read_imatrix(out)
    for name, (sums, counts) in im.entries.items():
        np.testing.assert_allclose(got[name], imx.importance(sums, counts), rtol=1e-4, atol=1e-6)
    bad = subprocess.run([sys.executable, "-m", "experiments.imatrix", f"--out={tmp_path}/no/such/x.gguf"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "does not exist" in bad.stderr
