"""Whole-model throughput: glm53 against transformers' eager `Glm5NextForConditionalGeneration` on the same weights.

Per model config a randomized transformers model is built (glm53.testing.hf_torch), saved with save_pretrained
and loaded into glm53 through glm53.checkpoint.hf.load_hf_model, so both run the same fp32 weights in one
process. Timed by `harness.time_calls` (one warm-up call each, then the repeats, glm53 and transformers taking
turns), batch 1:

  prefill  one forward over a prompt of `prefill_len` tokens (glm53: the runtime's prefill program, the serving
           engine's, one jitted call with a donated cache, glm53.benchmarks.greedy; transformers:
           `model(input_ids, use_cache=True)` under torch.no_grad);
  decode   `decode_len` greedy steps after that prefill (untimed), each one forward of the last token and an
           argmax (glm53: the insert program, then the decode program, argmax on device; transformers:
           `model(..., past_key_values=...)`, argmax on the host).

`run` returns the JSON result: machine (with torch's thread count), settings, and per config: model sizes,
build and compile time, per phase each side's timing and tokens_per_s and the ratio glm53 / transformers tokens/s
(> 1: glm53 is faster), and the greedy tokens of both with their agreement.

With `Settings.profile_dir`, one more round of the glm53 calls (already compiled, untimed: the profiler's own
cost stays out of the timings) runs under `jax.profiler.trace`, writing a TensorBoard / Perfetto trace per
config to `profile_dir/<config name>/`, each call inside a `TraceAnnotation` named glm53_prefill / glm53_decode.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import torch

from glm53.benchmarks import harness
from glm53.benchmarks.greedy import GreedyStreams
from glm53.checkpoint import hf as hf_ckpt
from glm53.config import ModelConfig
from glm53.model import count_params
from glm53.testing.hf_torch import random_hf_model


@dataclasses.dataclass(frozen=True)
class Settings:
    """Prompt and decode lengths, timed repeats (medians are reported) and the weights and prompt seed."""

    prefill_len: int = 64
    decode_len: int = 16
    repeats: int = 3
    seed: int = 0
    profile_dir: str | None = None  # a JAX profiler trace of the glm53 calls goes here (a folder per config)


class Glm53Runner:
    """glm53 greedy prefill + decode of one stream on the runtime's programs (glm53.benchmarks.greedy: the serving
    engine's, one program per shape, donated cache)."""

    def __init__(self, model, max_len: int):
        self.streams = GreedyStreams(model, prefill_chunk=max_len)
        self.max_len = max_len

    def fresh(self):
        """An empty staging cache for one stream."""
        return self.streams.fresh(1, self.max_len)

    def prefill(self, state, prompt_bt) -> tuple[object, np.ndarray]:
        """(prefilled, last-position logits [V]) after feeding the prompt."""
        prefilled, logits = self.streams.prefill(state, prompt_bt)
        return (prefilled, logits), logits[0]

    def decode(self, prefilled, steps: int) -> list[int]:
        """Greedy tokens [steps + 1] from a prefill."""
        return [int(t) for t in self.streams.decode(prefilled[0], steps)[0]]


class TorchRunner:
    """transformers greedy prefill + decode with its own cache (eager attention, fp32, no_grad)."""

    def __init__(self, model):
        self.model = model

    def fresh(self) -> None:
        """transformers makes its cache in the prefill."""

    @torch.no_grad()
    def prefill(self, cache, prompt_bt) -> tuple[object, np.ndarray]:
        del cache
        out = self.model(input_ids=torch.as_tensor(prompt_bt, dtype=torch.long), use_cache=True)
        return out.past_key_values, out.logits[0, -1].float().numpy()

    @torch.no_grad()
    def decode(self, prefilled, steps: int) -> list[int]:
        pkv, first = prefilled
        toks = [int(first.argmax())]
        for _ in range(steps):
            out = self.model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            toks.append(int(out.logits[0, -1].argmax()))
        return toks


def _phase(ours: harness.Timing, theirs: harness.Timing, tokens: int) -> dict:
    return {
        "tokens": tokens,
        "glm53": {**ours.to_dict(), "tokens_per_s": tokens / ours.median_s},
        "transformers": {**theirs.to_dict(), "tokens_per_s": tokens / theirs.median_s},
        "ratio": harness.speedup(theirs, ours),  # glm53 tokens/s over transformers tokens/s
    }


