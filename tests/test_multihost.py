"""Several JAX processes as one system (`glm53.parallel.distributed`, `experiments.launch`): 2 processes of 4
virtual CPU devices each (one 8-device mesh) against this one process (the unsharded model, or 8 devices).

* `experiments.score` under the launcher, expert parallel over a (1, 8) mesh with the routed experts kept
  quantized (Q4_K planes, the model axis across both processes): the logits of process 0's npz equal the
  unsharded model's; the entry point's flags and its process-0-only output.
* `experiments.convert` under the launcher writes the checkpoint one process writes (same sidecar, every
  tensor's CRC-32); it restores here on a (2, 4) expert-parallel mesh, every parameter bit-identical.
* tests/multihost_worker.py under the launcher: that checkpoint restored by both processes on a (1, 8)
  tensor-parallel mesh scores as the unsharded model does here; STEPS training steps on a (2, 4) "data" x "model"
  mesh (data parallel across processes, tensor parallel inside) give this process's losses and state; the
  Orbax checkpoint of the trained state, written by both processes, restores here on a (4, 2) mesh with every
  leaf bit-identical to what the processes held.
* The launcher's failure handling: a process that fails or is killed stops the others (none left behind) and
  the launcher's status is non-zero; the distributed flags' bad input; one process is unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import multihost_worker as W
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from experiments import launch
from glm53 import build, scoring
from glm53 import parallel as S
from glm53.checkpoint import orbax as orbax_ckpt
from glm53.checkpoint.convert import convert
from glm53.checkpoint.hf_export import export_hf
from glm53.errors import ConfigError
from glm53.parallel import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EP_Q4K = ["--config=configs/tiny.py:sharded", "--config.mesh.shape=(1,8)", "--config.mesh.rules=ep",
          "--config.model.hidden_size=256", "--config.model.moe_intermediate_size=256", "--config.quant.experts=q4_k", "--mtp=off"]  # fmt: skip
PROCESS_TIMEOUT = 600  # a bound on a launch, not a timing assertion


def _launch(*command: str, processes: int = 2, devices: int = 4, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.launch", f"--processes={processes}", f"--devices_per_process={devices}",
           "--", *command]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, **kw)


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, f"status {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def _close(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=what)


# ------------------------------------------------------------------------------------------------ entry point
@pytest.fixture(scope="module")
def ep_score(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep_score")
    (d / "tokens.json").write_text(json.dumps(W.SEQS))
    out = _ok(_launch(sys.executable, "-m", "experiments.score", *EP_Q4K, f"--tokens={d / 'tokens.json'}",
                      f"--out={d / 'scores.npz'}"))  # fmt: skip
    return out, np.load(d / "scores.npz")


def test_score_entry_point_two_processes_ep_quantized_equals_one_process(ep_score):
    out, got = ep_score
    # process 0 alone writes and reports; both processes built the model on one 8-device mesh
    assert out.stdout.count("wrote ") == 1 and "[0] wrote " in out.stdout
    assert out.stdout.count("mesh {'data': 1, 'model': 8}, rules ep") == 2
    c = tiny.get_config("sharded")
    c.mesh.shape, c.mesh.rules = (1, 8), "ep"
    c.model.hidden_size, c.model.moe_intermediate_size, c.quant.experts = 256, 256, "q4_k"
    _, model = build.model_from_experiment_config(c)  # the same seeded weights, unsharded (MTP built last)
    assert model.layers[3].mlp.experts.down_proj.get_value().format_name == "Q4_K"  # the quantized path
    logits, nll = scoring.score(model, W.SEQS)
    for i, want in enumerate(logits):
        _close(got[f"logits_{i}"], want, f"sequence {i}")
    np.testing.assert_allclose(got["nll"], nll, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ convert
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny sharded model's seeded random weights as an HF folder, converted by one process (here) and by
    `experiments.convert` under the launcher."""
    d = tmp_path_factory.mktemp("convert")
    cfg, model = build.model_from_experiment_config(W.score_config(W.TP_MESH))
    export_hf(model, cfg, d / "hf", dtype="float32")
    one = convert(str(d / "hf"), str(d / "one"), dtype="float32", progress=False)
    out = _ok(_launch(sys.executable, "-m", "experiments.convert", f"--hf={d / 'hf'}", f"--out={d / 'two'}",
                      "--dtype=f32"))  # fmt: skip
    return dict(one=one, two=str(d / "two"), model=model, stdout=out.stdout)


