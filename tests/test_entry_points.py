"""The entry points run the model on the device mesh of the config's ``mesh`` section (8 virtual CPU devices):
`experiments.score` / `experiments.generate` on the `sharded` tiny variant under tensor and expert parallelism
equal the unsharded model; a config without a ``mesh`` section gets the default mesh; a model that does not split
over an explicit mesh is an error naming the config field."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs import tiny
from glm53 import build, scoring
from glm53 import parallel as S
from glm53.config import model_config_from_dict
from glm53.errors import ShardingError
from glm53.parallel.moe import ShardedMoE
from glm53.runtime.sampling import SamplingParams
from glm53.serving import offline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = tiny.get_config("sharded")
SEQS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 9, 3]]
PROMPT = [3, 17, 99, 4, 56, 8, 21, 77, 30, 2, 90, 11, 64]
MAX_NEW = 8
FAST = {"xla_backend_optimization_level": 0}  # the engines' compiles here (as the serving tests): same programs


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _run(module, *args):
    # XLA's backend optimization level 0: shorter compiles, the same programs (as the serving tests); the run's
    # own flags (tests/conftest.py: 8 devices, YNNPACK fusions off) kept
    xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla)
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _without_mesh(config) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({k: v for k, v in config.items() if k != "mesh"})


@pytest.fixture(scope="module")
def unsharded():
    """Logits, NLL and greedy tokens of the config's seeded random model on one device."""
    _, model = build.model_from_experiment_config(CONFIG)
    logits, nll = scoring.score(model, SEQS)
    greedy = offline.generate(model, [PROMPT], SamplingParams(max_new=MAX_NEW), compiler_options=FAST)
    return dict(logits=logits, nll=nll, greedy=greedy.tokens[0])


@pytest.mark.parametrize("shape,rules", [((1, 8), "ep"), ((2, 4), "tp")])
def test_score_on_the_config_mesh_equals_unsharded(tmp_path, unsharded, shape, rules):
    tokens, out = tmp_path / "tokens.json", tmp_path / "scores.npz"
    tokens.write_text(json.dumps(SEQS))
    r = _run("experiments.score", "--config=configs/tiny.py:sharded", f"--config.mesh.shape=({shape[0]},{shape[1]})",
             f"--config.mesh.rules={rules}", f"--tokens={tokens}", f"--out={out}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"mesh: {{'data': {shape[0]}, 'model': {shape[1]}}} over 8 cpu device(s), rules {rules}" in r.stdout
    z = np.load(out)
    for i, want in enumerate(unsharded["logits"]):
        assert rel(z[f"logits_{i}"], want) <= 1e-5, i
    np.testing.assert_allclose(z["nll"], unsharded["nll"], rtol=1e-5)


def test_generate_on_the_config_mesh_equals_unsharded(unsharded):
    r = _run("experiments.generate", "--config=configs/tiny.py:sharded", "--config.mesh.shape=(1,8)",
             "--config.mesh.rules=ep", f"--prompt_ids={','.join(map(str, PROMPT))}", f"--max_new={MAX_NEW}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh: {'data': 1, 'model': 8} over 8 cpu device(s), rules ep" in r.stdout
    new = next(line for line in r.stdout.splitlines() if line.startswith("new ids:"))
    assert ast.literal_eval(new.removeprefix("new ids:").strip()) == unsharded["greedy"]


def test_config_without_a_mesh_section_runs_on_the_default_mesh(unsharded):
    run = build.sharded_model(_without_mesh(CONFIG))
    assert dict(run.mesh.shape) == {"data": 1, "model": 8} and run.rules.name == "tp"
    assert isinstance(run.model.layers[3].mlp, ShardedMoE)
    kernel = run.model.lm_head.kernel.get_value()
    assert len(kernel.sharding.device_set) == 8 and not kernel.sharding.is_fully_replicated
    logits, _ = scoring.score(run.model, SEQS)
    assert rel(logits[0], unsharded["logits"][0]) <= 1e-5
    eng = offline.engine_for(run.model, [PROMPT], MAX_NEW, slots=2, mesh=run.mesh, rules=run.rules,
                             compiler_options=FAST)  # fmt: skip
    want = S.cache_shardings(eng.cache, run.mesh, run.rules)
    for a, s in zip(jax.tree.leaves(eng.cache), jax.tree.leaves(want), strict=True):
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
    greedy = offline.generate(eng, [PROMPT], SamplingParams(max_new=MAX_NEW)).tokens[0]
    assert greedy == unsharded["greedy"]
    for a, s in zip(jax.tree.leaves(eng.cache), jax.tree.leaves(want), strict=True):  # the donated cache comes
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)  # back in the same shardings


def test_a_model_that_does_not_split_over_the_mesh():
    """The tiny default variant has 2 KDA heads: the default mesh falls back to one device; an explicit mesh
    that it does not split over is an error naming the config field."""
    config = tiny.get_config("default")
    cfg = model_config_from_dict(config.model)
    mesh, rules = build.experiment_mesh(config, cfg)
    assert mesh.size == 1 and rules.name == "tp"
    mesh, _ = build.experiment_mesh(_without_mesh(config), cfg)
    assert mesh.size == 1
    config.mesh.rules = "ep"
    with pytest.raises(ShardingError, match="linear_num_heads"):
        build.experiment_mesh(config, cfg)
