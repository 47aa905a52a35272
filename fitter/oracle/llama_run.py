"""llama.cpp as an oracle: its own dry run (or a real load) in a child process, with the log parsed.

`measure(model, params, mode="dry")` runs `python -m fitter.oracle._llama_child`, which loads the model and
creates a context with the reference build (llama-cpp-python 0.3.36, llama.cpp 0c1e57098bba):

- mode "dry": model param `no_alloc = true` and `load_mode = none` (LLAMA_LOAD_MODE_NONE), exactly what
  `common_get_device_memory_data` (common/fit.cpp, the engine of `--fit`) does. llama.cpp then sizes every
  buffer without allocating weights, KV cache or compute buffers (the output buffer and recurrent state
  are allocated anyway). No tensor data is read: about a second whatever the model size.
- mode "load": a real load (`load_mode` as given, library default auto = mmap) and a real context. The
  context is freed before the child exits so that llama.cpp logs its DEBUG compute-buffer check
  (`~llama_context: CPU compute buffer size is X.XXXX MiB, matches expectation of ...`).

A native abort (GGML_ASSERT, SIGSEGV, SIGILL) kills only the child; the parent reports `crash` with
ggml's own `file:line: message`. A refusal (model load failed, context creation returned NULL) is
`error` with llama.cpp's own first ERROR line. Exceeding `timeout` kills the child's whole process
group: `timeout`, and no process left behind.

Besides the log (`fitter.oracle.llama_log.LlamaReport`), the child reads exact figures from the C API:
`llama_model_size` / `llama_model_n_params` (`LlamaRun.api`), and the per-buffer-type byte counts of
`llama_get_memory_breakdown` (model / context = KV + recurrent state / compute; not the output buffer),
the numbers `--fit` itself works with (`LlamaRun.breakdown`).

Defaults: any `LlamaParams` field left at None keeps the LIBRARY default (`llama_model_default_params()`,
`llama_context_default_params()`): n_ctx 512, n_batch 2048, n_ubatch 512, n_seq_max 1, type_k/type_v
f16, flash_attn auto, swa_full TRUE, kv_unified false, offload_kqv true, n_gpu_layers -1 (all),
load_mode auto. The CLI tools (llama-server, llama-cli: common/common.h `common_params`) differ: n_ctx 0
(= the model's n_ctx_train) or 4096 depending on the tool, swa_full FALSE, n_parallel 1 (server: auto, 4
slots with kv_unified), n_ubatch 512, n_batch 2048. The one ggfit-wide exception is `use_extra_bufts`,
False by default here (the library says True): on an AMX CPU the CPU repack buffer types kill real decodes
of quantized weights with SIGILL (SIGSEGV on some) and abort deepseek2 contexts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fitter.errors import GGFitError
from fitter.ggml.types import GGML_TYPES
from fitter.llama_builds import PINNED_COMMIT
from fitter.oracle.child_process import (
    REPO_ROOT,
    check_model_path,
    child_env,
    child_events,
    child_preexec,
    kill_group,
    short_abort,
    signal_name,
    signals_held,
    sigterm_cleanup,
    watchdog_for,
)
from fitter.oracle.llama_log import LlamaReport, parse_log

_GGML_TYPES_LOWER = {k.lower(): k for k in GGML_TYPES}

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}  # enum llama_split_mode

Status = Literal["ok", "error", "crash", "timeout"]
Mode = Literal["dry", "load"]



class LlamaRunError(GGFitError):
    """A llama.cpp run that did not give ggfit its numbers (bad parameters, refused, crashed, timed out)."""


class LlamaParams(BaseModel):
    """llama.cpp's own model and context parameters, by their llama.h names. None = library default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # llama_model_params
    n_gpu_layers: int | None = None
    split_mode: Literal["none", "layer", "row", "tensor"] | None = None
    main_gpu: int | None = None
    load_mode: Literal["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"] | None = None
    use_mmap: bool | None = None  # convenience for older llama.h: True -> load_mode "mmap", False -> "none"
    use_extra_bufts: bool = False  # NOT the library default (True): see the module docstring
    no_host: bool | None = None
    load_mtp: bool | None = None
    # (pattern, buffer type name as ggml_backend_buft_name says it: CPU, CUDA0, ...), in order (-ot, --n-cpu-moe)
    tensor_buft_overrides: tuple[tuple[str, str], ...] | None = None
    tensor_split: tuple[float, ...] | None = None  # -ts: a proportion per device
    check_tensors: bool | None = None

    # llama_context_params
    n_ctx: int | None = Field(default=None, ge=0)
    n_batch: int | None = Field(default=None, ge=0)
    n_ubatch: int | None = Field(default=None, ge=0)
    n_seq_max: int | None = Field(default=None, ge=1)
    n_rs_seq: int | None = Field(default=None, ge=0)
    n_outputs_max: int | None = Field(default=None, ge=0)
    n_threads: int | None = Field(default=None, ge=1)
    n_threads_batch: int | None = Field(default=None, ge=1)
    type_k: str | None = None  # ggml type name: "f16", "q8_0", "q4_0", "bf16", ...
    type_v: str | None = None
    flash_attn: Literal["on", "off", "auto"] | None = None
    swa_full: bool | None = None
    kv_unified: bool | None = None
    offload_kqv: bool | None = None
    op_offload: bool | None = None
    embeddings: bool | None = None

    @field_validator("type_k", "type_v")
    @classmethod
    def _ggml_type(cls, v: str | None) -> str | None:
        if v is None:
            return v
        name = _GGML_TYPES_LOWER.get(v.lower())
        if name is None:
            raise ValueError(f"unknown ggml type {v!r} (known: {', '.join(GGML_TYPES)})")
        return name

    @field_validator("flash_attn", mode="before")
    @classmethod
    def _fa(cls, v: Any) -> Any:
        aliases = {"enabled": "on", "disabled": "off", True: "on", False: "off", "1": "on", "0": "off", -1: "auto"}
        return aliases.get(v, v) if isinstance(v, (str, bool, int)) else v

    @model_validator(mode="after")
    def _mmap(self) -> LlamaParams:
        if self.use_mmap is not None and self.load_mode is not None:
            if (self.load_mode in ("mmap", "mmap+mlock", "auto")) != self.use_mmap:
                raise ValueError(f"use_mmap={self.use_mmap} contradicts load_mode={self.load_mode!r}")
        return self

    @classmethod
    def make(cls, **kw: Any) -> LlamaParams:
        """Like the constructor, but a bad value is a LlamaRunError with one line (not a pydantic ValidationError)."""
        try:
            return cls(**kw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ())) or "params"
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            raise LlamaRunError(f"invalid llama.cpp parameter {where}: {msg}") from None

    def llama_model_fields(self) -> dict[str, Any]:
        """llama_model_params fields to set, as the child applies them."""
        out: dict[str, Any] = {}
        for k in ("n_gpu_layers", "main_gpu", "no_host", "load_mtp", "check_tensors"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        out["use_extra_bufts"] = self.use_extra_bufts
        if self.split_mode is not None:
            out["split_mode"] = SPLIT_MODES[self.split_mode]
        if self.tensor_buft_overrides:
            out["tensor_buft_overrides"] = [list(o) for o in self.tensor_buft_overrides]
        if self.tensor_split:
            out["tensor_split"] = list(self.tensor_split)
        if self.load_mode is not None:
            out["load_mode"] = self.load_mode
        elif self.use_mmap is not None:
            out["load_mode"] = "mmap" if self.use_mmap else "none"
        return out

    def llama_context_fields(self) -> dict[str, Any]:
        """llama_context_params fields to set (type_k/type_v as [name, id]: the child checks the id's name in the loaded ggml)."""
        out: dict[str, Any] = {}
        for k in (
            "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_outputs_max", "n_threads", "n_threads_batch",
            "type_k", "type_v", "swa_full", "kv_unified", "offload_kqv", "op_offload", "embeddings",
        ):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        for k in ("type_k", "type_v"):
            if k in out:
                out[k] = [out[k], GGML_TYPES[out[k]]]
        if self.flash_attn is not None:
            out["flash_attn_type"] = FLASH_ATTN[self.flash_attn]
        return out


class BuildReport(BaseModel):
    """The llama.cpp build that answered, as the library reports it at run time."""

    llama_cpp_python: str | None = None
    ggml_commit: str | None = None  # ggml_commit(): "0c1e570-dirty" (the vendored tree is patched by the bindings)
    ggml_version: str | None = None
    llama_version: str | None = None  # llama_version(): libllama's own version string
    system_info: str | None = None  # llama_print_system_info()
    pinned_commit: str = PINNED_COMMIT

    @property
    def commit(self) -> str:
        """The commit, from the library if it says, else the pinned constant."""
        if self.ggml_commit:
            return self.ggml_commit.split("-")[0]
        return PINNED_COMMIT

    @property
    def matches_pinned(self) -> bool:
        c = self.commit
        return bool(c) and (PINNED_COMMIT.startswith(c) or c.startswith(PINNED_COMMIT))


class BreakdownRow(BaseModel):
    """One buffer type of `llama_get_memory_breakdown` (exact bytes). context = KV cache + recurrent state."""

    buffer_type: str
    is_host: bool
    model: int
    context: int
    compute: int


class LlamaRun(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    status: Status
    mode: Mode
    model_path: str
    params: LlamaParams
    message: str | None = None  # error: llama.cpp's first ERROR line; crash: ggml's abort line; timeout: what ran out
    errors: list[str] = Field(default_factory=list)  # every ERROR-level log message
    warnings: list[str] = Field(default_factory=list)  # every WARN-level log message
    log: str = ""
    report: LlamaReport = Field(default_factory=LlamaReport)
    exit_code: int | None = None  # the child's exit status; negative = killed by that signal
    signal: str | None = None  # "SIGABRT", "SIGSEGV", "SIGILL", "SIGKILL" ...
    wall_s: float = 0.0  # spawn to exit, parent side (includes Python start and `import llama_cpp`)
    timings: dict[str, float] = Field(default_factory=dict)  # child side: import_s, model_s, context_s, free_s, total_s
    build: BuildReport = Field(default_factory=BuildReport)
    api: dict[str, Any] = Field(default_factory=dict)  # exact values from the C API (model_size, n_ctx, ...)
    breakdown: list[BreakdownRow] | None = None
    # measure(device_memory=True): {"stage": start|model|context|decode, "devices": [{device, free, total}]}
    device_memory: list[dict[str, Any]] = Field(default_factory=list)
    pid: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raise_for_status(self) -> LlamaRun:
        if self.status != "ok":
            raise LlamaRunError(f"llama.cpp {self.mode} run {self.status}: {self.message or 'no message'}")
        return self

    def breakdown_total(self, field: Literal["model", "context", "compute"]) -> int | None:
        if self.breakdown is None:
            return None
        return sum(getattr(r, field) for r in self.breakdown)


def measure(
    model_path: str | os.PathLike[str],
    params: LlamaParams | None = None,
    *,
    mode: Mode = "dry",
    timeout: float = 120.0,
    log_level: Literal["debug", "info"] = "debug",
    breakdown: bool = True,
    device_memory: bool = False,
    decode_tokens: int = 0,
    loras: Sequence[tuple[str, float]] = (),
    env: dict[str, str] | None = None,
    python: str | None = None,
    _test_signal: str | None = None,
) -> LlamaRun:
    """Run llama.cpp on `model_path` with `params` in a child process and report what it allocates.

    `device_memory`: read each GPU's free memory (cudaMemGetInfo) after each stage. `decode_tokens` (mode
    "load"): decode that many tokens after creating the context, so the compute graph really runs. `loras`:
    (adapter path, scale) loaded after the model and applied to the context (common_init_result); the first decode
    re-reserves the graph with them, and a breakdown after it replaces the one before.
    Raises SourceError for a missing/unreadable file and LlamaRunError for bad arguments; everything
    llama.cpp itself does (refuse, abort, hang) comes back as the run's status.
    """
    if mode not in ("dry", "load"):
        raise LlamaRunError(f"mode must be 'dry' or 'load', not {mode!r}")
    if params is None:
        params = LlamaParams()
    elif not isinstance(params, LlamaParams):
        params = LlamaParams.make(**dict(params))
    if timeout <= 0:
        raise LlamaRunError(f"timeout must be positive, not {timeout}")
    if decode_tokens < 0 or (decode_tokens and mode != "load"):
        raise LlamaRunError(f"decode_tokens={decode_tokens}: a positive count, and only with mode='load'")
    path = check_model_path(model_path)

    request = {
        "model_path": path,
        "mode": mode,
        "model": params.llama_model_fields(),
        "context": params.llama_context_fields(),
        "log_level": log_level,
        "breakdown": breakdown,
        "device_memory": device_memory,
        "decode_tokens": decode_tokens,
        "loras": [[check_model_path(p), float(s)] for p, s in loras],
        "test_signal": _test_signal,
    }
    cmd = [python or sys.executable, "-m", "fitter.oracle._llama_child"]
    proc, out, err, timed_out, wall = _run_child(cmd, json.dumps(request).encode(), child_env(env), timeout)
    return _assemble(proc, out, err, timed_out, wall, path, mode, params, timeout)


def _run_child(cmd: list[str], request: bytes, env: dict[str, str], timeout: float,
               ) -> tuple[subprocess.Popen[bytes], bytes, bytes, bool, float]:
    """measure's child, given the request on stdin: (the process, stdout, stderr, whether it timed out, wall seconds).
    A timeout, a Ctrl-C or a SIGTERM kills its process group."""
    with sigterm_cleanup():  # SIGTERM: the child's group is killed as on Ctrl-C; SIGKILL: the child dies with us
        t0 = time.perf_counter()
        proc: subprocess.Popen[bytes] | None = None
        watchdog = None
        timed_out = False
        try:
            with signals_held():  # a Ctrl-C or SIGTERM during the start is raised as it leaves: the cleanup below runs
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    cwd=REPO_ROOT,
                    start_new_session=True,  # its own process group: a timeout kills everything it started
                    preexec_fn=child_preexec(),
                )
                watchdog = watchdog_for(proc.pid)
            try:
                out, err = proc.communicate(request, timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_group(proc)
                out, err = proc.communicate()
        finally:
            if proc is not None and proc.poll() is None:  # KeyboardInterrupt or SIGTERM while starting or waiting
                kill_group(proc)
                proc.wait()
            if watchdog is not None:
                watchdog.release()
    return proc, out, err, timed_out, time.perf_counter() - t0


def _assemble(
    proc: subprocess.Popen[bytes], out: bytes, err: bytes, timed_out: bool, wall: float,
    path: str, mode: Mode, params: LlamaParams, timeout: float,
) -> LlamaRun:
    all_events = child_events(out)
    events = {ev["event"]: ev for ev in all_events}

    log = err.decode("utf-8", "replace")
    report = parse_log(log)
    rc = proc.returncode
    sig = signal_name(rc)
    done = events.get("done")

    build = BuildReport(**{k: v for k, v in events.get("build", {}).items() if k in BuildReport.model_fields})
    api: dict[str, Any] = {}
    api.update(events.get("model", {}).get("api", {}))
    api.update({f"ctx_{k}": v for k, v in events.get("context", {}).get("api", {}).items()})
    rows = events.get("breakdown", {}).get("rows")
    bd = [BreakdownRow(**r) for r in rows] if rows else None

    status, message = _outcome(events, report, log, rc, sig, timed_out, timeout)
    return LlamaRun(
        status=status,
        mode=mode,
        model_path=path,
        params=params,
        message=message,
        errors=(done or {}).get("errors", []),
        warnings=(done or {}).get("warnings", []),
        log=log,
        report=report,
        exit_code=rc,
        signal=sig,
        wall_s=wall,
        timings=(done or {}).get("timings", {}),
        build=build,
        api=api,
        breakdown=bd,
        device_memory=[{"stage": ev.get("stage"), "devices": ev.get("devices", [])} for ev in all_events
                       if ev["event"] == "memory"],
        pid=events.get("start", {}).get("pid", proc.pid),
    )


def _outcome(events: dict[str, dict], report: LlamaReport, log: str, rc: int | None, sig: str | None,
             timed_out: bool, timeout: float) -> tuple[Status, str | None]:
    """How the child's run ended: its status, and the message that says why where it did not end well."""
    done = events.get("done")
    message: str | None
    if timed_out:
        status: Status = "timeout"
        if "build" not in events:
            stage = "starting (import llama_cpp)"
        elif "model" not in events:
            stage = "loading the model"
        elif "context" not in events:
            stage = "creating the context"
        else:
            stage = "finishing"
        message = f"killed after {timeout:g} s while {stage}"
    elif sig is not None:
        status = "crash"
        message = f"{sig}: {short_abort(report.abort)}" if report.abort else f"child killed by {sig}"
    elif done is not None:
        status = "ok" if done.get("status") == "ok" else "error"
        message = done.get("message")
        if rc not in (0, None) and status == "ok":
            status, message = "error", f"child exited with status {rc} after reporting success"
    else:
        status = "error"
        tail = [ln for ln in log.strip().splitlines() if ln.strip()]
        last = tail[-1].strip() if tail else ""
        message = f"child exited with status {rc} without a result" + (f": {last}" if last else "")
    return status, message
