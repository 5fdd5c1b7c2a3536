"""Install layout: `glm53`, `kernels`, `experiments` (the entry points) and `configs` resolve to this repository
(a PyPI package named `kernels` exists), from any folder."""

import os
import subprocess
import sys

import configs
import experiments
import glm53
import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_packages_resolve_to_this_repository():
    for mod in (glm53, kernels, experiments, configs):
        path = os.path.realpath(os.path.dirname(mod.__file__))
        assert path == os.path.join(os.path.realpath(ROOT), mod.__name__), (mod.__name__, path)


def test_kernels_is_ours():
    assert "one folder per op" in kernels.__doc__


def test_installed_packages_resolve_from_another_folder(tmp_path):
    code = "import configs, experiments.cli, glm53, kernels; print(configs.__file__, experiments.__file__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [os.path.join(os.path.realpath(ROOT), p, "__init__.py") for p in ("configs", "experiments")]
