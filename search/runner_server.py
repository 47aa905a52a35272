"""The server runner: the pinned llama-server itself, driven over HTTP (/tokenize, /completion)."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from fitter.llama.cparams import RunConfig
from fitter.oracle.child_process import check_model_path, signal_name
from fitter.oracle.llama_run import BuildReport
from fitter.progress import Progress
from search import probe_result as pr
from search.errors import ProbeError
from search.probe_result import ProbeResult, RunSample, Status
from search.server import (
    HTTPFailure,
    LlamaServer,
    find_llama_server,
    free_port,
    parse_build,
    server_as_allowance,
    server_command,
    server_devices,
    server_version,
    split_log_line,
)
from search.workload import Workload

Failure = tuple[Status, str, list[str]]  # (status, message, evidence)


def _address_space_limit(binary: str, config: RunConfig, budget_bytes: int | None, threads: int) -> dict[str, Any]:
    """The RLIMIT_AS the server runs under (budget + the server's own allowance), or why it cannot be enforced."""
    if budget_bytes is None:
        return {}
    n_par = config.n_parallel if config.n_parallel is not None and config.n_parallel > 0 else 4
    allowance = server_as_allowance(n_par, threads)
    why_not = None
    devices = server_devices(binary)
    if not sys.platform.startswith("linux"):
        why_not = "RLIMIT_AS is enforced on Linux only"
    elif devices is None or devices:
        why_not = (f"GPU build ({', '.join(devices)}): RLIMIT_AS would break the GPU driver" if devices
                   else "cannot tell whether this llama-server has GPU devices (--list-devices failed)")
    if why_not:
        return {"enforced": False, "reason": why_not, "budget": budget_bytes}
    return {"enforced": True, "limit": budget_bytes + allowance, "allowance": allowance, "budget": budget_bytes}


def _start(command: Callable[[int], list[str]], res: ProbeResult, as_limit: int | None, deadline: float,
           say: Callable[[str], None], held: list[LlamaServer]) -> bool:
    """Start llama-server on a free port and wait for /health; once more on a new port when another process took
    the port in between. The server started last is `held[-1]` (the caller stops it, whatever happens here).
    Returns whether /health answered."""
    say("starting llama-server")
    for attempt in range(2):
        port = free_port()
        res.command = command(port)
        held.append(LlamaServer(res.command, port=port, as_limit=as_limit))
        if attempt == 0:
            say("loading the model (until llama-server's /health answers)")
        srv = held[-1]
        healthy = srv.wait_healthy(deadline)
        if healthy or srv.proc.alive or "couldn't bind HTTP server socket" not in srv.log:
            return healthy
        srv.stop()  # another process took the free port in between: once more on a new one
    return False


def _serve(srv: LlamaServer, workload: Workload, deadline: float, step: Callable[..., None],
           samples: list[RunSample]) -> tuple[Failure | None, bool]:
    """The workload's prompts, one request each, measured into `samples`. (failure, timed out)"""
    n_prompts = workload.warmup + workload.repeats
    for i, text in enumerate(workload.prompts()):
        label = pr._prompt_label(i, workload.warmup)
        step(i, n_prompts, f"{label}: prefill {workload.prompt_tokens} + decode {workload.gen_tokens} tokens")
        try:
            tok = srv.request("POST", "/tokenize", {"content": text, "add_special": True}, deadline - time.perf_counter())
            tokens = tok["tokens"][: workload.prompt_tokens]
            if len(tokens) < workload.prompt_tokens:
                return ("error", f"prompt {i} gave only {len(tokens)} tokens, {workload.prompt_tokens} wanted", []), False
            body = {"prompt": tokens, "n_predict": workload.gen_tokens, "ignore_eos": True, "cache_prompt": False,
                    "temperature": 0.0, "top_k": 1, "stream": False, "return_tokens": False}
            r = srv.request("POST", "/completion", body, deadline - time.perf_counter())
        except HTTPFailure as e:
            return _failed(srv, e, deadline)
        samples.append(_server_sample(r, i < workload.warmup))
        step(i + 1, n_prompts, f"{label}: {pr._rates(samples[-1])}")
    return None, False


def _failed(srv: LlamaServer, e: HTTPFailure, deadline: float) -> tuple[Failure | None, bool]:
    """A request that failed: (failure, timed out); (None, False) when the server died (its exit says why)."""
    if time.perf_counter() >= deadline - 0.05 and srv.proc.alive:
        return None, True
    if e.status is None:
        srv.proc.wait(2.0)  # a dropped connection: give a dying server time to be reaped
    if srv.proc.alive or e.status is not None:
        return ("error", f"HTTP {e.status}: {e.message}" if e.status else e.message, [e.message]), False
    return None, False


def _soak(srv: LlamaServer, res: ProbeResult, n: int, extra_args: list[str] | None, deadline: float,
          say: Callable[[str], None]) -> tuple[Failure | None, bool]:
    """--soak N after the workload: N more requests and the server's RSS after each (search.soak), with
    fitter.session's prediction for this model and these flags beside it, into res.soak."""
    from fitter.llama.model import load_model_spec
    from search.runner_openai import group_rss
    from search.soak import predict_soak, server_soak

    w = res.workload
    _, spec = load_model_spec(res.model_path)
    try:
        got = server_soak(lambda body: srv.request("POST", "/completion", body, deadline - time.perf_counter()),
                          lambda: group_rss(srv.proc.pid), n, spec.n_vocab, w.prompt_tokens, w.gen_tokens, say)
    except HTTPFailure as e:
        return _failed(srv, e, deadline)
    pred = predict_soak(res.model_path, res.config, extra_args or [], w.prompt_tokens, w.gen_tokens, w.runs, n)
    res.soak = got.model_copy(update=pred or {})
    return None, False


def _read_server(res: ProbeResult, srv: LlamaServer, binary: str, config: RunConfig) -> list[tuple[str | None, str]]:
    """The server's process facts, build and speculation verdict into `res`; its log lines as (level, text)."""
    res.pid = srv.proc.pid
    res.started_at, res.ended_at = srv.proc.started_at, srv.proc.ended_at
    parsed = [split_log_line(ln) for ln in srv.proc.lines if ln.strip()]
    res.log = srv.log
    rc = srv.proc.returncode
    res.exit_code = rc
    res.peak_rss_bytes = srv.proc.peak_rss_bytes
    res.build = BuildReport(**parse_build(server_version(binary), srv.log))
    spec_off = [text for _, text in parsed if pr._SPEC_OFF.search(text)]
    if config.spec_type != "none":
        res.speculation = "off" if spec_off else "on"
        if spec_off:  # the server's own verdict first ("failed to initialize speculative decoding context: <why>")
            res.speculation_message = next((t for t in spec_off if "failed to initialize" in t), spec_off[0])
    res.signal = signal_name(rc) if rc is not None and not srv.proc.signalled else None  # died on its own
    return parsed


def _classify(res: ProbeResult, parsed: list[tuple[str | None, str]], *, timed_out: bool, timeout: float,
              t_ready: float | None, failure: Failure | None, n_samples: int, stopped_by_us: bool) -> None:
    clean = "\n".join(text for _, text in parsed)
    if timed_out:
        stage = "loading" if t_ready is None else f"serving request {n_samples + 1}"
        res.status, res.message = "timeout", f"killed after {timeout:g} s while {stage}"
        res.evidence = clean.splitlines()[-3:]
    elif res.signal is not None:
        pr._classify_death(res, clean)
    elif stopped_by_us:
        res.status = "ok"
        spec_off = [text for _, text in parsed if pr._SPEC_OFF.search(text)]
        if spec_off:
            res.evidence = spec_off
    elif oom := pr.oom_lines(clean):
        res.status, res.message, res.evidence = "oom", oom[-1], oom
    else:
        errs = [t for lv, t in parsed if lv == "E" and "exiting due to" not in t]
        errs += [t for lv, t in parsed if lv is None and pr._ERROR_LINE.search(t)]
        if failure is not None:
            res.status, res.message = failure[0], failure[1]
            res.evidence = failure[2] + errs[:3]
        else:
            res.status = "error"
            res.message = errs[0] if errs else f"llama-server exited with status {res.exit_code}"
            res.evidence = errs[:5] or [ln for ln in res.log.strip().splitlines()[-3:]]


def server_probe(model_path: str, config: RunConfig, workload: Workload, *, budget_bytes: int | None, timeout: float,
                 threads: int, use_extra_bufts: bool, draft_n_min: int | None, draft_p_min: float | None,
                 llama_server: str | None, extra_args: list[str] | None, _test: dict[str, Any] | None,
                 progress: Progress | None, soak: int = 0) -> ProbeResult:
    say = progress.stage if progress is not None else (lambda text: None)
    step = progress.step if progress is not None else (lambda n, total, text="": None)
    binary = find_llama_server(llama_server)
    if config.spec_type == "draft-simple" and not config.draft_model:
        raise ProbeError("--spec-type draft-simple needs a draft model (-md)")
    draft = check_model_path(config.draft_model) if config.draft_model else None
    cfg = config.model_copy(update={"draft_model": draft}) if draft else config
    command = functools.partial(_command, binary, model_path, cfg, threads=threads, use_extra_bufts=use_extra_bufts,
                                n_min=draft_n_min, p_min=draft_p_min, extra_args=extra_args)
    res = ProbeResult(status="error", runner="server", model_path=model_path, config=config, workload=workload,
                      budget_bytes=budget_bytes, command=[])
    limit = _address_space_limit(binary, config, budget_bytes, threads)
    if limit:
        res.budget = limit
    t0 = time.perf_counter()
    deadline = t0 + timeout
    samples: list[RunSample] = []
    failure, timed_out, t_ready = None, False, None
    held: list[LlamaServer] = []
    try:
        healthy = _start(command, res, limit.get("limit"), deadline, say, held)
        srv = held[-1]
        if not healthy:
            timed_out = srv.proc.alive
        else:
            t_ready = time.perf_counter() - t0
            if _test and _test.get("signal"):  # test hook: the server dies like a native crash would
                os.kill(srv.proc.pid, getattr(signal, _test["signal"]))
            failure, timed_out = _serve(srv, workload, deadline, step, samples)
            if soak and failure is None and not timed_out and srv.proc.alive:
                failure, timed_out = _soak(srv, res, soak, extra_args, deadline, say)
    except BaseException:  # Ctrl-C, SIGTERM (Terminated): no grace for the server, the whole group goes now
        if held:
            held[-1].proc.kill()
        raise
    finally:
        if held:
            held[-1].stop()  # SIGTERM, then SIGKILL; the whole group; reads the log to its end
    res.wall_s = time.perf_counter() - t0
    parsed = _read_server(res, srv, binary, config)
    if t_ready is not None:
        res.timings["startup_s"] = t_ready
    if samples:
        res.llama_s = (t_ready or 0.0) + sum(s.prefill_ms + s.decode_ms for s in samples) / 1e3
    stopped_by_us = t_ready is not None and not timed_out and failure is None and len(samples) == workload.runs
    _classify(res, parsed, timed_out=timed_out, timeout=timeout, t_ready=t_ready, failure=failure,
              n_samples=len(samples), stopped_by_us=stopped_by_us)
    return pr._finish(res, samples)


def _command(binary: str, model_path: str, cfg: RunConfig, port: int, **kw: Any) -> list[str]:
    return server_command(binary, model_path, cfg, port=port, **kw)


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
