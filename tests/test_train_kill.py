"""A training run killed with SIGKILL while an (async) Orbax save is in flight: the half-written checkpoint is
never taken as the latest, and running the command again resumes from the previous complete checkpoint and
reproduces the killed run's loss of the next step.

The run saves every step; the test polls its checkpoints folder, freezes the process (SIGSTOP) the moment a
temporary (in-flight) checkpoint folder is there, and kills it (SIGKILL) only if that folder is still there
while it is frozen (else it lets it go on and waits for the next save)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from configs import train as train_configs
from glm53.data.prepare import data_config_from_dict, prepare_data

pytestmark = (
    pytest.mark.slow
)  # two runs of the train step in subprocesses (the second reuses the compile cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = """
from configs import train


def get_config():
    c = train.get_config("tiny")
    c.data.root, c.data.vocab_size, c.data.max_files, c.data.fractions = {root!r}, 300, 0, [0.7, 0.15, 0.15]
    c.model.vocab_size = {vocab}
    c.model.num_hidden_layers = 2
    c.model.layer_types, c.model.mlp_layer_types, c.model.indexer_types = ["kda", "dsa"], ["dense", "moe"], ["full"] * 2
    c.optim.total_steps, c.optim.warmup_steps = 10000, 2
    c.save_every, c.keep, c.eval_every, c.log_every = 1, 2, 10000, 1
    c.mesh.shape = (1, 1)
    return c
"""


def _source(i: int) -> str:
    return f"def f_{i}(x):\n    return [x, {i}, x * {i % 5}]\n\n\nclass C{i}:\n    value = f_{i}({i})\n" * 3


def _in_flight(ckpt: str) -> list[str]:
    try:
        return [n for n in os.listdir(ckpt) if "tmp" in n]
    except FileNotFoundError:
        return []


def _complete(ckpt: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())


def _train_losses(work) -> dict[int, float]:
    out = {}
    for line in open(os.path.join(work, "metrics.jsonl"), encoding="utf-8"):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by the kill
        if r["kind"] == "train":
            out[r["step"]] = r["loss"]
    return out


def test_sigkill_during_save_resumes_from_the_previous_checkpoint(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(30):
        (root / f"mod_{i}.py").write_text(_source(i))
    work = tmp_path / "work"
    c = train_configs.get_config("tiny")
    c.data.root, c.data.vocab_size, c.data.max_files, c.data.fractions = str(root), 300, 0, [0.7, 0.15, 0.15]
    vocab = prepare_data(data_config_from_dict(c.data), work / "data", log=lambda s: None)["vocab_size"]
    cfg = tmp_path / "kill_config.py"
    cfg.write_text(CONFIG.format(root=str(root), vocab=vocab))
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config={cfg}",
        f"--workdir={work}",
        "--progress=false",
    ]
    ckpt = str(work / "checkpoints")
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed_with = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if _in_flight(ckpt):
                proc.send_signal(signal.SIGSTOP)
                tmp = _in_flight(ckpt)
                if tmp and _complete(ckpt):
                    killed_with = (tmp, _complete(ckpt))
                    proc.kill()
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.002)
    finally:
        if proc.poll() is None and killed_with is None:
            proc.kill()
        proc.wait()
        log.close()
    assert killed_with is not None, (tmp_path / "first.log").read_text()[-3000:]
    assert proc.returncode == -signal.SIGKILL
    tmp, complete = killed_with
    last = complete[-1]
    assert _in_flight(ckpt) == tmp  # the half-written checkpoint is still there ...
    first_losses = _train_losses(work)
    assert max(first_losses) > last

    out = subprocess.run(cmd + [f"--steps={last + 1}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    resumed = re.findall(r"resumed from \S+/(\d+)", out.stdout + out.stderr)
    assert resumed == [str(last)]  # ... but not taken as the latest: the previous complete step is
    assert _train_losses(work)[last + 1] == pytest.approx(first_losses[last + 1], rel=1e-6)
    assert last + 1 in _complete(ckpt)
