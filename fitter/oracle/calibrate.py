"""`ggfit calibrate`'s measurement: llama.cpp's own dry run over a small grid, fitted into a calibration;
or (`calibrate --log`, `compare_log`) a user's own llama.cpp log, compared buffer by buffer with the prediction
for the build and settings it printed.

The fitted lines are stored by fitter.fit.calibration, which the prediction reads.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fitter.fit.calibration import (
    MIN_POINTS,
    Calibration,
    CalibrationError,
    Correction,
    LogPoint,
    add_log,
    build_key,
    fit_line,
)
from fitter.fit.memory import Prediction, predict
from fitter.ggml import backends
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.llama_builds import LLAMA_CPP_COMMIT, LlamaBuild, resolve_build
from fitter.llama_builds.identify import build_from_line
from fitter.oracle.check import llama_params
from fitter.oracle.child_process import REPO_ROOT, child_env
from fitter.oracle.llama_log import PRINT_TOLERANCE_BYTES
from fitter.oracle.llama_run import LlamaRun, measure
from fitter.oracle.log_settings import _side, log_run_config
from fitter.oracle.user_log import UserLog
from fitter.progress import Progress

GRID: list[tuple[int, int, Literal["on", "off"]]] = [  # (n_ctx, n_ubatch, flash_attn)
    (4096, 512, "on"), (16384, 512, "on"), (16384, 2048, "on"), (65536, 1024, "on"),
    (4096, 512, "off"), (16384, 1024, "off"),
]


# The devices of the local llama.cpp, asked in a child (a GPU build without its driver may abort on load).
# llama_backend_init loads the backends (ggml_backend_load_all) when none is registered; then each device's
# registry: "CPU", "CUDA", "MTL" (ggml-metal.cpp GGML_METAL_NAME), "Vulkan", ...
_DEVICES_CHILD = r"""
import ctypes, json, llama_cpp
from fitter.oracle._llama_child import load_ggml_base
llama_cpp.llama_backend_init()
g = load_ggml_base(llama_cpp, "ggml")
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


@functools.cache  # this process only, and only an answer llama.cpp gave (a raised error is not cached)
def local_devices(timeout: float = 60.0) -> list[dict[str, str]]:
    """llama.cpp's own list of backend devices here ({"name": "CUDA0", "reg": "CUDA"}, ...)."""
    why = None
    try:
        out = subprocess.run([sys.executable, "-c", _DEVICES_CHILD], capture_output=True, text=True, timeout=timeout,
                             env=child_env(None), cwd=REPO_ROOT)
        if out.returncode == 0:
            devices: list[dict[str, str]] = json.loads(out.stdout.strip().splitlines()[-1])["devices"]
            return devices
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
    if not any(d["reg"] == backends.get(backend).registry for d in devs):
        have = [b.value for b in Backend if any(d["reg"] == backends.get(b).registry for d in devs)]
        raise CalibrationError(
            f"--backend {backend.value}: the local llama.cpp has no {backends.get(backend).registry} device "
            f"(it has: {', '.join(d['name'] for d in devs) or 'none'}); calibrate here with --backend {' or '.join(have) or 'cpu'}"
        )


def _measured_compute(run: LlamaRun) -> dict[str, int]:
    """Compute bytes per buffer type that llama.cpp reported: its memory breakdown (exact), else its log lines."""
    if run.breakdown is not None:
        return {r.buffer_type: r.compute for r in run.breakdown if r.compute > 0}
    out: dict[str, int] = {}
    for line in run.report.rows("compute"):
        out[line.buffer] = out.get(line.buffer, 0) + line.bytes
    return {k: v for k, v in out.items() if v > 0}


