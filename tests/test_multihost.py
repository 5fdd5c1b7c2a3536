"""Several JAX processes as one system (`glm53.parallel.distributed`, `experiments.launch`): 2 processes of 4
virtual CPU devices each (one 8-device mesh) against this one process (the unsharded model, or 8 devices).

* `experiments.score` under the launcher on a GGUF whose routed experts are Q4_K, kept quantized, expert
  parallel over a (1, 8) mesh (the model axis across both processes: each process packs the planes of its own
  experts): the logits of process 0's npz equal the GGUF's unsharded model's here; the entry point's flags and
  its process-0-only output.
* `experiments.convert` under the launcher writes the checkpoint one process writes (same sidecar, every
  tensor's CRC-32); it restores here on a (2, 4) expert-parallel mesh, every parameter bit-identical.
* Sliced reads (the worker, with every tensor read recorded): the HF folder and the Q4_K GGUF loaded on the
  (1, 8) expert-parallel mesh by 2 processes; each process reads exactly its half of every expert stack (and
  of the embedding / lm_head), no byte twice, and places blocks equal to those of a whole-tensor load here; an
  Orbax checkpoint with Q4_K planes restores across the processes with the same blocks.
* tests/multihost_worker.py under the launcher: that checkpoint restored by both processes on a (1, 8)
  tensor-parallel mesh scores as the unsharded model does here; STEPS training steps on a (2, 4) "data" x "model"
  mesh (data parallel across processes, tensor parallel inside) give this process's losses and state; the
  Orbax checkpoint of the trained state, written by both processes, restores here on a (4, 2) mesh with every
  leaf bit-identical to what the processes held.
* The serving engine under the launcher (`glm53.serving.multihost`: process 0 leads, process 1 replays its
  program calls) on that checkpoint: greedy and sampled requests give the tokens of the same engine here.
* The launcher's failure handling: a process that fails or is killed stops the others (none left behind) and
  the launcher's status is non-zero; the distributed flags' bad input; one process is unchanged.
"""

from __future__ import annotations

import json
import os
import re
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
from glm53.checkpoint import gguf_export
from glm53.checkpoint import orbax as orbax_ckpt
from glm53.checkpoint.convert import convert
from glm53.checkpoint.hf_export import export_hf
from glm53.config import QuantConfig
from glm53.errors import ConfigError
from glm53.io.gguf import open_gguf
from glm53.io.safetensors import SafetensorsFile
from glm53.parallel import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The EP run of a GGUF whose routed experts are Q4_K, kept quantized: mesh and quant sections only (the model's
# shape comes from the weights).
EP_GGUF_CONFIG = textwrap.dedent("""
    from configs import tiny


    def get_config():
        c = tiny.get_config("sharded")
        c.model = None
        c.mesh.shape, c.mesh.rules, c.quant.experts = (1, 8), "ep", "q4_k"
        return c
""")
PROCESS_TIMEOUT = 600  # a bound on a launch, not a timing assertion


# The launched model runs compile at XLA's backend optimization level 0 (as the serving tests' engines and the
# train steps' fast_compile do): shorter compiles; the programs, and so what is compared, are the same.
FAST_ENV = {**os.environ,
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()}  # fmt: skip


def _launch(*command: str, processes: int = 2, devices: int = 4, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.launch", f"--processes={processes}", f"--devices_per_process={devices}",
           "--", *command]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, **kw)


def _launch_fast(*command: str) -> subprocess.CompletedProcess:
    """`_launch` (2 processes x 4 devices) of a command that compiles model programs, at optimization level 0."""
    return _launch(*command, env=FAST_ENV)


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, f"status {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def _close(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=what)


# ------------------------------------------------------------------------------------------------ entry point
@pytest.fixture(scope="module")
def ep_gguf(tmp_path_factory):
    """(GGUF, config file, checkpoint): the tiny sharded model at hidden size and expert width 256 (whole Q4_K
    blocks), its seeded random weights written with Q4_K routed experts; the config of its expert-parallel run;
    its glm53 checkpoint converted here from its HF folder and that GGUF (the experts as the GGUF's Q4_K planes)."""
    d = tmp_path_factory.mktemp("ep_gguf")
    c = tiny.get_config("sharded")
    c.model.hidden_size, c.model.moe_intermediate_size = 256, 256
    cfg, model = build.model_from_experiment_config(c)
    gguf_export.write_gguf(d / "ep.gguf", cfg, gguf_export.model_params(model), experts="Q4_K")
    (d / "ep_gguf.py").write_text(EP_GGUF_CONFIG)
    export_hf(model, cfg, d / "hf", dtype="float32")
    convert(str(d / "hf"), str(d / "qckpt"), gguf=[str(d / "ep.gguf")], dtype="float32", progress=False)
    return str(d / "ep.gguf"), str(d / "ep_gguf.py"), str(d / "qckpt")


