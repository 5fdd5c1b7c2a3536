"""Training throughput: our jitted train step against transformers' training step on the same model and batch.

Per model config a randomized transformers `Glm5NextForConditionalGeneration` (glm53.testing.hf_torch) is saved
and loaded into glm53 through its HF loader, so both start from the same fp32 weights in one process. One step:

  glm53         `glm53.train.step.make_train_step`: next-token loss (no MTP term: transformers has no MTP
                block), value_and_grad, global-norm clipping, optax AdamW, the router bias update; one jitted
                call with the state donated (routers instrumented, reference MoE kernel);
  transformers  ``model(input_ids, labels=...)`` loss, ``backward()``, ``clip_grad_norm_``,
                ``torch.optim.AdamW.step()``, ``zero_grad`` (train mode, fp32, eager attention).

Both first run one untimed step each (compile / warm-up) whose losses are recorded (they must agree: same weights,
same batch); then `harness.time_calls` takes turns. tokens/s = batch x seq_len / median step time; ratio = ours
over transformers' (> 1: glm53 is faster).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
import torch

from glm53.benchmarks import harness
from glm53.checkpoint import hf as hf_ckpt
from glm53.config import ModelConfig
from glm53.config.kernels import KernelConfig
from glm53.testing.hf_torch import random_hf_model
from glm53.train import routing
from glm53.train import step as S
from glm53.train.loss import LossConfig


@dataclasses.dataclass(frozen=True)
class Settings:
    """Batch shape, timed repeats (medians are reported), weights / batch seed, XLA:CPU's fast-compile mode
    for our step (tests: a slower step, compiled in half the time) and the kernels our model is built with
    (experiments.bench_train: configs/train.py's ``kernels`` section, the one training runs)."""

    batch_size: int = 4
    seq_len: int = 64
    repeats: int = 5
    seed: int = 0
    fast_compile: bool = False
    kernels: KernelConfig = KernelConfig()

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


OPTIM = S.OptimConfig(lr=1e-3, warmup_steps=0, total_steps=1000, clip_norm=1.0, weight_decay=0.1)


def _batch(cfg: ModelConfig, s: Settings) -> np.ndarray:
    return (
        np.random.default_rng(s.seed).integers(1, cfg.vocab_size, (s.batch_size, s.seq_len)).astype(np.int32)
    )


def ours(folder: str, tokens: np.ndarray, fast_compile: bool, kernels: KernelConfig) -> Callable[[], float]:
    """A step function (one train step per call; returns its loss) of glm53 on the HF folder's weights."""
    _, model = hf_ckpt.load_hf_model(folder, dtype=np.float32, with_mtp=False, kernels=kernels)
    names = routing.instrument_routers(model)
    graphdef, params, biases, rest = S.split_model(model)
    tx = S.optimizer(OPTIM)
    state = S.init_state(params, biases, tx)
    step = S.make_train_step(graphdef, rest, tx, LossConfig(mtp_weight=0.0, balance_weight=0.0), OPTIM, names,
                             fast_compile=fast_compile)  # fmt: skip
    batch = dict(tokens=jax.numpy.asarray(tokens), mask=jax.numpy.ones(tokens.shape, jax.numpy.float32))

    def call():
        nonlocal state
        state, m = step(state, batch)
        return m["loss"]

    return call


def theirs(model, tokens: np.ndarray) -> Callable[[], float]:
    """A step function of transformers: loss, backward, clipping, AdamW (the same hyperparameters)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=(OPTIM.b1, OPTIM.b2), eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)  # fmt: skip
    ids = torch.as_tensor(tokens, dtype=torch.long)

    def call():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return call


def bench_config(name: str, cfg: ModelConfig, s: Settings, log: Callable[[str], None] = print) -> dict:
    """The per-config JSON record: sizes, first-step losses of both, compile / warm-up time, timings, ratio."""
    tokens = _batch(cfg, s)
    hf = random_hf_model(cfg, s.seed)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        mine = ours(folder, tokens, s.fast_compile, s.kernels)
    ref = theirs(hf, tokens)
    t = time.perf_counter()
    first_ours = float(mine())
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    first_theirs = float(ref())
    warm_theirs_s = time.perf_counter() - t
    timing = harness.time_calls({"glm53": mine, "transformers": ref}, warmup=0, repeats=s.repeats)
    n = s.batch_size * s.seq_len
    rec = {
        "params": sum(p.numel() for p in hf.parameters()),
        "tokens_per_step": n,
        "first_loss": {"glm53": first_ours, "transformers": first_theirs},
        "last_loss": {k: float(timing[k].result) for k in ("glm53", "transformers")},
        "first_step_s": {"glm53 (compile)": compile_s, "transformers": warm_theirs_s},
        "glm53": {**timing["glm53"].to_dict(), "tokens_per_s": n / timing["glm53"].median_s},
        "transformers": {
            **timing["transformers"].to_dict(),
            "tokens_per_s": n / timing["transformers"].median_s,
        },
        "ratio": harness.speedup(timing["transformers"], timing["glm53"]),
    }
    log(f"{name}: train step, batch {s.batch_size} x {s.seq_len}: glm53 {rec['glm53']['tokens_per_s']:.0f} tok/s, "
        f"transformers {rec['transformers']['tokens_per_s']:.0f} tok/s, ratio {rec['ratio']:.2f}x "
        f"(first losses {first_ours:.6f} / {first_theirs:.6f}; compile {compile_s:.1f} s)")  # fmt: skip
    return rec


def run(models: Mapping[str, ModelConfig], s: Settings, log: Callable[[str], None] = print) -> dict:
    """{"machine", "settings", "configs": {name: record}} for every config."""
    return {
        "machine": harness.machine(
            ("flax", "optax", "torch", "transformers"), torch_threads=torch.get_num_threads()
        ),
        "settings": dataclasses.asdict(s),
        "optim": dataclasses.asdict(OPTIM),
        "configs": {name: bench_config(name, cfg, s, log) for name, cfg in models.items()},
    }
