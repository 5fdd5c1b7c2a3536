"""The training run on a tiny config and a small fake corpus: the jitted step (router bias update of the step's own
loads, metrics), Orbax checkpoints and exact resumption (N steps + resume + N == 2N steps), JSON-lines metrics with
evaluation, and the bad-input errors (a work directory of another config, a vocabulary that does not match, a
non-finite loss)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import jax
import numpy as np
import pytest

from configs import train as train_configs
from glm53.data import DataError
from glm53.data.prepare import data_config_from_dict, prepare_data
from glm53.errors import ConfigError
from glm53.train.loop import Trainer, TrainingError

pytestmark = pytest.mark.slow  # one train-step + eval compile: about 2-4 minutes on a loaded 2-core machine


def _source(i: int) -> str:
    return (f"def function_{i}(x, y=None):\n    if y is None:\n        return x + {i}\n    return [x, y, {i}]\n\n\n"
            f"class Thing{i}:\n    def __init__(self):\n        self.value = function_{i}({i}) * {i % 7}\n")  # fmt: skip


def _config(root, vocab):
    c = train_configs.get_config("tiny")
    c.data.root, c.data.vocab_size, c.data.max_files = str(root), 300, 0
    c.data.fractions = [0.7, 0.15, 0.15]
    c.model.vocab_size = vocab
    c.optim.total_steps, c.optim.bias_gamma = 4, 0.01
    c.save_every, c.eval_every, c.log_every = 2, 4, 1
    c.mesh.shape = (1, 1)  # one device (the sharded step: tests/test_train_sharded.py)
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (root / f"mod_{i}.py").write_text(_source(i) * 3)
    work = tmp_path_factory.mktemp("work")
    vocab = prepare_data(data_config_from_dict(_config(root, 0).data), work / "data", log=lambda s: None)[
        "vocab_size"
    ]
    trainer = Trainer(_config(root, vocab), str(work))  # log=print: its lines, as the entry point prints them
    biases0 = [np.asarray(x) for x in jax.tree.leaves(trainer.state.biases)]
    out, err = io.StringIO(), io.StringIO()  # not terminals, as a log file or CI
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        first = trainer.train(1)
        loads1 = {k: np.asarray(v) for k, v in trainer.last_loads.items()}
        biases1 = [np.asarray(x) for x in jax.tree.leaves(trainer.state.biases)]
        logged = first + trainer.train(4)
    yield dict(root=root, work=work, vocab=vocab, trainer=trainer, logged=logged, biases=(biases0, biases1),
               loads1=loads1, stdout=out.getvalue(), stderr=err.getvalue())  # fmt: skip
    trainer.close()


def test_bias_update_uses_the_steps_loads(run):
    b0, b1 = run["biases"]
    loads = run["loads1"]
    names = run["trainer"].router_names
    assert sorted(loads) == sorted(names) and len(b0) == len(names)
    for name, before, after in zip(names, b0, b1):  # tree order = sorted paths = the order of router_names
        ld = loads[name]
        expect = before + 0.01 * np.sign(ld.mean() - ld)
        np.testing.assert_allclose(after, expect, rtol=0, atol=1e-7, err_msg=name)
        assert np.any(after != before)


def test_metrics_jsonl_and_checkpoints(run):
    t, logged = run["trainer"], run["logged"]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    lines = [json.loads(x) for x in open(run["work"] / "metrics.jsonl")]
    train = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [
        1,
        4,
    ]  # at eval_every and where train() stops
    for key in ("loss", "lm_loss", "mtp_loss", "ppl", "lr", "grad_norm", "load_max", "load_min"):
        assert all(math.isfinite(r[key]) for r in train), key
    # log_every 1, train(1) then train(4): the first step of each call is timed apart (compilation), so steps 1
    # and 2 have compile_s and no tokens/s; steps 3 and 4 have tokens/s and no compile_s
    assert ["tokens_per_s" in r for r in train] == [False, False, True, True]
    assert ["compile_s" in r for r in train] == [True, True, False, False]
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in train[2:])
    assert train[0]["lr"] == 0.0 and train[1]["lr"] > 0  # warmup from 0
    assert 0 < evals[1]["loss"] < evals[0]["loss"]  # 4 steps already lower the validation loss
    assert 0 < evals[0]["loss"] < math.log(run["vocab"]) + 1 and evals[0]["ppl"] == pytest.approx(
        math.exp(evals[0]["loss"])
    )
    assert abs(train[0]["loss"] - train[0]["lm_loss"] - 0.3 * train[0]["mtp_loss"]) < 1e-3
    assert t.manager.all_steps() == [2, 4]
    assert (run["work"] / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the loss curves


def test_output_off_a_terminal_plain_lines_and_no_compile_inclusive_throughput(run):
    """Off a terminal: no progress bar, no carriage return, the step lines alone; the first step's line reports
    its compilation ("compiled in X s"), not a compile-inclusive tok/s; later lines report tok/s."""
    assert "\r" not in run["stdout"] + run["stderr"]
    assert run["stderr"] == ""  # no bar (nor anything else) on stderr
    steps = [ln for ln in run["stdout"].splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/1", "2/4", "3/4", "4/4"]
    for first in steps[:2]:  # the first step of each train() call
        assert "compiled in" in first and not re.search(r"\d tok/s", first), first
    for later in steps[2:]:
        assert later.endswith(" tok/s") and "compiled" not in later, later
    assert "eval step 4: validation loss" in run["stdout"]


def test_resume_reproduces_the_uninterrupted_losses(run):
    t, logged = run["trainer"], run["logged"]
    t.manager.delete(4)  # as if the run had been killed after the step-2 checkpoint
    resumed = t.train(4)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, logged[2:]):
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "load_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key


def test_non_finite_loss_stops_naming_the_step(run):
    t = run["trainer"]
    step_fn = t.step_fn

    def poisoned(state, batch):
        state, m = step_fn(state, batch)
        return state, dict(m, loss=m["loss"] * float("nan"))

    t.step_fn = poisoned
    try:
        with pytest.raises(
            TrainingError, match=r"step 4: loss is nan; stopped, the last good checkpoint is step 4"
        ):
            t.train(5)
    finally:
        t.step_fn = step_fn
    assert t.manager.latest_step() == 4


def test_workdir_of_another_config_and_wrong_vocab_are_clear_errors(run, tmp_path):
    other = _config(run["root"], run["vocab"])
    other.model.hidden_size = 32
    with pytest.raises(
        ConfigError, match=r"run.json: the work directory holds a run of another config .*model.hidden_size"
    ):
        Trainer(other, str(run["work"]), log=lambda s: None)
    with pytest.raises(
        DataError, match=r"tokenizer.json: the tokenizer has \d+ tokens but config field 'model.vocab_size'"
    ):
        Trainer(_config(run["root"], run["vocab"] + 1), str(tmp_path), log=lambda s: None)