@pytest.fixture(scope="module")
def ep_score(tmp_path_factory, ep_gguf):
    d = tmp_path_factory.mktemp("ep_score")
    (d / "tokens.json").write_text(json.dumps(W.SEQS))
    out = _ok(_launch_fast(sys.executable, "-m", "experiments.score", f"--config={ep_gguf[1]}", f"--weights={ep_gguf[0]}",
                      "--mtp=off", f"--tokens={d / 'tokens.json'}", f"--out={d / 'scores.npz'}"))  # fmt: skip
    return out, np.load(d / "scores.npz")


def _gguf_q4k(path: str):
    """The GGUF loaded here, unsharded, routed experts kept quantized (whole-tensor reads)."""
    _, model = build.load_model(path, quant=QuantConfig(experts="q4_k"), with_mtp=False)
    assert model.layers[3].mlp.experts.down_proj.get_value().format_name == "Q4_K"  # the quantized path
    return model


def test_score_entry_point_two_processes_ep_gguf_quantized_equals_one_process(ep_score, ep_gguf):
    out, got = ep_score
    # process 0 alone writes and reports; both processes built the model on one 8-device mesh, the routed
    # experts' Q4_K planes read from the GGUF by each process for its own devices' experts
    assert out.stdout.count("wrote ") == 1 and "[0] wrote " in out.stdout
    assert out.stdout.count("mesh: {'data': 1, 'model': 8} over 8 cpu device(s), rules ep") == 2
    logits, nll = scoring.score(_gguf_q4k(ep_gguf[0]), W.SEQS)
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
                      "--dtype=float32"))  # fmt: skip
    return dict(one=one, two=str(d / "two"), model=model, stdout=out.stdout, hf=str(d / "hf"))


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
def worker(tmp_path_factory, converted, ep_gguf):
    d = tmp_path_factory.mktemp("worker")
    _ok(_launch_fast(sys.executable, "tests/multihost_worker.py", f"--ckpt={converted['two']}", f"--out={d}",
                f"--hf={converted['hf']}", f"--gguf={ep_gguf[0]}", f"--qckpt={ep_gguf[2]}"))  # fmt: skip
    return d, np.load(d / "results.npz"), json.loads((d / "devices.json").read_text())


def test_worker_saw_one_system_of_two_processes(worker):
    assert worker[2] == {"processes": 2, "devices": 8, "local_devices": 4}


def test_tp_logits_two_processes_equal_one_process(worker, converted):
    _, got, _ = worker
    logits, _ = scoring.score(converted["model"], W.SEQS)  # the converted weights, unsharded
    for i, want in enumerate(logits):
        _close(got[f"logits_{i}"], want, f"sequence {i}")


def test_serving_engine_two_processes_equals_one_process(worker, converted):
    """The engine under 2 processes (process 0 leads, process 1 replays its program calls): the tokens of greedy
    and sampled requests equal those of the same engine over the same checkpoint in one process."""
    got = json.loads((worker[0] / "serve.json").read_text())
    assert got == W.serve_tokens(W.tp_run(converted["one"]))
    assert [len(t) for t in got] == [r.max_tokens for r in W.serve_requests()]  # no EOS stop: every token


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


# ------------------------------------------------------------------------------------------------ sliced reads
def _runs(reads, file: str, tensor: str = "") -> list[tuple[int, int]]:
    return sorted((off, off + n) for f, t, off, n in reads if f == file and t == tensor)


