"""The loss curves of a training run as a PNG: train loss (and its next-token part) per logged step and the
validation loss per evaluation, read from the run's ``metrics.jsonl``. matplotlib is optional (the ``plot``
extra): without it `plot_losses` logs one line and writes nothing. The PNG is written atomically."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable

from glm53.files import atomic_write


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def loss_curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{"train", "train lm", "validation"}: (steps, losses), each step once (a resumed run's re-logged steps:
    the last record wins), in step order."""
    curves: dict[str, dict[int, float]] = {"train": {}, "train lm": {}, "validation": {}}
    for r in records:
        if r.get("kind") == "train":
            curves["train"][r["step"]] = r["loss"]
            curves["train lm"][r["step"]] = r["lm_loss"]
        elif r.get("kind") == "eval":
            curves["validation"][r["step"]] = r["loss"]
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in curves.items()}


def plot_losses(
    metrics_path: str | os.PathLike, png_path: str | os.PathLike, *, log: Callable = print
) -> bool:
    """Writes the loss curves of `metrics_path` to `png_path`; False (one log line) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        log(f"matplotlib is not installed (pip install glm53[plot]): no loss-curve PNG {png_path}")
        return False
    # optional dependency (the `plot` extra): imported only when a PNG is wanted; Figure needs no GUI backend
    from matplotlib.figure import Figure

    curves = loss_curves(read_metrics(metrics_path))
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    for name, style in (("train", "-"), ("train lm", ":"), ("validation", "o-")):
        steps, losses = curves[name]
        if steps:
            ax.plot(steps, losses, style, label=f"{name} loss", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(png_path, "wb") as f:
        fig.savefig(f, format="png")
    return True
