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
(``use_extra_bufts=True`` or ``RunConfig.no_repack=False``): on AMX CPUs it kills decodes with SIGILL
(SIGSEGV on some).

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

import os
import re
from typing import Any, Literal

from fitter.bundled import resolve_model
from fitter.fit.budget import parse_size
from fitter.gguf.reader import read_header
from fitter.llama.cparams import SERVER_FLAGS, ConfigError, RunConfig
from fitter.oracle.child_process import check_model_path, sigterm_cleanup
from fitter.progress import Progress
from search.errors import ProbeError
from search.probe_lock import LOCK_WAIT_STAGE, host_probe_lock
from search.probe_result import DEFAULT_TIMEOUT, ProbeResult, Runner, RunSample, Spread, Status, oom_lines
from search.runner_python import _speculation as python_speculation
from search.runner_python import python_probe, resolve_server_defaults
from search.runner_server import server_probe
from search.server import find_llama_server
from search.workload import Workload

__all__ = ["DEFAULT_TIMEOUT", "LOCK_WAIT_STAGE", "ProbeError", "ProbeResult", "RunSample", "Runner", "Spread", "Status",
           "oom_lines", "probe_cli", "resolve_server_defaults", "run_probe"]


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
    soak: int = 0,
    _test: dict[str, Any] | None = None,
) -> ProbeResult:
    """Prove `config` on `model_path` with a real prefill + decode in an isolated process.

    Raises SourceError (model missing/unreadable), ProbeError (bad arguments), ServerNotFound (server runner
    without a binary); everything llama.cpp does (refuse, run out of memory, abort, hang) is the result's status.

    `extra_args`: further llama-server flags, passed verbatim by the server runner (llama-server judges them);
    the python runner has no flags to pass them to and reports them as an error.
    `progress`: where to report what the probe is doing as it happens (waiting for the host's probe lock,
    loading, prefill, decode); None says nothing. `soak`: server runner, N more requests (search.soak).
    Probes on one host never overlap: each holds `host_probe_lock` from before its child starts until the child is
    dead; a probe that waits for it says so on `progress`, and its wait does not count against `timeout`
    (`timings["lock_wait_s"]`). SIGTERM stops the child's group as Ctrl-C does (`sigterm_cleanup`), and the child
    dies with this process, even of SIGKILL (`child_preexec`).
    `_test`: test hooks (python runner: {"abort": stage} for a native ggml_abort, {"signal": [stage, name]},
    {"hang": stage}, stages load/context/prompt/decode/free; server runner: {"signal": name} once healthy).
    """
    config = config or RunConfig()
    workload = workload or Workload()
    _check_limits(runner, timeout, budget_bytes, soak)
    path = check_model_path(model_path)
    threads = threads or os.cpu_count() or 1
    extra_bufts = use_extra_bufts or not config.no_repack
    why = _python_refuses(config, extra_args) if runner == "python" else None
    if why:
        return ProbeResult(status="error", runner="python", model_path=path, config=config, workload=workload,
                           message=why, evidence=[why], budget_bytes=budget_bytes)
    _check_args(config, runner, threads=threads, use_extra_bufts=extra_bufts, draft_n_min=draft_n_min,
                draft_p_min=draft_p_min, llama_server=llama_server)  # before the lock: a bad argument waits for nothing
    common: dict[str, Any] = dict(budget_bytes=budget_bytes, timeout=timeout, threads=threads, use_extra_bufts=extra_bufts,
                                  draft_n_min=draft_n_min, draft_p_min=draft_p_min, _test=_test, progress=progress)
    with sigterm_cleanup(), host_probe_lock(progress) as lock:
        if runner == "python":
            res = python_probe(path, config, workload, log_level=log_level, **common)
        else:
            res = server_probe(path, config, workload, llama_server=os.fspath(llama_server) if llama_server else None,
                               extra_args=extra_args, soak=soak, **common)
    if lock["path"]:
        res.timings["lock_wait_s"] = lock["waited_s"]
    if res.ok and res.prompt_tokens:  # the speed model's rates beside the measured ones (issue 46)
        res.predicted = _predicted_rates(res, path, config, threads)
    return res


def _predicted_rates(res: ProbeResult, path: str, config: RunConfig, threads: int) -> dict[str, Any] | None:
    from search.probe_speed import predicted_rates

    assert res.prompt_tokens is not None  # a probe that ran
    return predicted_rates(path, config, res.prompt_tokens, threads=threads, system_info=res.build.system_info,
                           build_commit=res.build.ggml_commit)