def test_each_process_reads_only_its_own_blocks(worker, converted, ep_gguf):
    """HF folder and GGUF loaded on the expert-parallel (1, 8) mesh by 2 processes (the "model" axis across
    both): process p reads exactly the routed experts [4p, 4p + 4) of every expert stack (the HF per-expert
    tensors of those experts whole, the others not at all; the GGUF stack's byte range of those experts), exactly its half of the vocabulary-split embedding and lm_head, no byte twice, and the two processes
    together every byte of every tensor the model uses."""
    d = worker[0]
    reads = [json.loads((d / f"reads{p}.json").read_text()) for p in range(2)]
    hf_file = SafetensorsFile(os.path.join(converted["hf"], "model.safetensors"))
    experts, n = 0, W.score_config(W.TP_MESH).model.n_routed_experts
    for key in hf_file.keys():
        _, _, begin, end = hf_file.tensors[key]
        runs = [[(a - begin, b - begin) for a, b in _runs(r, "model.safetensors", key)] for r in reads]
        for p in range(2):
            assert _total(runs[p]) == _total(_union(runs[p])), f"{key}: a byte read twice by {p}"
        assert _union(runs[0] + runs[1]) == [(0, end - begin)], f"{key}: not read whole by the two together"
        m = re.search(r"\.experts\.(\d+)\.", key)
        if m:
            experts += 1
            owner = int(m[1]) // (n // 2)
            assert runs[owner] == [(0, end - begin)] and runs[1 - owner] == [], key
        if key.endswith(("embed_tokens.weight", "lm_head.weight")):
            half = (end - begin) // 2
            assert [_union(r) for r in runs] == [[(0, half)], [(half, end - begin)]], key
    assert experts == 2 * 3 * n  # 2 MoE layers
    with open_gguf(ep_gguf[0]) as g:
        name = os.path.basename(ep_gguf[0])
        stacks = 0
        for t in g.tensors.values():
            if t.name.startswith(f"blk.{W.score_config(W.TP_MESH).model.num_hidden_layers}."):
                continue  # the MTP block: loaded without it
            runs = [[(a - t.offset, b - t.offset) for a, b in _runs(r, name) if t.offset <= a < t.offset + t.nbytes]
                    for r in reads]  # fmt: skip
            for p in range(2):
                assert _total(runs[p]) == _total(_union(runs[p])), f"{t.name}: a byte read twice by {p}"
            assert _union(runs[0] + runs[1]) == [(0, t.nbytes)], (
                f"{t.name}: not read whole by the two together"
            )
            if "_exps." in t.name or t.name in ("token_embd.weight", "output.weight"):
                stacks += "_exps." in t.name
                assert [_union(r) for r in runs] == [[(0, t.nbytes // 2)], [(t.nbytes // 2, t.nbytes)]], (
                    t.name
                )
    assert stacks == 2 * 3


def _total(runs) -> int:
    return sum(b - a for a, b in runs)


def _union(runs) -> list[tuple[int, int]]:
    out = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def test_sliced_loads_equal_whole_tensor_reads(worker, converted, ep_gguf):
    """Every block each process placed (HF and GGUF, Q4_K planes included) equals that block of the parameter
    read whole in one process, and the two processes' blocks cover every parameter; so does every block of the
    checkpoint with Q4_K planes restored by both (the GGUF's planes and the same non-expert weights)."""
    d = worker[0]
    _, hf = build.load_model(converted["hf"], with_mtp=False)
    gguf = _leaves(_gguf_q4k(ep_gguf[0]))
    whole = {"hf": _leaves(hf), "gguf": gguf, "orbax": gguf}
    covered = {k: {leaf: 0 for leaf in v} for k, v in whole.items()}
    for p in range(2):
        for key, block in np.load(d / f"shards{p}.npz").items():
            which, leaf, box = key.split("|")
            index = tuple(slice(*map(int, b.split(":"))) for b in box.split(","))
            np.testing.assert_array_equal(block, whole[which][leaf][index], err_msg=key)
            covered[which][leaf] += block.size
    for which, leaves in whole.items():  # EP on (1, 8): a leaf is split over the 8 devices or replicated
        for leaf, x in leaves.items():
            assert covered[which][leaf] % x.size == 0 and covered[which][leaf] > 0, (which, leaf)


def _leaves(model) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}  # fmt: skip


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
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"[{i}] devices "))
        assert line.split()[2:].count("--xla_force_host_platform_device_count=2") == 1, line
        assert "--xla_force_host_platform_device_count=8" not in line
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


SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    flag = dict(a.split("=", 1) for a in sys.argv if a.startswith("--") and "=" in a)
    i, d, release = int(flag["--process_id"]), sys.argv[1], sys.argv[2] == "release"

    def on_signal(signum, frame):  # process 0 stands for a server: it releases the others and exits 0
        with open(os.path.join(d, f"got{i}"), "w") as f:
            f.write(str(signum))
        if i == 0 and release:
            open(os.path.join(d, "released"), "w").close()
        sys.exit(0 if i == 0 else 5)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with open(os.path.join(d, f".pid{i}"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, f".pid{i}"), os.path.join(d, f"pid{i}"))
    while not (i > 0 and os.path.exists(os.path.join(d, "released"))):
        time.sleep(0.02)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("how,status", [("release", 0), ("stuck", 5)])
def test_launcher_passes_a_signal_to_process_0(tmp_path, sig, how, status):
    """SIGTERM / SIGINT to the launcher go to process 0 alone; the launcher exits 0 when every process then exits
    0 (process 0 released the others), else with the status of the one stopped after --grace seconds."""
    script = tmp_path / "on_signal.py"  # not signal.py: it would shadow the module
    script.write_text(SIGNAL_SCRIPT)
    cmd = [sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1", "--grace=1", "--",
           sys.executable, str(script), str(tmp_path), how]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = [tmp_path / f"pid{i}" for i in range(2)]
        _wait_for(lambda: all(p.exists() for p in started), "the processes did not start")
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == status, err
    assert f"launch: {sig.name}: passed to process 0" in err
    assert (tmp_path / "got0").read_text() == str(int(sig))
    # released: process 1 exited by itself; stuck: the launcher stopped it with SIGTERM after the grace
    got1 = tmp_path / "got1"
    assert (not got1.exists()) if how == "release" else got1.read_text() == str(int(signal.SIGTERM))
    for i in range(2):
        assert not _alive(int((tmp_path / f"pid{i}").read_text()))
