"""Real-decode probes: prove a configuration with a real request, in isolation, and classify every failure.

    run_probe(model_path, config, workload, runner="python"|"server", budget_bytes=None, timeout=300)
        -> ProbeResult(status = ok | oom | crash | timeout | error, rates, peak memory, evidence ...)

Runners
- ``python`` (default): a fresh interpreter per probe (``python -m search._probe_child``, a new process, not
  a fork of this one) loads the model with llama-cpp-python 0.3.36's low-level API, every model and context
  parameter set explicitly (nothing auto-fitted), prefills a real prompt and decodes ``gen_tokens`` tokens
  greedily, on a persistent CPU threadpool attached as llama-server attaches its own. Rates come from llama.cpp's
  own counters (``llama_perf_context``). A native abort, a segfault or an allocation failure kills only the child.
  Speculation: ``draft-simple`` (an external draft GGUF) is driven in the child with two contexts, greedy
  draft-then-verify as common/speculative.cpp does it, including its vocabulary check; ``draft-mtp`` is only
  probed by the server runner (llama-cpp-python 0.3.36 binds the MTP hooks but has no drafting loop).
- ``server``: a ``llama-server`` binary (``--llama-server PATH``, $GGFIT_LLAMA_SERVER, ggfit's cached build of the
  pinned commit, or PATH) started on 127.0.0.1 with the config's flags and ``-fit off``, proven with real
  ``/completion`` requests (``cache_prompt: false``, a different prompt every time), rates from the response's
  ``timings``; the server and everything it started are stopped afterwards, also on timeout or Ctrl-C.

Both runners read ``RunConfig`` as llama-server flags: a field left at None takes llama-server's default
(n_ctx 0 = the training context, n_batch 2048, n_ubatch 512, -np auto = 4 slots with a unified KV cache,
swa_full off, load mode auto, threads = ``threads`` or os.cpu_count()); the python runner resolves those
defaults itself and passes the result explicitly, so both runners allocate the same buffers. The one deviation
from llama.cpp's defaults is ``use_extra_bufts`` (weight repacking, ``--repack``), off unless asked for
(``use_extra_bufts=True`` or ``RunConfig.no_repack=False``): on AMX CPUs it kills decodes with SIGILL.

Isolation: probes on one host take turns (``host_probe_lock``: an flock on /tmp/ggfit-probe.lock held from before
the child starts until it is dead; a waiting probe says so and its wait is not part of ``timeout``). The child dies
with ggfit, even when ggfit is SIGKILLed (PR_SET_PDEATHSIG on Linux), and SIGTERM stops it as Ctrl-C does. With a
``progress`` (``fitter.progress.Progress``) a probe reports its stages as they happen: the lock, the load, each
prompt's prefill and decode.

Statuses
- ``ok``: every run decoded ``gen_tokens`` tokens.
- ``oom``: an allocation failed: llama.cpp's "failed to allocate" / "unable to allocate" lines, ggml backend
  allocation errors, ``llama_decode`` returning -2/-3 ("Compute error." in the server), ``std::bad_alloc``,
  mmap ENOMEM, Metal's kIOGPUCommandBufferCallbackErrorOutOfMemory, CUDA out of memory, ggml's "insufficient
  memory" (and the GGML_ASSERT(ctx->mem_buffer != NULL) abort that follows it); or death by SIGKILL that ggfit did
  not send (the kernel's OOM killer).
- ``crash``: death by a signal (GGML_ASSERT / abort, SIGSEGV, SIGILL from repacked weights on AMX ...).
- ``timeout``: the probe ran past ``timeout``; the whole process group was killed.
- ``error``: llama.cpp refused the configuration (its own message: an invalid argument, an unsupported cache
  type, a model that fails to load ...).
``evidence`` holds the log lines that decided the status.

Rates (medians over the measured runs, with min/max in the spreads; the warm-up runs are reported but not counted):
prefill = prompt tokens / prefill time, decode = (generated - 1) / decode time (the first token comes from the
prefill's logits), TTFT = prompt start to first token. python runner: llama.cpp's compute time
(``llama_perf_context``; with speculation, target + draft contexts). server runner: llama-server's ``timings``
(wall time of the slot, sampling included). With one compute thread the two agree within a few percent on Gemma
3 270M; with several threads on a busy machine both swing several-fold (spin-waiting ggml threads).

Budget (``budget_bytes``, CPU builds on Linux): the child runs under RLIMIT_AS so that a configuration over
budget really fails to allocate. python runner: the limit is the child's address space right before the model
load plus the budget, i.e. the budget covers everything llama.cpp maps or allocates (mmap'd weights count, as
do KV cache, compute and output buffers, thread stacks). server runner: budget + `server_as_allowance()`
for the server's own baseline (see `search.server.LlamaServer`). Both run with MALLOC_ARENA_MAX=1 under a
budget (glibc's per-thread malloc arenas would each reserve 64 MiB of address space at random moments).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fitter.llama.cparams import SERVER_FLAGS, RunConfig
from fitter.errors import GGFitError
from fitter.oracle.llama_log import parse_log
from fitter.ggml.types import GGML_TYPES
from fitter.oracle.llama_run import FLASH_ATTN, REPO_ROOT as _REPO_ROOT, LlamaBuild, check_model_path as _check_model_path, child_env as _child_env, child_events, short_abort as _short_abort, signal_name, sigterm_cleanup
from fitter.progress import Progress
from search.server import (
    BUDGET_ENV, HTTPFailure, LlamaServer, Proc, find_llama_server, free_port, parse_build,
    server_as_allowance, server_command, server_devices, server_version, split_log_line,
)
from search.workload import Workload

Status = Literal["ok", "oom", "crash", "timeout", "error"]
Runner = Literal["python", "server"]
Speculation = Literal["none", "on", "off"]

DEFAULT_TIMEOUT = 300.0
SPEC_DEFAULT_N_MIN = 0  # common_params_speculative_draft defaults (common/common.h)
SPEC_DEFAULT_P_MIN = 0.0


class ProbeError(GGFitError):
    """The probe could not be attempted (bad arguments, no llama-server); llama.cpp's own failures are statuses."""


