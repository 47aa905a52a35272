"""`ggfit calibrate`: measure llama.cpp's compute buffers on this machine and correct the model.

The compute model replays llama.cpp's graph and allocator, which is exact where it was checked
(the CPU backend of the pinned build). On another backend or another llama.cpp build it can drift:
calibration runs llama.cpp's own dry run over a small grid, fits `measured = a + b * predicted` per
compute buffer (device and host) for this architecture and backend, and stores the coefficients with
the llama.cpp build they were measured on. Predictions use them only for that same build.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from fitter.build import LLAMA_CPP_COMMIT
from fitter.config import Backend, Frontend, RunConfig

GRID = [  # (n_ctx, n_ubatch, flash_attn)
    (4096, 512, "on"), (16384, 512, "on"), (16384, 2048, "on"), (65536, 1024, "on"),
    (4096, 512, "off"), (16384, 1024, "off"),
]


class Correction(BaseModel):
    a: float  # bytes
    b: float
    points: int
    max_abs_error_bytes: int  # of the corrected prediction on the grid

    def apply(self, predicted: int) -> int:
        return max(0, int(round(self.a + self.b * predicted)))


class Calibration(BaseModel):
    architecture: str
    backend: str
    llama_cpp: str
    device: Correction | None = None
    host: Correction | None = None


def store_path() -> Path:
    base = os.environ.get("GGFIT_DATA") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "ggfit"
    )
    return Path(base) / "calibration.json"


def _key(arch: str, backend: str, build: str) -> str:
    return f"{arch}|{backend}|{build}"


def load(arch: str, backend: str, build: str = LLAMA_CPP_COMMIT) -> Calibration | None:
    try:
        data = json.loads(store_path().read_text())
    except (OSError, ValueError):
        return None
    raw = data.get(_key(arch, backend, build))
    return Calibration.model_validate(raw) if raw else None


def save(cal: Calibration) -> Path:
    path = store_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[_key(cal.architecture, cal.backend, cal.llama_cpp)] = cal.model_dump(mode="json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


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


def calibrate(path: str, backend: Backend, *, ctx_max: int | None = None) -> tuple[Calibration, list[dict]]:
    """Dry-run llama.cpp over GRID on this machine; return the fitted calibration and the raw rows."""
    from fitter.check import llama_params
    from fitter.llama_run import measure
    from fitter.memory import predict
    from fitter.llama.model import load_model_spec

    header, spec = load_model_spec(path)
    rows, dev_pairs, host_pairs = [], [], []
    build = LLAMA_CPP_COMMIT
    for n_ctx, ub, fa in GRID:
        if ctx_max and n_ctx > ctx_max:
            continue
        cfg = RunConfig(n_ctx=min(n_ctx, spec.n_ctx_train), n_ubatch=ub, flash_attn=fa)
        pred = predict(header, spec, cfg, backend, Frontend.SERVER, calibrated=False)
        run = measure(path, llama_params(pred.context, cfg), mode="dry", log_level="info")
        if not run.ok or run.breakdown is None:
            rows.append({"n_ctx": n_ctx, "n_ubatch": ub, "flash_attn": fa, "status": run.status, "message": run.message})
            continue
        build = run.build.commit or build
        p_dev = sum(b.bytes for b in pred.buffers if b.kind == "compute" and b.owner == "target" and b.counts)
        p_host = sum(b.bytes for b in pred.buffers if b.kind == "compute" and b.owner == "target" and not b.counts)
        m_dev = sum(r.compute for r in run.breakdown if not r.is_host or backend == Backend.CPU)
        m_host = sum(r.compute for r in run.breakdown if r.is_host and backend != Backend.CPU)
        dev_pairs.append((p_dev, m_dev))
        if backend != Backend.CPU:
            host_pairs.append((p_host, m_host))
        rows.append({"n_ctx": n_ctx, "n_ubatch": ub, "flash_attn": fa, "status": "ok",
                     "predicted_device": p_dev, "measured_device": m_dev,
                     "predicted_host": p_host, "measured_host": m_host})
    cal = Calibration(
        architecture=spec.architecture, backend=backend.value, llama_cpp=_full_commit(build),
        device=fit_line(dev_pairs) if dev_pairs else None, host=fit_line(host_pairs) if host_pairs else None,
    )
    return cal, rows


def _full_commit(short: str) -> str:
    short = short.removesuffix("-dirty")
    return LLAMA_CPP_COMMIT if LLAMA_CPP_COMMIT.startswith(short) else short
