"""The shipped model is the default of `experiments.generate` / `experiments.score` (`glm53.assets`).

The entry points run on a stand-in for ``glm53/assets/mini`` (a random transformers model with an MTP block, saved
in bf16 with a BPE tokenizer and the GLM chat template), pointed to by $GLM53_DEFAULT_MODEL, the one documented
override. References: glm53's loader + the serving engine (glm53.serving.offline) / scoring in this process, the
`tokenizers` library directly.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from configs import train
from glm53 import assets, build, scoring
from glm53.config import model_config_from_dict
from glm53.data import bpe
from glm53.errors import CheckpointError
from glm53.runtime.sampling import SamplingParams
from glm53.serving import offline
from glm53.serving.offline import identity_line
from glm53.testing.hf_torch import random_hf_model
from tests.test_checkpoint_hf import release_names  # transformers' fused expert names -> the release's

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = "model.language_model."
TEXT = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"] * 20  # fmt: skip


def make_standin(folder: str) -> None:
    """A folder laid out like the shipped asset: config.json, model.safetensors (bf16, with an MTP block made of
    a copy of the last DSA + MoE layer plus random MTP projections), generation_config.json, tokenizer files."""
    tok = bpe.train_tokenizer(TEXT, 300)
    bpe.save_tokenizer(tok, folder)
    model = train.get_config("tiny").model
    model.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    model.eos_token_ids = list(bpe.stop_ids(tok))
    cfg = model_config_from_dict(model)
    hf = random_hf_model(cfg, seed=1)
    hf.to(torch.bfloat16).save_pretrained(folder)
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    src, dst = f"{P}layers.{n - 1}.", f"{P}layers.{n}."
    mtp = release_names({k: t for k, t in hf.state_dict().items() if k.startswith(src) and "_hc." not in k})
    mtp = {k.replace(src, dst): t for k, t in mtp.items()}
    g = torch.Generator().manual_seed(2)
    mtp[dst + "eh_proj.weight"] = 0.05 * torch.randn(d, 2 * d, generator=g)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[dst + name + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors.update({k: t.to(torch.bfloat16).contiguous().clone() for k, t in mtp.items()})
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("asset") / "mini")
    make_standin(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(standin):
    return build.load_model(standin)


@pytest.fixture(scope="module")
def greedy(loaded):
    """Plain greedy decoding of the stand-in loaded in this process (f32, as the entry points load it)."""
    cfg, model = loaded
    return lambda prompt, n: offline.generate(
        model, [prompt], SamplingParams(max_new=n, eos_ids=cfg.eos_token_ids)
    ).tokens[0]


def _run(module, *args, model_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{assets.ENV: model_dir})
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _ids(stdout: str, prefix: str) -> list[int]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(prefix))
    return ast.literal_eval(line.removeprefix(prefix).strip())


# ------------------------------------------------------------------------------------------------ glm53.assets
def test_default_model_location_and_override(tmp_path, monkeypatch):
    monkeypatch.delenv(assets.ENV, raising=False)
    here = os.path.join(ROOT, "glm53", "assets", "mini")
    assert os.path.realpath(assets.DEFAULT_MODEL) == os.path.realpath(here)
    assert assets.default_model() == assets.DEFAULT_MODEL
    assert assets.describe("/x/mini") == "glm53-mini: trained model shipped with glm53 (/x/mini)"
    monkeypatch.setenv(assets.ENV, str(tmp_path))
    assert assets.default_model() == str(tmp_path)
    assert assets.missing_files() == list(assets.REQUIRED) and not assets.is_present()
    with pytest.raises(CheckpointError, match=re.escape(f"${assets.ENV}={tmp_path} lacks config.json")):
        assets.require_default_model()
    assert assets.resolve("w", None) == ("w", None)
    assert assets.resolve(None, object()) == (None, None)


# ------------------------------------------------------------------------------------------------ entry points
def _model_line(stdout: str) -> str:
    """What the start-up block says runs (its ``  model:`` line, docs/workbench.md)."""
    return next(ln for ln in stdout.splitlines() if ln.startswith("  model: "))[len("  model: "):]


def test_default_generate_runs_the_shipped_model_and_its_chat_template(standin, greedy):
    """No --weights, no --config: the asset and its tokenizer, named on the first line; --chat renders the
    asset's template (its special tokens are single ids of the `tokenizers` encoding); the new tokens equal
    greedy decoding of the asset loaded here."""
    r = _run("experiments.generate", "--prompt=def fibonacci(n):", "--chat", "--max_new=6", model_dir=standin)
    assert r.returncode == 0, r.stderr[-3000:]
    first = _model_line(r.stdout)
    assert first.startswith(f"glm53-mini: trained model shipped with glm53 ({standin})"), first
    assert "with MTP" in first and "random weights" not in r.stdout and "tokenizer: none" not in r.stdout
    assert "chat: '[gMASK]<sop><|user|>def fibonacci(n):<|assistant|>'" in r.stdout, r.stdout
    tok = Tokenizer.from_file(os.path.join(standin, "tokenizer.json"))
    special = [tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>")]
    want = special[:3] + tok.encode("def fibonacci(n):", add_special_tokens=False).ids + special[3:]
    assert _ids(r.stdout, "prompt ids:") == want
    assert _ids(r.stdout, "new ids:") == greedy(want, 6)


def test_default_score_runs_the_shipped_model(standin, loaded, tmp_path):
    seqs = [[12, 40, 77, 3, 250, 91, 18], [5, 6, 7]]
    tokens, out = tmp_path / "t.json", tmp_path / "s.npz"
    tokens.write_text(json.dumps(seqs))
    r = _run("experiments.score", f"--tokens={tokens}", f"--out={out}", model_dir=standin)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _model_line(r.stdout).startswith(f"glm53-mini: trained model shipped with glm53 ({standin})")
    _, nll = scoring.score(loaded[1], seqs)
    np.testing.assert_allclose(np.load(out)["nll"], nll, rtol=1e-5)


def test_speculative_reports_acceptance_and_speedup_and_equals_greedy(standin, greedy):
    prompt = [12, 40, 77, 3, 250, 91, 18, 33]
    r = _run("experiments.generate", f"--prompt_ids={','.join(map(str, prompt))}", "--max_new=10",
             "--speculative", "--repeats=1", model_dir=standin)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^MTP drafts accepted: \d+/\d+ \(\d+\.\d%\)$", r.stdout, re.M), r.stdout
    assert "greedy identity: speculative and plain greedy decoding give the same 10 tokens" in r.stdout
    assert re.search(
        r"^speedup \d+\.\d\dx: speculative [\d.]+ tok/s vs plain greedy [\d.]+ tok/s", r.stdout, re.M
    )
    assert _ids(r.stdout, "new ids:") == greedy(prompt, 10)


def test_identity_line_says_where_the_decoders_differ():
    assert identity_line([1, 2, 3], [1, 2, 3]).startswith("greedy identity: ")
    assert "differ from new token 1; plain greedy ids: [1, 5, 3]" in identity_line([1, 2, 3], [1, 5, 3])
    assert "differ from new token 2" in identity_line([1, 2], [1, 2, 4])


def test_a_missing_default_model_is_an_error_naming_the_folder(tmp_path):
    missing = str(tmp_path / "no_model")
    r = _run("experiments.generate", "--prompt=hi", model_dir=missing)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: the default model glm53-mini is missing") and missing in lines[0], (
        lines
    )
