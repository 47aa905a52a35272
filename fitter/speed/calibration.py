"""The speed calibration store: one machine's measured llama-bench rates against the speed model's, per hardware
profile and llama.cpp build (`ggfit calibrate --bench FILE`).

The speed model's coefficients (fitter.speed.factors) are times per unit of work, fitted over many machines. One
machine runs a little faster or slower than the fit says; calibration stores, per kind of rate, the median over the
bench rows of predicted / measured rate (= measured seconds / predicted seconds), and `predict_speed(..., scale=)`
multiplies the coefficients (time) by it. Decode is scaled from tg rows, prefill from pp rows; a kind without rows
is left as fitted (scale 1). A stored scale replaces the one a profile ships (factors.PROFILE_SCALE, from the
speed model's truth set): both are against the fitted coefficients alone.

The store is `speed-calibration.json` in ggfit's cache directory (fitter.cache.cache_root), written as the memory
calibration store writes its own (fitter.fit.calibration): a format number, the entries by key, atomically replaced.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Literal

from fitter.cache import cache_root
from fitter.errors import GGFitError
from fitter.fit.calibration import build_key
from fitter.ggml import backends
from fitter.llama_builds import LlamaBuild
from fitter.record import Record

FORMAT = 1  # of speed-calibration.json
STORE = "speed-calibration.json"
KINDS = ("prefill", "decode")
UNSCALED = {k: 1.0 for k in KINDS}  # predict_speed's scale= for the fitted coefficients alone (no profile scale)


class SpeedCalibrationError(GGFitError):
    """A speed calibration that cannot be made or stored (no usable rows, an unwritable store)."""


class SpeedCalibration(Record, frozen=False):
    """One machine's scales: predicted / measured rate, the median over its llama-bench rows of each kind."""

    hardware: str  # the profile's name (nvidia-h200, apple-m4-pro-20, cpu, nvidia-unknown)
    llama_cpp: str  # the build's key (fitter.fit.calibration.build_key), else the rows' commit
    prefill: float = 1.0  # scale of the prefill coefficients (1: no pp rows)
    decode: float = 1.0
    prefill_rows: int = 0
    decode_rows: int = 0
    date: str = ""  # YYYY-MM-DD
    source: str = ""  # the bench file's name

    @property
    def scale(self) -> dict[str, float]:
        """predict_speed's `scale=`."""
        return {"prefill": self.prefill, "decode": self.decode}

    @property
    def rows(self) -> int:
        return self.prefill_rows + self.decode_rows

    @property
    def label(self) -> str:
        """predict_speed's `calibrated=`, and what `fit` and `quants` print."""
        return f"calibrated from {self.rows} llama-bench row{'s' if self.rows != 1 else ''} ({self.date})"


def store_path() -> Path:
    return Path(cache_root()) / STORE


def key_of(hardware: str, build: str) -> str:
    return f"{hardware}|{build}"


def rows_build_key(commit: str | None, number: int | None, fallback: LlamaBuild) -> str:
    """The store's name of the build that printed the rows: build_key of what fitter.llama_builds knows of its commit (else
    its number above 1: a source build without git prints 1), else the commit itself, else `fallback`'s."""
    from fitter.llama_builds import resolve_build

    for value in (commit, f"b{number}" if number and number > 1 else None):
        if value:
            try:
                return build_key(resolve_build(value))
            except GGFitError:
                continue
    return commit[:12] if commit else build_key(fallback)


def _warn(msg: str) -> None:
    print(f"ggfit: warning: {msg}", file=sys.stderr)


def _read(path: Path) -> dict[str, SpeedCalibration]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn(f"{path}: unreadable ({e}); speed calibrations ignored (`ggfit calibrate --bench` rewrites it)")
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        _warn(f"{path} was written by another ggfit version; speed calibrations ignored")
        return {}
    out = {}
    for key, raw in data["entries"].items():
        try:
            cal = SpeedCalibration.model_validate(raw)
        except (TypeError, ValueError):
            continue
        if all(v > 0 for v in cal.scale.values()):
            out[key] = cal
    return out


def stored() -> list[SpeedCalibration]:
    return sorted(_read(store_path()).values(), key=lambda c: (c.hardware, c.llama_cpp))


def load(hardware: str, build: LlamaBuild) -> SpeedCalibration | None:
    """The calibration stored for this hardware and build (a commit stored short matches the build's full one)."""
    entries = _read(store_path())
    want = build_key(build)
    for cal in entries.values():
        if cal.hardware != hardware:
            continue
        if cal.llama_cpp == want or (build.commit and len(cal.llama_cpp) >= 7
                                     and build.commit.startswith(cal.llama_cpp)):
            return cal
    return None


