"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""

import faulthandler
import os
import shutil
import sys
import tempfile

import pytest

# XLA:CPU's YNNPACK fusions off for every program the run compiles (its workers and the entry points it starts
# inherit XLA_FLAGS): in jaxlib 0.10.2 they crash or hang now and then on some fused broadcast-multiply-reduces
# (jax-ml/jax#39257, fixed in XNNPACK after that release). A CI run lost a worker to a SIGSEGV and then stalled
# until its time ran out; another run of the same commit passed. The fusions are a speed choice (the serving
# prefill takes them: glm53.runtime.programs); results are the same with them off, which is what the suite checks.
_OURS = ("--xla_force_host_platform_device_count=8", "--xla_cpu_experimental_ynn_fusion_type=")
os.environ["XLA_FLAGS"] = " ".join(  # each once: an inherited value of either flag is replaced
    [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in {o.split("=")[0] for o in _OURS}]
    + list(_OURS)
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache per test run, shared by the xdist workers and by the entry points the tests
# start as subprocesses (both inherit this environment from the process that loads this file first): identical
# programs, such as a tiny config's init, prefill and decode, compile once per run instead of once per process.
# Results are unchanged (an entry is keyed by the program and the compile options); the directory is removed at
# the end of the run. A JAX_COMPILATION_CACHE_DIR set by the caller is used as is and kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="glm53-tests-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.pop("GLM53_COMPILATION_CACHE", None)  # the entry points' own default would win over the one above
# Outputs an entry point writes without --out go to a run folder under $GLM53_RUNS (docs/workbench.md): this run's
# own, removed at the end, never the user's ~/glm53_runs.
_OWN_RUNS = os.environ["GLM53_RUNS"] = tempfile.mkdtemp(prefix="glm53-tests-runs-")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The longest test files first. The README runs the suite with pytest-xdist, one file per worker at a time
# (--dist loadfile) in collection order (--no-loadscope-reorder: xdist otherwise reorders the files by their
# number of tests); a worker is handed the next file when it is nearly done with its own, so starting the
# longest files first keeps one long file from running alone at the end (longest-first scheduling). The order of
# the other files, and every test's result, is unchanged. Measured per file in CI's `--durations` output;
# update when a file grows.
LONGEST_FIRST = (
    "test_multihost.py",  # 2-process launches (score, convert, worker) + their 1-process references
    "test_multihost_serve.py",  # experiments.serve under the launcher + its 1-process reference
    "test_model.py",
    "test_generation.py",
    "test_moe_quant.py",
    "test_entry_points.py",
    "test_sharding.py",
    "test_scan.py",  # scanned == unrolled: forward, prefill in pieces, sharded, Pallas experts in place
    "test_export.py",
    "test_scan_train.py",
    "test_gguf_model.py",
    "test_bench_peer.py",
    "test_compile_tpu.py",
    "test_convert.py",
    "test_defaults.py",
    "test_kda.py",
    "test_moe_pallas.py",
    "test_moe_pallas_gpu.py",
    "test_entry_points_errors.py",
    "test_tpu_compile.py",
    "test_train_sharded.py",
    "test_train_kill.py",
    "test_train_step.py",
    "test_serving_server.py",
    "test_serving_fuzz.py",  # >= 2,000 requests (schemathesis + hypothesis + raw HTTP)
    "test_scan_serving.py",
    "test_scan_checkpoints.py",
    "test_serving_engine.py",
    "test_serving_spec.py",
    "test_serving_prefix.py",
    "test_serving_constrain.py",
    "test_ablate.py",
    "test_imatrix.py",
    "test_dsa.py",
    "test_moe.py",
    "test_bench_model.py",
    "test_qweight.py",
    "test_checkpoint_hf.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file-internal order kept


# A hard limit per test (setup, call and teardown), past pyproject.toml's pytest-timeout (900 s): pytest-timeout's
# thread needs the GIL, so a test stuck inside compiled code that holds it (a deadlock in a C extension) would stall
# the whole run silently. faulthandler's watchdog is a C thread: it writes every thread's Python stack to the
# worker's own stderr and ends the worker, which xdist reports as a crash of that test, then the run goes on.
HARD_TIMEOUT_S = float(os.environ.get("GLM53_TEST_HARD_TIMEOUT_S", "1200"))
_STDERR_FD = None


def pytest_configure(config):
    global _STDERR_FD
    _STDERR_FD = os.dup(2)  # the real stderr: tests run with fd 2 captured, and what goes there is lost on exit
    if config.pluginmanager.hasplugin("xdist"):  # a dead worker: no deadlock, one rerun, its stacks at the end
        from tests import xdist_crashes

        config.pluginmanager.register(xdist_crashes, "glm53-xdist-crashes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from tests import xdist_crashes

    fd = xdist_crashes.worker_fd()  # a worker's dump file: the controller prints it when the worker dies
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True, file=_STDERR_FD if fd is None else fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_unconfigure(config):
    shutil.rmtree(_OWN_RUNS, ignore_errors=True)
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