def calibrate(path: str, backend: Backend, *, ctx_max: int | None = None,
              progress: Progress | None = None) -> tuple[Calibration, list[dict[str, Any]]]:
    """Dry-run llama.cpp over GRID on this machine; return the fitted calibration and the raw rows.

    Raises CalibrationError (nothing to store) when the backend is not here or llama.cpp did not report the
    device's compute buffer in MIN_POINTS runs."""
    require_backend(backend)
    header, spec = load_model_spec(path)
    points = _Points()
    grid = [(n_ctx, ub, fa) for n_ctx, ub, fa in GRID if not (ctx_max and n_ctx > ctx_max)]
    for i, (n_ctx, ub, fa) in enumerate(grid):
        cfg = RunConfig(n_ctx=min(n_ctx, spec.n_ctx_train), n_ubatch=ub, flash_attn=fa)
        if progress:
            progress.step(i + 1, len(grid), f"llama.cpp dry run -c {cfg.n_ctx} -ub {ub} -fa {fa}")
        pred = predict(header, spec, cfg, backend, Frontend.SERVER, calibrated=False)
        row: dict[str, Any] = {"n_ctx": cfg.n_ctx, "n_ubatch": ub, "flash_attn": fa}
        run = measure(path, llama_params(pred.context, cfg), mode="dry", log_level="info")
        points.add(row, pred, run)

    if not points.dev_names:
        raise CalibrationError(f"nothing stored: the model predicts no compute buffer on {backend.value}")
    device = points.line(points.dev_pairs, points.dev_names, "device")
    if isinstance(device, str):
        raise CalibrationError(f"nothing stored: {device}")
    host = points.line(points.host_pairs, points.host_names, "host") if points.host_names else None
    cal = Calibration(architecture=spec.architecture, backend=backend.value, llama_cpp=_full_commit(points.build),
                      device=device, host=host if isinstance(host, Correction) else None,
                      note=f"host compute left as predicted: {host}" if isinstance(host, str) else None)
    return cal, points.rows


class _Points:
    """The grid's rows and the (predicted, measured) pairs of the device and host compute buffers."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.dev_pairs: list[tuple[int, int]] = []
        self.host_pairs: list[tuple[int, int]] = []
        self.dev_names: set[str] = set()
        self.host_names: set[str] = set()
        self.build = LLAMA_CPP_COMMIT

    def add(self, row: dict[str, Any], pred: Prediction, run: LlamaRun) -> None:
        if not run.ok:
            self.rows.append({**row, "status": run.status, "message": run.message})
            return
        self.build = run.build.commit or self.build
        got = _measured_compute(run)
        target = [b for b in pred.buffers if b.kind == "compute" and b.owner == "target"]
        p_dev, p_host = {b.device: b.bytes for b in target if b.counts}, {b.device: b.bytes for b in target if not b.counts}
        self.dev_names |= set(p_dev)
        self.host_names |= set(p_host)
        row.update(status="ok", predicted_device=sum(p_dev.values()), predicted_host=sum(p_host.values()))
        # a point only where llama.cpp reported every buffer the prediction has (same buffer-type names)
        if p_dev and all(n in got for n in p_dev):
            row["measured_device"] = sum(got[n] for n in p_dev)
            self.dev_pairs.append((row["predicted_device"], row["measured_device"]))
        if p_host and all(n in got for n in p_host):
            row["measured_host"] = sum(got[n] for n in p_host)
            self.host_pairs.append((row["predicted_host"], row["measured_host"]))
        row["reported"] = sorted(got)
        self.rows.append(row)

    def line(self, pairs: list[tuple[int, int]], names: set[str], what: str) -> Correction | str:
        """The fitted line, or why there is none."""
        rows = self.rows
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


def _full_commit(short: str) -> str:
    short = short.removesuffix("-dirty")
    return LLAMA_CPP_COMMIT if LLAMA_CPP_COMMIT.startswith(short) else short


# --- calibrate --log: a user's own log, compared with the prediction for its build --------------------------

_KIND_ORDER = ("model", "kv", "rs", "output", "context", "compute", "state", "lora", "other")
_BACKEND_OF_LOG = {impl.label: kind for kind, impl in backends.BACKENDS.items()}  # "Metal" -> Backend.METAL, ...


class LogRow(BaseModel):
    """One kind of buffer on one side (the device, or host memory next to it): ggfit's prediction for the log's
    config and build, and what the log printed (None: that side has no such buffer)."""

    kind: str
    side: Literal["device", "host"]
    predicted_buffers: list[str]
    printed_buffers: list[str]
    predicted_bytes: int | None
    printed_bytes: int | None

    @property
    def diff_bytes(self) -> int | None:
        if self.predicted_bytes is None or self.printed_bytes is None:
            return None
        return self.predicted_bytes - self.printed_bytes


class LogComparison(BaseModel):
    """`ggfit calibrate --log`: the log, the config and build read from it, the prediction and the rows."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    log: UserLog
    build: LlamaBuild | None = None
    backend: Backend | None = None
    frontend: Frontend | None = None
    config: RunConfig | None = None
    assumed: dict[str, str] = Field(default_factory=dict)  # setting -> the value used, where the log is silent
    model: str | None = None  # the model file predicted
    architecture: str | None = None
    prediction: Prediction | None = None
    rows: list[LogRow] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    missing: str | None = None  # why nothing was predicted (which argument would let ggfit predict it)


