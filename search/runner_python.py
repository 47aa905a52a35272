"""The python runner: llama.cpp driven through llama-cpp-python in a child process (search/_probe_child.py), with
the context llama-server would build for the config."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from fitter.ggml.types import GGML_TYPES
from fitter.llama.cparams import ConfigError, RunConfig
from fitter.oracle.child_process import REPO_ROOT, check_model_path, child_env, child_event, child_events, signal_name
from fitter.oracle.llama_run import FLASH_ATTN, SPLIT_MODES, BuildReport
from fitter.progress import Progress
from search.errors import ProbeError
from search.probe_result import (
    SPEC_DEFAULT_N_MIN,
    SPEC_DEFAULT_P_MIN,
    ProbeResult,
    RunSample,
    _classify_death,
    _finish,
    _prompt_label,
    _rates,
    oom_lines,
)
from search.server import BUDGET_ENV, Proc
from search.workload import Workload


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
    model: dict[str, Any] = {
        "n_gpu_layers": c.n_gpu_layers,
        "load_mode": "none" if c.no_mmap else "auto",
        "use_extra_bufts": use_extra_bufts,
        "load_mtp": c.spec_type == "draft-mtp",
        "split_mode": SPLIT_MODES[c.split_mode],
        "main_gpu": c.main_gpu,
    }
    if c.tensor_overrides():
        model["tensor_buft_overrides"] = [list(o) for o in c.tensor_overrides()]
    if c.tensor_split:
        model["tensor_split"] = list(c.tensor_split)
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
        "offload_kqv": not c.no_kv_offload,
        "op_offload": not c.no_op_offload,
        "embeddings": bool(c.embeddings),
    }
    return model, context


def _speculation(config: RunConfig, model: dict[str, Any], context: dict[str, Any], draft_n_min: int | None,
                 draft_p_min: float | None) -> dict[str, Any] | None:
    """The drafter's model and context params and the speculation settings (None without speculation)."""
    if config.spec_type == "none":
        return None
    if config.spec_type == "draft-simple" and not config.draft_model:
        raise ProbeError("--spec-type draft-simple needs a draft model (-md)")
    dctx = dict(context, type_k=[config.draft_type_k, GGML_TYPES[config.draft_type_k]],
                type_v=[config.draft_type_v, GGML_TYPES[config.draft_type_v]],
                n_outputs_max=context["n_seq_max"], n_outputs_max_per_seq=1, n_rs_seq=0, embeddings=False)
    return {
        "type": config.spec_type,
        "draft_model": check_model_path(config.draft_model) if config.draft_model else None,
        "draft_model_params": {k: v for k, v in dict(model, n_gpu_layers=-1, load_mtp=False).items()
                               if k != "tensor_buft_overrides"},
        "draft_context": dctx,
        "n_max": config.draft_n_max,
        "n_min": SPEC_DEFAULT_N_MIN if draft_n_min is None else draft_n_min,
        "p_min": SPEC_DEFAULT_P_MIN if draft_p_min is None else draft_p_min,
    }


