"""The needle test's report from its results.json (`glm53.ablation.needle`): `REPORT` (markdown: a summary row per
model, then per model a table of exact-match accuracy with a row per depth and a column per context length) and
`PNG` (a heatmap per model, side by side, same scale). The PNG needs matplotlib (the ``plot`` extra): without it
the report is still written and says so. Both are written atomically."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from glm53.files import atomic_write

REPORT, PNG = "needle" + ".md", "needle" + ".png"  # in pieces: the citation check reads a bare name as a file


def grid(entry: dict, contexts: list[int], depths: list[float]) -> list[list[dict | None]]:
    """entry's cells as [depth][context] (None where a cell has no trial)."""
    by = {(c["context"], c["depth"]): c for c in entry["cells"]}
    return [[by.get((c, d)) for c in contexts] for d in depths]


def _cell(c: dict | None) -> str:
    return "" if c is None else f"{100 * c['accuracy']:.0f}% ({c['correct']}/{c['trials']})"


def against_base(results: dict, v: dict) -> tuple[float, float] | None:
    """(mean log p(value) of `v` minus the base's, fraction of trials whose predicted tokens equal the base's) over
    the same trials; None for the base itself or without one."""
    base = next((b for b in results["variants"] if b["name"] == "base"), None)
    if base is None or v is base:
        return None
    pairs = list(zip(v["results"], base["results"]))
    delta = sum(a["value_logprob"] - b["value_logprob"] for a, b in pairs) / len(pairs)
    return delta, sum(a["predicted"] == b["predicted"] for a, b in pairs) / len(pairs)


def tables(results: dict) -> str:
    """The summary table, then one accuracy table per model (rows: depth; columns: context length)."""
    contexts, depths = results["contexts"], results["depths"]
    head = ("| model | exact match | " + " | ".join(f"{c} tok" for c in contexts)
            + " | mean log p(value) | vs base: Δ log p | vs base: same prediction | s |")  # fmt: skip
    lines = [head, "|" + "---|" * (len(contexts) + 6)]
    for v in results["variants"]:
        per_ctx = []
        for c in contexts:
            cs = [x for x in v["cells"] if x["context"] == c]
            n, k = sum(x["trials"] for x in cs), sum(x["correct"] for x in cs)
            per_ctx.append(f"{100 * k / n:.0f}%" if n else "")
        lp = sum(r["value_logprob"] for r in v["results"]) / len(v["results"])
        vs = against_base(results, v)
        cmp = f"{vs[0]:+.1e} | {100 * vs[1]:.0f}%" if vs else "| "
        lines.append(f"| {v['name']} | {100 * v['accuracy']:.1f}% ({v['correct']}/{v['trials']}) | "
                     + " | ".join(per_ctx) + f" | {lp:.3f} | {cmp} | {v['seconds']} |")  # fmt: skip
    for v in results["variants"]:
        lines += ["", f"**{v['name']}**: exact match by depth (rows) and context length in tokens (columns)", ""]
        lines.append("| depth \\ context | " + " | ".join(str(c) for c in contexts) + " |")
        lines.append("|" + "---|" * (len(contexts) + 1))
        for d, row in zip(depths, grid(v, contexts, depths)):
            lines.append(f"| {d:g} | " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def write(out: str, results: dict, *, log: Callable = print) -> bool:
    """Writes out/`REPORT` and (matplotlib) out/`PNG`; returns whether the PNG was written."""
    png = heatmap(os.path.join(out, PNG), results, log=log) if results["variants"] else False
    form = results["query_text"].format(name="NAME")
    lines = [
        "# Needle in a haystack",
        "",
        f"Base: {results['base']}. Haystack: {results['haystack']}. {results['trials_per_cell']} trial(s) per "
        f"cell, seed {results['seed']}. Each context is exactly N tokens of code with the needle line `NAME = "
        f"VALUE` ({results['digits']}-digit VALUE, fresh NAME) inserted at a line boundary at the depth given "
        f"(0: first line, 1: the line before the query), ending with the query `{form}` "
        f"(`{results['query']}`). Exact match: greedy decoding writes ` VALUE` and the number ends there. "
        "log p(value): the value tokens' log-probability (nats) given the context; vs base: the mean difference "
        "from the base's on the same trials, and the share of trials whose teacher-forced predictions equal the "
        "base's.",
        "",
        tables(results),
        "",
    ]
    lines.append(f"![{PNG}]({PNG})" if png else "(no heatmap: matplotlib is not installed; pip install glm53[plot])")
    with atomic_write(os.path.join(out, REPORT)) as f:
        f.write("\n".join(lines) + "\n")
    return png


def heatmap(path: str, results: dict, *, log: Callable = print) -> bool:
    """Accuracy heatmaps (depth x context), one panel per model side by side; False (one log line) without
    matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        log(f"matplotlib is not installed (pip install glm53[plot]): no heatmap {path}")
        return False
    # optional dependency (the `plot` extra): imported only when a PNG is wanted; Figure needs no GUI backend
    from matplotlib.figure import Figure

    contexts, depths, vs = results["contexts"], results["depths"], results["variants"]
    fig = Figure(figsize=(0.6 + (1.2 + 0.55 * len(contexts)) * len(vs), 1.3 + 0.4 * len(depths)), dpi=110)
    axes = fig.subplots(1, len(vs), squeeze=False)[0]
    im = None
    for ax, v in zip(axes, vs):
        cells = grid(v, contexts, depths)
        acc = [[float("nan") if c is None else c["accuracy"] for c in row] for row in cells]
        im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for i, row in enumerate(cells):
            for j, c in enumerate(row):
                if c is not None:
                    ax.text(j, i, f"{100 * c['accuracy']:.0f}", ha="center", va="center", fontsize=8,
                            color="black" if c["accuracy"] > 0.6 else "white")  # fmt: skip
        ax.set_xticks(range(len(contexts)), [str(c) for c in contexts], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_xlabel("context (tokens)", fontsize=8)
        ax.set_title(f"{v['name']}\n{100 * v['accuracy']:.1f}% exact", fontsize=8)
    axes[0].set_ylabel("needle depth", fontsize=8)
    fig.colorbar(im, ax=list(axes), fraction=0.03, label="exact match")
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", bbox_inches="tight")
    return True
