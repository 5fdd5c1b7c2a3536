"""Needle in a haystack for a code model: the trials and their scoring (`python -m experiments.needle`).

A trial of context length C and depth d is exactly C tokens of real code (the haystack: a window of consecutive
lines of Python sources) with one line inserted, the needle ``<indent><name> = <value>``, and a query line at
the end that asks for the value:

  * `name` is a fresh, plausible identifier (two words and a short suffix, e.g. ``retry_bucket_k7``) that does
    not occur in the trial's text; `value` a random integer of `DIGITS` digits;
  * the needle takes the indentation of the line it is inserted before (valid code inside a block), and so does
    the query, ``<indent><name> =`` for the ``assign`` form (`QUERIES`); the expected continuation is
    `` <value>``;
  * depth: the needle's first token sits at about d x (C - needle - query) tokens, i.e. 0 = the first line of the
    context, 1 = the line just before the query; it is inserted at a line boundary of the haystack, so the actual
    depth (`Trial.depth_actual`) is the nearest line's;
  * the text is tokenized as one piece with the model's tokenizer (no junction ever splits what the tokenizer
    would merge) and cut from the front to exactly C tokens (the context starts mid-line, as a window does).

Score: exact match. Greedy decoding writes the value iff at every value position the argmax of the logits,
given the context and the value's earlier tokens, is the value's token, and the number ends there (the next
argmax is not a token that continues a number: a digit, ``_`` or ``.`` first, `number_continuations`). So one
teacher-forced forward over context + value tokens decides it (`predict`: the argmax and the value's
log-probability at those positions, batched rows of one context length); tests/test_needle.py checks the
identity against the serving engine's greedy decoding.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53 import build
from glm53.ablation import llama, needle_report, pipeline
from glm53.ablation.variants import Variant, expert_bytes
from glm53.config.kernels import KernelConfig
from glm53.data.corpus import Corpus, find_sources
from glm53.errors import ConfigError, DataError
from glm53.files import write_json
from glm53.progress import Progress
from glm53.quant import ggml
from glm53.tokenizer import load_tokenizer

RESULTS = "results.json"
DIGITS = 5  # the value: a random integer of this many digits
QUERIES = {
    "assign": "{name} =",  # the needle's own start: the model completes the line
    "assert": "assert {name} ==",
}
DEFAULT_QUERY = "assign"
WORDS = (
    "anchor", "batch", "bucket", "buffer", "cache", "chunk", "cursor", "delta", "depth", "epoch", "frame", "gate",
    "handle", "index", "limit", "margin", "mask", "node", "offset", "pivot", "pool", "prefix", "quota", "ratio",
    "retry", "scale", "seed", "shard", "slot", "span", "stride", "tally", "tick", "token", "vector", "weight",
    "window", "budget", "flux", "grain", "ledger", "notch", "orbit", "parcel", "ripple", "signal", "tether",
)  # fmt: skip
_INDENT = re.compile(r"[ \t]*")


# ------------------------------------------------------------------------------------------------ the haystack
@dataclasses.dataclass(frozen=True)
class Haystack:
    """The lines (each with its newline) of the haystack files, in order; `label` says where they come from."""

    lines: tuple[str, ...]
    label: str
    files: int

    def text(self, start: int, stop: int) -> str:
        """Lines start .. stop - 1, cyclically (the last file is followed by the first)."""
        n = len(self.lines)
        return "".join(self.lines[i % n] for i in range(start, stop))

    def indent(self, i: int) -> str:
        """The indentation of line i, or of the next non-blank line when it is blank."""
        n = len(self.lines)
        for j in range(i, i + min(n, 200)):
            line = self.lines[j % n]
            if line.strip():
                return _INDENT.match(line).group(0)
        return ""


def haystack_from(corpus: Corpus, files, label: str) -> Haystack:
    lines: list[str] = []
    for rel in files:
        text = corpus.read(rel)
        lines += (text if text.endswith("\n") else text + "\n").splitlines(keepends=True)
    return Haystack(tuple(lines), label, len(files))


def folder_haystack(folder: str, flag: str = "--haystack") -> Haystack:
    """Every readable UTF-8 ``.py`` file under `folder` (`glm53.data.corpus.find_sources`); ConfigError naming
    `flag` when there is none."""
    try:
        corpus = find_sources(folder, exclude=("__pycache__",))
    except DataError as e:
        raise ConfigError(f"{flag}={folder}: {e}") from None
    hay = haystack_from(corpus, corpus.files, f"{len(corpus.files)} .py files under {folder}")
    if not any(line.strip() for line in hay.lines):
        raise ConfigError(f"{flag}={folder}: the .py files hold no code")
    return hay


# ------------------------------------------------------------------------------------------------ trials
@dataclasses.dataclass(frozen=True)
class Trial:
    context: int  # tokens of the context, exactly
    depth: float  # the depth asked for
    index: int  # the trial's number in its (context, depth) cell
    tokens: tuple[int, ...]  # the context: haystack with the needle, then the query
    value: tuple[int, ...]  # the expected continuation's tokens (`` <value>``)
    name: str
    number: int
    position: int  # the needle line's first token in `tokens`
    needle_tokens: int  # tokens of the needle line alone
    query_tokens: int  # tokens of the query line alone

    @property
    def depth_actual(self) -> float:
        span = self.context - self.needle_tokens - self.query_tokens
        return min(1.0, max(0.0, self.position / span)) if span > 0 else 0.0

    def record(self) -> dict:
        """What results.json keeps of the trial (the tokens follow from the seed)."""
        return {"context": self.context, "depth": self.depth, "trial": self.index, "name": self.name,
                "value": self.number, "position": self.position, "depth_actual": round(self.depth_actual, 4),
                "value_tokens": len(self.value)}  # fmt: skip


def make_name(rng: np.random.Generator) -> str:
    a, b = rng.choice(len(WORDS), 2, replace=False)
    return f"{WORDS[a]}_{WORDS[b]}_{'kqvxz'[rng.integers(5)]}{rng.integers(10)}"


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def build_trial(hay: Haystack, tok, context: int, depth: float, rng: np.random.Generator, *,
                query: str = DEFAULT_QUERY, index: int = 0) -> Trial:  # fmt: skip
    """One trial (module docstring); ConfigError naming --contexts when `context` cannot hold the needle and the
    query, naming --haystack when the haystack is shorter than the context."""
    if query not in QUERIES:
        raise ConfigError(f"--query={query}: unknown query form; choose one of {sorted(QUERIES)}")
    n = len(hay.lines)
    k = int(rng.integers(n))  # the needle goes before line k
    indent = hay.indent(k)
    name, number = make_name(rng), int(rng.integers(10 ** (DIGITS - 1), 10**DIGITS))
    needle = f"{indent}{name} = {number}\n"
    q_text = indent + QUERIES[query].format(name=name)
    q_ids, qv_ids = _encode(tok, q_text), _encode(tok, f"{q_text} {number}")
    if qv_ids[: len(q_ids)] != q_ids or len(qv_ids) == len(q_ids):
        raise ConfigError(f"--query={query}: the tokenizer merges the query {q_text!r} with the value that "
                          "follows it; choose another query form")  # fmt: skip
    value = tuple(qv_ids[len(q_ids) :])
    n_needle, n_query = len(_encode(tok, needle)), len(q_ids)
    span = context - n_needle - n_query
    if span < 0:
        raise ConfigError(f"--contexts: {context} tokens cannot hold the needle line ({n_needle} tokens) and the "
                          f"query ({n_query} tokens); use at least {n_needle + n_query}")  # fmt: skip
    want = context - round(depth * span)  # tokens from the needle's first to the end of the context

    def after(m: int) -> str:
        return needle + hay.text(k, m) + q_text

    def count(m: int) -> int:
        return len(_encode(tok, after(m)))

    # the largest m with count(m) <= want (count grows with m), then m + 1 if it is nearer without overflowing
    short = ConfigError(f"--haystack: {hay.label} holds fewer tokens than a context of {context}")
    lo, step = k, 1
    while count(lo + step) <= want:
        lo, step = lo + step, step * 2
        if lo - k >= n:
            raise short
    hi = lo + step  # count(hi) > want
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= want else (lo, mid)
    m, t_after = lo, count(lo)
    t_next = count(m + 1)
    if t_next <= context and t_next - want < want - t_after:
        m, t_after = m + 1, t_next
    tail = after(m)
    back = 8  # lines before the needle: doubled until the text holds at least `context` tokens
    while True:
        back = min(back, n - (m - k))  # never a line twice
        head = hay.text(k - back, k)
        ids = _encode(tok, head + tail)
        if len(ids) >= context:
            break
        if back == n - (m - k):
            raise short
        back *= 2
    if name in head or name in hay.text(k, m):  # a name met in the text is not fresh: draw the trial again
        return build_trial(hay, tok, context, depth, rng, query=query, index=index)
    return Trial(context, depth, index, tuple(ids[-context:]), value, name, number, max(0, context - t_after),
                 n_needle, n_query)  # fmt: skip


def build_trials(hay: Haystack, tok, contexts, depths, trials: int, seed: int, query: str = DEFAULT_QUERY):
    """Every trial of the grid, in (context, depth, trial) order; trial t of a cell draws from the generator
    seeded (seed, context, depth index, t), so a cell's trials do not depend on the rest of the grid."""
    out = []
    for c in contexts:
        for j, d in enumerate(depths):
            for t in range(trials):
                rng = np.random.default_rng([seed, c, j, t])
                out.append(build_trial(hay, tok, c, d, rng, query=query, index=t))
    return out


