"""glm53.files: atomic writes leave nothing half-written, and every file and folder glm53 writes has the mode the
process's umask gives a plain `open` / `mkdir` (tempfile's private 0600 / 0700 staging never reaches the final
name), so a team on a shared filesystem can read what a run wrote."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from glm53 import files
from glm53.checkpoint.hf_export import staged_folder


@pytest.fixture(params=[0o022, 0o002, 0o077])
def mask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_umask_reads_the_process_mask_without_changing_it(mask):
    assert files.umask() == mask
    assert files.umask() == mask


def test_atomic_write_gives_the_mode_of_a_plain_open(tmp_path, mask):
    with open(tmp_path / "plain", "w") as f:
        f.write("x")
    files.write_json(tmp_path / "r.json", {"a": 1})
    with files.atomic_write(tmp_path / "s.npz", "wb") as f:
        np.savez(f, a=np.arange(3))
    assert mode(tmp_path / "plain") == 0o666 & ~mask
    assert mode(tmp_path / "r.json") == 0o666 & ~mask
    assert mode(tmp_path / "s.npz") == 0o666 & ~mask


def test_failed_atomic_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), files.atomic_write(tmp_path / "r.json") as f:
        f.write("half")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_staged_folder_follows_the_umask_inside_and_out(tmp_path, mask):
    os.mkdir(tmp_path / "plain")
    with staged_folder(tmp_path / "out") as tmp:
        os.mkdir(os.path.join(tmp, "sub"))
        with files.atomic_write(os.path.join(tmp, "sub", "w.json")) as f:
            f.write("{}")
        exe = os.path.join(tmp, "tool")
        with open(exe, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(exe, 0o700)
    out = tmp_path / "out"
    assert mode(out) == mode(tmp_path / "plain") == 0o777 & ~mask
    assert mode(out / "sub") == 0o777 & ~mask
    assert mode(out / "sub" / "w.json") == 0o666 & ~mask
    assert mode(out / "tool") == 0o777 & ~mask  # an executable keeps its x bits
