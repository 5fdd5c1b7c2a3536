"""One progress style (glm53/progress.py): a tqdm bar on a terminal, plain lines without carriage returns
elsewhere, lines printed above the bar; the entry points' uses (conversion, the compile census, the ablation,
the peer benchmark) go through it. No timing is asserted: the plain-line interval is 0 or effectively infinite."""

from __future__ import annotations

import io

from glm53.progress import Progress, is_terminal, progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_is_terminal():
    assert is_terminal(_Tty()) and not is_terminal(io.StringIO()) and not is_terminal(object())


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    with Progress(3, desc="convert -> ckpt", unit="unit", stream=out, min_interval=0) as bar:
        assert not bar.interactive
        for name in ("embed", "layers.0", "head"):
            bar.update(1, postfix=name)
    text = out.getvalue()
    assert "\r" not in text
    assert text.splitlines() == ["convert -> ckpt: 1/3 unit (embed)", "convert -> ckpt: 2/3 unit (layers.0)",
                                 "convert -> ckpt: 3/3 unit (head)"]  # fmt: skip


def test_plain_lines_at_most_every_interval_and_at_the_end():
    out = io.StringIO()
    items = list(progress(range(5), desc="work", unit="item", stream=out, min_interval=1e9))
    assert items == [0, 1, 2, 3, 4]
    assert out.getvalue() == "work: 5/5 item\n"  # nothing before the (never reached) interval; the end line


def test_no_lines_when_the_loop_logs_its_own_or_disabled(capsys):
    out = io.StringIO()
    with Progress(2, stream=out, lines=False) as bar:
        bar.update(1)
        bar.write("step 1", log=lambda s: print(s))
        bar.update(1)
    with Progress(2, stream=_Tty(), enabled=False) as off:
        off.update(2)
        assert not off.interactive
    assert out.getvalue() == ""
    assert capsys.readouterr().out == "step 1\n"


def test_on_a_terminal_a_tqdm_bar_and_lines_above_it(capsys):
    tty = _Tty()
    got = []
    with Progress(2, desc="train", unit="step", stream=tty) as bar:
        assert bar.interactive
        bar.update(1, postfix="loss=1.0")
        bar.write("step 1/2 loss 1.0", log=got.append)
        bar.update(1)
    assert got == ["step 1/2 loss 1.0"]
    assert "train" in tty.getvalue() and "2/2" in tty.getvalue()  # tqdm's bar (carriage returns: a terminal)
    assert capsys.readouterr().out == ""


def test_total_set_later():
    out = io.StringIO()
    with Progress(desc="compile_tpu", unit="program", stream=out, min_interval=0) as bar:
        bar.set_total(2)
        bar.update(1, postfix="decode 1x1")
        bar.update(1, postfix="prefill 1x16")
    assert out.getvalue().splitlines()[-1] == "compile_tpu: 2/2 program (prefill 1x16)"
