"""`ggfit fit --check --llama-bin DIR`: the user's own `llama-fit-params --fit-print on` beside the prediction.

llama-fit-params (tools/fit-params) runs llama.cpp's dry run (common_fit_print -> common_get_device_memory_data)
with the build the user runs, on their backend: on a Mac, the exact Metal figures of their build. It prints one
line per device and one for the host: `<device> <model> <context> <compute>`, each in MiB rounded down
(`bytes/1024/1024`); context is the KV cache and recurrent state (the output buffer is not in it).

Its context is common_params' (common_context_params_to_llama), not llama-server's: n_outputs_max is not set, so
logits are reserved for the whole ubatch; there is no --kv-unified or --no-mmap. ggfit predicts that context, with
the values of the config asked for, and says so.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitter.errors import GGFitError
from fitter.ggml.backends.base import is_host_buffer
from fitter.llama.cparams import Frontend, RunConfig

if TYPE_CHECKING:
    from fitter.fit.memory import Prediction

_LINE = re.compile(r"^(\S+) (\d+) (\d+) (\d+)\s*$")


class FitParamsError(GGFitError):
    """llama-fit-params is missing, failed or printed nothing ggfit can read."""


def fit_params_binary(bin_dir: str | os.PathLike[str]) -> Path:
    d = Path(bin_dir).expanduser()
    for name in ("llama-fit-params", "llama-fit-params.exe"):
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    raise FitParamsError(f"--llama-bin {bin_dir}: no llama-fit-params in it (it ships with llama.cpp's tools since "
                         "2025-12; give the folder that holds llama-server and llama-fit-params)")


def fit_params_check_config(pred: Prediction, cfg: RunConfig) -> RunConfig:
    """The config llama-fit-params can be asked for that is closest to the prediction's: the same context values,
    one KV stream per sequence (no --kv-unified), the file mapped."""
    cp = pred.context
    return cfg.model_copy(update={
        "n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "type_k": cp.type_k, "type_v": cp.type_v,
        "flash_attn": "on" if cp.flash_attn else "off", "n_parallel": cp.n_seq_max, "kv_unified": False,
        "swa_full": cp.swa_full, "no_mmap": False, "spec_type": "none", "draft_model": None,
    })


FIT_PARAMS_FRONTEND = Frontend.LIBRARY  # n_outputs_max unset: logits for the whole batch, as common_params gives


def _args(cfg: RunConfig) -> list[str]:
    out = ["-c", str(cfg.n_ctx), "-b", str(cfg.n_batch), "-ub", str(cfg.n_ubatch), "-ctk", cfg.type_k,
           "-ctv", cfg.type_v, "-fa", cfg.flash_attn, "-np", str(cfg.n_parallel), "-ngl", str(cfg.n_gpu_layers)]
    if cfg.swa_full:
        out.append("--swa-full")
    if cfg.no_repack:
        out.append("--no-repack")
    return out


def parse_fit_print(text: str) -> dict[str, dict[str, int]]:
    """{device: {"model": MiB, "context": MiB, "compute": MiB}} from `llama-fit-params --fit-print on`'s stdout."""
    out = {}
    for line in text.splitlines():
        if m := _LINE.match(line.strip()):
            out[m.group(1)] = {"model": int(m.group(2)), "context": int(m.group(3)), "compute": int(m.group(4))}
    return out


def _device_of(buffer: str) -> str:
    """A buffer's device as llama-fit-params names it: the host for every CPU-side buffer type."""
    if is_host_buffer(buffer):
        return "Host"
    return buffer.removesuffix("_Mapped")


def predicted_mib(pred: Prediction) -> dict[str, dict[str, int]]:
    """The prediction in llama-fit-params' terms: per device, model / context (KV + RS) / compute, MiB rounded down."""
    acc: dict[str, dict[str, int]] = {}
    for b in pred.buffers:
        if b.owner != "target" or b.kind == "output":
            continue
        kind = {"kv": "context", "rs": "context"}.get(b.kind, b.kind)
        d = acc.setdefault(_device_of(b.device), {"model": 0, "context": 0, "compute": 0})
        d[kind] += b.bytes
    return {dev: {k: v // 2**20 for k, v in kinds.items()} for dev, kinds in acc.items()}


def run_fit_params(binary: Path, model_path: str, cfg: RunConfig, *, timeout: float = 300.0) -> dict[str, Any]:
    cmd = [str(binary), "-m", model_path, *_args(cfg), "--fit-print", "on"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FitParamsError(f"{binary.name}: {e}") from None
    measured = parse_fit_print(r.stdout)
    if r.returncode != 0 or not measured:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FitParamsError(f"{binary.name} exited {r.returncode}: {tail}")
    return {"command": " ".join(cmd), "measured": measured, "log": r.stderr[-4000:]}


def fit_params_check(binary: Path, model_path: str, check_cfg: RunConfig, pred: Prediction) -> dict[str, Any]:
    """Rows of (device, kind, predicted MiB, llama-fit-params MiB): `pred` is ggfit's prediction of `check_cfg`
    (see `fit_params_check_config`) with the library front end (`FIT_PARAMS_FRONTEND`)."""
    got = run_fit_params(binary, model_path, check_cfg)
    want = predicted_mib(pred)
    rows = []
    for dev in sorted(set(want) | set(got["measured"])):
        for kind in ("model", "context", "compute"):
            p, m = want.get(dev, {}).get(kind), got["measured"].get(dev, {}).get(kind)
            if p is None and not m:
                continue
            rows.append({"device": dev, "kind": kind, "predicted_mib": p, "measured_mib": m})
    return {"tool": "llama-fit-params", "command": got["command"], "rows": rows,
            "exact": all(r["predicted_mib"] == r["measured_mib"] for r in rows)}

