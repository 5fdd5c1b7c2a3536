"""llama-perplexity's ``--kl-divergence`` statistics, with the estimators of llama.cpp's
tools/perplexity/perplexity.cpp (`kl_divergence`, `mean_and_uncertainty`, `covariance`, `percentile`).

Chunks of n_ctx tokens are scored from position ``n_ctx // 2`` on (`scored_positions`): the logits at positions
n_ctx/2 .. n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1, n_ctx - 1 - n_ctx/2 predictions per chunk. Per prediction
(`token_stats`): the NLL of the next token under Q and under the base, KL(base || Q) summed over the vocabulary
entries whose base log-probability exceeds -16 (llama.cpp's cut-off), Δp = p_Q(token) - p_base(token), and
whether both argmaxes agree (the first maximum, as llama.cpp scans). `summarize` turns them into the summary
llama-perplexity prints.

Differences from llama.cpp, all below its own float32 rounding: everything is float64, and the base
log-probabilities are used as they are rather than stored as uint16 steps of (max - min) / 65535 (its logits
file), so identical logits give a KL divergence of exactly 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

KLD_CUTOFF = -16.0  # base log-probabilities at or below this are left out of the KL sum (as llama.cpp)
PERCENTILES = (("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("median", 0.5), ("p10", 0.10),
               ("p5", 0.05), ("p1", 0.01), ("p0_1", 0.001))  # fmt: skip
DIST_KEYS = ("mean", "sem", "max", *(k for k, _ in PERCENTILES), "min")


def scored_positions(n_ctx: int) -> slice:
    """The positions of a chunk whose logits are scored: n_ctx // 2 .. n_ctx - 2 (each predicts the next token)."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4 to score the second half of a chunk, got {n_ctx}")
    return slice(n_ctx // 2, n_ctx - 1)


@dataclasses.dataclass
class TokenStats:
    """Per-prediction values (float64 [N]; same_top bool [N])."""

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray

    @staticmethod
    def concat(parts: list[TokenStats]) -> TokenStats:
        return TokenStats(
            *(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(TokenStats))
        )


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def token_stats(logits: np.ndarray, logits_base: np.ndarray, targets: np.ndarray) -> TokenStats:
    """Per-prediction statistics of Q's `logits` [N, V] against the base's [N, V]; `targets` [N]: the next tokens."""
    logits, logits_base = np.asarray(logits), np.asarray(logits_base)
    targets = np.asarray(targets, np.int64)
    if logits.shape != logits_base.shape or logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_stats: logits {logits.shape}, base {logits_base.shape}, targets {targets.shape}: "
                         "expected [N, V], [N, V], [N]")  # fmt: skip
    lq, lb = _log_softmax(logits), _log_softmax(logits_base)
    rows = np.arange(len(targets))
    nll, nll_base = -lq[rows, targets], -lb[rows, targets]
    keep = lb > KLD_CUTOFF
    kld = np.where(keep, np.exp(lb) * (lb - lq), 0.0).sum(axis=-1)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    same = np.argmax(logits, axis=-1) == np.argmax(logits_base, axis=-1)
    return TokenStats(nll, nll_base, kld, p_diff, same)


def chunk_stats(logits_ct: np.ndarray, logits_base_ct: np.ndarray, tokens_ct: np.ndarray) -> TokenStats:
    """`token_stats` of the scored half of each chunk: logits [C, n_ctx, V], tokens [C, n_ctx]."""
    tokens_ct = np.asarray(tokens_ct)
    sl = scored_positions(tokens_ct.shape[1])
    parts = [
        token_stats(lq[sl], lb[sl], t[sl.start + 1 :])
        for lq, lb, t in zip(logits_ct, logits_base_ct, tokens_ct)
    ]
    return TokenStats.concat(parts)


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """(mean, its standard error) as llama.cpp: sqrt((E[x²] - E[x]²) / (n - 1)), 0 when n <= 10 or not positive."""
    n = len(values)
    if n < 1:
        return 0.0, 0.0
    f = float(np.sum(values)) / n
    df = float(np.sum(np.square(values))) / n - f * f
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's covariance of the two means: (E[ab] - E[a]E[b]) / (n - 1); 0 when n < 10."""
    n = len(a)
    if n < 10:
        return 0.0
    return (float(np.sum(a * b)) / n - float(np.sum(a)) / n * float(np.sum(b)) / n) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation at fraction * (n - 1) of the sorted values."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)])


