"""Whole-model throughput: glm53 against transformers' eager `Glm5NextForConditionalGeneration` on the same weights.

  python -m experiments.bench_model                                  # tiny + small, a few minutes on 2 cores
  python -m experiments.bench_model --configs=small --prefill_len=128 --decode_len=32 --repeats=5 --out=b.json

For each config (``tiny`` = configs/tiny.py:default, ``small`` = configs/tiny.py:small, or any other variant name
of configs/tiny.py) a randomized transformers model is built (glm53.testing.hf_torch), saved with
save_pretrained and loaded into glm53 through glm53.checkpoint.hf.load_hf_model, so both run the same fp32
weights in one process. Measured per repeat, glm53 and transformers interleaved, batch 1:

  prefill  one forward over a prompt of --prefill_len tokens (glm53: `Generator.forward`, one jitted call with a
           donated cache; transformers: `model(input_ids, use_cache=True)` under torch.no_grad);
  decode   --decode_len greedy steps, each one forward of the last token plus a host-side argmax (glm53: the same
           jitted call; transformers: `model(..., past_key_values=..., use_cache=True)`).

glm53 is warmed up (compiled) by one untimed repeat, transformers likewise; torch uses os.cpu_count() threads.
Prints one line per (config, phase): medians, tokens/s of both and the ratio glm53 / transformers (> 1: glm53
is faster); warns when the greedy tokens differ (first mismatch index). --out writes JSON: machine (backend,
devices, cpu count, versions), settings, and per config: model sizes, compile time, per phase the per-repeat
times, median_s and tokens_per_s of both and ratio, and the greedy tokens with their agreement.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time

from absl import app, flags

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "small"], "configs/tiny.py variants (tiny = default)")
_PREFILL = flags.DEFINE_integer("prefill_len", 64, "prompt tokens (one-shot prefill)")
_DECODE = flags.DEFINE_integer("decode_len", 16, "greedy decode steps at batch 1")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed repeats (medians are reported)")
_SEED = flags.DEFINE_integer("seed", 0, "weights and prompt seed")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")

ALIASES = {"tiny": "default"}


def machine() -> dict:
    """Backend, devices, CPU count and library versions of this process."""
    import flax
    import jax
    import jaxlib
    import numpy as np
    import torch
    import transformers

    return {
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
                     "numpy": np.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }  # fmt: skip


class Glm53Runner:
    """glm53 greedy prefill + decode through `Generator.forward` (one jitted program per shape, donated cache)."""

    def __init__(self, model, max_len: int):
        from glm53 import generate

        self.gen = generate.Generator(model, prefill_chunk=max_len)
        self.max_len = max_len

    def run(self, prompt_bt, steps: int) -> tuple[float, float, list[int], object]:
        """(prefill s, decode s, greedy tokens [steps + 1], last-position prefill logits [V])."""
        import jax
        import numpy as np

        cache = self.gen.init_cache(1, self.max_len)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        _, logits, cache = self.gen.forward(cache, prompt_bt)
        first = np.asarray(logits[0, -1])
        tok = int(np.argmax(first))
        t1 = time.perf_counter()
        toks = [tok]
        for _ in range(steps):
            _, logits, cache = self.gen.forward(cache, np.asarray([[tok]], np.int32))
            tok = int(np.argmax(np.asarray(logits)[0, -1]))
            toks.append(tok)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, toks, first


class TorchRunner:
    """transformers greedy prefill + decode with its own cache (eager attention, fp32, no_grad)."""

    def __init__(self, model):
        self.model = model

    def run(self, prompt_bt, steps: int) -> tuple[float, float, list[int], object]:
        import torch

        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model(input_ids=torch.as_tensor(prompt_bt, dtype=torch.long), use_cache=True)
            first = out.logits[0, -1].float().numpy()
            tok = int(first.argmax())
            t1 = time.perf_counter()
            toks, pkv = [tok], out.past_key_values
            for _ in range(steps):
                out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                toks.append(tok)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, toks, first


def _phase(ours: list[float], theirs: list[float], tokens: int) -> dict:
    import numpy as np

    mo, mt = float(np.median(ours)), float(np.median(theirs))
    return {
        "tokens": tokens,
        "glm53": {"times_s": ours, "median_s": mo, "tokens_per_s": tokens / mo},
        "transformers": {"times_s": theirs, "median_s": mt, "tokens_per_s": tokens / mt},
        "ratio": mt / mo,  # glm53 tokens/s over transformers tokens/s
    }


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_config(name: str, prefill_len: int, decode_len: int, repeats: int, seed: int, log=print) -> dict:
    """Builds the pair for configs/tiny.py variant `name` and measures both; the per-config JSON record."""
    import jax.numpy as jnp
    import numpy as np

    from configs import tiny
    from glm53.checkpoint import hf as hf_ckpt
    from glm53.config import model_config_from_dict
    from glm53.model import count_params
    from glm53.testing.hf_torch import random_hf_model

    cfg = model_config_from_dict(tiny.model_config(ALIASES.get(name, name)))
    t = time.perf_counter()
    hf = random_hf_model(cfg, seed)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        _, model = hf_ckpt.load_hf_model(folder, dtype=jnp.float32, with_mtp=False)
    build_s = time.perf_counter() - t
    n_params = count_params(model)
    log(f"[{name}] hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({''.join(k[0] for k in cfg.layer_types)}"
        f"), {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, {n_params / 1e6:.1f}M params; "
        f"built + saved + loaded in {build_s:.1f}s")  # fmt: skip

    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, prefill_len)).astype(np.int32)
    ours = Glm53Runner(model, prefill_len + decode_len + 1)
    theirs = TorchRunner(hf)
    t = time.perf_counter()
    ours.run(prompt, decode_len)  # compiles the prefill and decode programs
    compile_s = time.perf_counter() - t
    theirs.run(prompt, decode_len)
    times = {k: [] for k in ("op", "od", "tp", "td")}
    for _ in range(repeats):
        op, od, toks_o, lo = ours.run(prompt, decode_len)
        tp, td, toks_t, lt = theirs.run(prompt, decode_len)
        for k, v in zip(times, (op, od, tp, td)):
            times[k].append(v)
    mis = first_mismatch(toks_o, toks_t)
    if mis is not None:
        log(f"WARNING [{name}]: greedy tokens differ from transformers at index {mis}: glm53 {toks_o[mis:mis + 4]} "
            f"vs transformers {toks_t[mis:mis + 4]} (a near-tie of the top logits, or an exact tie of indexer pool "
            "scores, which torch.topk breaks differently: glm53/layers/indexer.py)")  # fmt: skip
    logits_rel = float(np.abs(lo - lt).max() / np.abs(lt).max())
    rec = {
        "variant": ALIASES.get(name, name),
        "model": {"hidden_size": cfg.hidden_size, "layer_types": list(cfg.layer_types),
                  "mlp_layer_types": list(cfg.mlp_layer_types), "n_routed_experts": cfg.n_routed_experts,
                  "num_experts_per_tok": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size,
                  "params": n_params},
        "build_s": build_s,
        "glm53_compile_s": compile_s,
        "prefill": _phase(times["op"], times["tp"], prefill_len),
        "decode": _phase(times["od"], times["td"], decode_len),
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


def main(argv):
    del argv
    import torch

    from configs import tiny

    unknown = [c for c in _CONFIGS.value if ALIASES.get(c, c) not in tiny.VARIANTS]
    if unknown:
        raise app.UsageError(
            f"--configs: unknown {unknown}; choose from tiny, {', '.join(sorted(tiny.VARIANTS))}"
        )
    for flag in (_PREFILL, _DECODE, _REPEATS):
        if flag.value < 1:
            raise app.UsageError(f"--{flag.name} must be >= 1, got {flag.value}")
    torch.set_num_threads(os.cpu_count())
    result = {
        "machine": machine(),
        "settings": {"configs": list(_CONFIGS.value), "prefill_len": _PREFILL.value, "decode_len": _DECODE.value,
                     "repeats": _REPEATS.value, "batch": 1, "dtype": "float32", "seed": _SEED.value,
                     "transformers_attn": "eager"},
        "configs": {},
    }  # fmt: skip
    m = result["machine"]
    print(
        f"backend {m['backend']}, {m['cpu_count']} CPUs (torch threads {m['torch_threads']}), jax "
        f"{m['versions']['jax']}, torch {m['versions']['torch']}, transformers {m['versions']['transformers']}"
    )
    for name in _CONFIGS.value:
        result["configs"][name] = bench_config(
            name, _PREFILL.value, _DECODE.value, _REPEATS.value, _SEED.value
        )
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