# --- classification ---------------------------------------------------------------------------------------

_OOM = re.compile(
    r"failed to allocate|unable to allocate|cannot allocate memory|out of memory|std::bad_alloc|insufficient memory|"
    r"GGML_ASSERT\(ctx->mem_buffer != NULL\)|"  # ggml_init: ggml_aligned_malloc returned NULL
    r"kIOGPUCommandBufferCallbackErrorOutOfMemory|ggml_backend_\w*alloc\w*: .*fail|"
    r"\bret = -[23]\b|returned -[23]\b|Compute error\.|GGML status: error \(failed to allocate memory\)",
    re.IGNORECASE,
)
_OOM_BENIGN = re.compile(  # DEBUG lines that mention allocation without anything having failed
    r"failed to allocate graph, reserving|failed to allocate host buffer for async uploads", re.IGNORECASE)
_SPEC_OFF = re.compile(
    r"failed to initialize speculative decoding context|speculative decoding not supported by this context|"
    r"the target and draft vocabs are not compatible|draft model vocab type must match", re.IGNORECASE)
_ERROR_LINE = re.compile(r"^error: |\berror: invalid argument|\bERR\b|failed to load|error loading model", re.IGNORECASE)


def oom_lines(log: str) -> list[str]:
    """The log lines that say an allocation failed (deduplicated, in order)."""
    seen: dict[str, None] = {}
    for ln in log.splitlines():
        s = ln.strip()
        if s and _OOM.search(s) and not _OOM_BENIGN.search(s):
            seen.setdefault(s, None)
    return list(seen)


def _abort_lines(log: str) -> list[str]:
    rep = parse_log(log)
    out = []
    if rep.abort:
        out.append(_short_abort(rep.abort))
    for ln in log.splitlines():
        s = ln.strip()
        if s.startswith("terminate called") or s.startswith("what():") or "Illegal instruction" in s:
            out.append(s)
    return list(dict.fromkeys(out))


# --- results ----------------------------------------------------------------------------------------------