def _check_limits(runner: str, timeout: float, budget_bytes: int | None, soak: int = 0) -> None:
    if runner not in ("python", "server"):
        raise ProbeError(f"unknown runner {runner!r} (python or server)")
    if timeout <= 0:
        raise ProbeError(f"timeout must be positive, not {timeout}")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ProbeError(f"budget must be positive, not {budget_bytes}")
    if soak < 0 or (soak and runner != "server"):
        raise ProbeError(f"--soak {soak}: N requests (0 or more) for the server, openai or mlx runner")


def _python_refuses(config: RunConfig, extra_args: list[str] | None) -> str | None:
    """Why the python runner cannot run this probe (its result, not an error raised), or None."""
    if extra_args:
        return (f"the python runner has no llama-server flags: {' '.join(extra_args)} "
                "(use --runner server, or a flag ggfit knows)")
    if config.spec_type == "draft-mtp":
        return ("--spec-type draft-mtp: the python runner only drives draft-simple (llama-cpp-python 0.3.36 has no "
                "MTP drafting loop); use the server runner")
    return None


def _check_args(config: RunConfig, runner: Runner, *, threads: int, use_extra_bufts: bool, draft_n_min: int | None,
                draft_p_min: float | None, llama_server: str | os.PathLike[str] | None) -> None:
    """What each runner refuses before it starts a child (the same checks, raised the same way), done before the host
    probe lock is taken: an argument error says so at once, whatever other probes the host runs."""
    if config.spec_type == "draft-simple" and not config.draft_model:
        raise ProbeError("--spec-type draft-simple needs a draft model (-md)")
    if config.draft_model:
        check_model_path(config.draft_model)
    for lora, _ in config.lora:
        check_model_path(lora)
    if runner == "python":
        if config.mmproj:  # llama-cpp-python's Llama loads no projector: only llama-server's probe measures one
            raise ConfigError("--mmproj: the python runner loads no multimodal projector; use --runner server")
        model, context = resolve_server_defaults(config, threads=threads, use_extra_bufts=use_extra_bufts)
        python_speculation(config, model, context, draft_n_min, draft_p_min)
    else:
        find_llama_server(os.fspath(llama_server) if llama_server else None)


# --- for the CLI (llama-server flags -> RunConfig: RunConfig.from_server_args) ----------------------------------


def probe_cli(model: str, server_args: list[str], *, runner: Runner = "python", budget: str | None = None,
              llama_server: str | None = None, timeout: float = DEFAULT_TIMEOUT, workload: Workload | None = None,
              as_json: bool = False, soak: int = 0) -> tuple[int, str]:
    """What `ggfit probe MODEL [llama-server flags] [--runner] [--budget] [--json]` does: returns (exit code, text).

    Exit code 0 for ok, 1 for any other status (the text says which), 2 is left to GGFitError (bad input).
    """
    config, opts, unknown = RunConfig.from_server_args(server_args)
    if unknown and runner == "python":
        shown = " ".join(unknown[:2]) if len(unknown) > 1 and not unknown[1].startswith("-") else unknown[0]
        raise ProbeError(f"{shown}: not a llama-server flag the python runner takes (it takes "
                         f"{', '.join(n for n in SERVER_FLAGS if n.startswith('-') and not n.startswith('--'))} and their long "
                         "names); use --runner server to hand it to llama-server")
    if config.rpc and runner != "server":  # llama-cpp-python's loader registers no RPC device
        raise ProbeError(f"--rpc {config.rpc}: the {runner} runner loads no RPC devices; use --runner server")
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
                        llama_server=llama_server, extra_args=unknown or None, progress=progress, soak=soak,
                        **opts)
    invalid = re.compile(r"invalid argument: (\S+)")  # common_params_parse_ex: a flag llama-server does not have
    bad = next((hit for m in [res.message or "", *res.evidence] if m and (hit := invalid.search(m))), None)
    if not res.ok and bad:
        raise ProbeError(f"{bad.group(1)}: llama-server has no such option")
    if as_json:
        return (0 if res.ok else 1), res.model_dump_json(indent=2, exclude={"log"})
    lines = [res.summary()]
    if not res.ok:
        lines += [f"  {ln}" for ln in res.evidence[:5]]
    if res.command and runner == "server":
        lines.append("  command: " + " ".join(res.command))
    return (0 if res.ok else 1), "\n".join(lines)