def test_convert_two_processes_equals_one_process(converted):
    assert converted["stdout"].count(" units, ") == 1  # process 0 reports
    one, two = orbax_ckpt.read_metadata(converted["one"]), orbax_ckpt.read_metadata(converted["two"])
    assert two["manifest"] == one["manifest"]  # every tensor, with the CRC-32 of its bytes
    assert {k: v for k, v in two.items() if k != "sources"} == {
        k: v for k, v in one.items() if k != "sources"
    }


def test_checkpoint_of_two_processes_restores_in_one_on_another_mesh(converted):
    mesh = S.make_mesh(S.MeshConfig(shape=(2, 4), rules="ep"))
    restored = orbax_ckpt.restore_model(converted["two"], mesh, "ep")  # every leaf's CRC-32 checked
    want = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(converted["model"], nnx.Param))}
    got = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(restored, nnx.Param))}
    assert set(got) == set(want)
    split = 0
    for p, x in got.items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[p]), err_msg=str(p))
        split += x.sharding.mesh.shape == mesh.shape and not x.sharding.is_fully_replicated
    assert split > 10


# ------------------------------------------------------------------------------------------------ worker
@pytest.fixture(scope="module")
def worker(tmp_path_factory, converted):
    d = tmp_path_factory.mktemp("worker")
    _ok(_launch(sys.executable, "tests/multihost_worker.py", f"--ckpt={converted['two']}", f"--out={d}"))
    return d, np.load(d / "results.npz"), json.loads((d / "devices.json").read_text())


def test_worker_saw_one_system_of_two_processes(worker):
    assert worker[2] == {"processes": 2, "devices": 8, "local_devices": 4}


def test_tp_logits_two_processes_equal_one_process(worker, converted):
    _, got, _ = worker
    logits, _ = scoring.score(converted["model"], W.SEQS)  # the converted weights, unsharded
    for i, want in enumerate(logits):
        _close(got[f"logits_{i}"], want, f"sequence {i}")


@pytest.fixture(scope="module")
def trained_here():
    return W.train(W.TRAIN_MESH)


def test_training_losses_two_processes_equal_one_process(worker, trained_here):
    _, got, _ = worker
    state, losses = trained_here
    assert len(losses) == W.STEPS and len(set(losses)) == W.STEPS  # the steps change the model
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    for k, x in W.state_leaves(state).items():
        want = np.asarray(x)
        # the optimizer state's smallest entries (~1e-7) carry the summation order's noise of the gradient
        np.testing.assert_allclose(got[f"state_{k}"], want, rtol=1e-4, atol=1e-4 * max(np.abs(want).max(), 1e-30),
                                   err_msg=f"state leaf {k}")  # fmt: skip


def test_orbax_checkpoint_of_two_processes_restores_in_one_on_another_mesh(worker):
    d, got, _ = worker
    mesh, like, _, _ = W.train_setup(dict(axes=("data", "model"), shape=(4, 2), rules="tp"))
    restored = W.restore_state(str(d / "state"), like)
    assert set(restored) == set(W.state_leaves(like))
    split = 0
    for k, x in restored.items():
        assert x.sharding == W.state_leaves(like)[k].sharding  # resharded onto the (4, 2) mesh on restore
        split += not x.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(x), got[f"state_{k}"], err_msg=f"state leaf {k}")
    assert dict(mesh.shape) == {"data": 4, "model": 2} and split > 10


