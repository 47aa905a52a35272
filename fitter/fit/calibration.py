"""The calibration store: measured corrections of the compute buffers, per architecture, backend and build.

The compute model replays llama.cpp's graph and allocator, which is exact where it was checked
(the CPU backend of the pinned build). On another backend or another llama.cpp build it can drift:
calibration runs llama.cpp's own dry run over a small grid, fits `measured = a + b * predicted` per
compute buffer (device and host) for this architecture and backend, and stores the coefficients with
the llama.cpp build they were measured on. Predictions use them only for that same build. The
measurement itself (llama.cpp's dry runs) is fitter.oracle.calibrate's.

A calibration is only stored with data behind it: the backend must be one the local llama.cpp has,
and each stored line needs MIN_POINTS dry runs in which llama.cpp reported that very buffer.

`ggfit calibrate --log` learns from a user's own log instead (fitter.oracle.calibrate.compare_log): each log
is one point, (predicted, printed) per compute buffer, for the build and backend that printed it; the
correction is a ratio, `printed = b x predicted`, fitted through the origin over every log stored for that
architecture, backend and build (`fit_ratio`): a log holds one config, and what a build reserves beyond or
short of the prediction grows with the buffer (a tensor per token or per cell), so a ratio carries to other
contexts and batch sizes where an offset could go negative.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import field
from pathlib import Path
from typing import Literal

from fitter.cache import CACHES
from fitter.errors import GGFitError
from fitter.llama_builds import LLAMA_CPP_COMMIT, LlamaBuild
from fitter.record import Record

MIN_POINTS = 3  # dry runs in which llama.cpp reported the buffer, for a line to be stored
FORMAT = 2  # of calibration.json; format 1 (a flat dict, ggfit before issue 11) could hold fits without data


class CalibrationError(GGFitError):
    """A calibration that cannot be made or stored (no such backend here, no data)."""


class Correction(Record, frozen=False):
    a: float  # bytes
    b: float
    points: int
    max_abs_error_bytes: int  # of the corrected prediction on the grid

    def apply(self, predicted: int) -> int:
        return max(0, int(round(self.a + self.b * predicted)))

    @property
    def identity(self) -> bool:
        """measured = predicted, within the rounding of the least-squares fit."""
        return abs(self.a) < 0.5 and abs(self.b - 1.0) < 1e-9

    @property
    def sound(self) -> bool:
        """Fitted on enough reported points, and growing with the prediction."""
        return self.points >= MIN_POINTS and math.isfinite(self.a) and math.isfinite(self.b) and self.b > 0


class LogPoint(Record, frozen=False):
    """One user log's compute buffers: ggfit's prediction for the log's config and what llama.cpp printed."""

    log: str  # the log file's name
    predicted_device: int | None = None
    printed_device: int | None = None
    predicted_host: int | None = None
    printed_host: int | None = None


class Calibration(Record, frozen=False):
    architecture: str
    backend: str
    llama_cpp: str  # the build's key (build_key): the full commit of the pinned build, else bNNNN, a commit or a date
    device: Correction | None = None
    host: Correction | None = None
    note: str | None = None  # e.g. why the host buffer has no line
    source: Literal["dry-run", "log"] = "dry-run"  # llama.cpp's dry runs here, or users' logs (calibrate --log)
    logs: list[LogPoint] = field(default_factory=list)

    @property
    def identity(self) -> bool:
        return all(c is None or c.identity for c in (self.device, self.host))

    @property
    def min_points(self) -> int:
        """A dry-run line needs MIN_POINTS runs; a log is a real run of the user's own build: one is data."""
        return 1 if self.source == "log" else MIN_POINTS

    @property
    def sound(self) -> bool:
        """A device line, and every line with data behind it."""
        return self.device is not None and all(
            c is None or (c.points >= self.min_points and math.isfinite(c.a) and math.isfinite(c.b) and c.b > 0)
            for c in (self.device, self.host))


