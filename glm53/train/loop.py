"""A training run in a work directory: data, model, jitted step, Orbax checkpoints, JSON-lines metrics, evaluation.

    workdir/
      data/          the prepared data (glm53.data.prepare): tokenizer, token files, manifest
      run.json       the model / data / optim / loss config of the run (a resumed run must match it)
      checkpoints/   Orbax CheckpointManager: step_N/ {state, meta}; an interrupted save never becomes "latest"
      metrics.jsonl  one JSON object per logged step ("kind": "train") and per evaluation ("kind": "eval")
      loss.png       the loss curves, written at the end of `Trainer.train` (glm53.train.plot; needs matplotlib)

`run(config, workdir)` resumes from the latest checkpoint when there is one: the state is restored exactly and
the loader's batch is a function of (seed, step), so the resumed run reproduces the uninterrupted one's losses.
A non-finite loss stops the run with a `TrainingError` naming the step; the last checkpoint (all finite) stays.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from glm53 import build, parallel
from glm53.config import mesh_config_from_dict, model_config_from_dict, model_config_to_dict
from glm53.config.fields import from_dict, to_plain
from glm53.data import bpe
from glm53.data.packing import PackedLoader
from glm53.data.prepare import data_config_from_dict, prepare_data
from glm53.errors import ConfigError, TrainingError
from glm53.files import write_json
from glm53.model import Glm53Model
from glm53.parallel import distributed
from glm53.progress import Progress, is_terminal
from glm53.train import per_layer, plot, routing
from glm53.train import step as S
from glm53.train.loss import LossConfig

RUN_KEYS = ("batch_size", "seq_len", "seed", "eval_every", "eval_batches", "save_every", "keep", "log_every",
            "fast_compile")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunConfig:
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 16
    save_every: int = 200
    keep: int = 3
    log_every: int = 10
    fast_compile: bool = (
        False  # XLA:CPU FAST_COMPILE (glm53.train.step.compiler_options): tests and smoke runs
    )


def run_identity(config) -> dict:
    """What must not change between an interrupted run and its resumption."""
    return dict(model=model_config_to_dict(model_config_from_dict(config.model)),
                data=to_plain(config.data), optim=to_plain(config.optim), loss=to_plain(config.loss),
                run={k: config[k] for k in RUN_KEYS})  # fmt: skip


def _check_identity(workdir: str, ident: dict) -> None:
    path = os.path.join(workdir, "run.json")
    if not os.path.exists(path):
        if distributed.is_main_process():  # several processes: process 0 writes the run's files
            write_json(path, ident)
        return
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    if old != json.loads(json.dumps(ident)):
        diff = sorted(f"{s}.{k}" for s in ident for k in set(ident[s]) | set(old.get(s, {}))
                      if json.loads(json.dumps(ident[s])).get(k) != old.get(s, {}).get(k))  # fmt: skip
        raise ConfigError(f"{path}: the work directory holds a run of another config (differs in {diff[:8]}); "
                          "use a new --workdir")  # fmt: skip


def train_mesh(config, cfg) -> tuple[jax.sharding.Mesh, parallel.Rules]:
    """(mesh, rules) of the config's ``mesh`` section. No section: one device. A shape without -1 that holds
    fewer devices than there are: the first that many devices. Otherwise `glm53.build.experiment_mesh` (the
    default shape falls back to one device when the model does not split)."""
    if "mesh" not in config or config.mesh is None:
        if jax.process_count() > 1:
            raise ConfigError("config has no 'mesh' section: several processes need a mesh over all their devices")
        return parallel.make_mesh(parallel.MeshConfig(shape=(1, 1)), jax.devices()[:1]), parallel.get_rules(
            "tp"
        )
    mc = mesh_config_from_dict(config.mesh)
    n = math.prod(mc.shape)
    if -1 not in mc.shape and n < jax.device_count():
        if jax.process_count() > 1:  # several processes: every process's devices must be in the mesh
            raise ConfigError(f"config field 'mesh.shape': {mc.shape} holds {n} of the {jax.device_count()} devices "
                              f"of {jax.process_count()} processes; use all of them (e.g. a -1)")  # fmt: skip
        mesh, rules = parallel.make_mesh(mc, jax.devices()[:n]), parallel.get_rules(mc.rules)
        parallel.check_config(cfg, mesh, rules)
        return mesh, rules
    return build.experiment_mesh(config, cfg)


def progress_enabled(progress: bool, stream=None) -> bool:
    """Whether the training loop shows its progress bar: asked for and `stream` (default stderr) a terminal."""
    return bool(progress) and is_terminal(sys.stderr if stream is None else stream)


class Trainer:
    """Everything a run needs, built from the experiment config (see configs/train.py)."""

    def __init__(self, config, workdir: str, *, log=print, progress: bool = True):
        """`progress`: a tqdm progress bar on stderr while training (only when stderr is a terminal; the step
        lines are printed above it). Off a terminal the step lines alone report progress (no carriage returns)."""
        self.workdir, self.log = os.path.abspath(workdir), log
        self.progress = progress
        os.makedirs(self.workdir, exist_ok=True)
        self.rc = from_dict(RunConfig, {k: config[k] for k in RUN_KEYS}, "run config")
        self.optim = from_dict(S.OptimConfig, config.optim, "optim config")
        self.loss_cfg = from_dict(LossConfig, config.loss, "loss config")
        self.cfg = model_config_from_dict(config.model)
        _check_identity(self.workdir, run_identity(config))
        data_dir = os.path.join(self.workdir, "data")
        if distributed.is_main_process():  # several processes: process 0 prepares the data, the others read it
            self.manifest = prepare_data(data_config_from_dict(config.data), data_dir, log=log)
        distributed.barrier("glm53 train: data prepared")
        if not distributed.is_main_process():
            self.manifest = prepare_data(data_config_from_dict(config.data), data_dir, log=log)
        bpe.check_vocab(os.path.join(data_dir, "tokenizer"), self.cfg)
        kw = dict(batch_size=self.rc.batch_size, seq_len=self.rc.seq_len, pad_id=self.cfg.pad_token_id)
        self.train_data = PackedLoader(os.path.join(data_dir, "train.bin"), seed=self.rc.seed, **kw)
        self.val_data = PackedLoader(os.path.join(data_dir, "validation.bin"), **kw)
        self.kernels = build.kernels_from_experiment_config(config)  # configs/train.py: moe "blocked"
        model = Glm53Model(self.cfg, rngs=nnx.Rngs(self.rc.seed), kernels=self.kernels)
        self.router_names = routing.instrument_routers(model)  # module paths (a scanned group's router: once)
        self.groups = model.groups  # the trunk's grouping (ModelConfig.scan_layers): per-layer names of stats
        self.mesh, self.rules = train_mesh(config, self.cfg)
        if distributed.is_main_process():  # the model part of the start-up block (docs/workbench.md)
            log(build.describe_model(model, mesh=self.mesh, rules=self.rules, seed=self.rc.seed, training=True,
                                     label="the model to train"))  # fmt: skip
        self.graphdef, params, biases, self.rest = S.split_model(model)
        self.tx = S.optimizer(self.optim)
        state = S.init_state(params, biases, self.tx)
        self.state_sh = S.state_shardings(state, self.mesh, self.rules)
        self.batch_sh = S.batch_sharding(self.mesh, self.rules, self.rc.batch_size)
        self.state = distributed.device_put(state, self.state_sh)  # several processes: via the host
        fast = self.rc.fast_compile
        self.step_fn = S.make_train_step(self.graphdef, self.rest, self.tx, self.loss_cfg, self.optim,
                                         self.router_names, fast_compile=fast,
                                         shardings=(self.state_sh, self.batch_sh))  # fmt: skip
        self.eval_fn = S.make_eval_step(self.graphdef, self.rest, self.loss_cfg, self.optim.compute_dtype,
                                        fast_compile=fast)  # fmt: skip
        self.last_loads: dict = {}  # the last step's {per-layer router name: load [E]} (`per_layer.expand_names`)
        self.treedef = jax.tree.structure(self.state)
        self.manager = ocp.CheckpointManager(
            os.path.join(self.workdir, "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=self.rc.keep, enable_async_checkpointing=True),
        )

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> None:
        leaves = {str(i): x for i, x in enumerate(jax.tree.leaves(self.state))}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(leaves),
                                                        meta=ocp.args.JsonSave({"step": step})))  # fmt: skip

    def restore_latest(self) -> int:
        step = self.manager.latest_step()
        if step is None:
            return 0
        abstract = {str(i): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for i, x in enumerate(jax.tree.leaves(self.state))}  # fmt: skip
        got = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))  # fmt: skip
        leaves = [got["state"][str(i)] for i in range(len(abstract))]
        self.state = distributed.device_put(jax.tree.unflatten(self.treedef, leaves), self.state_sh)
        self.log(f"resumed from {self.manager.directory}/{step}")
        return step

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, loader: PackedLoader, max_batches: int | None) -> dict:
        sums: dict[str, float] = {}
        for batch in loader.eval_batches(max_batches):
            out = self.eval_fn(self.state.params, self.state.biases, batch)
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        lm = sums["lm_nll"] / max(sums["lm_tokens"], 1.0)
        res = dict(loss=lm, ppl=math.exp(min(lm, 50.0)), tokens=sums["lm_tokens"])
        if sums.get("mtp_tokens"):
            res["mtp_loss"] = sums["mtp_nll"] / sums["mtp_tokens"]
        return res

    # ------------------------------------------------------------------------------------------ the loop
    def train(self, steps: int | None = None) -> list[dict]:
        """Runs until step `steps` (default optim.total_steps); returns the train metrics logged in this call.
        At the end the loss curves of metrics.jsonl go to ``loss.png`` (`glm53.train.plot`)."""
        total = self.optim.total_steps if steps is None else steps
        start = self.restore_latest()
        logged, path = [], os.path.join(self.workdir, "metrics.jsonl")
        if distributed.is_main_process():
            _drop_torn_line(path)
        # off a terminal no bar and no extra lines: the step lines are the progress
        bar = Progress(total, initial=start, unit="step", enabled=progress_enabled(self.progress), lines=False)
        try:
            self._loop(start, total, path, logged, bar)
        finally:
            bar.close()
        self.manager.wait_until_finished()
        if os.path.exists(path) and distributed.is_main_process():
            plot.plot_losses(path, os.path.join(self.workdir, "loss.png"), log=self.log)
        return logged

    def _loop(self, start: int, total: int, path: str, logged: list, bar: Progress) -> None:
        """The steps. Throughput excludes compilation: the first step of this call (which compiles the train step)
        is timed alone (``compile_s`` in its interval's record, "compiled in X s" in its line) and tokens/s
        counts the steps after it; an interval of the first step alone has no ``tokens_per_s``."""
        log = functools.partial(bar.write, log=self.log)  # a line above the progress bar, never through it
        t0, tokens, compile_s, first = time.perf_counter(), 0.0, 0.0, False
        for step in range(start, total):
            batch = distributed.device_put(self.train_data.batch(step), self.batch_sh)  # each process: its rows
            self.state, m = self.step_fn(self.state, batch)
            self.last_loads = per_layer.expand_names(m.pop("loads"), self.groups)
            m = {k: float(v) for k, v in m.items()}  # waits for the step
            if not math.isfinite(m["loss"]):
                self.manager.wait_until_finished()
                kept = self.manager.latest_step()
                raise TrainingError(f"step {step}: loss is {m['loss']}; stopped, the last good checkpoint is "
                                    f"step {kept} in {self.manager.directory}")  # fmt: skip
            done = step + 1
            if step == start:  # compiled the step: timed apart, not in tokens/s
                compile_s = time.perf_counter() - t0
                t0, first = time.perf_counter(), True
            else:
                tokens += m["tokens"]
            bar.update(1, postfix=f"loss={m['loss']:.4f}")
            if done % self.rc.log_every == 0 or done == total:
                dt = time.perf_counter() - t0
                rec = dict(kind="train", step=done, **m, ppl=math.exp(min(m["lm_loss"], 50.0)),
                           epoch=self.train_data.epoch_of(done))  # fmt: skip
                speed = ""
                if tokens > 0:
                    rec["tokens_per_s"] = tokens / dt if dt > 0 else 0.0
                    speed = f" {rec['tokens_per_s']:.0f} tok/s"
                if first:
                    rec["compile_s"] = compile_s
                    speed += f"{';' if tokens > 0 else ''} compiled in {compile_s:.1f} s (the first step, not in tok/s)"
                    first = False
                logged.append(rec)
                _append(path, rec)
                log(f"step {done}/{total} loss {m['loss']:.4f} lm {m['lm_loss']:.4f} mtp {m['mtp_loss']:.4f} "
                    f"lr {m['lr']:.2e} |g| {m['grad_norm']:.3f} load {m.get('load_min', 0):.2f}-"
                    f"{m.get('load_max', 0):.2f}{speed}")  # fmt: skip
                t0, tokens = time.perf_counter(), 0.0
            if done % self.rc.eval_every == 0 or done == total:
                ev = dict(
                    kind="eval",
                    step=done,
                    split="validation",
                    **self.evaluate(self.val_data, self.rc.eval_batches),
                )
                _append(path, ev)
                log(f"eval step {done}: validation loss {ev['loss']:.4f} ppl {ev['ppl']:.2f}")
            if done % self.rc.save_every == 0 or done == total:
                self.save(done)
            if done % self.rc.eval_every == 0 or done % self.rc.save_every == 0:
                t0, tokens = time.perf_counter(), 0.0  # tokens/s counts training time only

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _drop_torn_line(path: str) -> None:
    """Cuts a last line without its newline (a run killed while appending) so that the next record starts a line."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def _append(path: str, rec: dict[str, Any]) -> None:
    if not distributed.is_main_process():  # several processes: process 0 writes the metrics
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({k: (float(v) if isinstance(v, (np.floating, jnp.ndarray)) else v)
                            for k, v in rec.items()}) + "\n")  # fmt: skip
        f.flush()
