"""fitter.progress: one rewritten line on a terminal, plain lines in a pipe, nothing when off."""

import io

from fitter.progress import Progress, bar, progress_mode


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_pipe_gets_one_plain_line_per_change(monkeypatch):
    monkeypatch.delenv("GGFIT_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("probe", stream=out) as p:
        assert p.mode == "lines"
        p.stage("loading the model")
        p.stage("loading the model")  # unchanged: not repeated
        p.step(1, 4, "trial 1")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("ggfit probe: [") and lines[0].endswith("loading the model")
    assert lines[1].endswith("1/4 trial 1")
    assert "\r" not in out.getvalue()


def test_terminal_rewrites_one_line_and_clears_it(monkeypatch):
    monkeypatch.delenv("GGFIT_PROGRESS", raising=False)
    out = _Tty()
    with Progress("optimise", stream=out) as p:
        assert p.mode == "tty"
        p.step(2, 4, "best 400 tok/s")
    text = out.getvalue()
    assert text.startswith("\r\x1b[K") and bar(2, 4) in text and "2/4 best 400 tok/s" in text
    assert text.endswith("\r\x1b[K") and "\n" not in text


def test_json_and_env_override(monkeypatch):
    monkeypatch.delenv("GGFIT_PROGRESS", raising=False)
    assert progress_mode(_Tty(), json_output=True) == "lines"
    monkeypatch.setenv("GGFIT_PROGRESS", "off")
    out = io.StringIO()
    Progress("calibrate", stream=out).stage("x")
    assert out.getvalue() == ""


def test_bar_bounds():
    assert bar(0, 10, 10) == "[..........]" and bar(10, 10, 10) == "[##########]" and bar(20, 10, 10) == "[##########]"


def test_sub_reports_through_the_parent_line(monkeypatch):
    monkeypatch.delenv("GGFIT_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("optimise", stream=out) as p:
        p.step(2, 5, "trial 2 of 5")
        sub = p.sub("trial 2 of 5")
        sub.stage("loading the model")
        sub.step(1, 4, "prompt 1")
        sub.close()  # leaves the parent's line alone
    lines = out.getvalue().splitlines()
    assert lines[1].endswith("2/5 trial 2 of 5: loading the model")
    assert lines[2].endswith("2/5 trial 2 of 5: 1/4 prompt 1")
