"""Entry points run as ``python -m module args`` in forked children of a clean process, for tests of their usage
errors: each case costs a fork, not an interpreter start.

The children are forked by multiprocessing's fork server, a process of its own that has imported JAX and the
entry points' shared modules (``experiments.cli``) and done nothing else: no XLA backend, no thread pools, no
kernel threads. Forking the pytest worker itself is not safe once it has run a model: a child inherits XLA's
client and the C++ kernels' pools without the threads behind them, and hangs the first time it waits on them
(a CI run stalled this way until its time ran out).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile

TIMEOUT_S = 600

_context = None


def _fork_server():
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.forkrun", "experiments.cli"])
        _context = ctx
    return _context


def _child(module: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The forked child: the caller's folder and environment, stdout / stderr into files; never returns."""
    code = 70
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 71
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_forked(module: str, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m module args`` run in the current folder and environment."""
    with tempfile.TemporaryDirectory(prefix="glm53-forkrun-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        for path in (out, err):
            open(path, "w").close()
        child = (module, list(args), os.getcwd(), dict(os.environ), out, err)
        p = _fork_server().Process(target=_child, args=child)
        p.start()
        p.join(TIMEOUT_S)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise AssertionError(f"python -m {module} {' '.join(args)} did not finish in {TIMEOUT_S} s")
        with open(out) as fo, open(err) as fe:
            return p.exitcode, fo.read(), fe.read()
