"""Run one command as several JAX processes on this machine: the local stand-in for several hosts.

  python -m experiments.launch --processes=2 --devices_per_process=4 -- \\
      python -m experiments.score --config=configs/tiny.py:sharded --config.mesh.shape="(1,8)" --tokens=t.json \\
      --out=s.npz

Starts --processes copies of the command after ``--``, each with ``--coordinator=127.0.0.1:PORT
--num_processes=N --process_id=I`` appended (PORT: a free loopback port, or --port), so that every glm53 entry
point joins one `jax.distributed` system (`glm53.parallel.distributed`); with --devices_per_process, each
process sees that many virtual CPU devices (XLA_FLAGS ``--xla_force_host_platform_device_count``, replacing any
count in the environment, and JAX_PLATFORMS=cpu). Every line a process writes is passed on with the prefix
``[I] `` (stdout to stdout, stderr to stderr), except gloo's ``[Gloo] Rank N is connected to ...`` lines (CPU
collectives), shown only with ``--verbosity=0`` given to the launcher or in the command.

Failure handling: when one process exits non-zero (or is killed), the others are stopped (SIGTERM to each
process group, SIGKILL after --grace seconds) and the launcher exits with that process's status (128 + signal
for a signal); so it does after --timeout seconds (status 124). No process outlives the launcher: on Linux each
process also gets SIGKILL when the launcher itself dies (PR_SET_PDEATHSIG, e.g. a ``kill -9`` of the launcher).
Exit status 0 when every process exits 0.

SIGINT / SIGTERM to the launcher: the signal goes to process 0 alone (a server under several processes stops
serving, then releases the others: `experiments.serve`); process 0 still running --grace seconds later, or
another process --grace seconds after process 0 exited, is stopped as above. The status is 0 when every process
exited 0, else that of the first process that did not (e.g. 143 for one stopped by SIGTERM). A second signal
stops every process at once.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from glm53 import logs

_PROCESSES = flags.DEFINE_integer("processes", 2, "number of processes", lower_bound=1)
_DEVICES = flags.DEFINE_integer(
    "devices_per_process",
    None,
    "virtual CPU devices per process (unset: the platform's devices)",
    lower_bound=1,
)
_PORT = flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0: a free one)", lower_bound=0)
_GRACE = flags.DEFINE_float(
    "grace", 15.0,
    "seconds between SIGTERM and SIGKILL when stopping processes; after SIGINT / SIGTERM, the wait for process 0, "
    "then for the others",
)  # fmt: skip
_TIMEOUT = flags.DEFINE_float("timeout", 0.0, "stop everything after this many seconds (0: no limit)")

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
TIMEOUT_EXIT = 124


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict[str, str], devices_per_process: int | None) -> dict[str, str]:
    """`base` with XLA_FLAGS' device count replaced by `devices_per_process` (None: `base` unchanged)."""
    env = dict(base)
    if devices_per_process is not None:
        xla = re.sub(rf"{DEVICE_COUNT_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*xla, f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def process_command(command: list[str], coordinator: str, n: int, i: int) -> list[str]:
    return [*command, f"--coordinator={coordinator}", f"--num_processes={n}", f"--process_id={i}"]


def _prctl():
    try:
        return ctypes.CDLL(None).prctl if sys.platform == "linux" else None
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up here, not in the forked child


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (Linux prctl PR_SET_PDEATHSIG = 1)."""
    _PRCTL(1, signal.SIGKILL)


def _pump(stream, out, prefix: str, drop=None) -> None:
    """Passes `stream`'s lines to `out` with `prefix`, except those `drop` (a compiled bytes pattern) matches."""
    for line in iter(stream.readline, b""):
        if drop is not None and drop.match(line):
            continue
        out.buffer.write(prefix.encode() + line if line.endswith(b"\n") else prefix.encode() + line + b"\n")
        out.flush()
    stream.close()


def quiet_gloo(command: list[str]) -> bool:
    """Whether the processes' gloo connectivity lines are dropped: unless --verbosity >= 0 is given to the
    launcher or in the command (`glm53.logs`: quiet unless verbose)."""
    return not (logs.verbose() or logs.verbosity_in_args(command))


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it (128 + signal for a signal)."""
    return 128 - returncode if returncode < 0 else returncode


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to the process group of every live process, SIGKILL to those left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # every group, also of processes that exited: a child they left behind dies too
        _signal_group(p, signal.SIGKILL)
    for p in live:
        p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pass_signal(procs: list[subprocess.Popen], signals: list[int], grace: float, poll: float) -> None:
    """The first of `signals` (a growing list) to process 0; waits up to `grace` seconds for it to exit and up
    to `grace` more for the others (a second signal ends the wait); `stop` then ends what is left."""
    sig = signals[0]
    print(f"launch: {signal.Signals(sig).name}: passed to process 0 (up to {grace:g} s for it to exit, then "
          f"{grace:g} s for the others)", file=sys.stderr, flush=True)  # fmt: skip
    _signal_group(procs[0], sig)
    deadline, others = time.monotonic() + grace, None  # for process 0; for the others once it exited
    while len(signals) == 1 and any(p.poll() is None for p in procs):
        if procs[0].poll() is not None and others is None:
            others = time.monotonic() + grace
        if time.monotonic() > (deadline if others is None else others):
            break
        time.sleep(poll)


def launch(command: list[str], processes: int, devices_per_process: int | None = None, *, port: int = 0,
           grace: float = 15.0, timeout: float = 0.0, poll: float = 0.05, quiet: bool | None = None) -> int:  # fmt: skip
    """Runs `command` as `processes` JAX processes (module docstring); returns the exit status. `quiet`: drop
    gloo's connectivity lines (None: `quiet_gloo(command)`)."""
    # On CPU the processes' collectives run over gloo, whose TCP transport prints "[Gloo] Rank N is connected to
    # M peer ranks. ..." with std::cout for every context XLA:CPU creates (several per process), unconditionally:
    # no environment variable or logging level reaches it, so the launcher drops those lines from what it passes on.
    drop = logs.GLOO_LINE if (quiet_gloo(command) if quiet is None else quiet) else None
    coordinator = f"127.0.0.1:{port or free_port()}"
    env = process_env(dict(os.environ), devices_per_process)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    stopping = threading.Event()
    status = {"code": None}
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(processes):
            p = subprocess.Popen(process_command(command, coordinator, processes, i), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=_die_with_parent if _PRCTL is not None else None)  # fmt: skip
            procs.append(p)
        for i, p in enumerate(procs):  # threads only after every fork (preexec_fn runs in the forked child)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] ", drop), daemon=True)
                t.start()
                pumps.append(t)
        start = time.monotonic()
        while not stopping.is_set():
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                print(f"launch: process {i} exited with status {exit_status(c)}; stopping the others",
                      file=sys.stderr, flush=True)  # fmt: skip
                status["code"] = exit_status(c)
                break
            if all(c == 0 for c in codes):
                status["code"] = 0
                break
            if timeout and time.monotonic() - start > timeout:
                print(
                    f"launch: timeout after {timeout:g} s; stopping every process",
                    file=sys.stderr,
                    flush=True,
                )
                status["code"] = TIMEOUT_EXIT
                break
            time.sleep(poll)
        if signals and procs:
            _pass_signal(procs, signals, grace, poll)
    finally:
        stop(procs, grace)
        if signals:  # every process's status is known now
            codes = [p.returncode for p in procs]
            status["code"] = next((exit_status(c) for c in codes if c != 0), 0 if codes else 128 + signals[0])
        for t in pumps:
            t.join(timeout=5.0)
        for s, h in old.items():
            signal.signal(s, h)
    return 1 if status["code"] is None else status["code"]


def main(argv):
    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "usage error: give the command after --, e.g. -- python -m experiments.score ...", file=sys.stderr
        )
        sys.exit(2)
    sys.exit(launch(command, _PROCESSES.value, _DEVICES.value, port=_PORT.value, grace=_GRACE.value,
                    timeout=_TIMEOUT.value))  # fmt: skip


def parse_flags(argv: list[str]) -> list[str]:
    """The launcher's own flags are those before ``--``; everything after it is the command. A launcher flag that
    does not parse, or a command given without ``--``, is one usage-error line (exit 2)."""
    own, sep, command = (argv, [], []) if "--" not in argv else (argv[: argv.index("--")], ["--"], argv[argv.index("--") + 1 :])
    try:
        rest = flags.FLAGS(own)
    except flags.Error as e:
        print(f"usage error: {e}; the command to launch goes after --, e.g. python -m experiments.launch "
              "--processes=2 -- python -m experiments.score ...", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if len(rest) > 1:
        print(f"usage error: {rest[1:]}: the command to launch goes after --, e.g. python -m experiments.launch "
              "--processes=2 -- python -m experiments.score ...", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    return rest + sep + command


if __name__ == "__main__":
    if any(a in ("--help", "-h", "--helpshort", "--helpfull") for a in sys.argv[1 : (sys.argv + ["--"]).index("--")]):
        print(__doc__.strip() + "\n\n" + flags.FLAGS.main_module_help())
        sys.exit(0)
    app.run(main, flags_parser=parse_flags)