# ------------------------------------------------------------------------------------------------ scoring
def number_continuations(tok, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: the tokens whose text starts with a digit, ``_`` or ``.`` (after the value, such a
    token would make another number)."""
    out = np.zeros(vocab_size, bool)
    for i in range(vocab_size):
        text = tok.decode([i])
        out[i] = bool(text) and (text[0].isdigit() or text[0] in "_.")
    return out


def predict(model, contexts: list, values: list, *, rows: int = 8, progress=None):
    """Teacher-forced predictions of the value after each context (every context of one length C): per context,
    (argmax [n + 1] at positions C - 1 .. C - 1 + n, log-probability of the n value tokens), one forward of
    context + value per row, `rows` rows per forward (rows padded at the end; the model is causal, so padding
    after a position does not change its logits). `progress`: called with the number of rows after each forward."""
    c = len(contexts[0])
    if any(len(x) != c for x in contexts):
        raise ValueError("predict: every context of one call must have the same length")
    width = max(len(v) for v in values)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, targets):
        m = nnx.merge(graphdef, state)
        h, _ = m.hidden(tokens)
        lp = jax.nn.log_softmax(m.logits(h[:, c - 1 : c + width]), axis=-1)
        picked = jnp.take_along_axis(lp[:, :width], targets[..., None], axis=-1)[..., 0]
        return jnp.argmax(lp, axis=-1), picked

    preds, logps = [], []
    for s in range(0, len(contexts), rows):
        batch = list(range(s, min(s + rows, len(contexts))))
        batch += [batch[-1]] * (rows - len(batch))  # a fixed shape: one program per context length
        tokens = np.zeros((rows, c + width), np.int32)
        targets = np.zeros((rows, width), np.int32)
        for r, i in enumerate(batch):
            v = values[i]
            tokens[r, :c], tokens[r, c : c + len(v)], targets[r, : len(v)] = contexts[i], v, v
        am, lp = jax.device_get(fwd(state, jnp.asarray(tokens), jnp.asarray(targets)))
        for r, i in enumerate(batch[: min(rows, len(contexts) - s)]):
            n = len(values[i])
            preds.append(np.asarray(am[r, : n + 1]))
            logps.append(float(np.sum(lp[r, :n])))
        if progress is not None:
            progress(min(rows, len(contexts) - s))
    return preds, logps


def exact_match(pred, value, continues: np.ndarray) -> bool:
    """Whether greedy decoding writes exactly `value`: pred[:n] == value and pred[n] does not continue a number."""
    n = len(value)
    return bool(np.array_equal(np.asarray(pred[:n]), np.asarray(value)) and not continues[int(pred[n])])


def rows_for(context: int, width: int, batch_tokens: int) -> int:
    """Rows per forward: as many as fit `batch_tokens` tokens (at least 1)."""
    return max(1, batch_tokens // (context + width))


def trial_results(trials: list[Trial], preds, logps, tok, continues) -> list[dict]:
    return [{"correct": exact_match(p, t.value, continues), "predicted": tok.decode([int(x) for x in p]),
             "value_logprob": round(lp, 6)} for t, p, lp in zip(trials, preds, logps)]  # fmt: skip


def cells(trials: list[Trial], results: list[dict]) -> list[dict]:
    """Accuracy per (context, depth): trials, correct, accuracy, mean actual depth, mean value log-probability."""
    out: dict[tuple[int, float], dict] = {}
    for t, r in zip(trials, results):
        cell = out.setdefault((t.context, t.depth), {"context": t.context, "depth": t.depth, "trials": 0,
                                                     "correct": 0, "depth_actual": 0.0, "value_logprob": 0.0})
        cell["trials"] += 1
        cell["correct"] += int(r["correct"])
        cell["depth_actual"] += t.depth_actual
        cell["value_logprob"] += r["value_logprob"]
    for cell in out.values():
        n = cell["trials"]
        cell["accuracy"] = cell["correct"] / n
        cell["depth_actual"] = round(cell["depth_actual"] / n, 4)
        cell["value_logprob"] = round(cell["value_logprob"] / n, 4)
    return list(out.values())


def check_grid(contexts, depths, trials: int) -> None:
    """ConfigError naming the flag for an empty grid, a depth outside [0, 1], a context < 2 or trials < 1."""
    if not contexts:
        raise ConfigError("--contexts: give at least one context length (tokens), e.g. 256,512,1024")
    if not depths:
        raise ConfigError("--depths: give at least one depth in [0, 1], e.g. 0,0.5,1")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ConfigError(f"--depths: every depth must be in [0, 1] (a fraction of the context), got {bad}")
    small = [c for c in contexts if c < 2]
    if small:
        raise ConfigError(f"--contexts: context lengths are token counts >= 2, got {small}")
    if len(set(contexts)) != len(contexts) or len(set(depths)) != len(depths):
        raise ConfigError("--contexts / --depths: a value is listed twice")
    if trials < 1:
        raise ConfigError(f"--trials: at least 1 trial per cell, got {trials}")


# ------------------------------------------------------------------------------------------------ the run
@dataclasses.dataclass(frozen=True)
class NeedleSetup:
    """The grid and how it runs (experiments/needle.py's flags)."""

    contexts: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int = 4
    seed: int = 0
    query: str = DEFAULT_QUERY
    batch_tokens: int = 8192  # tokens per forward (rows x (context + value))
    layout: str = "planes"  # how a variant keeps its quantized experts
    imatrix: str = ""  # +imatrix variants: this imatrix GGUF ("": computed from the validation split)

    def __post_init__(self):
        check_grid(self.contexts, self.depths, self.trials)
        if self.query not in QUERIES:
            raise ConfigError(f"--query={self.query}: unknown query form; choose one of {sorted(QUERIES)}")
        if self.batch_tokens < 1:
            raise ConfigError(f"--batch_tokens: must be positive, got {self.batch_tokens}")


def score_model(model, trials: list[Trial], tok, continues, batch_tokens: int, bar=None) -> list[dict]:
    """`trial_results` of every trial on `model`, one `predict` call (one program) per context length."""
    out: list[dict | None] = [None] * len(trials)
    for c in sorted({t.context for t in trials}):
        idx = [i for i, t in enumerate(trials) if t.context == c]
        width = max(len(trials[i].value) for i in idx)
        rows = min(len(idx), rows_for(c, width, batch_tokens))
        preds, logps = predict(model, [list(trials[i].tokens) for i in idx], [list(trials[i].value) for i in idx],
                               rows=rows, progress=None if bar is None else bar.update)  # fmt: skip
        for i, r in zip(idx, trial_results([trials[i] for i in idx], preds, logps, tok, continues)):
            out[i] = r
    return out  # type: ignore[return-value]


def summarize(name: str, trials: list[Trial], results: list[dict], seconds: float, **extra) -> dict:
    correct = sum(r["correct"] for r in results)
    return {"name": name, **extra, "accuracy": correct / len(results), "correct": correct,
            "trials": len(results), "seconds": round(seconds, 1), "cells": cells(trials, results),
            "results": results}  # fmt: skip


def run(weights: str, label: str, variants: list[Variant], hay: Haystack, s: NeedleSetup, out: str, *,
        log=print) -> dict:  # fmt: skip
    """The base model (as "base") and each variant on the same trials; results.json in `out` (rewritten
    atomically after each model; a rerun of the same setup skips the models already there), then the report
    (`needle_report.write`: the markdown tables and the heatmap PNG). Every input is checked, and every trial
    built, before any model is loaded."""
    cfg = build.weights_config(weights)
    if variants and not ggml.available():
        raise ConfigError(f"--variants: ggml's quantizer (llama.cpp's libggml-base) cannot be loaded: {llama.INSTALL} "
                          "(or --variants= : the base model alone)")  # fmt: skip
    if s.imatrix and not os.path.isfile(s.imatrix):
        raise ConfigError(f"--imatrix={s.imatrix}: no such file")
    need_tokens = any(v.imatrix for v in variants) and not s.imatrix
    if need_tokens and not os.path.isfile(os.path.join(weights, "tokenizer.json")):
        raise ConfigError(f"--imatrix: the +imatrix variants need an importance matrix, and {weights} has no "
                          "tokenizer.json to compute one from its validation split: give --imatrix=FILE")  # fmt: skip
    tok = load_tokenizer(weights, vocab_size=cfg.vocab_size)
    trials = build_trials(hay, tok, s.contexts, s.depths, s.trials, s.seed, s.query)
    longest = max(t.context + len(t.value) for t in trials)
    if longest > cfg.max_position_embeddings:
        raise ConfigError(f"--contexts: {longest} tokens exceed the model's max_position_embeddings "
                          f"{cfg.max_position_embeddings}")  # fmt: skip
    header = {"base": label, "haystack": hay.label, "tokenizer": type(tok).__name__, "query": s.query,
              "query_text": QUERIES[s.query], "digits": DIGITS, "contexts": list(s.contexts),
              "depths": list(s.depths), "trials_per_cell": s.trials, "seed": s.seed}  # fmt: skip
    os.makedirs(out, exist_ok=True)
    results = pipeline.read_results(os.path.join(out, RESULTS), header)
    results["trials"] = [t.record() for t in trials]
    done = {v["name"] for v in results["variants"]}
    todo = [v for v in variants if v.name not in done]
    log(f"needle: {len(trials)} trials ({len(s.contexts)} contexts x {len(s.depths)} depths x {s.trials}) in "
        f"{hay.label}; base + {len(variants)} variants, {len(done)} already in {RESULTS}")  # fmt: skip
    continues = number_continuations(tok, cfg.vocab_size)
    models = int("base" not in done) + len(todo)
    with Progress(models * len(trials), desc="needle", unit="trial") as bar:
        base_model = None
        if "base" not in done or todo:  # the base: the reference expert kernel, as the ablation's base
            t0 = time.time()
            _, base_model = build.load_model(weights, dtype=jnp.float32, with_mtp=False,
                                             kernels=KernelConfig().replace(moe="reference"))  # fmt: skip
            if "base" not in done:
                bar.write(build.describe_model(base_model, weights=weights, label=label), log)
                r = score_model(base_model, trials, tok, continues, s.batch_tokens, bar)
                _record(results, out, summarize("base", trials, r, time.time() - t0), bar, log)
        imp = None
        if todo:
            params = pipeline.layer_params(base_model)
            if any(v.imatrix for v in todo):
                imp, results["imatrix"] = pipeline.variant_imatrix(base_model, weights, out, path=s.imatrix)
        del base_model
        for v in todo:
            t0 = time.time()
            path, model, int8 = pipeline.variant_model(out, cfg, params, v, layout=s.layout, imp=imp)
            nbytes, nweights = expert_bytes(v, cfg)
            extra = {"gguf": os.path.basename(path), "bpw": round(8 * nbytes / nweights, 4)}
            extra |= {"latent_cache_dtype": v.latent} if v.latent != "auto" else {}
            extra |= {"int8_matrices": int8} if int8 else {}
            r = score_model(model, trials, tok, continues, s.batch_tokens, bar)
            del model
            _record(results, out, summarize(v.name, trials, r, time.time() - t0, **extra), bar, log)
    needle_report.write(out, results, log=log)
    return results


def _record(results: dict, out: str, entry: dict, bar, log) -> None:
    results["variants"].append(entry)
    write_json(os.path.join(out, RESULTS), results)
    lp = np.mean([r["value_logprob"] for r in entry["results"]])
    bar.write(f"{entry['name']}: exact match {100 * entry['accuracy']:.1f}% ({entry['correct']}/{entry['trials']}), "
              f"mean log p(value) {lp:.2f}, {entry['seconds']} s", log)  # fmt: skip