def profile(trace_dir: str, fns: Mapping[str, Callable], setup: Mapping[str, Callable]) -> None:
    """One call of each of `fns` (on its fresh `setup()` input, made before the trace starts) under
    `jax.profiler.trace(trace_dir)`, each inside a `jax.profiler.TraceAnnotation` of its name."""
    inputs = {k: jax.block_until_ready(setup[k]()) for k in fns}
    with jax.profiler.trace(trace_dir):
        for k, fn in fns.items():
            with jax.profiler.TraceAnnotation(k):
                jax.block_until_ready(fn(inputs[k]))


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_config(
    name: str, variant: str, cfg: ModelConfig, s: Settings, log: Callable[[str], None] = print
) -> dict:
    """Builds the pair for `cfg` and measures both; the per-config JSON record."""
    t = time.perf_counter()
    hf = random_hf_model(cfg, s.seed)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        # the routed experts' backend's own implementation (kernels.moe.api "auto": xla_cpu on CPU), as the
        # entry points that serve or benchmark use; the layers' default "reference" is the differentiable oracle
        _, model = hf_ckpt.load_hf_model(folder, dtype=jnp.float32, with_mtp=False, kernels={"moe": "auto"})
    build_s = time.perf_counter() - t
    n_params = count_params(model)
    log(f"[{name}] hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({''.join(k[0] for k in cfg.layer_types)}"
        f"), {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, {n_params / 1e6:.1f}M params; "
        f"built + saved + loaded in {build_s:.1f}s")  # fmt: skip

    prompt = (
        np.random.default_rng(s.seed).integers(0, cfg.vocab_size, size=(1, s.prefill_len)).astype(np.int32)
    )
    runners = {"glm53": Glm53Runner(model, s.prefill_len + s.decode_len + 1), "transformers": TorchRunner(hf)}
    fns, setup = {}, {}
    for who, r in runners.items():
        fns[f"{who}_prefill"] = lambda cache, r=r: r.prefill(cache, prompt)
        setup[f"{who}_prefill"] = r.fresh
        fns[f"{who}_decode"] = lambda prefilled, r=r: r.decode(prefilled, s.decode_len)
        setup[f"{who}_decode"] = lambda r=r: r.prefill(r.fresh(), prompt)
    tm = harness.time_calls(fns, warmup=1, repeats=s.repeats, setup=setup)
    if s.profile_dir:
        trace_dir = os.path.join(s.profile_dir, name)
        profile(trace_dir, {k: fns[k] for k in ("glm53_prefill", "glm53_decode")}, setup)
        log(f"[{name}] profiler trace of the glm53 calls: {trace_dir}")
    compile_s = tm["glm53_prefill"].warmup_s[0] + tm["glm53_decode"].warmup_s[0]
    toks_o, toks_t = tm["glm53_decode"].result, tm["transformers_decode"].result
    mis = first_mismatch(toks_o, toks_t)
    if mis is not None:
        log(f"WARNING [{name}]: greedy tokens differ from transformers at index {mis}: glm53 {toks_o[mis:mis + 4]} "
            f"vs transformers {toks_t[mis:mis + 4]} (a near-tie of the top logits, or an exact tie of indexer pool "
            "scores, which torch.topk breaks differently: glm53/layers/indexer.py)")  # fmt: skip
    lo, lt = tm["glm53_prefill"].result[1], tm["transformers_prefill"].result[1]
    logits_rel = float(np.abs(lo - lt).max() / np.abs(lt).max())
    rec = {
        "variant": variant,
        "model": {"hidden_size": cfg.hidden_size, "layer_types": list(cfg.layer_types),
                  "mlp_layer_types": list(cfg.mlp_layer_types), "n_routed_experts": cfg.n_routed_experts,
                  "num_experts_per_tok": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size,
                  "params": n_params},
        "build_s": build_s,
        "glm53_compile_s": compile_s,
        "prefill": _phase(tm["glm53_prefill"], tm["transformers_prefill"], s.prefill_len),
        "decode": _phase(tm["glm53_decode"], tm["transformers_decode"], s.decode_len),
        "greedy": {"agree": mis is None, "first_mismatch": mis, "glm53": toks_o, "transformers": toks_t},
        "prefill_last_logits_rel_diff": logits_rel,
    }  # fmt: skip
    for phase in ("prefill", "decode"):
        r = rec[phase]
        log(f"[{name}] {phase:7s} {r['tokens']:4d} tokens: glm53 {r['glm53']['median_s'] * 1e3:9.1f} ms "
            f"({r['glm53']['tokens_per_s']:8.1f} tok/s)  transformers {r['transformers']['median_s'] * 1e3:9.1f} ms "
            f"({r['transformers']['tokens_per_s']:8.1f} tok/s)  ratio {r['ratio']:6.2f}x")  # fmt: skip
    log(f"[{name}] greedy tokens agree: {mis is None}; prefill last-token logits rel diff {logits_rel:.1e}; "
        f"glm53 compile {compile_s:.1f}s")  # fmt: skip
    return rec


def run(
    models: Mapping[str, tuple[str, ModelConfig]], s: Settings, log: Callable[[str], None] = print
) -> dict:
    """Benchmarks every model, name -> (config variant, ModelConfig), with torch on every CPU core; the result."""
    torch.set_num_threads(os.cpu_count())
    return {
        "machine": harness.machine(
            ("flax", "numpy", "torch", "transformers"), torch_threads=torch.get_num_threads()
        ),
        "settings": {"configs": list(models), **dataclasses.asdict(s), "batch": 1, "dtype": "float32",
                     "transformers_attn": "eager"},
        "configs": {name: bench_config(name, variant, cfg, s, log) for name, (variant, cfg) in models.items()},
    }  # fmt: skip