# ------------------------------------------------------------------------------------------------ launcher
FAIL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    flag = dict(a.split("=", 1) for a in sys.argv if a.startswith("--") and "=" in a)
    i, n, d = int(flag["--process_id"]), int(flag["--num_processes"]), sys.argv[1]
    print(f"devices {os.environ['XLA_FLAGS']}", flush=True)
    with open(os.path.join(d, f".pid{i}"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, f".pid{i}"), os.path.join(d, f"pid{i}"))
    if i == 1 and sys.argv[2] != "sleep":
        while not all(os.path.exists(os.path.join(d, f"pid{j}")) for j in range(n)):
            time.sleep(0.05)
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)
    time.sleep(3600)  # the others would wait forever: the launcher must stop them
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("how,status", [("exit", 3), ("kill", 128 + signal.SIGKILL)])
def test_launcher_stops_every_process_when_one_fails(tmp_path, how, status):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_SCRIPT)
    out = _launch(sys.executable, str(script), str(tmp_path), how, processes=3, devices=2)
    assert out.returncode == status, out.stderr
    assert f"launch: process 1 exited with status {status}" in out.stderr
    for i in range(3):  # every process started, got its own device count and a prefix, and is gone now
        assert f"[{i}] devices --xla_force_host_platform_device_count=2" in out.stdout
        assert not _alive(int((tmp_path / f"pid{i}").read_text()))


def _wait_for(predicate, what: str, bound: float = 60.0) -> None:
    deadline = time.monotonic() + bound  # a bound on a hang, not a timing assertion
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_no_process_outlives_a_killed_launcher(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(FAIL_SCRIPT)
    cmd = [sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1", "--",
           sys.executable, str(script), str(tmp_path), "sleep"]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = [tmp_path / f"pid{i}" for i in range(2)]
    _wait_for(lambda: all(p.exists() for p in pids), "the processes did not start")
    children = [int(p.read_text()) for p in pids]
    assert all(_alive(c) for c in children)
    launcher.kill()  # SIGKILL: no chance to stop anything itself
    launcher.wait()
    try:
        _wait_for(lambda: not any(_alive(c) for c in children), "a process outlived the launcher")
    finally:
        for c in filter(_alive, children):  # after a failure: leave nothing behind
            os.kill(c, signal.SIGKILL)


def test_launcher_environment_and_command():
    env = launch.process_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}, 4)
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert launch.process_env({"A": "1"}, None) == {"A": "1"}
    assert launch.process_command(["python", "-m", "m"], "127.0.0.1:5", 2, 1) == [
        "python", "-m", "m", "--coordinator=127.0.0.1:5", "--num_processes=2", "--process_id=1"]  # fmt: skip
    assert launch.exit_status(-9) == 137 and launch.exit_status(2) == 2


@pytest.mark.parametrize("args,match", [
    ((None, 2, None), "--num_processes without --coordinator"),
    (("localhost", 2, 0), "expected HOST:PORT"),
    (("localhost:1234", None, 0), "needs --num_processes=N and --process_id=I"),
    (("localhost:1234", 2, 2), r"--process_id=2: must be in \[0, 2\)"),
])  # fmt: skip
def test_distributed_flags_bad_input(args, match):
    with pytest.raises(ConfigError, match=match):
        distributed.check_args(*args)


def test_entry_point_distributed_flags_usage_error(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "experiments.score", "--process_id=1", f"--tokens={tmp_path / 't.json'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == "usage error: --process_id without --coordinator=HOST:PORT (or --coordinator=auto)"
    )


def test_one_process_is_unchanged(monkeypatch):
    for var in distributed.CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() is False  # no flags, no cluster: nothing to join
    assert distributed.is_main_process() and distributed.process_count() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert distributed.detected_cluster() is None  # not under mpirun
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1:34911")
    assert distributed.detected_cluster() == "Open MPI"
    x = np.arange(24.0).reshape(3, 8)
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    np.testing.assert_array_equal(distributed.to_host(distributed.put(x, s)), x)
