"""The researcher's workbench (docs/workbench.md), over every entry point:

* ``--help`` prints the entry point's usage and exits 0;
* a bad ``--config`` path, a misspelled ``--config.*`` key, a value the config rejects, an unknown flag: one
  ``usage error:`` line on stderr, exit 2, no traceback, nothing written;
* configs by name (``--config=tiny``) and the entry points from any folder;
* the start-up block (flags, backend, compilation cache, then the model's lines: weights, mesh, dtype, layers,
  expert storage, the implementation of each kernel op, "interpret mode" where a Pallas kernel is interpreted);
* outputs in a run folder with the run record beside them, files with the umask's mode;
* the persistent compilation cache: a second identical run finds its programs there.

The error cases run in children forked from a clean process that has imported JAX and the entry points' shared
modules once (tests/forkrun.py): each case costs a fork, not an interpreter start.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys

import pytest

from tests.forkrun import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = sorted(
    f"experiments.{os.path.basename(p)[:-3]}"
    for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))
    if "cli.run(main)" in open(p).read() or p.endswith("launch.py")
)
def _source(module: str) -> str:
    return open(os.path.join(ROOT, *module.split(".")) + ".py").read()


WITH_CONFIG = [e for e in ENTRY_POINTS if "DEFINE_config_file" in _source(e)]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: nothing may land in the current folder either
    monkeypatch.setenv("GLM53_RUNS", str(tmp_path / "runs"))


def _one_usage_line(code, out, err, needle):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("usage error:") and needle in lines[0], lines


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_exits_zero_with_the_usage(module):
    code, out, err = run_forked(module, "--help")
    assert code == 0 and "Traceback" not in err, err[-2000:]
    mod_doc = _source(module).split('"""')[1].strip()
    assert out.startswith(mod_doc.splitlines()[0]), out[:300]
    assert "--" in out  # the flags


REQUIRED = {"experiments.ablate": ["--out=o"], "experiments.score": ["--tokens=t.json"]}  # flags absl requires


@pytest.mark.parametrize("module", WITH_CONFIG)
def test_bad_config_path_is_one_usage_line(module, tmp_path):
    code, out, err = run_forked(module, "--config=no_such_config.py", *REQUIRED.get(module, []))
    _one_usage_line(code, out, err, "--config=no_such_config.py: no such file, nor a config shipped with glm53")
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("module", WITH_CONFIG)
def test_misspelled_config_key_is_one_usage_line(module, tmp_path):
    config = "configs/train.py:tiny" if module == "experiments.train" else "configs/tiny.py"
    if module in ("experiments.ablate", "experiments.bench_kernels"):
        config = f"configs/{module.split('.')[1]}.py"
    code, out, err = run_forked(module, f"--config={os.path.join(ROOT, config)}", "--config.seeed=1",
                                *REQUIRED.get(module, []))  # fmt: skip
    _one_usage_line(code, out, err, "--config.seeed: the config has no field 'seeed'")
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize(
    "module,args,needle",
    [
        ("experiments.generate", ["--config=tiny", "--prompt=x", "--config.model.hidden_size=-4"],
         "config field 'hidden_size': must be a positive integer, got -4"),
        ("experiments.generate", ["--config=tiny:gguf", "--prompt=x", "--config.kernels.moe=pallas_tpu"],
         "config field 'kernels.moe': 'pallas_tpu' decodes GGUF expert blocks, and the experts are dense"),
        ("experiments.score", ["--config=tiny", "--tokens=t.json", "--config.kernels.moe=nope"],
         "config field 'kernels.moe': unknown implementation 'nope'"),
        ("experiments.generate", ["--config=tiny:nope", "--prompt=x"], "unknown variant 'nope'"),
        ("experiments.train", ["--config=tiny", "--workdir=w"], "not a training config"),
        ("experiments.bench_train", ["--configs=train:nope"], "--configs: unknown ['train:nope']"),
        ("experiments.generate", ["--prompt=x", "--no_such_flag=1"], "no_such_flag"),
        ("experiments.launch", ["-m", "experiments.generate"], "the command to launch goes after --"),
        ("experiments.launch", ["--processes=x", "--", "python", "-c", "1"], "--processes=x"),
        ("experiments.generate", ["--config=tiny", "--prompt=x", "--moe_impl=reference"],
         "--moe_impl=reference: with --config, set --config.kernels.moe=reference instead"),
    ],
)  # fmt: skip
def test_rejected_values_are_one_usage_line_before_any_work(module, args, needle, tmp_path):
    code, out, err = run_forked(module, *args)
    _one_usage_line(code, out, err, needle)
    assert sorted(os.listdir(tmp_path)) == []  # no workdir, no run folder