def _run_child(cmd: list[str], request: dict[str, Any], *, budget: bool, timeout: float, workload: Workload,
               progress: Progress | None) -> tuple[Proc, bool]:
    """Run the child to its end (or kill it at the timeout); nothing of its process group survives. (proc, timed out)"""
    if progress is not None:
        progress.stage("starting the child")
    proc = Proc(cmd, env=child_env(BUDGET_ENV if budget else None), cwd=REPO_ROOT,
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
    return proc, timed_out


def _read_events(res: ProbeResult, proc: Proc) -> tuple[dict[str, dict[str, Any]], list[RunSample]]:
    """The child's events (by name) and measured runs; fills the result's process facts, build, limit, timings."""
    events: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    for ev in child_events(bytes(proc.out)):
        events[ev["event"]] = ev
        if ev["event"] == "run":
            runs.append(ev)
    res.log = proc.err.decode("utf-8", "replace")
    res.exit_code = proc.returncode
    res.signal = signal_name(proc.returncode)
    res.peak_rss_bytes = proc.peak_rss_bytes
    b = events.get("build", {})
    res.build = BuildReport(**{k: v for k, v in b.items() if k in BuildReport.model_fields})
    if "limit" in events:
        res.budget = {k: v for k, v in events["limit"].items() if k != "event"}
    done = events.get("done")
    if done:
        res.timings = {k: float(v) for k, v in (done.get("timings") or {}).items()}
    if "draft" in events:
        res.speculation = events["draft"]["speculation"]
        res.speculation_message = events["draft"].get("message")
        if res.speculation == "off" and res.speculation_message:
            res.evidence.append(res.speculation_message)
    samples = [_python_sample(r) for r in runs]
    t = res.timings
    if samples and "load_model_s" in t:
        res.llama_s = (t.get("load_model_s", 0) + t.get("context_s", 0) + t.get("draft_s", 0)
                       + sum(s.prefill_ms + s.decode_ms for s in samples) / 1e3)
    return events, samples


def _classify(res: ProbeResult, events: dict[str, dict[str, Any]], timed_out: bool, timeout: float) -> None:
    """The status, message and evidence: from the timeout, the signal, the child's "done" event, or its log."""
    log, done = res.log, events.get("done")
    errors = (done or {}).get("errors", [])
    if timed_out:
        res.status, res.message = "timeout", f"killed after {timeout:g} s while {_stage(events)}"
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
            res.message = (f"child exited with status {res.exit_code} without a result"
                           + (f": {tail[-1].strip()}" if tail else ""))
            res.evidence = tail[-3:]


def python_probe(model_path: str, config: RunConfig, workload: Workload, *, budget_bytes: int | None, timeout: float,
                 threads: int, use_extra_bufts: bool, draft_n_min: int | None, draft_p_min: float | None,
                 log_level: str, _test: dict[str, Any] | None, progress: Progress | None) -> ProbeResult:
    if config.mmproj:  # llama-cpp-python's Llama loads no projector: only llama-server's probe measures one
        raise ConfigError("--mmproj: the python runner loads no multimodal projector; use --runner server")
    model, context = resolve_server_defaults(config, threads=threads, use_extra_bufts=use_extra_bufts)
    spec = _speculation(config, model, context, draft_n_min, draft_p_min)
    request = {
        "model_path": model_path, "model": model, "context": context, "prompts": workload.prompts(),
        "warmup": workload.warmup, "prompt_tokens": workload.prompt_tokens, "gen_tokens": workload.gen_tokens,
        "budget_bytes": budget_bytes, "spec": spec, "log_level": log_level, "test": _test or {},
        "loras": [[check_model_path(p), s] for p, s in config.lora],
    }
    cmd = [sys.executable, "-m", "search._probe_child"]
    res = ProbeResult(status="error", runner="python", model_path=model_path, config=config, workload=workload,
                      budget_bytes=budget_bytes, command=cmd, params={"model": model, "context": context, "spec": spec})
    t0 = time.perf_counter()
    proc, timed_out = _run_child(cmd, request, budget=budget_bytes is not None, timeout=timeout, workload=workload,
                                 progress=progress)
    res.wall_s = time.perf_counter() - t0
    res.pid = proc.pid
    res.started_at, res.ended_at = proc.started_at, proc.ended_at
    events, samples = _read_events(res, proc)
    _classify(res, events, timed_out, timeout)
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


def _child_progress(progress: Progress, workload: Workload) -> Callable[[str], None]:
    """A Proc stdout-line callback: the python runner's child events, reported on `progress` as they come."""
    n, warm = workload.warmup + workload.repeats, workload.warmup

    def on_line(line: str) -> None:
        ev = child_event(line)
        if ev is None:
            return
        e = ev["event"]
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
