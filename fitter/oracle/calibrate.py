"""`ggfit calibrate`'s measurement: llama.cpp's own dry run over a small grid, fitted into a calibration.

The fitted lines are stored by fitter.fit.calibration, which the prediction reads.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

from fitter.build import LLAMA_CPP_COMMIT
from fitter.fit.calibration import (
    MIN_POINTS,
    Calibration,
    CalibrationError,
    Correction,
    fit_line,
)
from fitter.fit.memory import Prediction, predict
from fitter.ggml import backends
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.oracle.check import llama_params
from fitter.oracle.llama_run import REPO_ROOT, LlamaRun, child_env, measure
from fitter.progress import Progress

GRID = [  # (n_ctx, n_ubatch, flash_attn)
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
