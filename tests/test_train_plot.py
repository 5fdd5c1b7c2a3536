"""The training loop's progress bar switch and the loss-curve PNG (glm53.train.plot): curves from metrics.jsonl
(a resumed run's re-logged steps once, a torn last line skipped), a real PNG written atomically, and one log line
instead of a PNG without matplotlib."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest

from glm53.train import plot
from glm53.train.loop import progress_enabled


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal_and_when_asked():
    assert progress_enabled(True, _Tty())
    assert not progress_enabled(False, _Tty())
    assert not progress_enabled(True, io.StringIO())


def _metrics(tmp_path):
    recs = [dict(kind="train", step=s, loss=5.0 - 0.1 * s, lm_loss=4.0 - 0.1 * s) for s in (1, 2, 3, 4)]
    recs += [
        dict(kind="eval", step=2, loss=4.5),
        dict(kind="train", step=3, loss=1.0, lm_loss=0.5),
    ]  # resumed
    recs += [dict(kind="eval", step=4, loss=4.2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tra')  # torn last line
    return path


def test_loss_curves(tmp_path):
    c = plot.loss_curves(plot.read_metrics(_metrics(tmp_path)))
    assert c["train"] == ([1, 2, 3, 4], [4.9, 4.8, 1.0, 4.6])
    assert c["train lm"][1][2] == 0.5 and c["validation"] == ([2, 4], [4.5, 4.2])


def test_png_of_the_loss_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import image

    png = tmp_path / "loss.png"
    assert plot.plot_losses(_metrics(tmp_path), png, log=lambda s: None)
    img = image.imread(png)
    assert img.shape[:2] == (400, 700) and np.ptp(img[..., :3]) > 0.5  # 7 x 4 inches at 100 dpi, not blank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]  # no temporary left


def test_without_matplotlib_one_log_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    lines = []
    assert not plot.plot_losses(_metrics(tmp_path), tmp_path / "loss.png", log=lines.append)
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0] and "loss.png" in lines[0]
    assert not (tmp_path / "loss.png").exists()


def test_a_torn_metrics_line_is_cut_before_appending(tmp_path):
    from glm53.train.loop import _drop_torn_line

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')  # killed while appending
    _drop_torn_line(str(path))
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    _drop_torn_line(str(path))  # whole lines: unchanged
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
