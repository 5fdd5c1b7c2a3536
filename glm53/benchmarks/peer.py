"""Peer benchmark: glm53 against llama.cpp and transformers eager on the same weights, in one process.

The weights: a randomized transformers model of a config (glm53.testing.hf_torch.random_hf_model), saved as an
HF folder and converted by `glm53.checkpoint.gguf_export` to an F32 GGUF (every matrix F32), whose routed experts
are then re-quantized with llama.cpp's quantizer (`quantize_experts`) to each other format: Q8_0, Q4_K, IQ4_XS,
UD-IQ3_XXS. Only the routed experts are quantized; the non-expert matrices stay F32 in every file.

Per file the engines (glm53/benchmarks/peer_engines.py) are:
  glm53         `glm53.checkpoint.gguf` loads the file itself (f32, routed experts kept quantized as planes,
                kernels.moe "auto"); runs on the runtime's programs (glm53.benchmarks.greedy).
  llama_cpp     llama-cpp-python's C API, default CPU settings, F32 KV cache (exact logits for this arch).
  transformers  eager fp32 on the HF weights (the dense F32 reference): timed in the first file's rounds only,
                its row is the reference of every file's glm53/transformers ratio.

Phases, each timed by `harness.time_calls` (one warm-up call, then `repeats` rounds, the engines taking turns;
medians reported):
  prefill_P   one forward over a P-token prompt at batch 1 (last-position logits to the host).
  decode_bB   `decode_steps` greedy steps of B streams together after an untimed prefill of `prefill[0]` tokens
              per stream; tokens/s = B * decode_steps / median. llama.cpp decodes one llama_batch of B tokens
              with sequence ids 0..B-1 per step.
Thread count `threads`: llama.cpp n_threads / n_threads_batch and torch.set_num_threads; XLA's CPU client sizes
its own pool (all usable cores) and is only reported.

`run` returns the JSON result: machine, settings, model and per file: size, expert types, load time and per
phase each engine's timing and tokens_per_s and the ratios "glm53/llama_cpp" and "glm53/transformers" (glm53
tokens/s over the peer's; > 1: glm53 is faster); greedy agreement of glm53 with llama.cpp per decode batch
(first mismatch per stream) and the last-position prefill logits' difference.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import os
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from glm53 import logs
from glm53.benchmarks import harness
from glm53.benchmarks.model import first_mismatch
from glm53.benchmarks.peer_engines import Glm53Engine, LlamaCppEngine, TorchEngine, silence_llama_cpp
from glm53.checkpoint import gguf as gguf_ckpt
from glm53.checkpoint import gguf_export
from glm53.config import ModelConfig, QuantConfig
from glm53.progress import Progress
from glm53.quant.mixes import LAYOUTS
from glm53.testing.hf_torch import random_hf_model

FORMATS = ("F32", "Q8_0", "Q4_K", "IQ4_XS", "UD-IQ3_XXS")
ENGINES = ("glm53", "llama_cpp", "transformers")
PACKAGES = ("flax", "numpy", "torch", "transformers", "llama-cpp-python", "gguf")
XLA_THREADS = "XLA's CPU client: its own thread pool over the usable cores (not set by --threads)"


def _positive_ints(name: str, values) -> tuple[int, ...]:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name}: expected one or more positive integers, got {list(values)}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: repeated values in {list(values)}")
    return values


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to measure (module docstring). The decode prompt is `prefill[0]` tokens per stream."""

    formats: tuple[str, ...] = FORMATS
    prefill: tuple[int, ...] = (64, 512)
    batch: tuple[int, ...] = (1, 8)
    decode_steps: int = 32
    repeats: int = 3
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    seed: int = 0
    profile_dir: str | None = None
    layout: str = "reencoded"  # glm53's expert layout: on CPU the gather-free IQ2_S / IQ3_S decode is the fast one

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {self.layout!r}")
        formats = tuple(self.formats)
        unknown = [f for f in formats if f not in FORMATS]
        if not formats or unknown or len(set(formats)) != len(formats):
            raise ValueError(f"formats: expected distinct names among {list(FORMATS)}, got {list(formats)}")
        object.__setattr__(self, "formats", formats)
        object.__setattr__(self, "prefill", _positive_ints("prefill", self.prefill))
        object.__setattr__(self, "batch", _positive_ints("batch", self.batch))
        for name in ("decode_steps", "repeats", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")

    @property
    def decode_prompt(self) -> int:
        return self.prefill[0]

    def max_len(self, prompt: int) -> int:
        """Cache length of every stream: the prompt, the decode steps and one spare position."""
        return prompt + self.decode_steps + 1


# ------------------------------------------------------------------------------------------------ the files
def build_files(
    cfg: ModelConfig, s: Settings, folder: str, log: Callable[[str], None]
) -> tuple[object, dict]:
    """The random transformers model, its HF folder and GGUF files in `folder`; (torch model, {format: record})."""
    t = time.perf_counter()
    hf = random_hf_model(cfg, s.seed)
    hf_dir = os.path.join(folder, "hf")
    hf.save_pretrained(hf_dir)
    f32 = os.path.join(folder, "model-F32.gguf")
    gguf_export.convert_hf_to_gguf(hf_dir, f32, with_mtp=False)
    files = {}
    for fmt in s.formats:
        path = f32 if fmt == "F32" else os.path.join(folder, f"model-{fmt}.gguf")
        if fmt == "F32":
            with gguf_ckpt.open_gguf_model(f32) as g:
                types = {"F32": sum(1 for n in g.tensors if gguf_export.EXPERT_NAME.fullmatch(n))}
        else:
            types = dict(collections.Counter(gguf_export.quantize_experts(f32, path, fmt).values()))
        files[fmt] = {"path": path, "bytes": os.path.getsize(path), "expert_types": types,
                      "non_expert_types": "F32"}  # fmt: skip
    log(f"built the HF folder and {len(files)} GGUF files in {time.perf_counter() - t:.1f}s")
    return hf, files


def load_glm53(path: str, fmt: str, layout: str = "reencoded"):
    """glm53's model of one GGUF: f32, routed experts kept in the file's format (dense for F32) in `layout`,
    every kernel op "auto" (KernelConfig's default)."""
    quant = QuantConfig(experts="none" if fmt == "F32" else fmt, layout=layout)
    _, model, _ = gguf_ckpt.load_gguf_checkpoint(path, dtype=jnp.float32, quant=quant, with_mtp=False)
    return model


# ------------------------------------------------------------------------------------------------ measuring
def _engine_record(t: harness.Timing, tokens: int) -> dict:
    return {**t.to_dict(), "warmup_s": list(t.warmup_s), "tokens_per_s": tokens / t.median_s}


def measure(engines: dict, phase: str, s: Settings, prompts: np.ndarray) -> tuple[dict, dict]:
    """Times one phase ("prefill_P" / "decode_bB") on every engine; (JSON record, {engine: last output})."""
    kind, _, n = phase.partition("_")
    fns, setup = {}, {}
    if kind == "prefill":
        p = int(n)
        batch, tokens, x = 1, p, prompts[:1, :p]
        for name, e in engines.items():
            setup[name] = lambda e=e: e.fresh(1, s.max_len(p))
            fns[name] = lambda st, e=e: e.prefill(st, x)[1]
    else:
        batch = int(n.removeprefix("b"))
        tokens, x = batch * s.decode_steps, prompts[:batch, : s.decode_prompt]
        for name, e in engines.items():
            setup[name] = lambda e=e: e.prefill(e.fresh(batch, s.max_len(s.decode_prompt)), x)
            fns[name] = lambda st, e=e: e.decode(st, s.decode_steps)
    tm = harness.time_calls(fns, warmup=1, repeats=s.repeats, setup=setup)
    rec = {"tokens": tokens, "batch": batch, **{k: _engine_record(t, tokens) for k, t in tm.items()}}
    return rec, {k: t.result for k, t in tm.items()}


def _ratios(rec: dict) -> None:
    for peer in ("llama_cpp", "transformers"):
        if peer in rec:
            rec[f"glm53/{peer}"] = rec["glm53"]["tokens_per_s"] / rec[peer]["tokens_per_s"]


def _logits_diff(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max_abs": float(d.max()), "rel": float(d.max() / np.abs(b).max()),
            "top1_agree": bool((a.argmax(-1) == b.argmax(-1)).all())}  # fmt: skip


def _greedy(ours: np.ndarray, theirs: np.ndarray) -> dict:
    mis = [first_mismatch(a.tolist(), b.tolist()) for a, b in zip(ours, theirs)]
    return {"agree": all(m is None for m in mis), "first_mismatch": mis,
            "glm53": ours.tolist(), "peer": theirs.tolist()}  # fmt: skip


def _progress(fmt: str, phase: str, rec: dict) -> str:
    parts = [f"{k} {rec[k]['tokens_per_s']:8.1f}" for k in ENGINES if k in rec]
    ratios = [
        f"glm53/{p} {rec[f'glm53/{p}']:5.2f}x" for p in ("llama_cpp", "transformers") if f"glm53/{p}" in rec
    ]
    ref = " (transformers: F32 reference)" if rec.get("transformers", {}).get("reference_of") else ""
    return f"[{fmt:10s}] {phase:12s} tok/s: {', '.join(parts)}; {', '.join(ratios)}{ref}"


def _profile(engines: dict, phases: list[str], s: Settings, prompts: np.ndarray, fmt: str) -> str:
    """One call of each glm53 phase under `jax.profiler.trace` (profile_dir/fmt), annotated by phase."""
    out = os.path.join(s.profile_dir, fmt)
    e = engines["glm53"]
    with jax.profiler.trace(out):
        for phase in phases:
            kind, _, n = phase.partition("_")
            if kind == "prefill":
                st = e.fresh(1, s.max_len(int(n)))
                with jax.profiler.TraceAnnotation(f"glm53 {fmt} {phase}"):
                    e.prefill(st, prompts[:1, : int(n)])
            else:
                b = int(n.removeprefix("b"))
                st = e.prefill(e.fresh(b, s.max_len(s.decode_prompt)), prompts[:b, : s.decode_prompt])
                with jax.profiler.TraceAnnotation(f"glm53 {fmt} {phase}"):
                    e.decode(st, s.decode_steps)
    return out


def bench_file(fmt: str, info: dict, torch_engine, reference: dict | None, s: Settings, prompts, log) -> dict:
    """Measures every phase on one GGUF (transformers too when `reference` is None); the per-file record."""
    t = time.perf_counter()
    model = load_glm53(info["path"], fmt, s.layout)
    load_s = time.perf_counter() - t
    engines = {"glm53": Glm53Engine(model, prefill_chunk=max(s.prefill)),
               "llama_cpp": LlamaCppEngine(info["path"], s.threads)}  # fmt: skip
    if reference is None:
        engines["transformers"] = torch_engine
    phases = [f"prefill_{p}" for p in s.prefill] + [f"decode_b{b}" for b in s.batch]
    rec = {**{k: v for k, v in info.items() if k != "path"}, "file": os.path.basename(info["path"]),
           "glm53_load_s": load_s, "phases": {}, "greedy": {}, "prefill_logits": {}}  # fmt: skip
    try:
        for phase in phases:
            r, out = measure(engines, phase, s, prompts)
            if reference is not None and phase in reference:
                r["transformers"] = {**reference[phase]["transformers"], "reference_of": reference["format"]}
            _ratios(r)
            rec["phases"][phase] = r
            if phase.startswith("prefill"):
                rec["prefill_logits"][phase] = {
                    f"glm53_vs_{k}": _logits_diff(out["glm53"], out[k]) for k in out if k != "glm53"
                }
            else:
                rec["greedy"][phase] = {"vs_llama_cpp": _greedy(out["glm53"], out["llama_cpp"])}
                if "transformers" in out:
                    rec["greedy"][phase]["vs_transformers"] = _greedy(out["glm53"], out["transformers"])
            log(_progress(fmt, phase, r))
        rec["llama_cpp_context"] = engines["llama_cpp"].params()
        if s.profile_dir:
            rec["profile"] = _profile(engines, phases, s, prompts, fmt)
    finally:
        engines["llama_cpp"].close()
        del engines, model
        gc.collect()
    return rec


def _check_f32_agreement(rec: dict, log) -> None:
    for phase, g in rec["greedy"].items():
        v = g["vs_llama_cpp"]
        if not v["agree"]:
            log(f"WARNING [F32] {phase}: glm53's greedy tokens differ from llama.cpp's (first mismatch per stream "
                f"{v['first_mismatch']}); on F32 they must agree")  # fmt: skip


def run(
    cfg: ModelConfig,
    variant: str,
    s: Settings,
    log: Callable[[str], None] = print,
    folder: str | None = None,
    on_file: Callable[[dict], None] | None = None,
):
    """The whole benchmark (module docstring) with the files in `folder` (default: a temporary folder); the JSON.
    on_file(partial result): called after each file (e.g. to save what is measured so far)."""
    torch.set_num_threads(s.threads)
    silence_llama_cpp()
    logs.quiet_llama_cpp()  # llama.cpp's load logs only with --verbosity >= 0
    result = {
        "machine": harness.machine(PACKAGES, torch_threads=torch.get_num_threads(), threads=s.threads,
                                   llama_cpp_threads=s.threads, xla_threads=XLA_THREADS),
        "settings": {**dataclasses.asdict(s), "config": variant, "decode_prompt": s.decode_prompt,
                     "dtype": "float32", "quantized": "routed experts only; non-expert matrices F32 in every file",
                     "glm53": "runtime programs (serving engine), f32, experts kept quantized, kernels auto",
                     "llama_cpp": "llama-cpp-python C API, default CPU settings, F32 KV cache (type_k / type_v)",
                     "transformers": "eager fp32 on the HF weights, timed with the first file (F32 reference)"},
        "model": {"hidden_size": cfg.hidden_size, "layer_types": list(cfg.layer_types),
                  "mlp_layer_types": list(cfg.mlp_layer_types), "n_routed_experts": cfg.n_routed_experts,
                  "num_experts_per_tok": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size},
        "files": {},
    }  # fmt: skip
    prompts = np.random.default_rng(s.seed).integers(1, cfg.vocab_size, size=(max(s.batch), max(s.prefill)))
    prompts = prompts.astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        hf, files = build_files(cfg, s, folder or tmp, log)
        result["model"]["params"] = sum(p.numel() for p in hf.model.language_model.parameters())
        torch_engine, reference = TorchEngine(hf), None
        # a tqdm bar over the files on a terminal, the progress lines printed above it; elsewhere the lines alone
        with Progress(len(files), desc="bench_peer", unit="file", lines=False) as bar:
            say = functools.partial(bar.write, log=log)
            for fmt, info in files.items():
                bar.set_postfix(fmt)
                rec = bench_file(fmt, info, torch_engine, reference, s, prompts, say)
                if reference is None:
                    reference = {"format": fmt, **rec["phases"]}
                if fmt == "F32":
                    _check_f32_agreement(rec, say)
                result["files"][fmt] = rec
                result["summary"] = summary(result)
                if on_file is not None:
                    on_file(result)
                bar.update(1)
    return result


def summary(result: dict) -> dict:
    """{format: {phase: {engine tokens/s and the two ratios}}}: the README table's numbers."""
    out = {}
    for fmt, rec in result["files"].items():
        out[fmt] = {
            phase: {**{k: r[k]["tokens_per_s"] for k in ENGINES if k in r},
                    **{k: v for k, v in r.items() if k.startswith("glm53/")}}
            for phase, r in rec["phases"].items()
        }  # fmt: skip
    return out


def table(result: dict) -> str:
    """The summary as a markdown table: per file and phase, tokens/s of the three engines and the ratios."""
    rows = ["| file | phase | glm53 tok/s | llama.cpp tok/s | transformers tok/s (F32) | glm53 / llama.cpp | "
            "glm53 / transformers |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for fmt, phases in result["summary"].items():
        for phase, r in phases.items():
            rows.append(f"| {fmt} | {phase} | {r['glm53']:.1f} | {r['llama_cpp']:.1f} | {r['transformers']:.1f} | "
                        f"**{r['glm53/llama_cpp']:.2f}x** | {r['glm53/transformers']:.2f}x |")  # fmt: skip
    return "\n".join(rows)
