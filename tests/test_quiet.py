"""Quiet by default (glm53/logs.py): third-party chatter only when --verbosity asks for it.

* the decision: absl's --verbosity given and >= 0 (on the command line of the run, or of the command the launcher
  starts); library use is quiet;
* native stderr held back around a step (libtpu's start-up messages) and replayed when the step fails;
* ``python -m experiments.launch`` over gloo (2 processes of 1 CPU device, one all-gather): no ``[Gloo]`` lines
  by default, and they do appear with ``--verbosity=0`` in the command (so the first check is not vacuous).

llama.cpp's load logs: tests/test_ablate.py (a GGUF of the tiny model loaded by `glm53.ablation.llama`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from experiments import launch
from glm53 import logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = """
import sys
sys.path.insert(0, {root!r})
from absl import app, flags
from glm53.parallel import distributed
flags.DEFINE_string("coordinator", None, "")
flags.DEFINE_integer("num_processes", None, "")
flags.DEFINE_integer("process_id", None, "")


def main(argv):
    F = flags.FLAGS
    distributed.initialize(F.coordinator, F.num_processes, F.process_id)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    print("gathered", multihost_utils.process_allgather(jnp.ones(2)).shape, flush=True)


app.run(main)
"""


def test_verbosity_decision():
    assert not logs.verbose()  # pytest parses no absl flags: library use is quiet
    assert logs.verbosity_in_args(["python", "-m", "experiments.score", "--verbosity=0"])
    assert logs.verbosity_in_args(["x", "--verbosity", "1"]) and logs.verbosity_in_args(["x", "-v", "0"])
    assert not logs.verbosity_in_args(["x", "--verbosity=-1"]) and not logs.verbosity_in_args(["x"])
    assert launch.quiet_gloo(["python", "-m", "experiments.score"])
    assert not launch.quiet_gloo(["python", "-m", "experiments.score", "--verbosity=0"])
    assert logs.GLOO_LINE.match(b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
                                b"ranks is : 1\n")  # fmt: skip
    assert not logs.GLOO_LINE.match(b"step 1/8 loss 8.1 [Gloo] Rank 1 is connected to 1 peer ranks\n")


def test_native_stderr_held_back_and_replayed_on_failure(capfd):
    with logs.native_stderr_quiet():
        os.write(2, b"libtpu: Failed to find host bounds\n")
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError), logs.native_stderr_quiet():
        os.write(2, b"context of the failure\n")
        raise RuntimeError("boom")
    assert capfd.readouterr().err == "context of the failure\n"
    with logs.native_stderr_quiet(quiet=False):
        os.write(2, b"verbose\n")
    assert capfd.readouterr().err == "verbose\n"


def test_libtpu_env_defaults(monkeypatch):
    monkeypatch.delenv("TPU_STDERR_LOG_LEVEL", raising=False)
    logs.libtpu_env_defaults()
    assert os.environ["TPU_STDERR_LOG_LEVEL"] == logs.TPU_STDERR_QUIET
    monkeypatch.setenv("TPU_STDERR_LOG_LEVEL", "0")  # the user's setting wins
    logs.libtpu_env_defaults()
    assert os.environ["TPU_STDERR_LOG_LEVEL"] == "0"


def _launch(script, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1", "--timeout=300",
           "--", sys.executable, str(script), *extra]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("gathered (2, 2)") == 2, out.stdout
    return out


def test_launch_drops_gloo_lines_unless_verbose(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=ROOT))
    quiet = _launch(script)
    assert "[Gloo]" not in quiet.stdout + quiet.stderr
    verbose = _launch(script, "--verbosity=0")
    assert "[Gloo] Rank" in verbose.stdout  # gloo prints them (stdout); the launcher passes them on when asked


def test_quiet_third_party_sets_only_unset_defaults(monkeypatch):
    monkeypatch.delenv("TPU_STDERR_LOG_LEVEL", raising=False)
    logs.quiet_third_party()
    assert os.environ["TPU_STDERR_LOG_LEVEL"] == logs.TPU_STDERR_QUIET