def log_backend(log: UserLog, given: Backend | None) -> Backend | None:
    """--backend, else the backend the log's buffers name, when ggfit models it (Metal, CUDA, CPU)."""
    if given is not None:
        return given
    b = log.backend
    return _BACKEND_OF_LOG.get(b) if b else None


def log_build(log: UserLog, value: str | None) -> LlamaBuild:
    """--llama-build VALUE (`auto` or none: the log's build line). A log without one is the user's to name."""
    if value not in (None, "auto"):
        return resolve_build(value)
    return build_from_line(log.build, log.source)


def _rows(log: UserLog, pred: Prediction | None, backend: Backend | None) -> list[LogRow]:
    """One row per kind and side: the printed buffers (summed: several KV caches, several GPUs) and the predicted."""
    Key = tuple[str, Literal["device", "host"]]
    printed: dict[Key, tuple[list[str], int]] = {}
    predicted: dict[Key, tuple[list[str], int]] = {}
    pairs = [(kind, buf, n, printed) for kind, buf, n in log.buffers()]
    # whole-MiB tables (breakdown, --fit-print) print KV, recurrent state and outputs together as "context"
    context = any(kind == "context" for kind, _, _, _ in pairs)
    pairs += [("context" if context and b.kind in ("kv", "rs", "output") else b.kind, b.device, b.bytes, predicted)
              for b in (pred.buffers if pred else []) if b.owner == "target"]
    for kind, buf, n, into in pairs:
        key: Key = (kind, _side(buf, backend))
        names, total = into.get(key, ([], 0))
        into[key] = (names + ([buf] if buf not in names else []), total + n)
    rows = []
    for key in sorted(set(printed) | set(predicted),
                      key=lambda k: (_KIND_ORDER.index(k[0]) if k[0] in _KIND_ORDER else 99, k[1])):
        p, m = predicted.get(key), printed.get(key)
        rows.append(LogRow(kind=key[0], side=key[1], predicted_buffers=p[0] if p else [],
                           printed_buffers=m[0] if m else [], predicted_bytes=p[1] if p else None,
                           printed_bytes=m[1] if m else None))
    return rows


