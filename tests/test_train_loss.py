"""Training oracles against transformers 5.23: on a tiny randomized model (every parameter random, constant-init ones
included), our next-token loss equals `Glm5NextForConditionalGeneration(labels=...)`'s loss on the same weights and
batch (padding masked as -100), and our gradient of it equals torch autograd's for every parameter both define
(names mapped with glm53/checkpoint/hf_rules.py). The indexer's top-k is differentiated by neither: torch gives no
gradient to the indexer's parameters and ours are exactly zero. The torch side runs in float64, ours in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_reference import tiny_hf_model

from configs import tiny
from glm53.checkpoint import hf as hf_ckpt
from glm53.checkpoint import hf_rules
from glm53.config import model_config_from_dict
from glm53.layers.param import path_str
from glm53.train import loss as L
from glm53.train import routing
from glm53.train import step as S

_d = tiny.get_config("default").model  # 4 layers: KDA 0-2 (dense MLP), DSA 3 (sparse past 12 tokens) with MoE
_d.num_hidden_layers, _d.layer_types, _d.mlp_layer_types = 4, ["kda"] * 3 + ["dsa"], ["dense"] * 3 + ["moe"]
_d.indexer_types = ["full"] * 4
CFG = model_config_from_dict(_d)
B, T, PAD_FROM = 2, 24, 17  # row 1 is padded from position 17 on


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf_model(CFG, 3)
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    _, model = hf_ckpt.load_hf_model(folder, dtype=np.float32, with_mtp=False)
    names = routing.instrument_routers(model)
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, CFG.vocab_size, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), np.float32)
    tokens[1, PAD_FROM:], mask[1, PAD_FROM:] = CFG.pad_token_id, 0.0
    # torch, float64
    hf = hf.double()
    hf.set_experts_implementation("eager")  # torch's grouped_mm has no float64
    labels = torch.as_tensor(tokens, dtype=torch.long).masked_fill(torch.as_tensor(mask) == 0, -100)
    out = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long), labels=labels, use_cache=False)
    out.loss.backward()
    ref_grads = {n: p.grad.numpy() if p.grad is not None else None for n, p in hf.named_parameters()}
    # ours, float32, value_and_grad of the library's loss
    graphdef, params, biases, rest = S.split_model(model)
    cfg = L.LossConfig(mtp_weight=0.0)
    loss_fn = S.make_loss_fn(graphdef, rest, cfg, jnp.float32, names)
    batch = dict(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask))
    (loss, aux), grads = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True), compiler_options=S.compiler_options(True)
    )(params, biases, batch)
    ours = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    return dict(
        ref_loss=float(out.loss.detach()),
        ref_grads=ref_grads,
        loss=float(loss),
        aux=aux,
        grads=ours,
        names=names,
    )


def test_next_token_loss_equals_transformers(pair):
    print(f"loss ours {pair['loss']:.8f} transformers(f64) {pair['ref_loss']:.8f}")
    assert abs(pair["loss"] - pair["ref_loss"]) <= 1e-5 * abs(pair["ref_loss"])
    assert float(pair["aux"]["lm_tokens"]) == B * (T - 1) - (T - PAD_FROM)
    assert 3.0 < pair["loss"] < 8.0  # a random model over 128 tokens: about log(128) = 4.85


def test_gradients_equal_torch_autograd(pair):
    grads, ours = pair["ref_grads"], pair["grads"]
    compared, no_grad, worst = set(), set(), (0.0, "")
    mapped: dict = {}
    for name, g in grads.items():
        c = hf_rules.classify(name, CFG.num_hidden_layers, 0)
        if not isinstance(c, hf_rules.Mapped):
            continue
        if g is None:
            no_grad.add(c.target_prefix())
            continue
        for pl in c.apply(g):
            if pl.expert is None:
                mapped[pl.path] = pl.value
            else:
                mapped.setdefault(pl.path, {})[pl.expert] = pl.value
    for path, ref in mapped.items():
        if isinstance(ref, dict):
            ref = np.stack([ref[e] for e in sorted(ref)])
        assert path in ours, f"{path_str(path)}: torch has a gradient, we have no parameter"
        r = rel(ours[path], ref)
        compared.add(path)
        worst = max(worst, (r, path_str(path)))
        assert r <= 1e-4, f"{path_str(path)}: gradient rel {r:.2e}"
    print(f"{len(compared)} parameters compared, worst rel {worst[0]:.2e} ({worst[1]})")
    # Every parameter of ours is either compared or one torch does not differentiate (the indexers).
    rest = set(ours) - compared
    assert rest and all("indexer" in p for p in rest), sorted(map(path_str, rest))
    assert all(any(p[: len(q)] == q for q in no_grad) for p in rest)
    for p in rest:
        assert not np.any(ours[p]), f"{path_str(p)}: indexer parameter got a gradient"
    assert len(compared) > 90


def test_loads_count_every_unpadded_slot(pair):
    loads = pair["aux"]["loads"]
    assert sorted(loads) == sorted(n for n in pair["names"] if not n.startswith("mtp"))
    n_valid = B * T - (T - PAD_FROM)
    for name, ld in loads.items():
        assert float(jnp.sum(ld)) == n_valid * CFG.num_experts_per_tok, name
        assert ld.shape == (CFG.n_routed_experts,)