# ------------------------------------------------------------------------------------------------ real runs
def _run(*args, cwd, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_score_from_any_folder_writes_a_run_folder_a_record_and_readable_files(tmp_path):
    (tmp_path / "t.json").write_text("[[5, 6, 7, 8]]")
    old = os.umask(0o022)
    try:
        r = _run("experiments.score", "--config=tiny", "--tokens=t.json", "--config.model.index_topk=8",
                 cwd=tmp_path, env={"GLM53_RUNS": str(tmp_path / "runs")})  # fmt: skip
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "experiments.score: flags --config=tiny --tokens=t.json --config.model.index_topk=8", lines[0]
    assert lines[1].startswith("  backend: cpu") and lines[2].startswith("  compilation cache: ")
    block = "\n".join(lines[:12])
    for needle in ("  model: config ", "random weights (seed 0): output is noise", "  weights: random init",
                   "  mesh: ", "  dtype: parameters float32", "  layers: ", "  experts: dense",
                   "  kernels (cpu): mhc=xla_cpu (auto), kda=xla_cpu (auto), sparse_mla=gather (auto), moe=xla_cpu (auto)"):  # fmt: skip
        assert needle in block, (needle, block)
    assert sorted(os.listdir(tmp_path)) == ["runs", "t.json"]  # nothing else in the current folder
    (folder,) = glob.glob(str(tmp_path / "runs" / "score" / "*"))
    assert sorted(os.listdir(folder)) == ["scores.npz", "scores.run.json"]
    for name in os.listdir(folder):
        assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o644, name
    record = json.loads(open(os.path.join(folder, "scores.run.json")).read())
    assert record["entry"] == "experiments.score" and record["flags"]["config.model.index_topk"] == 8
    assert record["config"]["model"]["index_topk"] == 8 and record["backend"] == "cpu"


def test_interpret_mode_and_gguf_experts_are_named():
    """The model lines of the block for GGUF experts under the TPU kernel on this CPU (built, not run)."""
    from configs import tiny
    from glm53 import build
    from glm53.config import QuantConfig, model_config_from_dict

    cfg = model_config_from_dict(tiny.get_config("gguf").model)
    model = build.random_model(cfg, quant=QuantConfig(experts="q4_k"), kernels={"moe": "pallas_tpu"})
    block = build.describe_model(model, config_name="tiny:gguf", seed=0)
    assert "  experts: GGUF blocks, Q4_K (planes layout), decoded inside the expert kernel" in block, block
    assert "moe=pallas_tpu (interpret mode)" in block and "mhc=xla_cpu (auto)" in block, block
    assert "  mesh: one cpu device, unsharded" in block


def test_the_compilation_cache_is_warm_the_second_time(tmp_path):
    cache = tmp_path / "cache"
    args = ("experiments.generate", "--config=tiny", "--prompt_ids=1,2", "--max_new=1",
            f"--compilation_cache={cache}")  # fmt: skip
    first = _run(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"compilation cache: {cache} (empty" in first.stdout
    n = len(os.listdir(cache))
    assert n > 0
    second = _run(*args, cwd=tmp_path)
    assert second.returncode == 0 and f"compilation cache: {cache} ({n} entries" in second.stdout
    assert len(os.listdir(cache)) == n  # every program was found in the cache: nothing new compiled