def compare_log(log: UserLog, model: str | None, *, backend: Backend | None = None,
                llama_build: str | None = None) -> LogComparison:
    """Predict the log's config for the log's build and put it next to every buffer the log printed.

    Without a model (none given, and the one the log names is not on this machine) or without a backend ggfit
    models, the comparison holds only the log's side and `missing` says which argument would complete it.
    A log without a build line raises BuildError unless --llama-build names the build."""
    out = LogComparison(log=log, backend=log_backend(log, backend), notes=list(log.notes))
    if backend is not None and log.backend and _BACKEND_OF_LOG.get(log.backend) != backend:
        out.notes.append(f"the log's backend is {log.backend}: compared as {backend.value} (--backend)")
    if model is None and log.model.path and Path(log.model.path).is_file():
        model = log.model.path
        out.notes.append(f"model: the log's own {model}")
    if model is None:
        named = ", ".join(x for x in (log.model.name, log.model.path) if x)
        out.missing = (f"the log's model{f' ({named})' if named else ''} is not on this machine: give it as MODEL "
                       f"(a GGUF path, an http(s) URL or a bundled name) to predict the same config")
    elif out.backend is None:
        out.missing = (f"the log's backend is {log.backend or 'not named'}; ggfit models metal, cuda and cpu: give "
                       f"--backend to compare it as one of them")
    out.build = log_build(log, llama_build)  # after the log's side is known: the message is about the build
    if out.missing is not None:
        out.rows = _rows(log, None, out.backend)
        return out
    assert model is not None and out.backend is not None
    header, spec = load_model_spec(model)
    out.model, out.architecture = model, spec.architecture
    if log.model.arch and log.model.arch != spec.architecture:
        out.notes.append(f"the log's model is {log.model.arch}, MODEL is {spec.architecture}: not the same model")
    cfg, fe, assumed = log_run_config(log, spec, out.backend)
    out.config, out.frontend, out.assumed = cfg, fe, assumed
    out.prediction = predict(header, spec, cfg, out.backend, fe, calibrated=False, build=out.build)
    cp = out.prediction.context
    for name, got in (("n_ctx", log.settings.n_ctx), ("n_ctx_seq", log.settings.n_ctx_seq),
                      ("n_batch", log.settings.n_batch), ("n_ubatch", log.settings.n_ubatch),
                      ("n_outputs_max", log.settings.n_outputs_max)):
        want = getattr(cp, name)
        if got is not None and got != want:
            out.notes.append(f"{name}: the log printed {got}, ggfit resolves {want} for this build")
    if any(b.kind == "model" and "REPACK" in b.buffer for b in log.report.buffers):
        out.notes.append("the log's CPU_REPACK model buffer (llama.cpp's extra CPU buffer types, --repack) is not "
                         "modelled by ggfit: the model rows differ by it")
    if log.settings.n_rs_seq:
        out.notes.append(f"n_rs_seq {log.settings.n_rs_seq}: an MTP draft context; only the target's buffers "
                         f"are compared")
    out.rows = _rows(log, out.prediction, out.backend)
    return out


def log_point(cmp: LogComparison) -> LogPoint:
    """The comparison's compute rows as one calibration point. A printed figure within its print precision of
    the prediction (PRINT_TOLERANCE_BYTES per line; a whole-MiB table: below the next MiB) is the prediction:
    the log confirms it, and no ratio is learned from the rounding."""
    row = {r.side: r for r in cmp.rows if r.kind == "compute"}
    whole_mib = not cmp.log.report.buffers  # figures from the breakdown or --fit-print: floored to whole MiB

    def printed(r: LogRow | None) -> int | None:
        if r is None or r.printed_bytes is None or r.predicted_bytes is None:
            return None
        diff = r.predicted_bytes - r.printed_bytes
        if (0 <= diff < 2**20 * len(r.printed_buffers)) if whole_mib else \
                abs(diff) <= PRINT_TOLERANCE_BYTES * len(r.printed_buffers):
            return r.predicted_bytes
        return r.printed_bytes

    dev, host = row.get("device"), row.get("host")
    return LogPoint(log=Path(cmp.log.source).name,
                    predicted_device=dev.predicted_bytes if dev else None, printed_device=printed(dev),
                    predicted_host=host.predicted_bytes if host else None, printed_host=printed(host))


def record_log(cmp: LogComparison) -> tuple[Calibration, Path]:
    """Store the comparison's compute residuals for its architecture, backend and build (fitter.fit.calibration)."""
    assert cmp.architecture is not None and cmp.backend is not None and cmp.build is not None
    return add_log(cmp.architecture, cmp.backend.value, build_key(cmp.build), log_point(cmp))