def _median(s: np.ndarray) -> float:
    n = len(s)
    return float(0.5 * (s[n // 2] + s[n // 2 - 1])) if n % 2 == 0 else float(s[n // 2])


def distribution(values: np.ndarray) -> dict[str, float]:
    """mean ± sem, max, the `PERCENTILES` (median: the middle value or the mean of the two), min."""
    s = np.sort(np.asarray(values, np.float64))
    mean, sem = mean_and_uncertainty(s)
    out = {"mean": mean, "sem": sem, "max": float(s[-1])}
    for key, frac in PERCENTILES:
        out[key] = _median(s) if key == "median" else percentile(s, frac)
    out["min"] = float(s[0])
    return out


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def summarize(ts: TokenStats) -> dict:
    """The llama-perplexity summary: ppl, ppl_sem, ppl_base, ppl_base_sem, ln_ppl_ratio (± ln_ppl_ratio_sem),
    ppl_ratio, cor_ln_ppl (Cor(ln PPL(Q), ln PPL(base)); None when undefined), kld {DIST_KEYS}, delta_p
    {DIST_KEYS, rms, rms_sem}, same_top1 ± same_top1_sem, n_tokens."""
    n = len(ts.nll)
    if n < 2:
        raise ValueError(f"summarize: need at least 2 scored tokens, got {n}")
    lq, lq_unc = mean_and_uncertainty(ts.nll)
    lb, lb_unc = mean_and_uncertainty(ts.nll_base)
    cov = covariance(ts.nll, ts.nll_base)
    cor = cov / (lq_unc * lb_unc) if lq_unc > 0 and lb_unc > 0 else float("nan")
    ratio_unc = math.sqrt(max(0.0, lq_unc**2 + lb_unc**2 - 2 * cov))
    delta = distribution(ts.p_diff)
    mse, mse_unc = mean_and_uncertainty(np.square(ts.p_diff))
    rms = math.sqrt(mse)
    delta.update(rms=rms, rms_sem=0.5 / rms * mse_unc if rms > 0 else 0.0)
    p = float(np.mean(ts.same_top))
    return {
        "ppl": math.exp(lq), "ppl_sem": math.exp(lq) * lq_unc,
        "ppl_base": math.exp(lb), "ppl_base_sem": math.exp(lb) * lb_unc,
        "ln_ppl_ratio": lq - lb, "ln_ppl_ratio_sem": ratio_unc, "ppl_ratio": math.exp(lq - lb),
        "cor_ln_ppl": _finite(cor),
        "kld": distribution(ts.kld), "delta_p": delta,
        "same_top1": p, "same_top1_sem": math.sqrt(p * (1 - p) / (n - 1)),
        "n_tokens": n,
    }  # fmt: skip


def render(s: dict) -> str:
    """The summary as llama-perplexity prints it (percentages where it uses them)."""
    k, d = s["kld"], s["delta_p"]
    cor = "n/a" if s["cor_ln_ppl"] is None else f"{100 * s['cor_ln_ppl']:6.2f}%"
    lines = [
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_sem']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_sem']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {cor}",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_sem']:10.6f}",
        f"Mean    KLD: {k['mean']:10.6f} ± {k['sem']:10.6f}",
        f"Maximum KLD: {k['max']:10.6f}",
        *(f"{name:<7} KLD: {k[key]:10.6f}" for key, name in zip([p for p, _ in PERCENTILES],
          ["99.9%", "99.0%", "95.0%", "90.0%", "Median", "10.0%", " 5.0%", " 1.0%", " 0.1%"])),
        f"Minimum KLD: {k['min']:10.6f}",
        f"Mean    Δp: {100 * d['mean']:6.3f} ± {100 * d['sem']:5.3f} %",
        f"RMS Δp    : {100 * d['rms']:6.3f} ± {100 * d['rms_sem']:5.3f} %",
        f"Same top p: {100 * s['same_top1']:6.3f} ± {100 * s['same_top1_sem']:5.3f} %",
    ]  # fmt: skip
    return "\n".join(lines)
