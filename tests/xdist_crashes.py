"""A pytest plugin for runs under pytest-xdist's --dist loadfile: a worker that dies is survivable and explained.

Registered by tests/conftest.py. Three things, all only when a worker process dies (a segfault in a C extension,
the hard per-test limit of tests/conftest.py):

1. **No deadlock after the crash.** pytest-xdist 3.8.0's file scheduler puts a dead worker's whole workload back
   on the queue, the files it had finished included; those come back as empty work units that never report
   completion, and the run waits forever once the live workers are out of real work (pytest-dev/pytest-xdist#1378,
   #1323, #1327). A CI run spent its last 50 minutes that way. `CrashSafeLoadFile` requeues only the tests not
   yet run and keeps every worker at least two tests ahead (a worker runs a test only once it knows the next).
2. **The crashed test runs once more.** xdist reports the test the worker died in as
   failed; here its first crash is reported as `rerun` and the test goes back on the queue. A second crash of the
   same test fails it. The crash is never hidden: see 3.
3. **The crash's stacks are printed where a log's tail shows them.** Each worker's faulthandler (every thread's
   Python stack on a fatal signal) and the hard limit's dump write into a file of the worker's own; when a worker
   dies, the controller prints that file at once and again in a "worker crashes" section at the end of the run,
   with the test that was running. (XLA's own C++ stack still goes to the worker's stderr, the run's output.)
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # plain pytest runs (no xdist) need none of this
    LoadFileScheduling = None

STDERR_DIR_ENV = "GLM53_TEST_WORKER_STDERR"
TAIL_CHARS = 12_000  # of a dead worker's stderr: its last dump of every thread's stack
_OWN_DIR = None
_WORKER_FD = None
_CRASHES: list[dict] = []  # controller: {"worker", "test", "outcome", "stderr"}


def _crash_path(worker_id: str) -> str:
    return os.path.join(os.environ[STDERR_DIR_ENV], f"{worker_id}.stderr")


def pytest_configure(config):
    global _OWN_DIR
    if not hasattr(config, "workerinput") and STDERR_DIR_ENV not in os.environ:
        # the controller (or a plain run): the folder its workers write into (they inherit the environment)
        _OWN_DIR = os.environ[STDERR_DIR_ENV] = tempfile.mkdtemp(prefix="glm53-tests-stderr-")


def pytest_sessionstart(session):
    """A worker: faulthandler writes into the worker's own file (after pytest's plugin set it on stderr)."""
    global _WORKER_FD
    worker = getattr(session.config, "workerinput", None)
    if worker is None or STDERR_DIR_ENV not in os.environ:
        return
    _WORKER_FD = os.open(_crash_path(worker["workerid"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    faulthandler.enable(file=_WORKER_FD, all_threads=True)


def worker_fd() -> int | None:
    """The file this worker's fatal-error dumps go to (None outside a worker): tests/conftest.py's hard limit."""
    return _WORKER_FD


def pytest_unconfigure(config):
    if _OWN_DIR is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_DIR, ignore_errors=True)


def _tail(worker_id: str) -> str:
    try:
        with open(_crash_path(worker_id), errors="replace") as f:
            text = f.read()
    except OSError as e:
        return f"(no stderr file: {e})"
    return text[-TAIL_CHARS:]


@pytest.hookimpl
def pytest_testnodedown(node, error):
    if error is None:
        return
    stderr = _tail(node.gateway.id)
    _CRASHES.append({"worker": node.gateway.id, "test": None, "outcome": "", "stderr": stderr})
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("-", f"worker {node.gateway.id} died ({error}); the end of its stderr")
        reporter.write_line(stderr)


@pytest.hookimpl
def pytest_handlecrashitem(crashitem, report, sched):
    if not isinstance(sched, CrashSafeLoadFile):
        return
    crash = next((c for c in reversed(_CRASHES) if c["test"] is None), None)
    if crashitem in sched.crashed:  # the second crash of the same test fails it
        outcome = "failed"
    else:
        sched.crashed.add(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = outcome = "rerun"
    if crash is not None:
        crash.update(test=crashitem, outcome=outcome)


@pytest.hookimpl
def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def crashing_thread(dump: str, fallback_lines: int = 40) -> str:
    """The first line and the crashing thread's block of a faulthandler dump (else the dump's last lines)."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return "\n".join(lines[-fallback_lines:])
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    first = next((line for line in lines if line.startswith("Fatal Python error")), "")
    return "\n".join(([first] if first else []) + lines[start:end])


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    if not _CRASHES:
        return
    terminalreporter.write_sep("=", f"worker crashes: {len(_CRASHES)}")
    for c in _CRASHES:
        what = "run again" if c["outcome"] == "rerun" else "failed"
        terminalreporter.write_sep("-", f"worker {c['worker']} died in {c['test']} ({what})")
        terminalreporter.write_line(crashing_thread(c["stderr"]))


@pytest.hookimpl
def pytest_xdist_make_scheduler(config, log):
    if LoadFileScheduling is not None and config.getoption("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None


if LoadFileScheduling is not None:

    class CrashSafeLoadFile(LoadFileScheduling):
        """xdist's file scheduler, with a dead worker's unfinished tests (only) requeued and crashes rerun once."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.crashed: set[str] = set()

        def remove_node(self, node):
            workload = self.assigned_work.pop(node)
            pending = [(s, t) for s, unit in workload.items() for t, done in unit.items() if not done]
            if not pending:
                return None
            scope, crashitem = pending[0]  # a worker runs its tests in order: the first not done is the one
            workload[scope][crashitem] = True  # reported by xdist; pytest_handlecrashitem may queue it again
            for s, unit in workload.items():
                if not all(unit.values()):
                    self.workqueue[s] = unit
                    self.workqueue.move_to_end(s, last=False)
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def mark_test_pending(self, item):
            scope = self._split_scope(item)
            self.workqueue.setdefault(scope, {})[item] = False
            self.workqueue.move_to_end(scope, last=False)
            for other in self.assigned_work:
                self._reschedule(other)

        def _assign_work_unit(self, node):
            scope, unit = self.workqueue.popitem(last=False)
            if all(unit.values()):
                return
            collection = self.registered_collections[node]
            try:
                node.send_runtest_some([collection.index(t) for t, done in unit.items() if not done])
            except OSError:  # the worker is gone, and its errordown event is on its way: the unit stays queued
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
                return
            self.assigned_work.setdefault(node, {})[scope] = unit

        def _reschedule(self, node):
            if node.shutting_down or node not in self.assigned_work or node.channel.isclosed():
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()  # it runs what it holds, then ends
