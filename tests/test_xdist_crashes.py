"""tests/xdist_crashes.py: a run whose workers die ends, reruns a crashed test once, and shows the crash's stack.

A nested pytest run (2 workers, --dist loadfile as the README runs the suite) over small test files in which one
test segfaults the first time it runs and another segfaults every time. With xdist 3.8.0's own file scheduler the
same run never ends (pytest-dev/pytest-xdist#1378: the dead worker's finished files come back as empty work).
"""

import os
import subprocess
import sys
import textwrap

from tests import xdist_crashes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FILES = {
    "conftest.py": """
        import os
        import pytest

        @pytest.fixture(scope="module")
        def counted(request):
            yield  # a module fixture: loadfile keeps a file on one worker at a time
    """,
    "test_a.py": "".join(f"\ndef test_a{i}():\n    pass\n" for i in range(6)),
    "test_b.py": """
        import ctypes
        import os

        def test_b0(counted):
            pass

        def test_b_crashes_once(counted):
            marker = os.path.join(os.environ["CRASH_MARKERS"], "b")
            if not os.path.exists(marker):
                open(marker, "w").close()
                ctypes.string_at(0)  # SIGSEGV

        def test_b2(counted):
            pass
    """,
    "test_c.py": """
        import ctypes

        def test_c_always_crashes():
            ctypes.string_at(0)

        def test_c1():
            pass
    """,
    "test_d.py": "".join(f"\ndef test_d{i}():\n    pass\n" for i in range(5)),
    "test_e.py": "\ndef test_e0():\n    pass\n",
}


def _run(tmp_path, plugin: bool):
    for name, text in FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "markers").mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "CRASH_MARKERS": str(tmp_path / "markers"),
        "PYTHONFAULTHANDLER": "",
    }
    env.pop(xdist_crashes.STDERR_DIR_ENV, None)  # the nested run's controller makes its own
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    cmd += ["-p", "tests.xdist_crashes"] if plugin else []
    cmd += ["-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_crashed_workers_end_the_run_with_one_rerun_and_their_stacks(tmp_path):
    proc = _run(tmp_path, plugin=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    # 17 tests: test_b_crashes_once passes on its rerun; test_c_always_crashes crashes twice and fails
    assert "1 failed" in last and "16 passed" in last and "2 rerun" in last, last
    assert "FAILED test_c.py::test_c_always_crashes" in out
    summary = out[out.index("worker crashes: 3"):]
    assert summary.count("Fatal Python error: Segmentation fault") == 3, summary
    # the crashing thread's own frames, with the test function, in the end section
    assert "in test_b_crashes_once" in summary and summary.count("in test_c_always_crashes") == 2, summary
    assert "died in test_b.py::test_b_crashes_once (run again)" in summary
    assert "died in test_c.py::test_c_always_crashes (run again)" in summary
    assert "died in test_c.py::test_c_always_crashes (failed)" in summary


def test_crashing_thread_picks_the_current_thread_block():
    dump = (
        "Fatal Python error: Segmentation fault\n\n"
        "Thread 0x1 (most recent call first):\n  File \"t.py\", line 3 in wait\n\n"
        "Current thread 0x2 (most recent call first):\n  File \"x.py\", line 9 in boom\n\n"
        "Thread 0x3 (most recent call first):\n  File \"y.py\", line 1 in idle\n"
    )
    got = xdist_crashes.crashing_thread(dump)
    assert got.splitlines() == [
        "Fatal Python error: Segmentation fault",
        "Current thread 0x2 (most recent call first):",
        '  File "x.py", line 9 in boom',
    ]
    assert xdist_crashes.crashing_thread("a\nb\nc", fallback_lines=2) == "b\nc"