def save(cal: SpeedCalibration) -> Path:
    path = store_path()
    entries = _read(path)
    entries[key_of(cal.hardware, cal.llama_cpp)] = cal
    data = {"format": FORMAT, "entries": {k: v.model_dump(mode="json") for k, v in sorted(entries.items())}}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        if tmp.is_file():
            tmp.unlink()
        raise SpeedCalibrationError(f"cannot write the speed calibration store {path} ({e.strerror or e}); set "
                                    "GGFIT_CACHE to a writable directory") from None
    return path


def scale_of(pairs: list[tuple[float, float]]) -> float:
    """The median of predicted / measured over (predicted, measured) rates; 1 without a usable pair."""
    ratios = [p / m for p, m in pairs if p > 0 and m > 0]
    return statistics.median(ratios) if ratios else 1.0


# --- llama-bench rows against the model ------------------------------------------------------------------------


class BenchPoint(Record, frozen=False):
    """One llama-bench row, and the rate the model predicts for it before and after calibration."""

    test: str  # pp512, tg128 @ d4096
    kind: str  # prefill (a pp row) or decode (a tg row)
    model: str  # the model's file name
    measured: float
    predicted: float = 0.0  # before calibration: the fitted coefficients', with the profile's shipped scale
    fitted: float = 0.0  # the fitted coefficients' alone: what the stored scale is taken against
    calibrated: float = 0.0  # with this machine's scale
    settings: str = ""  # -ngl 99 -ub 512 ... as the row ran


def kind_of(row) -> str | None:
    """prefill for a pp row, decode for a tg row; None for a pp+tg row (both in one rate)."""
    n_p, n_g = row.n_prompt or 0, row.n_gen or 0
    if n_p > 0 and n_g == 0:
        return "prefill"
    if n_g > 0 and n_p == 0:
        return "decode"
    return None


def backend_of_row(row, default):
    """llama-bench's `backends` (test::get_backend: "CUDA", "Metal,BLAS", "CPU"): the GPU backend it names."""
    from fitter.ggml import backends
    from fitter.ggml.backends.base import Backend

    b = row.backends or ""
    named = [kind for kind, impl in backends.BACKENDS.items() if impl.is_gpu and impl.named_in(b)]
    return named[0] if named else Backend.CPU if b else default


def config_of_row(row, backend) -> tuple:
    """The RunConfig llama-bench ran the row with (tools/llama-bench/llama-bench.cpp cmd_params_instance::
    to_llama_cparams / to_llama_mparams: n_ctx = n_prompt + n_gen + n_depth, one sequence), and its -ts's GPUs.
    -ngl 99 (llama-bench's default) and more is every layer: -1."""
    from fitter.llama.cparams import RunConfig

    ngl = row.n_gpu_layers
    ts: tuple[float, ...] | None = None
    if row.tensor_split:
        parts = tuple(float(x) for x in row.tensor_split.replace(",", "/").split("/") if x.strip())
        ts = parts if sum(1 for x in parts if x > 0) > 1 else None
    ot = () if row.tensor_buft_overrides in (None, "", "none") else tuple(
        x for x in row.tensor_buft_overrides.split(";") if x)
    n_ctx = (row.n_prompt or 0) + (row.n_gen or 0) + (row.n_depth or 0)
    fa: Literal["on", "off", "auto"] = "on" if row.flash_attn == 1 else "off" if row.flash_attn == 0 else "auto"
    cfg = RunConfig(
        n_ctx=max(n_ctx, 1), n_batch=row.n_batch, n_ubatch=row.n_ubatch, type_k=row.type_k or "f16",
        type_v=row.type_v or "f16", flash_attn=fa,
        n_parallel=1, n_gpu_layers=-1 if ngl is None or ngl >= 99 or not backends.get(backend).is_gpu else ngl,
        n_cpu_moe=row.n_cpu_moe or 0, override_tensor=ot, no_kv_offload=bool(row.no_kv_offload),
        no_op_offload=bool(row.no_op_offload), split_mode=row.split_mode or "layer", main_gpu=row.main_gpu or 0,
        tensor_split=ts)
    return cfg, len(ts) if ts else 1


def settings_of(row) -> str:
    parts = [f"-ngl {row.n_gpu_layers}" if row.n_gpu_layers is not None else "",
             f"--n-cpu-moe {row.n_cpu_moe}" if row.n_cpu_moe else "", f"-ub {row.n_ubatch}" if row.n_ubatch else "",
             f"-ctk {row.type_k}" if row.type_k and row.type_k != "f16" else "",
             f"-t {row.n_threads}" if row.n_threads else ""]
    return " ".join(p for p in parts if p)


def row_matches(row, spec) -> bool:
    """The row ran this model: its parameter count and tensor bytes (llama_model_n_params, llama_model_size; the
    markdown table rounds both to 2 decimals) within 1% of the header's, where the row says them."""
    size = sum(spec.bytes_by_type.values())
    for said, have in ((row.model_n_params, spec.n_params), (row.model_size, size)):
        if said and have and abs(said - have) > 0.01 * have:
            return False
    return True
