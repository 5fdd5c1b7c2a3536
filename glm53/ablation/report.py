"""The markdown report (`REPORT`: a table a reader can paste) and the PNGs of an ablation's results.json.

  kld_vs_bpw.png   mean and 99.9% KLD against bits per weight of the routed experts, with the Pareto front
                   (variants no cheaper variant beats on mean KLD)
  roles.png        one matrix role quantized at a time (variants gate=X,up=F32,down=F32 ...): mean KLD per role
  layers.png       one MoE layer quantized at a time (variants F32,N.gate=X,N.up=X,N.down=X): mean KLD per layer

The PNGs need matplotlib (the ``plot`` extra); without it the report is still written and says so.
"""

from __future__ import annotations

import os
import re

from glm53.files import atomic_write

ROLE = re.compile(r"gate=(\w+),up=(\w+),down=(\w+)")
REPORT = (
    "report" + ".md"
)  # in two pieces: the citation check (tests/test_layering.py) reads a bare name as a file
LAYER = re.compile(r"F32,(\d+)\.gate=(\w+),\1\.up=\2,\1\.down=\2")


def _f(x, spec=".4f") -> str:
    return "" if x is None else format(x, spec)


def table(results: dict) -> str:
    """The markdown table of every variant."""
    head = ("| variant | bpw | expert MiB | rel. Frobenius gate / up / down | PPL(Q)/PPL(base) | KLD mean ± sem "
            "| KLD 99.9% | same top-1 % | Δp RMS % | llama.cpp KLD mean | llama.cpp same top-1 % "
            "| llama.cpp − glm53 KLD |")  # fmt: skip
    rows = [head, "|" + "---|" * 12]
    for v in results["variants"]:
        w = v["weight_rel_frobenius"]
        ll = v.get("llama_cpp") or {}
        d = (v.get("llama_cpp_minus_glm53") or {}).get("kld_mean")
        rows.append(
            f"| {v['name']} | {v['bpw']:.3f} | {v['expert_bytes'] / 2**20:.2f} "
            f"| {100 * w['gate']:.1f}% / {100 * w['up']:.1f}% / {100 * w['down']:.1f}% "
            f"| {v['ppl'] / v['ppl_base']:.5f} | {v['kld']['mean']:.3e} ± {v['kld']['sem']:.1e} "
            f"| {v['kld']['p99_9']:.2e} | {100 * v['same_top1']:.2f} ± {100 * v['same_top1_sem']:.2f} "
            f"| {100 * v['delta_p']['rms']:.4f} | {_f(ll.get('kld', {}).get('mean'), '.3e')} "
            f"| {_f(ll.get('same_top1') and 100 * ll['same_top1'], '.2f')} | {_f(d, '+.1e')} |"
        )
    return "\n".join(rows)


def write(out: str, results: dict) -> list[str]:
    """Writes out/`REPORT` and the PNGs; returns the PNG names written."""
    pngs = plots(out, results) if results["variants"] else []
    lines = [
        "# Quantization ablation",
        "",
        f"Base: {results['base']}. {results['n_tokens_scored']} tokens scored: chunks of {results['n_ctx']} "
        f"tokens, positions {results['scored_from']}..{results['n_ctx'] - 1} predicted (llama-perplexity's "
        "--kl-divergence statistics, KL(base || Q)). llama.cpp columns: llama.cpp's logits on the same GGUF "
        "against llama.cpp's on base.gguf (empty for +int8: GGUF has no int8 type, and for +latent_*: llama.cpp "
        "keeps an F32 KV cache).",
        "",
        table(results),
        "",
        *(f"![{p}]({p})" for p in pngs),
    ]
    if results["variants"] and not pngs:
        lines.append("(no PNGs: matplotlib is not installed; pip install matplotlib)")
    with atomic_write(os.path.join(out, REPORT)) as f:
        f.write("\n".join(lines) + "\n")
    return pngs


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points (bpw, kld, name) no point with fewer or equal bits beats on kld, by bpw."""
    front, best = [], float("inf")
    for p in sorted(points):
        if p[1] < best:
            front.append(p)
            best = p[1]
    return front


def plots(out: str, results: dict) -> list[str]:
    try:
        import matplotlib  # optional dependency (the plot extra): without it no PNG is written

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency, as above
    except ImportError:
        return []
    vs = results["variants"]
    written = []

    def save(fig, name):
        with atomic_write(os.path.join(out, name), "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(8, 5))
    floor = 1e-7  # F32 variants sit at (almost) zero KLD: drawn at the floor of the log axis
    mean = [(v["bpw"], max(v["kld"]["mean"], floor), v["name"]) for v in vs]
    p999 = [(v["bpw"], max(v["kld"]["p99_9"], floor), v["name"]) for v in vs]
    ax.scatter([p[0] for p in mean], [p[1] for p in mean], label="mean KLD")
    ax.scatter([p[0] for p in p999], [p[1] for p in p999], marker="x", label="99.9% KLD")
    front = pareto(mean)
    ax.plot([p[0] for p in front], [p[1] for p in front], "--", label="Pareto front (mean)")
    for b, k, name in mean:
        ax.annotate(name, (b, k), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="bits per weight (routed experts)", ylabel="KL divergence (nats)", yscale="log",
           title="KLD vs bits per weight")  # fmt: skip
    ax.legend()
    save(fig, "kld_vs_bpw.png")
    roles = {}
    for v in vs:
        m = ROLE.fullmatch(v["name"])
        if m and sum(f != "F32" for f in m.groups()) == 1:
            i = [f != "F32" for f in m.groups()].index(True)
            roles.setdefault(m.groups()[i], {})[("gate", "up", "down")[i]] = v["kld"]["mean"]
    if roles:
        fig, ax = plt.subplots(figsize=(6, 4))
        for j, (fmt, d) in enumerate(sorted(roles.items())):
            xs = [i + 0.8 * j / len(roles) for i in range(3)]
            ax.bar(xs, [d.get(r, 0) for r in ("gate", "up", "down")], width=0.8 / len(roles), label=fmt)
        ax.set_xticks(range(3), ["gate", "up", "down"])
        ax.set(ylabel="mean KLD", title="one role quantized at a time (others F32)")
        ax.legend()
        save(fig, "roles.png")
    layers = {}
    for v in vs:
        m = LAYER.fullmatch(v["name"])
        if m:
            layers.setdefault(m[2], []).append((int(m[1]), v["kld"]["mean"]))
    if layers:
        fig, ax = plt.subplots(figsize=(6, 4))
        for fmt, pts in sorted(layers.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=fmt)
        ax.set(xlabel="MoE layer", ylabel="mean KLD", title="one layer quantized at a time (others F32)")
        ax.legend()
        save(fig, "layers.png")
    return written
