"""Install layout: `glm53` and `kernels` resolve to this repository (a PyPI package named `kernels` exists)."""

import os

import glm53
import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_packages_resolve_to_this_repository():
    for mod in (glm53, kernels):
        path = os.path.realpath(os.path.dirname(mod.__file__))
        assert path == os.path.join(os.path.realpath(ROOT), mod.__name__), (mod.__name__, path)


def test_kernels_is_ours():
    assert "one folder per op" in kernels.__doc__