class Spread(BaseModel):
    """Median and range over the measured runs."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        vals = [v for v in values if v is not None]
        if not vals:
            return None
        return cls(median=statistics.median(vals), min=min(vals), max=max(vals), n=len(vals))


class RunSample(BaseModel):
    """One prompt: prefill + decode, as llama.cpp timed it."""

    warmup: bool
    prompt_tokens: int
    generated_tokens: int
    prefill_ms: float
    decode_ms: float
    decode_n: int  # decode steps timed in decode_ms (generated_tokens - 1: the first token comes from the prefill)
    ttft_ms: float
    prefill_tps: float | None = None
    decode_tps: float | None = None
    draft_n: int | None = None
    draft_n_accepted: int | None = None


class ProbeResult(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    status: Status
    message: str | None = None  # one line: why this status
    evidence: list[str] = Field(default_factory=list)  # the log lines that decided the status
    runner: Runner
    model_path: str
    config: RunConfig
    workload: Workload

    # medians over the measured runs (warm-up excluded); the spreads give min/max
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None
    ttft_s: float | None = None
    prefill_spread: Spread | None = None
    decode_spread: Spread | None = None
    ttft_spread: Spread | None = None
    runs: list[RunSample] = Field(default_factory=list)

    # speculative decoding (sums over the measured runs)
    speculation: Speculation = "none"  # none: not asked for; on: drafting; off: asked for but switched off
    speculation_message: str | None = None
    draft_tokens: int | None = None
    draft_accepted: int | None = None
    acceptance_rate: float | None = None

    peak_rss_bytes: int | None = None  # the child's RSS high-water mark (wait4 ru_maxrss)
    budget_bytes: int | None = None
    budget: dict[str, Any] = Field(default_factory=dict)  # how the limit was applied (enforced, limit, baseline)

    build: LlamaBuild = Field(default_factory=LlamaBuild)
    command: list[str] | None = None  # server runner: the argv; python runner: the child's argv
    params: dict[str, Any] = Field(default_factory=dict)  # python runner: the llama.cpp parameters passed

    wall_s: float = 0.0  # whole probe, parent side
    llama_s: float | None = None  # llama.cpp's own time: load + context (+ draft) + every prefill and decode
    overhead_s: float | None = None  # wall_s - llama_s: what ggfit adds (process start, imports, tokenizing, HTTP)
    timings: dict[str, float] = Field(default_factory=dict)
    exit_code: int | None = None
    signal: str | None = None
    pid: int | None = None  # the child (python) or llama-server; the leader of its own process group
    started_at: float | None = None  # when the child was started and when it was reaped (time.time())
    ended_at: float | None = None
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self) -> str:
        """One human line."""
        if self.status != "ok":
            return f"{self.status}: {self.message or ''}"
        parts = [f"ok: prefill {self.prefill_tps:.1f} tok/s, decode {self.decode_tps:.1f} tok/s, "
                 f"TTFT {self.ttft_s * 1e3:.0f} ms ({self.prompt_tokens} prompt + {self.generated_tokens} generated tokens"
                 f", median of {len([r for r in self.runs if not r.warmup])})"]
        if self.peak_rss_bytes:
            parts.append(f"peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB")
        if self.speculation == "on" and self.acceptance_rate is not None:
            parts.append(f"draft acceptance {self.acceptance_rate:.0%} ({self.draft_accepted}/{self.draft_tokens})")
        elif self.speculation == "off":
            parts.append(f"speculation off: {self.speculation_message}")
        if self.budget_bytes is not None and not self.budget.get("enforced"):
            parts.append(f"budget NOT enforced: {self.budget.get('reason', 'unknown')}")
        return "; ".join(parts)


def _finish(res: ProbeResult, samples: list[RunSample]) -> ProbeResult:
    res.runs = samples
    measured = [s for s in samples if not s.warmup] or samples
    if measured:
        res.prompt_tokens = measured[0].prompt_tokens
        res.generated_tokens = measured[0].generated_tokens
        res.prefill_spread = Spread.of([s.prefill_tps for s in measured])
        res.decode_spread = Spread.of([s.decode_tps for s in measured])
        res.ttft_spread = Spread.of([s.ttft_ms / 1e3 for s in measured])
        res.prefill_tps = res.prefill_spread.median if res.prefill_spread else None
        res.decode_tps = res.decode_spread.median if res.decode_spread else None
        res.ttft_s = res.ttft_spread.median if res.ttft_spread else None
        if any(s.draft_n is not None for s in measured):
            res.draft_tokens = sum(s.draft_n or 0 for s in measured)
            res.draft_accepted = sum(s.draft_n_accepted or 0 for s in measured)
            res.acceptance_rate = res.draft_accepted / res.draft_tokens if res.draft_tokens else None
    if res.llama_s is not None:
        res.overhead_s = res.wall_s - res.llama_s
    return res


# --- the python runner ------------------------------------------------------------------------------------


def resolve_server_defaults(config: RunConfig, *, threads: int, use_extra_bufts: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """llama_model_params / llama_context_params fields that llama-server would pass for `config`
    (common_model_params_to_llama / common_context_params_to_llama, tools/server/server.cpp, server_output_limits),
    with `-fit off`. Every field is explicit."""
    c = config
    n_parallel = c.n_parallel if c.n_parallel is not None else -1
    kv_unified = bool(c.kv_unified)
    if n_parallel < 0:  # tools/server/server.cpp: -np auto
        n_parallel, kv_unified = 4, True
    if n_parallel == 0:
        raise ProbeError("-np 0: invalid value for n_parallel")
    n_batch = c.n_batch if c.n_batch is not None else 2048
    n_ubatch = c.n_ubatch if c.n_ubatch is not None else 512
    n_draft = c.draft_n_max if c.spec_type != "none" else 0
    model = {
        "n_gpu_layers": c.n_gpu_layers,
        "load_mode": "none" if c.no_mmap else "auto",
        "use_extra_bufts": use_extra_bufts,
        "load_mtp": c.spec_type == "draft-mtp",
    }
    context = {
        "n_ctx": c.n_ctx if c.n_ctx is not None else 0,
        "n_batch": n_batch,
        "n_ubatch": n_ubatch,
        "n_seq_max": n_parallel,
        "n_rs_seq": c.draft_n_max if c.spec_type == "draft-mtp" else 0,
        "n_outputs_max": max(1, min(n_batch, n_parallel * (1 + n_draft))),
        "n_outputs_max_per_seq": max(1, min(n_batch, 1 + n_draft)),
        "n_threads": threads,
        "n_threads_batch": threads,
        "type_k": [c.type_k, GGML_TYPES[c.type_k]],
        "type_v": [c.type_v, GGML_TYPES[c.type_v]],
        "flash_attn_type": FLASH_ATTN[c.flash_attn],
        "swa_full": bool(c.swa_full),
        "kv_unified": kv_unified,
        "offload_kqv": True,
        "op_offload": True,
        "embeddings": bool(c.embeddings),
    }
    return model, context


def _python_probe(model_path: str, config: RunConfig, workload: Workload, *, budget_bytes: int | None, timeout: float,
                  threads: int, use_extra_bufts: bool, draft_n_min: int | None, draft_p_min: float | None,
                  log_level: str, _test: dict[str, Any] | None, progress: Progress | None) -> ProbeResult:
    model, context = resolve_server_defaults(config, threads=threads, use_extra_bufts=use_extra_bufts)
    spec = None
    if config.spec_type != "none":
        if config.spec_type == "draft-simple" and not config.draft_model:
            raise ProbeError("--spec-type draft-simple needs a draft model (-md)")
        dctx = dict(context, type_k=[config.draft_type_k, GGML_TYPES[config.draft_type_k]],
                    type_v=[config.draft_type_v, GGML_TYPES[config.draft_type_v]],
                    n_outputs_max=context["n_seq_max"], n_outputs_max_per_seq=1, n_rs_seq=0, embeddings=False)
        spec = {
            "type": config.spec_type,
            "draft_model": _check_model_path(config.draft_model) if config.draft_model else None,
            "draft_model_params": dict(model, n_gpu_layers=-1, load_mtp=False),
            "draft_context": dctx,
            "n_max": config.draft_n_max,
            "n_min": SPEC_DEFAULT_N_MIN if draft_n_min is None else draft_n_min,
            "p_min": SPEC_DEFAULT_P_MIN if draft_p_min is None else draft_p_min,
        }
    request = {
        "model_path": model_path, "model": model, "context": context, "prompts": workload.prompts(),
        "warmup": workload.warmup, "prompt_tokens": workload.prompt_tokens, "gen_tokens": workload.gen_tokens,
        "budget_bytes": budget_bytes, "spec": spec, "log_level": log_level, "test": _test or {},
    }
    cmd = [sys.executable, "-m", "search._probe_child"]
    res = ProbeResult(status="error", runner="python", model_path=model_path, config=config, workload=workload,
                      budget_bytes=budget_bytes, command=cmd, params={"model": model, "context": context, "spec": spec})
    t0 = time.perf_counter()
    if progress is not None:
        progress.stage("starting the child")
    proc = Proc(cmd, env=_child_env(BUDGET_ENV if budget_bytes is not None else None), cwd=_REPO_ROOT,
                stdin=json.dumps(request).encode(),
                on_stdout_line=_child_progress(progress, workload) if progress is not None else None)
    timed_out = False
    try:
        if not proc.wait(timeout):
            timed_out = True
            proc.kill()
    finally:
        if proc.alive:  # KeyboardInterrupt while waiting: nothing survives the probe
            proc.kill()
        proc.signal_group(signal.SIGKILL)
    res.wall_s = time.perf_counter() - t0
    res.pid = proc.pid
    res.started_at, res.ended_at = proc.started_at, proc.ended_at

    events: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    for ev in child_events(proc.out):
        events[ev["event"]] = ev
        if ev["event"] == "run":
            runs.append(ev)
    log = proc.err.decode("utf-8", "replace")
    res.log = log
    rc = proc.returncode
    res.exit_code = rc
    res.signal = signal_name(rc)
    res.peak_rss_bytes = proc.peak_rss_bytes
    b = events.get("build", {})
    res.build = LlamaBuild(**{k: v for k, v in b.items() if k in LlamaBuild.model_fields})
    if "limit" in events:
        res.budget = {k: v for k, v in events["limit"].items() if k != "event"}
    done = events.get("done")
    if done:
        res.timings = {k: float(v) for k, v in (done.get("timings") or {}).items()}
    if "draft" in events:
        res.speculation = events["draft"]["speculation"]
        res.speculation_message = events["draft"].get("message")
        if res.speculation == "off":
            res.evidence.append(res.speculation_message)

    samples = [_python_sample(r) for r in runs]
    t = res.timings
    if samples and "load_model_s" in t:
        res.llama_s = (t.get("load_model_s", 0) + t.get("context_s", 0) + t.get("draft_s", 0)
                       + sum(s.prefill_ms + s.decode_ms for s in samples) / 1e3)

    errors = (done or {}).get("errors", [])
    if timed_out:
        stage = _stage(events)
        res.status, res.message = "timeout", f"killed after {timeout:g} s while {stage}"
        res.evidence = [ln for ln in log.strip().splitlines()[-3:]]
    elif res.signal is not None:
        _classify_death(res, log, errors)
    elif done is not None:
        st = done.get("status")
        if st == "ok":
            res.status = "ok"
        else:
            msg = done.get("message") or "llama.cpp refused the configuration"
            oom = oom_lines("\n".join(errors + [msg]))
            if st == "oom" or oom:  # the message: llama.cpp's outermost report (what failed); evidence: every line
                res.status, res.message = "oom", oom[-1] if oom else msg
                res.evidence = oom or [msg]
            else:
                res.status, res.message = "error", msg
                res.evidence = [msg] + [e for e in errors if e != msg][:3]
    else:
        tail = [ln for ln in log.strip().splitlines() if ln.strip()]
        oom = oom_lines(log)
        if oom:
            res.status, res.message, res.evidence = "oom", oom[-1], oom
        else:
            res.status = "error"
            res.message = f"child exited with status {rc} without a result" + (f": {tail[-1].strip()}" if tail else "")
            res.evidence = tail[-3:]
    return _finish(res, samples)


def _python_sample(r: dict[str, Any]) -> RunSample:
    s = RunSample(
        warmup=r["warmup"], prompt_tokens=r["prompt_tokens"], generated_tokens=r["generated_tokens"],
        prefill_ms=r["prefill_ms"], decode_ms=r["decode_ms"], decode_n=r["decode_n"], ttft_ms=r["ttft_ms"],
        draft_n=r.get("draft_n"), draft_n_accepted=r.get("draft_n_accepted"),
    )
    s.prefill_tps = r["prefill_n"] / r["prefill_ms"] * 1e3 if r["prefill_ms"] > 0 else None
    s.decode_tps = s.decode_n / s.decode_ms * 1e3 if s.decode_ms > 0 and s.decode_n > 0 else None
    return s


def _stage(events: dict[str, Any]) -> str:
    if "hang" in events:
        return f"hanging at {events['hang']['stage']}"
    if "build" not in events:
        return "starting (import llama_cpp)"
    if "model" not in events:
        return "loading the model"
    if "context" not in events:
        return "creating the context"
    if "run" not in events:
        return "running the first prompt"
    return f"running prompt {events['run']['index'] + 2}"


def _classify_death(res: ProbeResult, log: str, errors: list[str] | None = None) -> None:
    """A child killed by a signal: oom when the log says an allocation failed (or the kernel's OOM killer), else crash."""
    oom = oom_lines(log)
    aborts = _abort_lines(log)
    if oom:
        res.status, res.message = "oom", f"{res.signal}: {_short_abort(oom[0])}"
        res.evidence = list(dict.fromkeys(_short_abort(x) for x in oom + aborts))
    elif res.signal == "SIGKILL":
        res.status = "oom"
        res.message = "SIGKILL that ggfit did not send: most likely the kernel's out-of-memory killer"
        res.evidence = [ln for ln in log.strip().splitlines()[-3:]]
    else:
        res.status = "crash"
        res.message = f"{res.signal}: {aborts[0]}" if aborts else f"killed by {res.signal}"
        res.evidence = aborts or [ln for ln in log.strip().splitlines()[-3:]]
        if res.signal == "SIGILL" and not aborts:
            res.message += " (an instruction this CPU refused: on AMX CPUs, repacked weights; use --no-repack)"


# --- the server runner ------------------------------------------------------------------------------------


def _server_probe(model_path: str, config: RunConfig, workload: Workload, *, budget_bytes: int | None, timeout: float,
                  threads: int, use_extra_bufts: bool, draft_n_min: int | None, draft_p_min: float | None,
                  llama_server: str | None, extra_args: list[str] | None, _test: dict[str, Any] | None,
                  progress: Progress | None) -> ProbeResult:
    say = progress.stage if progress is not None else (lambda text: None)
    step = progress.step if progress is not None else (lambda n, total, text="": None)
    binary = find_llama_server(llama_server)
    if config.spec_type == "draft-simple" and not config.draft_model:
        raise ProbeError("--spec-type draft-simple needs a draft model (-md)")
    draft = _check_model_path(config.draft_model) if config.draft_model else None
    cfg = config.model_copy(update={"draft_model": draft}) if draft else config
    port = free_port()
    cmd = server_command(binary, model_path, cfg, port=port, threads=threads, use_extra_bufts=use_extra_bufts,
                         n_min=draft_n_min, p_min=draft_p_min, extra_args=extra_args)
    n_par = config.n_parallel if config.n_parallel is not None and config.n_parallel > 0 else 4
    allowance = server_as_allowance(n_par, threads)
    as_limit = budget_bytes + allowance if budget_bytes is not None else None
    why_not = None
    if as_limit is not None:
        devices = server_devices(binary)
        if not sys.platform.startswith("linux"):
            why_not = "RLIMIT_AS is enforced on Linux only"
        elif devices is None or devices:
            why_not = (f"GPU build ({', '.join(devices)}): RLIMIT_AS would break the GPU driver" if devices
                       else "cannot tell whether this llama-server has GPU devices (--list-devices failed)")
        if why_not:
            as_limit = None
    res = ProbeResult(status="error", runner="server", model_path=model_path, config=config, workload=workload,
                      budget_bytes=budget_bytes, command=cmd)
    if budget_bytes is not None:
        res.budget = ({"enforced": True, "limit": as_limit, "allowance": allowance, "budget": budget_bytes}
                      if as_limit is not None else {"enforced": False, "reason": why_not, "budget": budget_bytes})
    t0 = time.perf_counter()
    deadline = t0 + timeout
    samples: list[RunSample] = []
    failure: tuple[str, str, list[str]] | None = None  # (status, message, evidence)
    timed_out = False
    t_ready = None
    say("starting llama-server")
    srv = LlamaServer(cmd, port=port, as_limit=as_limit)
    try:
        say("loading the model (until llama-server's /health answers)")
        healthy = srv.wait_healthy(deadline)
        if not healthy and not srv.proc.alive and "couldn't bind HTTP server socket" in srv.log:
            srv.stop()  # another process took the free port in between: once more on a new one
            port = free_port()
            cmd = server_command(binary, model_path, cfg, port=port, threads=threads, use_extra_bufts=use_extra_bufts,
                                 n_min=draft_n_min, p_min=draft_p_min, extra_args=extra_args)
            res.command = cmd
            srv = LlamaServer(cmd, port=port, as_limit=as_limit)
            healthy = srv.wait_healthy(deadline)
        if not healthy:
            timed_out = srv.proc.alive
        else:
            t_ready = time.perf_counter() - t0
            if _test and _test.get("signal"):  # test hook: the server dies like a native crash would
                os.kill(srv.proc.pid, getattr(signal, _test["signal"]))
            n_prompts = workload.warmup + workload.repeats
            for i, text in enumerate(workload.prompts()):
                warm = i < workload.warmup
                label = _prompt_label(i, workload.warmup)
                step(i, n_prompts, f"{label}: prefill {workload.prompt_tokens} + decode {workload.gen_tokens} tokens")
                try:
                    tok = srv.request("POST", "/tokenize", {"content": text, "add_special": True},
                                      deadline - time.perf_counter())
                    tokens = tok["tokens"][: workload.prompt_tokens]
                    if len(tokens) < workload.prompt_tokens:
                        failure = ("error", f"prompt {i} gave only {len(tokens)} tokens, {workload.prompt_tokens} wanted", [])
                        break
                    body = {"prompt": tokens, "n_predict": workload.gen_tokens, "ignore_eos": True, "cache_prompt": False,
                            "temperature": 0.0, "top_k": 1, "stream": False, "return_tokens": False}
                    r = srv.request("POST", "/completion", body, deadline - time.perf_counter())
                except HTTPFailure as e:
                    if time.perf_counter() >= deadline - 0.05 and srv.proc.alive:
                        timed_out = True
                    else:
                        if e.status is None:
                            srv.proc.wait(2.0)  # a dropped connection: give a dying server time to be reaped
                        if srv.proc.alive or e.status is not None:
                            failure = ("error", f"HTTP {e.status}: {e.message}" if e.status else e.message, [e.message])
                    break
                samples.append(_server_sample(r, warm))
                step(i + 1, n_prompts, f"{label}: {_rates(samples[-1])}")
    except BaseException:  # Ctrl-C, SIGTERM (Terminated): no grace for the server, the whole group goes now
        srv.proc.kill()
        raise
    finally:
        srv.stop()  # SIGTERM, then SIGKILL; the whole group; reads the log to its end
    res.wall_s = time.perf_counter() - t0
    res.pid = srv.proc.pid
    res.started_at, res.ended_at = srv.proc.started_at, srv.proc.ended_at
    log = srv.log
    parsed = [split_log_line(ln) for ln in srv.proc.lines if ln.strip()]
    clean = "\n".join(text for _, text in parsed)
    res.log = log
    rc = srv.proc.returncode
    res.exit_code = rc
    res.peak_rss_bytes = srv.proc.peak_rss_bytes
    bi = parse_build(server_version(binary), log)
    res.build = LlamaBuild(**bi)
    spec_off = [text for _, text in parsed if _SPEC_OFF.search(text)]
    if config.spec_type != "none":
        res.speculation = "off" if spec_off else "on"
        if spec_off:  # the server's own verdict first ("failed to initialize speculative decoding context: <why>")
            res.speculation_message = next((t for t in spec_off if "failed to initialize" in t), spec_off[0])
    if t_ready is not None:
        res.timings["startup_s"] = t_ready
    if samples:
        res.llama_s = (t_ready or 0.0) + sum(s.prefill_ms + s.decode_ms for s in samples) / 1e3
    stopped_by_us = t_ready is not None and not timed_out and failure is None and len(samples) == workload.runs
    res.signal = signal_name(rc) if rc is not None and not srv.proc.signalled else None  # died on its own

    if timed_out:
        stage = "loading" if t_ready is None else f"serving request {len(samples) + 1}"
        res.status, res.message = "timeout", f"killed after {timeout:g} s while {stage}"
        res.evidence = clean.splitlines()[-3:]
    elif res.signal is not None:
        _classify_death(res, clean)
    elif stopped_by_us:
        res.status = "ok"
        if spec_off:
            res.evidence = spec_off
    else:
        oom = oom_lines(clean)
        if oom:
            res.status, res.message, res.evidence = "oom", oom[-1], oom
        else:
            errs = [t for lv, t in parsed if lv == "E" and "exiting due to" not in t]
            errs += [t for lv, t in parsed if lv is None and _ERROR_LINE.search(t)]
            if failure is not None:
                res.status, res.message = failure[0], failure[1]
                res.evidence = failure[2] + errs[:3]
            else:
                res.status = "error"
                res.message = errs[0] if errs else f"llama-server exited with status {rc}"
                res.evidence = errs[:5] or [ln for ln in log.strip().splitlines()[-3:]]
    return _finish(res, samples)


def _server_sample(r: dict[str, Any], warm: bool) -> RunSample:
    t = r.get("timings", {})
    s = RunSample(
        warmup=warm, prompt_tokens=int(t.get("prompt_n", r.get("tokens_evaluated", 0))),
        generated_tokens=int(t.get("predicted_n", r.get("tokens_predicted", 0))),
        prefill_ms=float(t.get("prompt_ms", 0.0)), decode_ms=float(t.get("predicted_ms", 0.0)),
        decode_n=max(0, int(t.get("predicted_n", 0)) - 1), ttft_ms=float(t.get("prompt_ms", 0.0)),
        draft_n=t.get("draft_n"), draft_n_accepted=t.get("draft_n_accepted"),
    )
    s.prefill_tps = t.get("prompt_per_second")
    s.decode_tps = t.get("predicted_per_second")
    return s


# --- one probe at a time per host -------------------------------------------------------------------------

# Two probes on one host share its cores and memory bandwidth and measure each other (two optimise workers on
# one study once measured 143 tok/s where either alone measured 356-416). So every probe holds this lock from
# before its child starts until the child is dead. /tmp, because the lock must be the same file for every
# user's ggfit on the host: $XDG_RUNTIME_DIR is per user, and tempfile.gettempdir() follows $TMPDIR (per user
# on macOS). GGFIT_PROBE_LOCK=PATH moves it, GGFIT_PROBE_LOCK=off drops it (e.g. probes pinned to separate GPUs).
PROBE_LOCK = "/tmp/ggfit-probe.lock"
LOCK_WAIT_STAGE = "waiting for another probe on this host"


def probe_lock_path() -> str | None:
    v = os.environ.get("GGFIT_PROBE_LOCK")
    if v is None:
        return PROBE_LOCK
    return None if v.strip().lower() in ("", "off", "none", "0") else v


def _open_lock(path: str) -> int | None:
    """A read-only descriptor on the lock file, created readable by all (flock needs no write access). Read-only,
    and without O_CREAT on an existing file: /tmp is sticky and fs.protected_regular refuses O_CREAT on another
    user's file there. None when it cannot be opened (then the probe runs unlocked rather than fails)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            except OSError:
                return None
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o644)  # whatever the umask: other users must be able to open it
            return fd
        except OSError:
            return None
    return None


@contextlib.contextmanager
def host_probe_lock(progress: Progress | None = None) -> Iterator[dict[str, Any]]:
    """Hold the host-wide probe lock (fcntl.flock, so it dies with the process) for the block; yields
    {"path", "waited_s"}. While another probe holds it, says so on `progress` and waits."""
    info: dict[str, Any] = {"path": probe_lock_path(), "waited_s": 0.0}
    fd = _open_lock(info["path"]) if info["path"] else None
    if fd is None:
        info["path"] = None
        yield info
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                progress.stage(LOCK_WAIT_STAGE)
            t = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)  # Ctrl-C / SIGTERM interrupt the wait
            info["waited_s"] = time.perf_counter() - t
        yield info
    finally:
        os.close(fd)  # releases the lock


# --- live progress ----------------------------------------------------------------------------------------


def _prompt_label(i: int, warmup: int) -> str:
    return f"prompt {i + 1}" + (" (warm-up)" if i < warmup else "")


def _child_progress(progress: Progress, workload: Workload) -> Callable[[str], None]:
    """A Proc stdout-line callback: the python runner's child events, reported on `progress` as they come."""
    n, warm = workload.warmup + workload.repeats, workload.warmup

    def on_line(line: str) -> None:
        line = line.strip()
        if not line.startswith("{"):
            return
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            return
        e = ev.get("event") if isinstance(ev, dict) else None
        if e == "start":
            progress.stage("importing llama_cpp")
        elif e == "build":
            progress.stage("loading the model")
        elif e == "model":
            progress.stage("creating the context")
        elif e == "context":
            progress.stage("context ready")
        elif e == "phase":
            i = int(ev.get("index", 0))
            progress.step(i, n, f"{_prompt_label(i, warm)}: {ev.get('phase')} {ev.get('tokens')} tokens")
        elif e == "decoded":
            i = int(ev.get("index", 0))
            progress.step(i, n, f"{_prompt_label(i, warm)}: decode {ev.get('generated')}/{ev.get('tokens')} tokens")
        elif e == "run":
            i = int(ev.get("index", 0))
            s = _python_sample(ev)
            progress.step(i + 1, n, f"{_prompt_label(i, warm)}: {_rates(s)}")

    return on_line


def _rates(s: RunSample) -> str:
    pre = f"{s.prefill_tps:.1f}" if s.prefill_tps else "-"
    dec = f"{s.decode_tps:.1f}" if s.decode_tps else "-"
    return f"prefill {pre} tok/s, decode {dec} tok/s"


# --- public API -------------------------------------------------------------------------------------------


def run_probe(
    model_path: str | os.PathLike[str],
    config: RunConfig | None = None,
    workload: Workload | None = None,
    *,
    runner: Runner = "python",
    budget_bytes: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    llama_server: str | os.PathLike[str] | None = None,
    use_extra_bufts: bool = False,
    threads: int | None = None,
    draft_n_min: int | None = None,
    draft_p_min: float | None = None,
    extra_args: list[str] | None = None,
    log_level: Literal["info", "debug"] = "info",
    progress: Progress | None = None,
    _test: dict[str, Any] | None = None,
) -> ProbeResult:
    """Prove `config` on `model_path` with a real prefill + decode in an isolated process.

    Raises SourceError (model missing/unreadable), ProbeError (bad arguments), ServerNotFound (server runner
    without a binary); everything llama.cpp does (refuse, run out of memory, abort, hang) is the result's status.

    `extra_args`: further llama-server flags, passed verbatim by the server runner (llama-server judges them);
    the python runner has no flags to pass them to and reports them as an error.
    `progress`: where to report what the probe is doing as it happens (waiting for the host's probe lock,
    loading, prefill, decode); None says nothing.
    Probes on one host never overlap: each holds `host_probe_lock` from before its child starts until the child is
    dead; a probe that waits for it says so on `progress`, and its wait does not count against `timeout`
    (`timings["lock_wait_s"]`). SIGTERM stops the child's group as Ctrl-C does (`sigterm_cleanup`), and the child
    dies with this process, even of SIGKILL (`child_preexec`).
    `_test`: test hooks (python runner: {"abort": stage} for a native ggml_abort, {"signal": [stage, name]},
    {"hang": stage}, stages load/context/prompt/decode/free; server runner: {"signal": name} once healthy).
    """
    config = config or RunConfig()
    workload = workload or Workload()
    if runner not in ("python", "server"):
        raise ProbeError(f"unknown runner {runner!r} (python or server)")
    if timeout <= 0:
        raise ProbeError(f"timeout must be positive, not {timeout}")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ProbeError(f"budget must be positive, not {budget_bytes}")
    path = _check_model_path(model_path)
    threads = threads or os.cpu_count() or 1
    extra_bufts = use_extra_bufts or not config.no_repack
    if runner == "python":
        why = None
        if extra_args:
            why = (f"the python runner has no llama-server flags: {' '.join(extra_args)} "
                   "(use --runner server, or a flag ggfit knows)")
        elif config.spec_type == "draft-mtp":
            why = ("--spec-type draft-mtp: the python runner only drives draft-simple (llama-cpp-python 0.3.36 has no "
                   "MTP drafting loop); use the server runner")
        if why:
            return ProbeResult(status="error", runner="python", model_path=path, config=config, workload=workload,
                               message=why, evidence=[why], budget_bytes=budget_bytes)
    with sigterm_cleanup(), host_probe_lock(progress) as lock:
        if runner == "python":
            res = _python_probe(path, config, workload, budget_bytes=budget_bytes, timeout=timeout, threads=threads,
                                use_extra_bufts=extra_bufts, draft_n_min=draft_n_min, draft_p_min=draft_p_min,
                                log_level=log_level, _test=_test, progress=progress)
        else:
            res = _server_probe(path, config, workload, budget_bytes=budget_bytes, timeout=timeout, threads=threads,
                                use_extra_bufts=extra_bufts, draft_n_min=draft_n_min, draft_p_min=draft_p_min,
                                llama_server=os.fspath(llama_server) if llama_server else None, extra_args=extra_args,
                                _test=_test, progress=progress)
    if lock["path"]:
        res.timings["lock_wait_s"] = lock["waited_s"]
    return res


# --- for the CLI (llama-server flags -> RunConfig: fitter.llama.cparams.RunConfig.from_server_args) ------------

def probe_cli(model: str, server_args: list[str], *, runner: Runner = "python", budget: str | None = None,
              llama_server: str | None = None, timeout: float = DEFAULT_TIMEOUT, workload: Workload | None = None,
              as_json: bool = False) -> tuple[int, str]:
    """What `ggfit probe MODEL [llama-server flags] [--runner] [--budget] [--json]` does: returns (exit code, text).

    Exit code 0 for ok, 1 for any other status (the text says which), 2 is left to GGFitError (bad input).
    """
    from fitter.fit.budget import parse_size  # noqa: PLC0415
    from fitter.bundled import resolve_model  # noqa: PLC0415
    from fitter.gguf.reader import read_header  # noqa: PLC0415

    config, opts, unknown = RunConfig.from_server_args(server_args)
    if unknown and runner == "python":
        shown = " ".join(unknown[:2]) if len(unknown) > 1 and not unknown[1].startswith("-") else unknown[0]
        raise ProbeError(f"{shown}: not a llama-server flag the python runner takes (it takes "
                         f"{', '.join(n for n in SERVER_FLAGS if n.startswith('-') and not n.startswith('--'))} and their long "
                         "names); use --runner server to hand it to llama-server")
    budget_bytes = None
    if budget is not None:
        budget_bytes = parse_size(budget, what="--budget")
        if budget_bytes <= 0:
            raise ProbeError(f"--budget {budget}: must be more than zero")
    # a missing, empty, text or truncated file is the user's: one line from ggfit's reader, as `fit` does,
    # before llama.cpp's loader prints its own log lines
    path = resolve_model(model)
    read_header(path)
    if config.draft_model:
        read_header(resolve_model(config.draft_model))
    with Progress("probe", json_output=as_json) as progress:  # live stages on stderr; closed before the result
        res = run_probe(path, config, workload, runner=runner, budget_bytes=budget_bytes, timeout=timeout,
                        llama_server=llama_server, extra_args=unknown or None, progress=progress, **opts)
    invalid = re.compile(r"invalid argument: (\S+)")  # common_params_parse_ex: a flag llama-server does not have
    bad = next((m for m in [res.message or "", *res.evidence] if m and invalid.search(m)), None)
    if not res.ok and bad:
        raise ProbeError(f"{invalid.search(bad).group(1)}: llama-server has no such option")
    if as_json:
        return (0 if res.ok else 1), res.model_dump_json(indent=2, exclude={"log"})
    lines = [res.summary()]
    if not res.ok:
        lines += [f"  {ln}" for ln in res.evidence[:5]]
    if res.command and runner == "server":
        lines.append("  command: " + " ".join(res.command))
    return (0 if res.ok else 1), "\n".join(lines)
