"""`ggfit calibrate`: measure llama.cpp's compute buffers on this machine and correct the model.

The compute model replays llama.cpp's graph and allocator, which is exact where it was checked
(the CPU backend of the pinned build). On another backend or another llama.cpp build it can drift:
calibration runs llama.cpp's own dry run over a small grid, fits `measured = a + b * predicted` per
compute buffer (device and host) for this architecture and backend, and stores the coefficients with
the llama.cpp build they were measured on. Predictions use them only for that same build.

A calibration is only stored with data behind it: the backend must be one the local llama.cpp has,
and each stored line needs MIN_POINTS dry runs in which llama.cpp reported that very buffer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from fitter.build import LLAMA_CPP_COMMIT
from fitter.config import Backend, Frontend, RunConfig
from fitter.errors import GGFitError
from fitter.progress import Progress

GRID = [  # (n_ctx, n_ubatch, flash_attn)
    (4096, 512, "on"), (16384, 512, "on"), (16384, 2048, "on"), (65536, 1024, "on"),
    (4096, 512, "off"), (16384, 1024, "off"),
]
MIN_POINTS = 3  # dry runs in which llama.cpp reported the buffer, for a line to be stored
FORMAT = 2  # of calibration.json; format 1 (a flat dict, ggfit before issue 11) could hold fits without data


class CalibrationError(GGFitError):
    """A calibration that cannot be made or stored (no such backend here, no data)."""


class Correction(BaseModel):
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


class Calibration(BaseModel):
    architecture: str
    backend: str
    llama_cpp: str
    device: Correction | None = None
    host: Correction | None = None
    note: str | None = None  # e.g. why the host buffer has no line

    @property
    def identity(self) -> bool:
        return all(c is None or c.identity for c in (self.device, self.host))

    @property
    def sound(self) -> bool:
        """A device line, and every line with data behind it."""
        return self.device is not None and all(c is None or c.sound for c in (self.device, self.host))


class BufferChange(BaseModel):
    owner: str
    device: str
    predicted_bytes: int  # the model's own prediction
    calibrated_bytes: int


class Applied(BaseModel):
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


_WARNED: set[str] = set()


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
        except ValidationError:
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


def _write(path: Path, entries: dict[str, Calibration]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "entries": {k: v.model_dump(mode="json") for k, v in sorted(entries.items())}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


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


def clear(arch: str | None = None) -> tuple[list[Calibration], Path]:
    """Remove every stored calibration, or those of one architecture; return what was removed."""
    path = store_path()
    entries, why = _read_store(path)
    if arch is None:
        if path.exists():
            path.unlink()
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


# The devices of the local llama.cpp, asked in a child (a GPU build without its driver may abort on load).
# llama_backend_init loads the backends (ggml_backend_load_all) when none is registered; then each device's
# registry: "CPU", "CUDA", "MTL" (ggml-metal.cpp GGML_METAL_NAME), "Vulkan", ...
_DEVICES_CHILD = r"""
import ctypes, json, llama_cpp
from fitter._llama_child import _ggml_base
llama_cpp.llama_backend_init()
g = _ggml_base(llama_cpp, "ggml")
g.ggml_backend_dev_count.restype = ctypes.c_size_t
g.ggml_backend_dev_get.restype = ctypes.c_void_p
g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
for f in ("ggml_backend_dev_name", "ggml_backend_reg_name"):
    getattr(g, f).restype = ctypes.c_char_p
    getattr(g, f).argtypes = [ctypes.c_void_p]
g.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
g.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
devs = []
for i in range(g.ggml_backend_dev_count()):
    d = g.ggml_backend_dev_get(i)
    devs.append({"name": g.ggml_backend_dev_name(d).decode(), "reg": g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(d)).decode()})
print(json.dumps({"devices": devs}))
"""
_REGISTRY = {Backend.CPU: "CPU", Backend.CUDA: "CUDA", Backend.METAL: "MTL"}
_DEVICES: list[dict[str, str]] | None = None  # this process only, and only an answer llama.cpp gave


def local_devices(timeout: float = 60.0) -> list[dict[str, str]]:
    """llama.cpp's own list of backend devices here ({"name": "CUDA0", "reg": "CUDA"}, ...)."""
    global _DEVICES
    if _DEVICES is not None:
        return _DEVICES
    from fitter.llama_run import _REPO_ROOT, _child_env

    why = None
    try:
        out = subprocess.run([sys.executable, "-c", _DEVICES_CHILD], capture_output=True, text=True, timeout=timeout,
                             env=_child_env(None), cwd=_REPO_ROOT)
        if out.returncode == 0:
            _DEVICES = json.loads(out.stdout.strip().splitlines()[-1])["devices"]
            return _DEVICES
        tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        why = tail[-1].strip() if tail else f"exit status {out.returncode}"
    except subprocess.TimeoutExpired:
        why = f"no answer in {timeout:g} s"
    except (ValueError, KeyError, IndexError):
        why = "unreadable answer"
    raise CalibrationError(f"cannot ask the local llama.cpp which backends it has: {why}")


