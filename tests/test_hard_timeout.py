"""The suite's hard per-test limit (tests/conftest.py, HARD_TIMEOUT_S): a test stuck in compiled code that holds the
GIL, where pytest-timeout's thread never runs (shown: its 1 s limit passes unnoticed), still ends, with its stack on
the real stderr, instead of stalling the run."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUCK = '''
import re


def test_stuck_holding_the_gil():
    re.match(r"(a+)+$", "a" * 64 + "b")  # exponential backtracking inside the re module, which keeps the GIL
'''


def test_a_test_holding_the_gil_is_ended_with_its_stack(tmp_path):
    (tmp_path / "stuck.py").write_text(STUCK)
    env = dict(os.environ, GLM53_TEST_HARD_TIMEOUT_S="3")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-o", "timeout=1",
         "-o", "timeout_method=thread",
         str(tmp_path / "stuck.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "Timeout (0:00:03)!" in r.stderr and "line 6 in test_stuck_holding_the_gil" in r.stderr, out[-3000:]
    assert "+++++ Timeout +++++" not in out  # pytest-timeout's thread never got the GIL
