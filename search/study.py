"""`ggfit optimise`: an Optuna study over the settings that the memory model says fit, each proven by a real probe.

    run_study(model, "prefill", budget="8GiB") -> StudyResult   (best config as a llama-server command and JSON,
                                                                   measured against llama.cpp's defaults)

The study is plain Optuna: an RDB storage, a TPE sampler, an objective. What ggfit adds is inside the objective:

1. The trial's parameters (search/space.py) become a `RunConfig`; `fitter.fit.memory.predict` sizes it. A config llama.cpp
   would refuse (a quantized V cache without flash attention ...) is labelled ``invalid``; one predicted over the
   budget minus the margin is labelled ``skipped``. Neither is probed.
2. A config that fits is probed (`search.probe.run_probe`, in its own process, under the budget where the OS can
   enforce it). ``ok`` gives the objective value(s). ``oom`` means the memory model was wrong: it is counted and
   listed as a model miss. ``crash``/``timeout``/``error`` keep llama.cpp's reason.
3. A config already measured in this study (the same llama.cpp run, e.g. two n_batch factors clamped to one n_batch)
   reuses that measurement instead of probing again (``duplicate_of``); one that another worker is probing at
   that moment is waited for.

How failures reach the sampler (optuna 5.0.0, read in optuna/samplers/_tpe/sampler.py): TPESampler only learns from
COMPLETE and PRUNED trials (plus RUNNING ones under constant liar); FAIL trials are invisible to it. `_split_trials`
checks feasibility before state: a COMPLETE or PRUNED trial whose constraint values sum to more than 0 is infeasible,
ranked by that sum, and kept out of the "good" group whenever enough feasible trials exist. So every trial that must
steer the sampler away is **PRUNED with a violated constraint** (``trial.set_constraint``, the core API since 5.0;
the sampler-level ``constraints_func`` is deprecated there): ``predicted_over_budget_mib`` (predicted total minus
what is available, in MiB; negative = headroom), ``invalid`` (1) and ``probe_failed`` (1 for oom/crash/timeout/
error). An OOM is thus a *failed probe* in the report (user attr ``status = oom``) but PRUNED + infeasible for Optuna,
so TPE stops proposing its region; recording it as FAIL would teach the sampler nothing. Successful probes are
COMPLETE with every constraint <= 0.

What each trial keeps (user attrs): ``status`` (ok, oom, crash, timeout, error, skipped, invalid), ``reason`` (one
line), ``probed``, ``predicted_bytes``, ``available_bytes``, ``predicted_fits``, ``model_miss``, the metrics
(``prefill_tps``, ``decode_tps``, ``ttft_s``, ``acceptance``, spreads, ``peak_rss_bytes``), ``flags`` (the searched
llama-server flags), ``config`` (the RunConfig), ``threads``, ``draft_p_min``, ``model``, ``worker``.

Storage and resume: `RDBStorage` (default: SQLite at ``${XDG_DATA_HOME:-~/.local/share}/ggfit/studies.db``; any
Optuna RDB URL, e.g. PostgreSQL, lets several machines work on one study). Heartbeats (`heartbeat_interval`) with
`RetryHeartbeatStaleTrialCallback` fail a dead worker's RUNNING trial once its heartbeat is older than the grace
period and enqueue a copy (WAITING), which the next ``ask`` runs first. A restart on the same machine does not wait
for the grace period: a RUNNING trial whose recorded worker process (host, pid, start time) no longer exists is
failed and retried at once. Ctrl-C fails the running trial (status ``interrupted``) and queues a copy, which the next
run (of any worker) runs first. Completed trials are never lost; at most the running one is run again.

Counting (`count_trials`, for `optimise` and `report` alike): every trial is in one part (probed ok / oom / failed /
skipped / invalid / duplicate / stale or interrupted and run again / not probed because the goal was reached /
running or queued), so the parts add up to the total. ``--trials N`` is N probes that gave a result; a worker about
to probe counts the probes other live workers are running, so several workers stop at N too (short of proposals
made within the same instant). The comparison with llama.cpp's defaults is counted and reported separately.

The study name is ``<study>-<model>-<hash>``, the hash over the model files (names and sizes), the device, the
budget and margin, the runner and the study definition, so the same run on the same kind of machine resumes the
same study and any change starts a new one. ``optuna-dashboard <storage URL>`` shows it live.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
import tomllib
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fitter.fit.budget import MiB, Budget, available_bytes, parse_budget, parse_margin
from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig
from fitter.progress import Progress
from search.probe import DEFAULT_TIMEOUT, ProbeResult, Spread, run_probe
from search.space import Candidate, SearchSpace, SpaceDef, StudyError
from search.workload import Workload

# The named studies: the checkout's studies/ (editable installs), else where a wheel puts them (data-files)
STUDIES_DIR = Path(__file__).resolve().parent.parent / "studies"
if not STUDIES_DIR.is_dir():
    STUDIES_DIR = Path(sys.prefix) / "share" / "ggfit" / "studies"
HEARTBEAT_S = 10  # RDBStorage heartbeat interval
GRACE_S = 60  # a RUNNING trial without a heartbeat for this long belongs to a dead worker
MAX_RETRY = 2  # a stale trial is retried this many times

Metric = Literal["prefill_tps", "decode_tps", "ttft_s", "acceptance", "served_share"]
DIRECTIONS: dict[str, str] = {"prefill_tps": "maximize", "decode_tps": "maximize", "ttft_s": "minimize",
                              "acceptance": "maximize", "served_share": "maximize"}
UNITS = {"prefill_tps": "tok/s", "decode_tps": "tok/s", "ttft_s": "s", "acceptance": "", "served_share": ""}

__all__ = ["StudyDef", "StudyError", "StudyResult", "load_study", "run_study", "study_name", "default_storage_url",
           "open_storage", "named_studies"]


# --- the study file ------------------------------------------------------------------------------------------


class SamplerDef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["tpe", "random"] = "tpe"
    n_startup_trials: int = Field(10, ge=0, description="random trials (probed or not) before TPE models the space")
    seed: int | None = None


class PromptLengths(BaseModel):
    """Lengths of the user's prompts, in tokens: quantiles (``p50 = 1800``...) and/or a file of one length a line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantiles: dict[str, int] = Field(default_factory=dict)
    file: str | None = None

    @field_validator("quantiles")
    @classmethod
    def _q(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            m = re.fullmatch(r"p(\d+(?:\.\d+)?)", k)
            if not m or not 0 < float(m.group(1)) <= 100:
                raise ValueError(f"quantile key {k!r}: write p50, p90, p99, p99.9 or p100")
            if n < 1:
                raise ValueError(f"{k} = {n}: a length in tokens must be positive")
        shares = sorted((float(k[1:]), n) for k, n in v.items())
        if any(b[1] < a[1] for a, b in zip(shares, shares[1:])):
            raise ValueError("quantile lengths must grow with the quantile")
        return v

    @model_validator(mode="after")
    def _some(self) -> PromptLengths:
        if not self.quantiles and not self.file:
            raise ValueError("give quantiles (p50 = ..., p99 = ...) or a file of lengths")
        return self


class PickDef(BaseModel):
    """How the one recommended config is chosen: among trials meeting every ``require`` minimum (else the ones
    coming closest to the first requirement), the best single objective, or for several objectives the Pareto trial
    with the highest weighted sum of objectives normalised by their best values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    require: dict[Metric, float] = Field(default_factory=dict)
    weights: dict[Metric, float] = Field(default_factory=dict)


class StudyDef(BaseModel):
    """A study file (studies/*.toml): objectives, workload, search space, trial budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    objectives: list[Metric] = Field(min_length=1, max_length=3)
    trials: int = Field(ge=1, description="probes (real measurements) the study may spend")
    max_trials: int | None = Field(None, ge=1, description="all trials, skipped ones included (default 10 x trials)")
    workload: Workload = Field(default_factory=Workload)
    space: SpaceDef = Field(default_factory=SpaceDef)
    fixed: dict[str, Any] = Field(default_factory=dict, description="RunConfig fields every trial shares")
    prompt_lengths: PromptLengths | None = None
    pick: PickDef = Field(default_factory=PickDef)
    sampler: SamplerDef = Field(default_factory=SamplerDef)

    @field_validator("objectives")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("objectives must be distinct")
        return v

    @field_validator("fixed")
    @classmethod
    def _fixed(cls, v: dict[str, Any]) -> dict[str, Any]:
        searched = {"n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "spec_type", "draft_model",
                    "draft_type_k", "draft_type_v", "draft_n_max"}
        for k in v:
            if k not in RunConfig.model_fields:
                raise ValueError(f"unknown RunConfig field {k!r} (known: {', '.join(RunConfig.model_fields)})")
            if k in searched:
                raise ValueError(f"{k!r} belongs in [space] (one value = fixed), not [fixed]")
        RunConfig(**v)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> StudyDef:
        if "served_share" in self.objectives or "served_share" in self.pick.require:
            if self.prompt_lengths is None:
                raise ValueError("served_share needs [prompt_lengths]")
        for m in list(self.pick.require) + list(self.pick.weights):
            if m not in self.objectives:
                raise ValueError(f"[pick] names {m!r}, which is not an objective")
        if "acceptance" in self.objectives and self.space.draft is None:
            raise ValueError("the acceptance objective needs [space.draft]")
        return self

    @property
    def directions(self) -> list[str]:
        return [DIRECTIONS[m] for m in self.objectives]

    @property
    def total_cap(self) -> int:
        return self.max_trials or 10 * self.trials


def _one_line(e: ValidationError) -> str:
    errs = e.errors()
    first = errs[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {msg}{more}"


def named_studies() -> list[str]:
    return sorted(p.stem for p in STUDIES_DIR.glob("*.toml"))


def load_study(which: str | os.PathLike[str] | StudyDef) -> StudyDef:
    """A named study (studies/<name>.toml) or a study file. Raises StudyError with one line on bad input."""
    if isinstance(which, StudyDef):
        return which
    text = str(which)
    path = Path(text).expanduser()
    if not (path.suffix == ".toml" or path.exists() or os.sep in text):
        path = STUDIES_DIR / f"{text}.toml"
        if not path.is_file():
            raise StudyError(f"no study named {text!r}; named studies: {', '.join(named_studies())} (or pass a .toml file)")
    if not path.is_file():
        raise StudyError(f"study file {text!r} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise StudyError(f"{path}: not a TOML file: {e}") from None
    try:
        d = StudyDef.model_validate(data)
    except ValidationError as e:
        raise StudyError(f"{path}: {_one_line(e)}") from None
    if d.prompt_lengths and d.prompt_lengths.file and not Path(d.prompt_lengths.file).is_absolute():
        pl = d.prompt_lengths.model_copy(update={"file": str((path.parent / d.prompt_lengths.file).resolve())})
        d = d.model_copy(update={"prompt_lengths": pl})
    return d


# --- prompt lengths: which share of requests a context serves -----------------------------------------------------


class LengthDistribution:
    """Share of requests whose prompt fits in L tokens, from quantiles (linear between them) or a file (empirical)."""

    def __init__(self, pl: PromptLengths):
        pts: list[tuple[int, float]] = [(n, float(k[1:]) / 100) for k, n in pl.quantiles.items()]
        self.samples: list[int] | None = None
        if pl.file:
            try:
                vals = [int(x) for x in Path(pl.file).read_text().split()]
            except (OSError, ValueError) as e:
                raise StudyError(f"prompt_lengths.file {pl.file}: {e}") from None
            if not vals or min(vals) < 0:
                raise StudyError(f"prompt_lengths.file {pl.file}: needs non-negative integers, one a line")
            self.samples = sorted(vals)
            if not pts:
                for q in (0.5, 0.9, 0.95, 0.99, 1.0):
                    pts.append((self.samples[min(len(vals) - 1, math.ceil(q * len(vals)) - 1)], q))
        self.points = sorted(set(pts))

    def share(self, tokens: int) -> float:
        """Share of prompts of at most `tokens` tokens."""
        if self.samples is not None:
            import bisect

            return bisect.bisect_right(self.samples, tokens) / len(self.samples)
        prev_n, prev_q = 0, 0.0
        for n, q in self.points:
            if tokens < n:
                return prev_q + (q - prev_q) * (tokens - prev_n) / (n - prev_n) if n > prev_n else prev_q
            prev_n, prev_q = n, q
        return prev_q  # beyond the largest known quantile: at least that share (exact when p100 is given)

    def lengths(self) -> list[tuple[float, int]]:
        return [(q, n) for n, q in self.points]


# --- storage, names, workers ---------------------------------------------------------------------------------------


def default_storage_url() -> str:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ggfit"
    return f"sqlite:///{base / 'studies.db'}"


def _redact(url: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def open_storage(url: str | None = None, *, heartbeat: bool = True):
    """An optuna RDBStorage with heartbeats and stale-trial retries. A plain path means a SQLite file."""
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    url = url or default_storage_url()
    if "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().resolve()}"
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):])
        if str(db) not in ("", ":memory:"):
            if url != default_storage_url() and not db.parent.is_dir():  # only ggfit's own directory is made
                raise StudyError(f"--storage {url}: directory {db.parent} does not exist")
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StudyError(f"--storage {url}: cannot create {db.parent}: {e.strerror}") from None
        engine_kwargs = {"connect_args": {"timeout": 60}}
    kw: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if heartbeat:
            kw = {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S,
                  "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)}
        try:
            for attempt in range(5):
                try:
                    return RDBStorage(url, engine_kwargs=engine_kwargs, **kw)
                except Exception as e:  # two workers creating the schema of a new database at once: one loses
                    if attempt == 4 or not re.search(r"duplicate key|already exists|UniqueViolation", str(e)):
                        raise
                    time.sleep(0.5 + attempt)
        except ImportError:
            # SQLAlchemy 2.1 reads postgresql:// with psycopg 3 (postgresql+psycopg2:// for psycopg2)
            hint = " (pip install 'psycopg[binary]')" if url.startswith("postgresql") else ""
            raise StudyError(f"--storage {_redact(url)}: the database driver for this URL is not installed{hint}") from None
        except Exception as e:  # sqlalchemy: bad URL, server down, no such database ...
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StudyError(f"--storage {_redact(url)}: {first}") from None


def device_id(backend: Backend) -> str:
    """The kind of machine, as stable across identical machines (no hostname): results only mix within a kind."""
    if backend == Backend.CUDA:
        import subprocess

        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        return f"cuda:{out.splitlines()[0] if out else 'unknown'}"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        if m:
            cpu = m.group(1).strip()
    return f"{backend.value}:{platform.system()}:{cpu}:{os.cpu_count()}"


def _file_id(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError:
        size = None
    return {"name": p.name, "size": size}


def study_name(study_def: StudyDef, models: Sequence[str], *, budget_bytes: int, margin_bytes: int,
               backend: Backend, runner: str, drafts: Sequence[str] = ()) -> str:
    """``<study>-<model stem>-<10 hex>``: stable for the same models, device, budget, runner and study definition."""
    payload = {
        "models": [_file_id(m) for m in models], "drafts": [_file_id(d) for d in drafts],
        "device": device_id(backend), "budget": budget_bytes, "margin": margin_bytes, "runner": runner,
        "study": study_def.model_dump(mode="json"),
    }
    h = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(models[0]).stem)[:48]
    return f"{study_def.name}-{stem}-{h}"


def _proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[19]  # field 22: starttime


def _worker() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _proc_start(os.getpid())}


def _alive(w: dict[str, Any]) -> bool:
    pid = int(w.get("pid", 0))
    if pid <= 0:
        return False
    start = _proc_start(pid)
    if start is not None:
        return w.get("start") in (None, start)
    if Path("/proc").is_dir():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_stale(study) -> list[int]:
    """Run again the trials this host's dead ggfit processes left behind: a RUNNING trial whose worker is gone
    (SIGKILL, power cut) is failed as ``stale``; a trial Optuna failed on Ctrl-C (or on an exception) that was not
    queued again then (a second Ctrl-C) is queued now. Each gets a queued copy (`_retry`) that the next ``ask``
    runs first. Other hosts' trials are left to the heartbeat. Returns the trial numbers queued again."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage
    host = socket.gethostname()
    trials = study.get_trials(deepcopy=False)
    rerun = _rerun_numbers(trials)
    out = []
    for t in trials:
        w = t.user_attrs.get("worker")
        if not isinstance(w, dict) or w.get("host") != host or _alive(w):
            continue
        if t.state == TrialState.RUNNING:
            try:
                storage.set_trial_user_attr(t._trial_id, "status", "stale")
                storage.set_trial_user_attr(t._trial_id, "reason", f"worker {w.get('host')}:{w.get('pid')} died "
                                                                   f"mid-trial; run again")
                if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                    continue
            except UpdateFinishedTrialError:
                continue
            max_retry: int | None = MAX_RETRY
        elif (t.state == TrialState.FAIL and t.user_attrs.get("status") in ("running", "interrupted")
              and t.number not in rerun):
            max_retry = None
        else:
            continue
        if _retry(study, storage.get_trial(t._trial_id), max_retry):
            out.append(t.number)
    return out


def _rerun_numbers(trials) -> set[int]:
    """Numbers of the trials that a later trial runs again (optuna's ``failed_trial`` / ``retry_history``)."""
    out: set[int] = set()
    for t in trials:
        if t.system_attrs.get("failed_trial") is not None:
            out.add(t.system_attrs["failed_trial"])
        out.update(t.system_attrs.get("retry_history") or ())
    return out


def _retry(study, t, max_retry: int | None = None) -> bool:
    """Queue a copy of `t` (same parameters; WAITING, so the next ``ask`` of any worker runs it first), as optuna's
    RetryFailedTrialCallback does, but without `t`'s user attrs: the dead run's status and numbers are not the copy's."""
    from optuna.trial import TrialState, create_trial

    history = [*(t.system_attrs.get("retry_history") or []), t.number]
    if max_retry is not None and len(history) > max_retry:
        return False
    sa: dict[str, Any] = {"failed_trial": t.number, "retry_history": history}
    if "fixed_params" in t.system_attrs:
        sa["fixed_params"] = t.system_attrs["fixed_params"]
    study.add_trial(create_trial(state=TrialState.WAITING, params=t.params, distributions=t.distributions,
                                 system_attrs=sa))
    return True


class StudyInterrupted(KeyboardInterrupt):
    """Ctrl-C during `run_study`: the trial it cut short (``trial``, or None) is queued to run again on resume."""

    def __init__(self, trial: int | None = None):
        super().__init__(trial)
        self.trial = trial

    def hint(self) -> str:
        again = f" (trial #{self.trial} runs again first)" if self.trial is not None else ""
        return f"interrupted; run the same command to resume{again}"


def _interrupted(study, trial_id: int | None) -> int | None:
    """After Ctrl-C: the trial that was running is failed (Optuna has usually done it; the objective labelled it
    ``interrupted``) and queued again, so resuming loses nothing. Returns its number, or None when no trial was cut
    short."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    if trial_id is None:
        return None
    storage = study._storage
    t = storage.get_trial(trial_id)
    if t.state == TrialState.RUNNING:  # Ctrl-C outside the objective (the sampler, the storage)
        with contextlib.suppress(UpdateFinishedTrialError):
            storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        t = storage.get_trial(trial_id)
    if t.state != TrialState.FAIL or t.number in _rerun_numbers(study.get_trials(deepcopy=False)):
        return None  # it had finished (the Ctrl-C came between trials), or it is queued again already
    _retry(study, t)
    return t.number


class _Unneeded(Exception):
    """Ends a trial without a probe: the --trials goal was reached while it was being proposed (other workers)."""


@contextlib.contextmanager
def _quiet_trial_failures():
    """Optuna logs every failed trial as a warning with a traceback; for a Ctrl-C (we say it in one line) and for a
    trial that ends unprobed because the goal was reached, that is noise. Other failures are still logged."""
    import logging

    class Quiet(logging.Filter):
        def __init__(self) -> None:
            super().__init__()
            self.trials: set[str] = set()

        def filter(self, record: logging.LogRecord) -> bool:
            m = re.match(r"Trial (\d+) failed", record.getMessage())
            if m is None:
                return True
            exc = record.exc_info[1] if record.exc_info else None
            if isinstance(exc, (KeyboardInterrupt, _Unneeded)):
                self.trials.add(m.group(1))
                return False
            return m.group(1) not in self.trials  # the "failed with value None" line that follows

    logger = logging.getLogger("optuna.study._optimize")
    f = Quiet()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _probing_elsewhere(study, trials, me: int) -> int:
    """Probes other live workers are running now (RUNNING trials marked ``probing``; heartbeat-stale ones and dead
    local workers' are not counted)."""
    from optuna.trial import TrialState

    stale: set[int] = set()
    with contextlib.suppress(Exception):  # RDBStorage with heartbeats only
        stale = set(study._storage._get_stale_trial_ids(study._study_id))
    host = socket.gethostname()
    n = 0
    for t in trials:
        if t.state != TrialState.RUNNING or t.number == me or not t.user_attrs.get("probing"):
            continue
        w = t.user_attrs.get("worker") or {}
        if t._trial_id in stale or (w.get("host") == host and not _alive(w)):
            continue
        n += 1
    return n


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
    "invalid": "invalid (llama.cpp refuses the flags)",
    "duplicate": "duplicate (reused an earlier trial's probe)",
    "retried": "stale or interrupted (run again as a later trial)",
    "unneeded": "not probed (the probe goal was already reached)",
    "running": "running or queued",
}


# How a trial's outcome line names its status
STATUS_LABELS = {"skipped": "skipped (predicted over budget)", "oom": "out of memory",
                 "unneeded": "not probed (goal reached)"}


class TrialCounts(BaseModel):
    """Trials by what happened to them: every trial in exactly one part, so the parts add up to `total`."""

    total: int = 0
    ok: int = 0
    oom: int = 0
    failed: int = 0
    skipped: int = 0
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
    if status in ("skipped", "invalid"):
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
            lines.append(f"best: trial {self.best.number}: {m}")
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
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    if metric in ("acceptance", "served_share"):
        return f"{v:.1%}"
    if metric == "ttft_s":
        return f"{v * 1e3:.0f} ms"
    return f"{v:.1f} {UNITS[metric]}"


# --- helpers for the objective ---------------------------------------------------------------------------------


class _Predictor:
    def __init__(self, backend: Backend, frontend: Frontend):
        self.backend, self.frontend = backend, frontend
        self._specs: dict[str, Any] = {}

    def spec(self, path: str):
        from fitter.llama.model import load_model_spec

        if path not in self._specs:
            self._specs[path] = load_model_spec(path)
        return self._specs[path]

    def predict(self, cand: Candidate):
        from fitter.fit.memory import predict

        header, spec = self.spec(cand.model_path)
        draft = self.spec(cand.config.draft_model) if cand.config.spec_type == "draft-simple" else None
        return predict(header, spec, cand.config, self.backend, self.frontend, draft)


def _metrics(res: ProbeResult, cand: Candidate, share: Callable[[Candidate], float | None]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in ("prefill_tps", "decode_tps", "ttft_s"):
        v = getattr(res, k)
        if v is not None:
            out[k] = float(v)
    if res.acceptance_rate is not None:
        out["acceptance"] = float(res.acceptance_rate)
    elif res.status == "ok":
        out["acceptance"] = 0.0  # no drafting, or nothing drafted (p_min never reached, speculation switched off)
    s = share(cand)
    if s is not None:
        out["served_share"] = s
    return out


def _feasible_done(trials) -> list:
    from optuna.trial import TrialState

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
    scale = {}
    for m, d in zip(objectives, dirs):
        vals = [abs(val(t, m)) for t in done] or [1.0]
        scale[m] = max(vals) or 1.0
    weights = {m: pick.weights.get(m, 1.0 if not pick.weights else 0.0) for m in objectives}

    def score(t):
        s = 0.0
        for m, d in zip(objectives, dirs):
            x = val(t, m) / scale[m]
            s += weights[m] * (x if d == "maximize" else -x)
        return s

    return max(cand, key=score), front


# --- run_study ------------------------------------------------------------------------------------------------


def _as_budget(budget: Budget | int | str, backend: Backend) -> Budget:
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, int):
        if budget <= 0:
            raise StudyError(f"budget must be positive, not {budget}")
        return Budget(bytes=budget, source=f"{budget} bytes")
    return parse_budget(str(budget), backend.value)


def run_study(
    model: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    study_def: StudyDef | str | os.PathLike[str],
    *,
    budget: Budget | int | str,
    margin: int | str | None = None,
    backend: Backend | str = Backend.CPU,
    storage: str | Any | None = None,
    n_trials: int | None = None,
    runner: Literal["python", "server"] = "python",
    drafts: Sequence[str | os.PathLike[str]] = (),
    workload: Workload | None = None,
    name: str | None = None,
    seed: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    llama_server: str | None = None,
    compare_defaults: bool = True,
    confirm_rounds: int = 1,
    frontend: Frontend = Frontend.SERVER,
    progress: Callable[[str], None] | None = print,
    live: Progress | None = None,
    feasibility: bool = True,
    probe: Callable[..., ProbeResult] = run_probe,
    enqueue_defaults: bool = True,
) -> StudyResult:
    """Run (or resume, or join) the study and return its best config, measured against llama.cpp's defaults.

    `model`: a GGUF path (or bundled name), or several GGUF files of one model (quantisations: the ``quant``
    parameter; the first one is used for the defaults). `budget`: bytes, a `Budget`, or --budget text; `margin`:
    bytes or --margin text (default 1024 MiB, llama.cpp's --fit-target). `n_trials`: probes to spend (default: the
    study file's ``trials``), counted over the whole study, so a resumed or shared study stops at the same total.
    `workload` replaces the study file's. `name` replaces the derived study name. `compare_defaults`: probe
    llama.cpp's defaults (with the best config's -c) and the best config again, `confirm_rounds` times each,
    alternating, and report the ratio (not counted in `n_trials`; skipped when the best config is the defaults).
    `progress` receives the lasting lines (each trial's outcome); `live` (a `fitter.progress.Progress`) shows what
    runs now: the probe in flight, the best so far.

    For benchmarks: ``feasibility=False`` probes every valid proposal whatever its prediction (the sampler then learns
    the budget from OOMs only); ``probe`` replaces `run_probe` (same signature), e.g. a lookup in measured results;
    ``enqueue_defaults=False`` leaves out the first trial, llama.cpp's defaults projected into the space.
    """
    import optuna
    from optuna.trial import TrialState

    from fitter.bundled import resolve_model

    backend = Backend(backend)
    d = load_study(study_def)
    if workload is not None:
        d = d.model_copy(update={"workload": workload})
    trials_goal = n_trials if n_trials is not None else d.trials
    if trials_goal < 1:
        raise StudyError(f"--trials {trials_goal}: must be at least 1")
    cap = max(d.total_cap, trials_goal)
    if confirm_rounds < 0:
        raise StudyError("confirm_rounds must be >= 0")
    models = [resolve_model(str(m)) for m in ([model] if isinstance(model, (str, os.PathLike)) else list(model))]
    if not models:
        raise StudyError("no model file given")
    drafts_l = [str(Path(x).expanduser()) for x in drafts]
    b = _as_budget(budget, backend)
    margin_bytes = margin if isinstance(margin, int) else parse_margin(margin)
    avail = available_bytes(b, margin_bytes)
    def say(line: str) -> None:  # a lasting line; the live line (if any) is cleared first and redrawn by its next step
        if live is not None:
            live.close()
        if progress is not None:
            progress(line)
    notes: list[str] = []

    predictor = _Predictor(backend, frontend)
    header0, spec0 = predictor.spec(models[0])
    for m in models[1:]:
        _, s = predictor.spec(m)
        same = (s.architecture, s.n_layer, s.n_embd, s.n_vocab) == (spec0.architecture, spec0.n_layer, spec0.n_embd, spec0.n_vocab)
        if not same:
            raise StudyError(f"{Path(m).name} is not the same model as {Path(models[0]).name} "
                             f"({s.architecture}/{s.n_layer} layers vs {spec0.architecture}/{spec0.n_layer})")
    for dr in drafts_l:
        predictor.spec(dr)
    ctx_need = d.workload.prompt_tokens + d.workload.gen_tokens
    dist = LengthDistribution(d.prompt_lengths) if d.prompt_lengths else None
    ctx_choices = None
    if dist is not None and d.space.n_ctx is None:
        raw = sorted({n + d.workload.gen_tokens for _, n in dist.lengths()})
        ctx_choices = [c for c in raw if c <= spec0.n_ctx_train]
        if len(ctx_choices) < len(raw):
            ctx_choices.append(spec0.n_ctx_train)  # the most the model was trained for serves the most it can
            notes.append(f"prompt lengths above the training context ({spec0.n_ctx_train}) are not searched; "
                         f"it serves {dist.share(spec0.n_ctx_train - d.workload.gen_tokens):.1%} of requests")
        ctx_choices = [max(c, ctx_need) for c in ctx_choices]
    space = SearchSpace(d.space, models=models, n_ctx_train=spec0.n_ctx_train, ctx_need=ctx_need, fixed=d.fixed,
                        drafts=drafts_l, has_mtp=bool(getattr(spec0, "has_mtp", False)), runner=runner,
                        ctx_choices=ctx_choices, notes=notes)

    def share(cand: Candidate) -> float | None:
        if dist is None:
            return None
        return dist.share(int(cand.config.n_ctx) - d.workload.gen_tokens)

    sname = name or study_name(d, models, budget_bytes=b.bytes, margin_bytes=margin_bytes, backend=backend,
                               runner=runner, drafts=drafts_l)
    if storage is not None and not isinstance(storage, str):  # an optuna storage object (benchmarks: in memory)
        st, url = storage, type(storage).__name__
    else:
        url = storage or default_storage_url()
        st = open_storage(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    worker = _worker()
    probe_budget = b.bytes if backend == Backend.CPU else None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message=".*constraint value is ignored.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
        probe_sampler_seed = seed if seed is not None else d.sampler.seed
        try:
            existing = optuna.load_study(study_name=sname, storage=st)
            n_before = len(existing.get_trials(deepcopy=False))
        except KeyError:
            n_before = 0
        sseed = None if probe_sampler_seed is None else probe_sampler_seed + n_before
        if d.sampler.kind == "random":
            sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=sseed)
        else:
            sampler = optuna.samplers.TPESampler(seed=sseed, n_startup_trials=d.sampler.n_startup_trials,
                                                 multivariate=True, group=space.conditional)
        study = optuna.create_study(study_name=sname, storage=st, sampler=sampler, directions=d.directions,
                                    load_if_exists=True)
        if study.directions != [optuna.study.StudyDirection.MAXIMIZE if x == "maximize" else
                                optuna.study.StudyDirection.MINIMIZE for x in d.directions]:
            raise StudyError(f"study {sname} exists in {_redact(url)} with other objectives; pass another name")
        if not study.user_attrs.get("ggfit"):
            study.set_metric_names(list(d.objectives))
            study.set_user_attr("ggfit", {
                "study": d.model_dump(mode="json"), "models": models, "drafts": drafts_l,
                "budget_bytes": b.bytes, "budget_source": b.source, "margin_bytes": margin_bytes,
                "available_bytes": avail, "backend": backend.value, "runner": runner, "device": device_id(backend),
                "objectives": list(d.objectives), "space": space.describe(),
            })
        retried = recover_stale(study)
        if retried:
            say(f"[ggfit] trials {', '.join(map(str, retried))} were cut short (their process died or was "
                f"interrupted): retried first")

        def best_text(trials) -> str:
            best, front = pick_best(trials, d.objectives, d.pick)
            if best is None:
                return "-"
            if len(d.objectives) == 1:
                return f"{_fmt(best.values[0], d.objectives[0])} (#{best.number})"
            return f"Pareto front {len(front)}, pick #{best.number}"

        c0 = count_trials(study.get_trials(deepcopy=False))
        finished0 = c0.total - c0.running
        if enqueue_defaults and c0.total == 0:
            # llama.cpp's own defaults, as close as the space allows, go first (Optuna's enqueue_trial idiom)
            seed_point = space.nearest({"n_ubatch": 512, "n_batch_factor": 4, "flash_attn": "auto",
                                        "kv_type": "f16", "type_k": "f16", "type_v": "f16",
                                        "threads": os.cpu_count(), "draft": "none",
                                        "quant": Path(models[0]).name, "n_ctx": 0})
            if seed_point:
                study.enqueue_trial(seed_point, skip_if_exists=True)

        def known(key: str, number: int):
            """A finished trial that probed `key`. When an earlier trial (another worker's) is probing it right
            now, wait for its result rather than probe the same run twice; a dead worker's trial is failed by the
            heartbeat within GRACE_S, and after the probe timeout we stop waiting and probe ourselves."""
            deadline = time.monotonic() + timeout + GRACE_S
            while True:
                in_flight = False
                for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                   TrialState.RUNNING)):
                    if t.number == number or t.user_attrs.get("key") != key:
                        continue
                    if t.state != TrialState.RUNNING:
                        if t.user_attrs.get("probed"):
                            return t
                    elif t.number < number:
                        in_flight = True
                if not in_flight or time.monotonic() > deadline:
                    return None
                time.sleep(0.5)

        current: dict[str, int] = {}  # the trial this process runs now (its storage id), for Ctrl-C

        def objective(trial: optuna.Trial):
            current["id"] = trial._trial_id
            try:
                return run_trial(trial)
            except KeyboardInterrupt:
                with contextlib.suppress(Exception):  # Optuna fails it next; attrs can only change before that
                    trial.set_user_attr("status", "interrupted")
                    trial.set_user_attr("reason", "interrupted (Ctrl-C) mid-trial; run again")
                raise

        def run_trial(trial: optuna.Trial):
            params = space.suggest(trial)
            cand = space.candidate(params)
            ua = {"worker": worker, "key": cand.key(), "flags": cand.short(), "model": Path(cand.model_path).name,
                  "config": cand.config.model_dump(mode="json"), "threads": cand.threads,
                  "draft_p_min": cand.draft_p_min, "probed": False, "probing": False, "status": "running",
                  "reason": None}
            # a retry queued by optuna's heartbeat callback inherits the dead trial's attrs: they are not this run's
            ua.update({k: None for k in trial.user_attrs if k not in ua})
            for k, v in ua.items():
                trial.set_user_attr(k, v)
            try:
                pred = predictor.predict(cand)
            except ConfigError as e:
                trial.set_user_attr("status", "invalid")
                trial.set_user_attr("reason", str(e))
                trial.set_constraint("invalid", 1.0)
                raise optuna.TrialPruned(f"invalid: {e}") from None
            total = pred.total_device_bytes
            over = total - avail
            trial.set_user_attr("predicted_bytes", total)
            trial.set_user_attr("available_bytes", avail)
            trial.set_user_attr("predicted_fits", over <= 0)
            trial.set_constraint("invalid", 0.0)
            if feasibility:
                trial.set_constraint("predicted_over_budget_mib", over / MiB)
            if over > 0 and feasibility:
                why = f"predicted {total / MiB:,.1f} MiB > {avail / MiB:,.1f} MiB available (budget - margin)"
                trial.set_user_attr("status", "skipped")
                trial.set_user_attr("reason", why)
                raise optuna.TrialPruned(why)

            prev = known(cand.key(), trial.number)
            if prev is not None:
                pua = prev.user_attrs
                for k in list(DIRECTIONS) + ["status", "reason", "peak_rss_bytes", "model_miss", "spread"]:
                    if k in pua:
                        trial.set_user_attr(k, pua[k])
                trial.set_user_attr("duplicate_of", prev.number)
                ok = pua.get("status") == "ok"
                trial.set_constraint("probe_failed", 0.0 if ok else 1.0)
                if not ok:
                    raise optuna.TrialPruned(f"same run as trial {prev.number}: {pua.get('status')}")
                return _values(pua, d.objectives)

            # --trials N is N probes: with several workers, probes running elsewhere count before this one starts
            trials_now = study.get_trials(deepcopy=False)
            done, elsewhere = count_trials(trials_now).probes, _probing_elsewhere(study, trials_now, trial.number)
            if done + elsewhere >= trials_goal:
                trial.set_user_attr("status", "unneeded")
                trial.set_user_attr("reason", f"not probed: {done} probes done and {elsewhere} running in other "
                                              f"workers reach the goal of {trials_goal}")
                study.stop()
                raise _Unneeded(trial.user_attrs["reason"])
            trial.set_user_attr("probing", True)
            if live is not None:
                live.step(done + elsewhere + 1, trials_goal,
                          f"trial {done + elsewhere + 1} of {trials_goal} (#{trial.number}), best so far "
                          f"{best_text(trials_now)}: probing {cand.short()}")  # the flags last: a terminal cuts there
            probe_kw: dict[str, Any] = {}
            if live is not None:  # the probe's stages on the same line, after the trial's bar
                probe_kw["progress"] = live.sub(f"trial {done + elsewhere + 1} of {trials_goal}")
            res = probe(cand.model_path, cand.config, d.workload, runner=runner, budget_bytes=probe_budget,
                        timeout=timeout, llama_server=llama_server, threads=cand.threads, draft_p_min=cand.draft_p_min,
                        **probe_kw)
            trial.set_user_attr("probed", True)
            trial.set_user_attr("status", res.status)
            trial.set_user_attr("reason", res.message if res.status != "ok" else res.summary())
            trial.set_user_attr("peak_rss_bytes", res.peak_rss_bytes)
            trial.set_user_attr("probe_wall_s", round(res.wall_s, 3))
            if cand.config.spec_type != "none":
                trial.set_user_attr("speculation", res.speculation)
                trial.set_user_attr("draft_tokens", res.draft_tokens)
                if res.speculation_message:
                    trial.set_user_attr("speculation_message", res.speculation_message)
            if res.prefill_spread:
                trial.set_user_attr("prefill_spread", [res.prefill_spread.min, res.prefill_spread.max])
            if res.decode_spread:
                trial.set_user_attr("decode_spread", [res.decode_spread.min, res.decode_spread.max])
            spread = _spreads([res])
            if spread:
                trial.set_user_attr("spread", {k: v.model_dump() for k, v in spread.items()})
            mets = _metrics(res, cand, share)
            for k, v in mets.items():
                trial.set_user_attr(k, v)
            missing = [m for m in d.objectives if m not in mets]
            if res.status == "ok" and missing:
                trial.set_user_attr("status", "error")
                trial.set_user_attr("reason", f"the probe measured no {', '.join(missing)}")
            if trial.user_attrs.get("status") != "ok":
                trial.set_user_attr("model_miss", res.status == "oom" and over <= 0)
                trial.set_constraint("probe_failed", 1.0)
                raise optuna.TrialPruned(f"{res.status}: {res.message}")
            trial.set_constraint("probe_failed", 0.0)
            return _values(mets, d.objectives)

        def on_trial(study_: optuna.Study, ft) -> None:
            trials = study_.get_trials(deepcopy=False)
            c = count_trials(trials)
            ua = ft.user_attrs
            status = ua.get("status", ft.state.name.lower())
            if status == "ok":
                what = ", ".join(f"{m} {_fmt(ua.get(m), m)}" for m in d.objectives)
            else:
                what = ua.get("reason") or ""
            label = STATUS_LABELS.get(status, status)
            if ua.get("duplicate_of") is not None:
                label = f"duplicate of #{ua['duplicate_of']} ({label})"
            say(f"[ggfit] trial #{ft.number}: {label}: {what[:110]} | best {best_text(trials)} | "
                f"probes {c.probes}/{trials_goal} | {ua.get('flags', '')}")
            if c.probes >= trials_goal or c.total - c.running >= cap:
                study_.stop()

        say(f"[ggfit] study {sname} in {_redact(url)}: {trials_goal} probes, budget {b.bytes / MiB:,.0f} MiB "
            f"- margin {margin_bytes / MiB:,.0f} MiB = {avail / MiB:,.0f} MiB; {len(space.dims)} searched parameters")
        for n in notes:
            say(f"[ggfit] note: {n}")
        if c0.probes < trials_goal and finished0 < cap:
            try:
                with _quiet_trial_failures():
                    study.optimize(objective, n_trials=cap - finished0, callbacks=[on_trial], gc_after_trial=False,
                                   catch=(_Unneeded,))
            except KeyboardInterrupt:
                again = _interrupted(study, current.get("id"))
                raise StudyInterrupted(again) from None
        else:
            say(f"[ggfit] study already has {c0.probes} probes ({c0.text()}): nothing to run")

    result = _summarise(study, d, url, b.bytes, margin_bytes, avail, notes, retried)
    best_t, _ = pick_best(study.get_trials(deepcopy=False), d.objectives, d.pick)
    if best_t is not None:
        cand = space.candidate(best_t.params)
        result.command = cand.command()
        result.config = {"model": cand.model_path, **cand.config.model_dump(mode="json", exclude_defaults=True),
                         "threads": cand.threads, "draft_p_min": cand.draft_p_min,
                         "predicted_bytes": best_t.user_attrs.get("predicted_bytes")}
        result.served_share = share(cand)
        if compare_defaults:
            _compare(result, study, best_t, cand, d, models[0], predictor, avail, probe_budget, runner, timeout,
                     llama_server, confirm_rounds, share, say, live, probe)
    return result


def _values(attrs: dict[str, Any], objectives: Sequence[str]) -> float | list[float]:
    vals = [float(attrs[m]) for m in objectives]
    return vals[0] if len(vals) == 1 else vals


def _summarise(study, d: StudyDef, url: str, budget_bytes: int, margin_bytes: int, avail: int, notes: list[str],
               retried: list[int]) -> StudyResult:
    trials = study.get_trials(deepcopy=False)
    c = count_trials(trials)
    best, front = pick_best(trials, d.objectives, d.pick)
    return StudyResult(
        study_name=study.study_name, storage=_redact(url), objectives=list(d.objectives), directions=d.directions,
        budget_bytes=budget_bytes, margin_bytes=margin_bytes, available_bytes=avail, counts=c, n_trials=c.total,
        n_probed=c.probes, n_skipped=c.skipped, n_invalid=c.invalid, n_duplicates=c.duplicate, n_failed=c.failed,
        model_misses=model_misses(trials),
        retried=retried, best=_info(best) if best else None,
        pareto=[_info(t) for t in front] if len(d.objectives) > 1 else [], notes=notes,
    )


def _spreads(results: Sequence[ProbeResult]) -> dict[str, Spread]:
    """Median and range of each timed metric over every measured run (warm-ups excluded) of the ok probes."""
    runs = [r for x in results if x.ok for r in x.runs if not r.warmup]
    vals = {"prefill_tps": [r.prefill_tps for r in runs], "decode_tps": [r.decode_tps for r in runs],
            "ttft_s": [r.ttft_ms / 1e3 for r in runs]}
    return {k: sp for k, v in vals.items() if (sp := Spread.of(v)) is not None}


def _pm(v: float, sp: Spread | None, metric: str) -> str:
    """412 ± 9 (the half-range of the measured runs; no ± for a single run)."""
    half = (sp.max - sp.min) / 2 if sp is not None and sp.n > 1 else None
    if metric in ("acceptance", "served_share"):
        return f"{v:.1%}" + (f" ± {half:.1%}" if half is not None else "")
    scale, unit = (1e3, "ms") if metric == "ttft_s" else (1.0, UNITS[metric])
    x = v * scale
    digits = 0 if abs(x) >= 100 else 1
    return f"{x:.{digits}f}" + (f" ± {half * scale:.{digits}f}" if half is not None else "") + f" {unit}".rstrip()


def compare_verdict(objectives: Sequence[str], mine: Measurement, base: Measurement,
                    where: str = "") -> tuple[dict[str, float], dict[str, str], str]:
    """(ratio, outcome, verdict) of the best config against llama.cpp's defaults, both measured ok.

    ratio: best / defaults per objective (> 1: better; minimised metrics inverted). outcome: ``better``, ``worse``
    or ``tie``: a difference no larger than the two half-ranges together (the measured runs' spreads, centred on
    the medians, overlap) is noise, a tie. With a single run on either side there is no spread, and the medians
    decide."""
    ratio: dict[str, float] = {}
    outcome: dict[str, str] = {}
    parts = []
    noise_known = True
    for m in objectives:
        a, b_ = mine.metrics.get(m), base.metrics.get(m)
        if a is None or b_ is None or m == "served_share":
            continue
        if DIRECTIONS[m] == "maximize":
            ratio[m] = a / b_ if b_ > 0 else math.inf
        else:
            ratio[m] = b_ / a if a > 0 else math.inf
        sa, sb = mine.spread.get(m), base.spread.get(m)
        if sa is not None and sb is not None and sa.n > 1 and sb.n > 1:
            tie = abs(a - b_) <= (sa.max - sa.min) / 2 + (sb.max - sb.min) / 2
        else:
            tie, noise_known = a == b_, False
        outcome[m] = "tie" if tie else ("better" if ratio[m] > 1 else "worse")
        parts.append(f"{m} {_pm(a, sa, m)} vs {_pm(b_, sb, m)} ({ratio[m]:.2f}x"
                     + (", within the spread" if tie and a != b_ else "") + ")")
    groups = {k: [m for m, o in outcome.items() if o == k] for k in ("better", "tie", "worse")}
    n = len(outcome)
    if n and len(groups["better"]) == n:
        lead = "the best config beats llama.cpp's defaults"
    elif n and len(groups["tie"]) == n:
        lead = "the best config ties llama.cpp's defaults (the difference is inside the measured spread)"
    elif n and len(groups["worse"]) == n:
        lead = "the best config measured worse than llama.cpp's defaults (beyond the measured spread)"
    else:
        said = []
        if groups["better"]:
            said.append(f"beats llama.cpp's defaults on {', '.join(groups['better'])}")
        if groups["tie"]:
            said.append(("ties them on " if said else "ties llama.cpp's defaults on ") + ", ".join(groups["tie"]))
        if groups["worse"]:
            said.append(("is worse on " if said else "is worse than llama.cpp's defaults on ")
                        + ", ".join(groups["worse"]))
        lead = "the best config " + ", ".join(said)
    runs = f"{mine.probes} probe{'s' if mine.probes != 1 else ''} each, alternating"
    if not noise_known:
        runs += ", a single measured run on one side: no spread to judge the noise by"
    return ratio, outcome, f"{lead}: " + "; ".join(parts) + f" ({runs}{where})"


def same_run(a: Candidate, b: Candidate, spec, frontend: Frontend = Frontend.SERVER) -> bool:
    """Whether two candidates are the same llama.cpp run: the context llama.cpp builds (llama_context's cparams after
    llama-server's defaults, as `fitter.llama.cparams.resolve_context` mirrors them: -b 2048, -ub 512, -np auto, -fa auto
    = on ...), the model side (-ngl, mmap, repack), the thread count run_probe passes (-t, default os.cpu_count())
    and the drafter."""
    from fitter.llama.cparams import resolve_context

    threads = os.cpu_count() or 1  # run_probe's default

    def run(c: Candidate):
        cp = resolve_context(spec, c.config, frontend).model_dump(exclude={"defaults_applied"})
        cf = c.config
        return (c.model_path, cp, c.threads or threads, cf.n_gpu_layers, cf.no_mmap, cf.no_repack, cf.spec_type,
                cf.draft_model, cf.draft_type_k, cf.draft_type_v, c.draft_p_min if cf.spec_type != "none" else None)

    try:
        return run(a) == run(b)
    except ConfigError:
        return False


def _trial_measurement(t, flags: str) -> Measurement:
    ua = t.user_attrs
    spread = {k: Spread.model_validate(v) for k, v in (ua.get("spread") or {}).items() if v}
    return Measurement(flags=flags, status=ua.get("status") or "ok", probes=1, predicted_bytes=ua.get("predicted_bytes"),
                       metrics={k: float(ua[k]) for k in DIRECTIONS if isinstance(ua.get(k), (int, float))},
                       spread=spread)


def _compare(result: StudyResult, study, best_t, best: Candidate, d: StudyDef, model0: str, predictor: _Predictor,
             avail: int, probe_budget: int | None, runner: str, timeout: float, llama_server: str | None,
             rounds: int, share, say, live: Progress | None, probe: Callable[..., ProbeResult]) -> None:
    """Probe llama.cpp's defaults (-m MODEL -c <best's context>) and the best config, alternating, and compare them
    with their measured spreads. When the best config is the defaults' own run, say so: nothing to compare."""
    base = Candidate(model_path=model0, config=RunConfig(n_ctx=best.config.n_ctx), threads=None)
    base_flags = " ".join(" ".join(g) for g in base.flags(model_label=Path(model0).name)[1:-2]) + " (llama-server defaults)"
    if same_run(best, base, predictor.spec(model0)[1], predictor.frontend):
        mine = _trial_measurement(best_t, best.short())
        result.best_measured = mine
        result.baseline = Measurement(flags=base_flags, status="same config", metrics=mine.metrics,
                                      spread=mine.spread, predicted_bytes=mine.predicted_bytes)
        result.verdict = (f"the best config is llama.cpp's defaults' own run (-c {best.config.n_ctx}; its flags only "
                          f"spell the defaults out): "
                          + "; ".join(f"{m} {_pm(v, mine.spread.get(m), m)}" for m, v in mine.metrics.items()
                                      if m in d.objectives and m != "served_share")
                          + " (trial #" + str(best_t.number) + "); nothing to change")
        _save_final(study, result)
        return
    baseline = Measurement(flags=base_flags, status="not probed")
    mine = Measurement(flags=best.short(), status="not probed")
    try:
        bp = predictor.predict(base).total_device_bytes
    except ConfigError as e:
        bp = None
        baseline.status, baseline.reason = "invalid", str(e)
    baseline.predicted_bytes = bp
    mine.predicted_bytes = result.config.get("predicted_bytes") if result.config else None
    base_fits = bp is not None and bp <= avail
    if bp is not None and not base_fits:
        baseline.status = "skipped"
        baseline.reason = f"llama.cpp's defaults are predicted at {bp / MiB:,.1f} MiB, over the {avail / MiB:,.1f} MiB available"
    runs: dict[str, list[ProbeResult]] = {"best": [], "base": []}
    plan = [(r, which, cand) for r in range(rounds) for which, cand in (("base", base), ("best", best))
            if which == "best" or base_fits]
    for i, (r, which, cand) in enumerate(plan, 1):
        what = "llama.cpp's defaults" if which == "base" else "the best config"
        if live is not None:
            live.step(i, len(plan), f"comparing with llama.cpp's defaults: probing {what} (round {r + 1} of {rounds})")
        else:
            say(f"[ggfit] comparing: {what} (round {r + 1}/{rounds})")
        runs[which].append(probe(cand.model_path, cand.config, d.workload, runner=runner, budget_bytes=probe_budget,
                                 timeout=timeout, llama_server=llama_server, threads=cand.threads,
                                 draft_p_min=cand.draft_p_min))
    result.compare_probes = len(plan)
    for which, meas, cand in (("base", baseline, base), ("best", mine, best)):
        rs = runs[which]
        if not rs:
            continue
        meas.probes = len(rs)
        ok = [x for x in rs if x.ok]
        meas.status = "ok" if ok else rs[-1].status
        if not ok:
            meas.reason = rs[-1].message
            continue
        meas.spread = _spreads(ok)
        for k in DIRECTIONS:
            if k in meas.spread:
                meas.metrics[k] = meas.spread[k].median
                continue
            vals = [v for v in (_metrics(x, cand, share).get(k) for x in ok) if v is not None]
            if vals:
                meas.metrics[k] = statistics.median(vals)
    result.baseline, result.best_measured = baseline, mine
    if baseline.status == "ok" and mine.status == "ok":
        result.ratio, result.outcome, result.verdict = compare_verdict(d.objectives, mine, baseline,
                                                                       where=f", -c {best.config.n_ctx}")
    elif baseline.status != "ok":
        result.verdict = f"llama.cpp's defaults were not measured: {baseline.status}: {baseline.reason}"
    else:
        result.verdict = f"the best config failed when probed again: {mine.status}: {mine.reason}"
    _save_final(study, result)


def _save_final(study, result: StudyResult) -> None:
    with contextlib.suppress(Exception):
        study.set_user_attr("final", {"baseline": result.baseline.model_dump(mode="json") if result.baseline else None,
                                      "best": result.best_measured.model_dump(mode="json") if result.best_measured else None,
                                      "ratio": result.ratio, "outcome": result.outcome, "verdict": result.verdict,
                                      "best_trial": result.best.number if result.best else None})