def require_backend(backend: Backend) -> None:
    """Refuse a backend the local llama.cpp has no device for: its dry runs would measure something else."""
    devs = local_devices()
    if not any(d["reg"] == _REGISTRY[backend] for d in devs):
        have = [b.value for b in Backend if any(d["reg"] == _REGISTRY[b] for d in devs)]
        raise CalibrationError(
            f"--backend {backend.value}: the local llama.cpp has no {_REGISTRY[backend]} device "
            f"(it has: {', '.join(d['name'] for d in devs) or 'none'}); calibrate here with --backend {' or '.join(have) or 'cpu'}"
        )


def _measured_compute(run) -> dict[str, int]:
    """Compute bytes per buffer type that llama.cpp reported: its memory breakdown (exact), else its log lines."""
    if run.breakdown is not None:
        return {r.buffer_type: r.compute for r in run.breakdown if r.compute > 0}
    out: dict[str, int] = {}
    for line in run.report.rows("compute"):
        out[line.buffer] = out.get(line.buffer, 0) + line.bytes
    return {k: v for k, v in out.items() if v > 0}


def calibrate(path: str, backend: Backend, *, ctx_max: int | None = None,
              progress: Progress | None = None) -> tuple[Calibration, list[dict]]:
    """Dry-run llama.cpp over GRID on this machine; return the fitted calibration and the raw rows.

    Raises CalibrationError (nothing to store) when the backend is not here or llama.cpp did not report the
    device's compute buffer in MIN_POINTS runs."""
    from fitter.check import llama_params
    from fitter.llama_run import measure
    from fitter.memory import predict
    from fitter.llama.model import load_model_spec

    require_backend(backend)
    header, spec = load_model_spec(path)
    rows, dev_pairs, host_pairs = [], [], []
    build = LLAMA_CPP_COMMIT
    dev_names: set[str] = set()
    host_names: set[str] = set()
    grid = [(n_ctx, ub, fa) for n_ctx, ub, fa in GRID if not (ctx_max and n_ctx > ctx_max)]
    for i, (n_ctx, ub, fa) in enumerate(grid):
        cfg = RunConfig(n_ctx=min(n_ctx, spec.n_ctx_train), n_ubatch=ub, flash_attn=fa)
        if progress:
            progress.step(i + 1, len(grid), f"llama.cpp dry run -c {cfg.n_ctx} -ub {ub} -fa {fa}")
        pred = predict(header, spec, cfg, backend, Frontend.SERVER, calibrated=False)
        row = {"n_ctx": cfg.n_ctx, "n_ubatch": ub, "flash_attn": fa}
        run = measure(path, llama_params(pred.context, cfg), mode="dry", log_level="info")
        if not run.ok:
            rows.append({**row, "status": run.status, "message": run.message})
            continue
        build = run.build.commit or build
        got = _measured_compute(run)
        target = [b for b in pred.buffers if b.kind == "compute" and b.owner == "target"]
        p_dev, p_host = {b.device: b.bytes for b in target if b.counts}, {b.device: b.bytes for b in target if not b.counts}
        dev_names |= set(p_dev)
        host_names |= set(p_host)
        row.update(status="ok", predicted_device=sum(p_dev.values()), predicted_host=sum(p_host.values()))
        # a point only where llama.cpp reported every buffer the prediction has (same buffer-type names)
        if p_dev and all(n in got for n in p_dev):
            row["measured_device"] = sum(got[n] for n in p_dev)
            dev_pairs.append((row["predicted_device"], row["measured_device"]))
        if p_host and all(n in got for n in p_host):
            row["measured_host"] = sum(got[n] for n in p_host)
            host_pairs.append((row["predicted_host"], row["measured_host"]))
        row["reported"] = sorted(got)
        rows.append(row)

    def line(pairs: list[tuple[int, int]], names: set[str], what: str) -> Correction | str:
        """The fitted line, or why there is none."""
        label = f"{'/'.join(sorted(names))} compute buffer ({what})"
        if len(pairs) < MIN_POINTS:
            failed = next((r for r in rows if r["status"] != "ok"), None)
            hint = f"; llama.cpp {failed['status']}: {failed['message']}" if failed else (
                f"; it reported only {', '.join(sorted({n for r in rows for n in r.get('reported', [])})) or 'nothing'}")
            return f"llama.cpp reported the {label} in {len(pairs)} of {len(rows)} dry runs, {MIN_POINTS} needed{hint}"
        corr = fit_line(pairs)
        if corr.b <= 0:
            return f"the measured {label} does not grow with the prediction (slope {corr.b:.5f})"
        return corr

    if not dev_names:
        raise CalibrationError(f"nothing stored: the model predicts no compute buffer on {backend.value}")
    device = line(dev_pairs, dev_names, "device")
    if isinstance(device, str):
        raise CalibrationError(f"nothing stored: {device}")
    host = line(host_pairs, host_names, "host") if host_names else None
    cal = Calibration(architecture=spec.architecture, backend=backend.value, llama_cpp=_full_commit(build),
                      device=device, host=host if isinstance(host, Correction) else None,
                      note=f"host compute left as predicted: {host}" if isinstance(host, str) else None)
    return cal, rows


def _full_commit(short: str) -> str:
    short = short.removesuffix("-dirty")
    return LLAMA_CPP_COMMIT if LLAMA_CPP_COMMIT.startswith(short) else short
