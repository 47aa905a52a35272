"""Live progress for the slow commands (probe, optimise, calibrate), on stderr so stdout stays the result.

On a terminal it is one line rewritten in place: elapsed time, an optional bar (`n of N`) and the stage.
In a pipe, under `--json`, or with `GGFIT_PROGRESS=lines`, it degrades to plain lines, one per change of
stage, so a log keeps the story and nothing needs a terminal to read. `GGFIT_PROGRESS=off` silences it.

    with Progress("probe") as p:
        p.stage("loading the model")
        p.step(3, 10, "trial 3 of 10, best 412 tok/s")
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Literal, TextIO

Mode = Literal["tty", "lines", "off"]
BAR_WIDTH = 20


def progress_mode(stream: TextIO | None = None, *, json_output: bool = False) -> Mode:
    """tty when `stream` is a terminal (and the output is not JSON), lines otherwise; GGFIT_PROGRESS overrides."""
    forced = os.environ.get("GGFIT_PROGRESS", "").strip().lower()
    if forced in ("tty", "lines", "off"):
        return forced  # type: ignore[return-value]
    stream = stream or sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return "tty" if tty and not json_output else "lines"


def bar(n: int, total: int, width: int = BAR_WIDTH) -> str:
    """[#######.............] for n of total."""
    filled = 0 if total <= 0 else min(width, round(width * n / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Progress:
    """One task's progress: `stage(text)` for what it is doing now, `step(n, total, text)` for how far it is.

    Thread-safe (a probe reports its child's events from a reader thread). `close()` (or leaving the `with`
    block) ends the tty line so the result starts on a clean line.
    """

    def __init__(self, label: str, *, stream: TextIO | None = None, mode: Mode | None = None,
                 json_output: bool = False) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.mode: Mode = mode or progress_mode(self.stream, json_output=json_output)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._last = ""
        self._drawn = False
        self._step: tuple[int, int] | None = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stage(self, text: str) -> None:
        """What is happening now ("loading the model", "prefill 512 tokens")."""
        self._emit(text)

    def step(self, n: int, total: int, text: str = "") -> None:
        """How far along: `n` of `total` (trials, grid points), with what to say about it."""
        self._step = (n, total)
        self._emit(text)

    def sub(self, prefix: str) -> Progress:
        """A nested task's progress on this line: its stages and steps follow `prefix`, this task's bar stays."""
        return _Sub(self, prefix)

    def _line(self, text: str) -> str:
        where = ""
        if self._step is not None:
            n, total = self._step
            where = (f"{bar(n, total)} {n}/{total} " if self.mode == "tty" else f"{n}/{total} ")
        return f"ggfit {self.label}: [{self.elapsed():6.1f} s] {where}{text}".rstrip()

    def _emit(self, text: str) -> None:
        if self.mode == "off":
            return
        with self._lock:
            key = f"{self._step}|{text}"
            if self.mode == "lines":
                if key != self._last:
                    print(self._line(text), file=self.stream, flush=True)
            else:
                width = _columns(self.stream)
                self.stream.write("\r\x1b[K" + self._line(text)[: width - 1])
                self.stream.flush()
                self._drawn = True
            self._last = key

    def close(self) -> None:
        with self._lock:
            if self.mode == "tty" and self._drawn:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._drawn = False


class _Sub(Progress):
    """Progress.sub: reports through the parent (one line, one lock, the parent's bar)."""

    def __init__(self, parent: Progress, prefix: str) -> None:
        super().__init__(parent.label, stream=parent.stream, mode=parent.mode)
        self.parent, self.prefix = parent, prefix

    def stage(self, text: str) -> None:
        self.parent.stage(f"{self.prefix}: {text}")

    def step(self, n: int, total: int, text: str = "") -> None:
        self.parent.stage(f"{self.prefix}: {n}/{total} {text}".rstrip())

    def close(self) -> None:  # the parent's line is the parent's to end
        pass


def _columns(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = 0
    return columns if columns > 0 else 80  # a pty with no size set reports 0