class BufferChange(Record, frozen=False):
    owner: str
    device: str
    predicted_bytes: int  # the model's own prediction
    calibrated_bytes: int


class Applied(Record, frozen=False):
    """A stored calibration that a prediction used, and the compute buffers it changed."""

    architecture: str
    backend: str
    llama_cpp: str
    stored: str  # the calibration file
    identity: bool
    changed: list[BufferChange]


def store_path() -> Path:
    base = os.environ.get("GGFIT_DATA") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "ggfit"
    )
    return Path(base) / "calibration.json"


def _key(arch: str, backend: str, build: str) -> str:
    return f"{arch}|{backend}|{build}"


def build_key(build: LlamaBuild) -> str:
    """How the store names a build: the pinned build by its full commit (what dry runs here record), another
    by its number (bNNNN), else its commit, else its date; `--llama-build` given any of its names finds it."""
    if build.is_pinned:
        return LLAMA_CPP_COMMIT
    if build.number is not None:
        return f"b{build.number}"
    if build.commit:
        return build.commit[:12]
    return build.date.isoformat()


_WARNED: set[str] = CACHES.keep(set(), "warnings")


def _warn(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        print(f"ggfit: warning: {msg}", file=sys.stderr)


def _read_store(path: Path) -> tuple[dict[str, Calibration], str | None]:
    """The stored calibrations, and why (part of) the file was ignored, if it was."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"cannot read {path} ({e.strerror}); calibrations ignored"
    fix = "`ggfit calibrate --clear` removes it"
    try:
        data = json.loads(text)
    except ValueError:
        return {}, f"{path} is not valid JSON; calibrations ignored ({fix})"
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        found = data.get("format", 1) if isinstance(data, dict) else "?"
        return {}, f"{path} was written by another ggfit version (format {found}, this one reads {FORMAT}); " \
                   f"calibrations ignored ({fix})"
    out, bad = {}, []
    for key, raw in data["entries"].items():
        try:
            cal = Calibration.model_validate(raw)
        except ValueError:  # pydantic's ValidationError is one
            bad.append(key)
            continue
        if not cal.sound:
            bad.append(key)  # a fit without data behind it (a hand edit, or a bug): never applied
            continue
        out[key] = cal
    why = f"{path}: ignored {len(bad)} damaged entr{'y' if len(bad) == 1 else 'ies'} ({', '.join(bad)})" if bad else None
    return out, why


def stored(*, warn: bool = True) -> list[Calibration]:
    """Every usable stored calibration (a warning line for anything ignored)."""
    entries, why = _read_store(store_path())
    if why and warn:
        _warn(why)
    return sorted(entries.values(), key=lambda c: (c.architecture, c.backend, c.llama_cpp))


def load(arch: str, backend: str, build: str = LLAMA_CPP_COMMIT) -> Calibration | None:
    entries, why = _read_store(store_path())
    if why:
        _warn(why)
    return entries.get(_key(arch, backend, build))


def _unwritable(path: Path, e: OSError) -> CalibrationError:
    why = "a directory" if path.is_dir() else (e.strerror or str(e)).lower()
    return CalibrationError(f"cannot write the calibration store {path} ({why}); set XDG_DATA_HOME (or GGFIT_DATA) "
                            "to a writable directory")


def check_store() -> Path:
    """The store can be written (its directory made or there, writable, the file not a directory): a CalibrationError
    line before a calibration runs, not a traceback after it. Leaves no file behind."""
    path = store_path()
    if path.is_dir():
        raise _unwritable(path, IsADirectoryError())
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # to take away again
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _unwritable(path, e) from None
    finally:
        for d in made:  # innermost first
            try:
                d.rmdir()
            except OSError:
                break
    return path


def _write(path: Path, entries: dict[str, Calibration]) -> None:
    data = {"format": FORMAT, "entries": {k: v.model_dump(mode="json") for k, v in sorted(entries.items())}}
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        if tmp.is_file():  # a directory in place of calibration.json: the new file is not left beside it
            tmp.unlink()
        raise _unwritable(path, e) from None


def save(cal: Calibration) -> Path:
    if not cal.sound:
        raise CalibrationError(f"not storing a calibration of {cal.architecture} on {cal.backend} without data behind it")
    path = store_path()
    entries, why = _read_store(path)
    if why:
        _warn(why + "; replaced by this calibration")
    entries[_key(cal.architecture, cal.backend, cal.llama_cpp)] = cal
    _write(path, entries)
    return path


def add_log(arch: str, backend: str, build: str, point: LogPoint) -> tuple[Calibration, Path]:
    """Store one log's compute residuals for this architecture, backend and build: the ratio is refitted over
    every log stored there (the same log again replaces its point). A dry-run calibration of the same key is
    replaced (a log is the user's own build at work). CalibrationError when the log printed no device compute."""
    if point.predicted_device is None or point.printed_device is None:
        raise CalibrationError("nothing stored: the log prints no compute buffer of the device that ggfit predicts")
    path = store_path()
    entries, why = _read_store(path)
    if why:
        _warn(why + "; replaced by this calibration")
    old = entries.get(_key(arch, backend, build))
    points = [p for p in (old.logs if old is not None and old.source == "log" else []) if p.log != point.log]
    points.append(point)
    dev = [(p.predicted_device, p.printed_device) for p in points
           if p.predicted_device is not None and p.printed_device is not None]
    host = [(p.predicted_host, p.printed_host) for p in points
            if p.predicted_host is not None and p.printed_host is not None]
    cal = Calibration(architecture=arch, backend=backend, llama_cpp=build, device=fit_ratio(dev),
                      host=fit_ratio(host) if host else None, source="log", logs=points,
                      note=None if host else "host compute left as predicted: no log printed it")
    if not cal.sound:
        raise CalibrationError("nothing stored: the log printed no compute on the device, or ggfit predicts none")
    entries[_key(arch, backend, build)] = cal
    _write(path, entries)
    return cal, path


def clear(arch: str | None = None) -> tuple[list[Calibration], Path]:
    """Remove every stored calibration, or those of one architecture; return what was removed."""
    path = store_path()
    entries, why = _read_store(path)
    if arch is None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise _unwritable(path, e) from None
        return sorted(entries.values(), key=lambda c: (c.architecture, c.backend)), path
    if why and not entries:
        raise CalibrationError(f"{why.split(';')[0]}; `ggfit calibrate --clear` (no architecture) removes the file")
    gone = [c for c in entries.values() if c.architecture == arch]
    if gone:
        _write(path, {k: c for k, c in entries.items() if c.architecture != arch})
    return gone, path


def fit_line(pairs: list[tuple[int, int]]) -> Correction:
    """Least squares of measured on predicted; a pure offset when the predictions do not vary."""
    n = len(pairs)
    xs = [p for p, _ in pairs]
    ys = [m for _, m in pairs]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in pairs) / sxx if sxx > 0 else 1.0
    a = my - b * mx
    corr = Correction(a=a, b=b, points=n, max_abs_error_bytes=0)
    err = max(abs(corr.apply(x) - y) for x, y in pairs)
    return corr.model_copy(update={"max_abs_error_bytes": err})


def fit_ratio(pairs: list[tuple[int, int]]) -> Correction:
    """Least squares of measured on predicted through the origin: measured = b x predicted."""
    sxx = sum(p * p for p, _ in pairs)
    b = sum(p * m for p, m in pairs) / sxx if sxx > 0 else 0.0
    corr = Correction(a=0.0, b=b, points=len(pairs), max_abs_error_bytes=0)
    err = max(abs(corr.apply(p) - m) for p, m in pairs)
    return corr.model_copy(update={"max_abs_error_bytes": err})
