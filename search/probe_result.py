"""What a probe found: its result, each measured run, and how llama.cpp's log and exit say it failed."""

from __future__ import annotations

import re
import statistics
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fitter.llama.cparams import RunConfig
from fitter.oracle.child_process import short_abort
from fitter.oracle.llama_log import parse_log
from fitter.oracle.llama_run import BuildReport
from search.soak import Soak
from search.workload import Workload

Status = Literal["ok", "oom", "crash", "timeout", "error"]
Runner = Literal["python", "server"]
Speculation = Literal["none", "on", "off"]

DEFAULT_TIMEOUT = 300.0
SPEC_DEFAULT_N_MIN = 0  # common_params_speculative_draft defaults (common/common.h)
SPEC_DEFAULT_P_MIN = 0.0


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
        out.append(short_abort(rep.abort))
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
    def of(cls, values: Sequence[float | None]) -> Spread | None:
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

    # the speed model's rates for this config on this machine (search.probe_speed; None: not predicted)
    predicted: dict[str, Any] | None = None

    peak_rss_bytes: int | None = None  # the child's RSS high-water mark (wait4 ru_maxrss)
    soak: Soak | None = None  # server runner, --soak N: the RSS after each of N more requests, the predicted session
    budget_bytes: int | None = None
    budget: dict[str, Any] = Field(default_factory=dict)  # how the limit was applied (enforced, limit, baseline)

    build: BuildReport = Field(default_factory=BuildReport)
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
                 f"TTFT {(self.ttft_s or 0.0) * 1e3:.0f} ms ({self.prompt_tokens} prompt + {self.generated_tokens} generated tokens"
                 f", median of {len([r for r in self.runs if not r.warmup])})"]
        p = self.predicted
        if p and p.get("prefill_tps") and p.get("decode_tps"):
            parts.append(f"predicted prefill {p['prefill_tps']:.1f} tok/s, decode {p['decode_tps']:.1f} tok/s "
                         f"({p.get('hardware')})")
        if self.peak_rss_bytes:
            parts.append(f"peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB")
        if self.soak is not None:
            parts.append(self.soak.line())
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


def _classify_death(res: ProbeResult, log: str, errors: list[str] | None = None) -> None:
    """A child killed by a signal: oom when the log says an allocation failed (or the kernel's OOM killer), else crash."""
    oom = oom_lines(log)
    aborts = _abort_lines(log)
    if oom:
        res.status, res.message = "oom", f"{res.signal}: {short_abort(oom[0])}"
        res.evidence = list(dict.fromkeys(short_abort(x) for x in oom + aborts))
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
        elif res.signal == "SIGSEGV" and not aborts and _repacked(res):
            res.message += " (with repacked weights: on some AMX CPUs they die this way; use --no-repack)"


def _repacked(res: ProbeResult) -> bool:
    """Whether the probe ran with llama.cpp's extra CPU buffer types (weight repacking): the python runner's
    use_extra_bufts, llama-server's --repack."""
    return bool(res.params.get("model", {}).get("use_extra_bufts")) or "--repack" in (res.command or [])


def _prompt_label(i: int, warmup: int) -> str:
    return f"prompt {i + 1}" + (" (warm-up)" if i < warmup else "")


def _rates(s: RunSample) -> str:
    pre = f"{s.prefill_tps:.1f}" if s.prefill_tps else "-"
    dec = f"{s.decode_tps:.1f}" if s.decode_tps else "-"
    return f"prefill {pre} tok/s, decode {dec} tok/s"
