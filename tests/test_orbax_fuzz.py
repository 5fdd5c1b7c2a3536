"""Fuzzing glm53 Orbax checkpoints (`glm53.checkpoint.orbax.restore_model`): a copy of a converted tiny
checkpoint with one file deleted, truncated or with bytes flipped restores to exactly the same logits or raises
a CheckpointError naming the directory; never another exception, never different numbers."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from fuzzing import fuzz
from gguf_fixtures import make_hf_folder
from hypothesis import given
from hypothesis import strategies as st

from configs import tiny
from glm53.checkpoint import orbax as orbax_ckpt
from glm53.checkpoint.convert import convert
from glm53.config import model_config_from_dict
from glm53.errors import CheckpointError

CFG = model_config_from_dict(tiny.model_config("default"))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (1, 16)), jnp.int32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("orbax_fuzz")
    make_hf_folder(str(d / "hf"), CFG, seed=0)
    out = convert(str(d / "hf"), str(d / "ckpt"), dtype="float32", chunk_bytes=4096, progress=False)
    model = orbax_ckpt.restore_model(out)
    graphdef, _ = nnx.split(model)
    fwd = jax.jit(lambda s: nnx.merge(graphdef, s)(TOKENS)[0])
    files = sorted(os.path.relpath(os.path.join(r, f), out) for r, _, fs in os.walk(out) for f in fs)
    return dict(dir=out, work=d, fwd=fwd, want=np.asarray(fwd(nnx.state(model))), files=files)


_COUNT = [0]


@fuzz(30)
@given(data=st.data(), op=st.sampled_from(["delete", "truncate", "flip"]))
def test_fuzz_damaged_checkpoints(ckpt, data, op):
    name = data.draw(st.sampled_from(ckpt["files"]), label="file")
    _COUNT[0] += 1
    d = str(ckpt["work"] / f"case{_COUNT[0]}")
    shutil.copytree(ckpt["dir"], d)
    path = os.path.join(d, name)
    size = os.path.getsize(path)
    if op == "delete":
        os.remove(path)
    elif op == "truncate":
        with open(path, "r+b") as f:
            f.truncate(data.draw(st.integers(0, max(size - 1, 0)), label="keep"))
    elif size:
        at = data.draw(st.integers(0, size - 1), label="at")
        n = data.draw(st.integers(1, 64), label="n")
        with open(path, "r+b") as f:
            f.seek(at)
            chunk = f.read(n)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in chunk))
    try:
        model = orbax_ckpt.restore_model(d)
    except CheckpointError as e:
        assert d in str(e)
    else:
        np.testing.assert_array_equal(np.asarray(ckpt["fwd"](nnx.state(model))), ckpt["want"])
    finally:
        shutil.rmtree(d)
