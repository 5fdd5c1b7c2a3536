"""The shipped model (glm53/assets/mini, written by ``python -m experiments.export``) loads in transformers with
logits equal to ours.

Reference: transformers' `Glm5NextForConditionalGeneration.from_pretrained` of the folder, f32 compute on the
same bf16 weights, on a held-out sequence: the first 256 tokens of this file's own source (text the model never
trained on: the corpus is the Python standard library), tokenized by the folder's tokenizer.

Other folders (e.g. an export of a tiny run) are checked the same way when named in the environment variable
``GLM53_TEST_ASSETS`` (os.pathsep-separated). A folder without an exported model fails, naming it.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from tokenizers import Tokenizer
from transformers import Glm5NextForConditionalGeneration

from glm53.checkpoint.hf import load_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "glm53", "assets", "mini")
ENV = "GLM53_TEST_ASSETS"
FOLDERS = [SHIPPED] + [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
T = 256


def held_out_ids(folder: str) -> list[int]:
    with open(__file__, encoding="utf-8") as f:
        text = f.read()
    ids = (
        Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    )
    assert len(ids) >= T, len(ids)
    return ids[:T]


def _topk_lowest_index_first(x, k, dim=-1, largest=True, sorted=True):
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@pytest.mark.parametrize("folder", FOLDERS)
def test_asset_logits_equal_transformers(folder, monkeypatch):
    # Ties broken as ours are (jax.lax.top_k: among equal values the lower index first). The DSA indexer's pool
    # scores are sums of ReLU'd head scores, so a query with fewer positive pools than it selects ties at exactly 0
    # between the last ones, and torch.topk leaves the order of ties unspecified: on the shipped model one of the
    # 256 positions then picked another zero-score pool and its logits differed by 0.15 (rel 8e-3), every other
    # position agreeing to rel 1e-6. Both choices implement the formula; this makes them the same choice.
    monkeypatch.setattr(torch, "topk", _topk_lowest_index_first)
    monkeypatch.setattr(torch.Tensor, "topk", _topk_lowest_index_first)
    assert os.path.isfile(os.path.join(folder, "config.json")), (
        f"{folder}: no exported model (python -m experiments.export --workdir=RUN --out={folder})"
    )
    ids = np.asarray([held_out_ids(folder)])
    cfg, model = load_hf_model(folder, dtype=jnp.float32)
    assert model.mtp is not None  # the MTP block (model-mtp.safetensors) is shipped for speculative decoding
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32))[0])
    hf, info = Glm5NextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                                output_loading_info=True)  # fmt: skip
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(
        k.startswith("model.visual.") for k in info["missing_keys"]
    )  # the placeholder vision tower only
    with torch.no_grad():
        theirs = hf.eval()(input_ids=torch.as_tensor(ids), use_cache=False).logits.float().numpy()
    rel = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
    print(f"{folder}: logits over {T} tokens, ours vs transformers rel {rel:.2e}")
    assert rel <= 1e-4, rel
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    with open(os.path.join(folder, "card.json"), encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["architecture"]["params"] == sum(int(np.prod(x.shape)) for x in _params(model))


def _params(model):
    return [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
