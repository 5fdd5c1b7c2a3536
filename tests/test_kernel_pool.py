"""The C++ kernels' thread pool (kernels/csrc/pool.h), built on its own with the kernels' compiler and flags: every
item runs exactly once, from the caller and the workers, run after run; a second caller while a run is in
progress runs its own items; and a child forked after the pool has started its threads (which the child does
not inherit) gets a pool of its own instead of waiting forever for the parent's threads."""

from __future__ import annotations

import subprocess

import pytest

from kernels import ffi_build

PROGRAM = r"""
#include "pool.h"
#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <thread>
#include <vector>

static int check(int runs, int64_t n) {  // each item exactly once per run
  for (int r = 0; r < runs; ++r) {
    std::vector<std::atomic<int>> hits(n);
    glm53::pool(4).run(n, [&](int64_t i) { hits[i].fetch_add(1); });
    for (int64_t i = 0; i < n; ++i)
      if (hits[i].load() != 1) return 1;
  }
  return 0;
}

int main() {
  if (check(200, 97)) return 10;
  int bad = 0;  // two callers at once: one takes the workers, the other runs its items itself
  std::thread other([&] { bad |= check(100, 33); });
  bad |= check(100, 51);
  other.join();
  if (bad) return 11;
  pid_t pid = fork();
  if (pid == 0) {
    alarm(60);  // a child waiting on threads it does not have dies of SIGALRM
    _exit(check(50, 97) ? 12 : 0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return 20 + WTERMSIG(status);
  if (WEXITSTATUS(status) != 0) return WEXITSTATUS(status);
  return check(50, 97) ? 13 : 0;  // the parent's pool is untouched by the fork
}
"""


def test_pool_runs_every_item_once_and_survives_fork(tmp_path):
    cxx = ffi_build.compiler()
    if cxx is None:
        pytest.fail("no C++ compiler: the kernels' own build needs one (ffi_build.compiler)")
    src, exe = tmp_path / "pool_test.cc", tmp_path / "pool_test"
    src.write_text(PROGRAM)
    flags = [f for f in ffi_build.FLAGS if f not in ("-shared", "-fPIC")]
    build = subprocess.run([cxx, *flags, "-pthread", f"-I{ffi_build.INCLUDE}", str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode} (20 + 14: the forked child hung and died of SIGALRM)"
