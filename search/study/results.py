"""What a study found: each trial's part in the count, the result, the best trial and the Pareto front."""

from __future__ import annotations

import json
from typing import Any, Sequence

from optuna.trial import TrialState
from pydantic import BaseModel, ConfigDict, Field

from fitter.fit.budget import MiB
from search.probe import ProbeResult, Spread
from search.study.define import DIRECTIONS, UNITS, PickDef, StudyDef
from search.study.storage import _redact, _rerun_numbers, running_elsewhere, worker_text

# --- results ----------------------------------------------------------------------------------------------------


class TrialInfo(BaseModel):
    """One trial as the report shows it."""

    model_config = ConfigDict(protected_namespaces=())

    number: int
    state: str
    status: str
    reason: str | None = None
    probed: bool = False
    flags: str = ""
    model: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    predicted_bytes: int | None = None
    model_miss: bool = False
    duplicate_of: int | None = None


# What `optimise` and `report` call each part of a study (one function counts for both; the parts add up to the total)
COUNT_PARTS: dict[str, str] = {
    "ok": "probed ok",
    "oom": "probed out of memory",
    "failed": "failed (crash, timeout or error)",
    "skipped": "skipped (predicted over budget)",
    "slow": "skipped (predicted below the --speed-cut)",
    "invalid": "invalid (llama.cpp refuses the flags)",
    "duplicate": "duplicate (reused an earlier trial's probe)",
    "retried": "stale or interrupted (run again as a later trial)",
    "unneeded": "not probed (the probe goal was already reached)",
    "running": "running or queued",
}


# How a trial's outcome line names its status
STATUS_LABELS = {"skipped": "skipped (predicted over budget)", "slow": "skipped (predicted slow)", "oom": "out of memory",
                 "unneeded": "not probed (goal reached)"}


class TrialCounts(BaseModel):
    """Trials by what happened to them: every trial in exactly one part, so the parts add up to `total`."""

    total: int = 0
    ok: int = 0
    oom: int = 0
    failed: int = 0
    skipped: int = 0
    slow: int = 0
    invalid: int = 0
    duplicate: int = 0
    retried: int = 0
    unneeded: int = 0
    running: int = 0
    probes: int = 0  # probes of the search that gave a result (ok + oom + failed probes): what --trials counts

    def text(self) -> str:
        parts = [f"{getattr(self, k)} {label}" for k, label in COUNT_PARTS.items() if getattr(self, k)]
        return f"{self.total} trial{'s' if self.total != 1 else ''}" + (f": {', '.join(parts)}" if parts else "")


def trial_part(t, retried: set[int] | frozenset[int] = frozenset()) -> str:
    """Which `COUNT_PARTS` part a trial is in. `retried`: numbers of the trials that a later trial runs again."""
    ua = t.user_attrs
    state, status = t.state.name, ua.get("status")
    if state in ("RUNNING", "WAITING"):
        return "running"
    if state == "FAIL":
        if t.number in retried:
            return "retried"
        return "unneeded" if status == "unneeded" else "failed"  # a stale trial past its retries, an exception
    if ua.get("duplicate_of") is not None:
        return "duplicate"
    if status in ("skipped", "slow", "invalid"):
        return status
    if ua.get("probed") and status in ("ok", "oom"):
        return status
    return "failed"


def model_misses(trials) -> list[int]:
    """Trials whose probe ran out of memory (the memory model's misses when the config was predicted to fit)."""
    trials = list(trials)
    rerun = _rerun_numbers(trials)
    return [t.number for t in trials if trial_part(t, rerun) == "oom"]


def count_trials(trials) -> TrialCounts:
    """The one count of a study's trials, for `optimise` (progress, result) and `report` alike."""
    trials = list(trials)
    retried = _rerun_numbers(trials)
    c = TrialCounts(total=len(trials))
    for t in trials:
        part = trial_part(t, retried)
        setattr(c, part, getattr(c, part) + 1)
        if part in ("ok", "oom", "failed") and t.state.name != "FAIL" and t.user_attrs.get("probed"):
            c.probes += 1
    return c


class Measurement(BaseModel):
    """A config probed in the final comparison: medians and spreads over every measured run of its probes."""

    flags: str
    status: str
    reason: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    spread: dict[str, Spread] = Field(default_factory=dict)  # per metric: median, min, max over n measured runs
    predicted_bytes: int | None = None
    probes: int = 0


class StudyResult(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    study_name: str
    storage: str
    objectives: list[str]
    directions: list[str]
    budget_bytes: int
    margin_bytes: int
    available_bytes: int
    counts: TrialCounts  # every trial of the study, by part (the parts add up to the total)
    n_trials: int  # every trial (counts.total)
    n_probed: int  # probes of the search (counts.probes: what --trials counts)
    n_skipped: int  # predicted over the budget: never probed
    n_invalid: int
    n_duplicates: int
    n_failed: int  # crash / timeout / error probes (and trials failed by an exception)
    model_misses: list[int] = Field(default_factory=list)  # trial numbers: predicted to fit, probe ran out of memory
    retried: list[int] = Field(default_factory=list)  # stale trials failed and retried in this run
    best: TrialInfo | None = None
    pareto: list[TrialInfo] = Field(default_factory=list)
    command: str | None = None  # llama-server, one flag a line
    config: dict[str, Any] | None = None  # the best config as JSON (RunConfig fields + probe options)
    best_measured: Measurement | None = None
    baseline: Measurement | None = None
    ratio: dict[str, float] = Field(default_factory=dict)  # best / defaults per objective (>1: better)
    outcome: dict[str, str] = Field(default_factory=dict)  # per objective: better, worse, or tie (inside the spread)
    verdict: str | None = None
    compare_probes: int = 0  # probes of the comparison with llama.cpp's defaults (not counted in --trials)
    served_share: float | None = None  # long-context: share of requests the chosen context serves
    running_elsewhere: list[str] = Field(default_factory=list)  # trials other live workers run as this one ends
    notes: list[str] = Field(default_factory=list)

    def text(self) -> str:
        lines = [f"study {self.study_name} ({self.storage})",
                 f"{self.counts.text()}; {self.n_probed} probe{'s' if self.n_probed != 1 else ''} of the search "
                 f"(--trials), budget - margin = {self.available_bytes / MiB:,.0f} MiB"
                 + (f"; {self.compare_probes} more comparing with llama.cpp's defaults" if self.compare_probes else ""),
                 f"memory-model misses (predicted to fit, probe ran out of memory): {len(self.model_misses)}"
                 + (f" (trials {', '.join(map(str, self.model_misses))})" if self.model_misses else "")]
        if self.best is None:
            lines.append("no config was measured successfully")
        else:
            m = ", ".join(f"{k} {_fmt(v, k)}" for k, v in self.best.metrics.items() if k in self.objectives)
            lines.append(f"best{' so far' if self.running_elsewhere else ''}: trial {self.best.number}: {m}")
            if self.served_share is not None:
                lines.append(f"the chosen context serves {self.served_share:.1%} of requests")
            lines.append("")
            lines.append(self.command or "")
            lines.append("")
            lines.append(json.dumps(self.config, indent=2))
        if len(self.pareto) > 1:
            lines.append(f"Pareto front ({len(self.pareto)} trials):")
            for t in self.pareto:
                lines.append(f"  #{t.number}: " + ", ".join(f"{k} {_fmt(t.metrics.get(k), k)}" for k in self.objectives)
                             + f"  [{t.flags}]")
        if self.verdict:
            lines.append(self.verdict)
        if self.running_elsewhere:
            lines.append(running_text(self.running_elsewhere, self.study_name))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def running_text(running: Sequence[str], name: str) -> str:
    """The line that says other workers still run trials of the study, so its best may still change."""
    return (f"another worker is still running trial{'s' if len(running) > 1 else ''} {', '.join(running)}: the "
            f"study's best may still change (ggfit report {name} shows it as it stands)")


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    if metric in ("acceptance", "served_share"):
        return f"{v:.1%}"
    if metric == "ttft_s":
        return f"{v * 1e3:.0f} ms"
    return f"{v:.1f} {UNITS[metric]}"


def _feasible_done(trials) -> list:
    return [t for t in trials if t.state == TrialState.COMPLETE and all(v <= 0 for v in t.constraints.values())]


def _info(t) -> TrialInfo:
    ua = t.user_attrs
    metrics = {k: float(ua[k]) for k in DIRECTIONS if isinstance(ua.get(k), (int, float))}
    status = ua.get("status", t.state.name.lower())
    if t.state.name == "FAIL" and status == "running":
        status = "interrupted"  # Ctrl-C (or an exception) while the trial ran: Optuna failed it
    return TrialInfo(number=t.number, state=t.state.name, status=status,
                     reason=ua.get("reason"), probed=bool(ua.get("probed")), flags=ua.get("flags", ""),
                     model=ua.get("model"), metrics=metrics, predicted_bytes=ua.get("predicted_bytes"),
                     model_miss=bool(ua.get("model_miss")), duplicate_of=ua.get("duplicate_of"))


def pick_best(trials, objectives: Sequence[str], pick: PickDef) -> tuple[Any | None, list]:
    """(the chosen trial, the Pareto front) among feasible COMPLETE trials."""
    done = _feasible_done(trials)
    if not done:
        return None, []
    dirs = [DIRECTIONS[m] for m in objectives]

    def val(t, m):
        return t.values[objectives.index(m)]

    def better_or_equal(a, b):  # a dominates-or-equals b
        return all((val(a, m) >= val(b, m)) if d == "maximize" else (val(a, m) <= val(b, m))
                   for m, d in zip(objectives, dirs))

    front = [t for t in done if not any(better_or_equal(o, t) and o.values != t.values for o in done)]
    pool = [t for t in done if all(val(t, m) >= v for m, v in pick.require.items())]
    if not pool and pick.require:
        first = next(iter(pick.require))
        top = max(val(t, first) for t in done)
        pool = [t for t in done if val(t, first) == top]
    if len(objectives) == 1:
        m = objectives[0]
        best = (max if dirs[0] == "maximize" else min)(pool, key=lambda t: val(t, m))
        return best, front
    cand = [t for t in pool if t in front] or pool
    scale: dict[str, float] = {}
    for m in objectives:
        vals = [abs(val(t, m)) for t in done] or [1.0]
        scale[m] = max(vals) or 1.0
    given: dict[str, float] = {str(k): w for k, w in pick.weights.items()}
    weights = {m: given.get(m, 1.0 if not given else 0.0) for m in objectives}

    def score(t):
        s = 0.0
        for m, d in zip(objectives, dirs):
            x = val(t, m) / scale[m]
            s += weights[m] * (x if d == "maximize" else -x)
        return s

    return max(cand, key=score), front


def _summarise(study, d: StudyDef, url: str, budget_bytes: int, margin_bytes: int, avail: int, notes: list[str],
               retried: list[int], trials: Sequence | None = None) -> StudyResult:
    """The result from one reading of the study's trials (`trials`, else read now): counts, best and Pareto front
    agree with each other, and with what `ggfit report` picks from the same trials."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    c = count_trials(trials)
    best, front = pick_best(trials, d.objectives, d.pick)
    return StudyResult(
        study_name=study.study_name, storage=_redact(url), objectives=list(d.objectives), directions=d.directions,
        budget_bytes=budget_bytes, margin_bytes=margin_bytes, available_bytes=avail, counts=c, n_trials=c.total,
        n_probed=c.probes, n_skipped=c.skipped, n_invalid=c.invalid, n_duplicates=c.duplicate, n_failed=c.failed,
        model_misses=model_misses(trials),
        retried=retried, best=_info(best) if best else None,
        pareto=[_info(t) for t in front] if len(d.objectives) > 1 else [], notes=notes,
        running_elsewhere=[worker_text(t) for t in running_elsewhere(study, trials)],
    )


def _spreads(results: Sequence[ProbeResult]) -> dict[str, Spread]:
    """Median and range of each timed metric over every measured run (warm-ups excluded) of the ok probes."""
    runs = [r for x in results if x.ok for r in x.runs if not r.warmup]
    vals: dict[str, list[float | None]] = {"prefill_tps": [r.prefill_tps for r in runs],
                                           "decode_tps": [r.decode_tps for r in runs],
                                           "ttft_s": [r.ttft_ms / 1e3 for r in runs]}
    return {k: sp for k, v in vals.items() if (sp := Spread.of(v)) is not None}


def best_text(trials, d: StudyDef) -> str:
    """The best trial so far, for the live line and each trial's outcome line."""
    best, front = pick_best(trials, d.objectives, d.pick)
    if best is None:
        return "-"
    if len(d.objectives) == 1:
        return f"{_fmt(best.values[0], d.objectives[0])} (#{best.number})"
    return f"Pareto front {len(front)}, pick #{best.number}"
