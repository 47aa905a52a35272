"""Where a study lives and who works on it: the Optuna storage, the study's name, the workers, and the recovery of
the trials a dead or interrupted worker left behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import TrialState, create_trial
from sqlalchemy.exc import SQLAlchemyError

from fitter.ggml import backends
from fitter.ggml.backends.base import Backend
from search.signals import Terminated
from search.space import StudyError
from search.study.define import SPEED_CUT, StudyDef

HEARTBEAT_S = 10  # RDBStorage heartbeat interval
GRACE_S = 60  # a RUNNING trial without a heartbeat for this long belongs to a dead worker
MAX_RETRY = 2  # a stale trial is retried this many times

# --- storage, names, workers ---------------------------------------------------------------------------------------


def default_storage_url() -> str:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ggfit"
    return f"sqlite:///{base / 'studies.db'}"


def _redact(url: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def open_storage(url: str | None = None, *, heartbeat: bool = True):
    """An optuna RDBStorage with heartbeats and stale-trial retries. A plain path means a SQLite file."""
    url = url or default_storage_url()
    if "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().resolve()}"
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):])
        if str(db) not in ("", ":memory:"):
            if url != default_storage_url() and not db.parent.is_dir():  # only ggfit's own directory is made
                raise StudyError(f"--storage {url}: {db.parent} is not a directory" if db.parent.exists()
                                 else f"--storage {url}: directory {db.parent} does not exist")
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
                except SQLAlchemyError as e:  # two workers creating the schema of a new database at once: one loses
                    if attempt == 4 or not re.search(r"duplicate key|already exists|UniqueViolation", str(e)):
                        raise
                    time.sleep(0.5 + attempt)
        except ImportError:
            # SQLAlchemy 2.1 reads postgresql:// with psycopg 3 (postgresql+psycopg2:// for psycopg2)
            hint = " (pip install 'psycopg[binary]')" if url.startswith("postgresql") else ""
            raise StudyError(f"--storage {_redact(url)}: the database driver for this URL is not installed{hint}") from None
        except (SQLAlchemyError, ValueError, RuntimeError) as e:  # bad URL, server down, no such database, old schema
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StudyError(f"--storage {_redact(url)}: {first}") from None


def device_id(backend: Backend) -> str:
    """The kind of machine, as stable across identical machines (no hostname): results only mix within a kind."""
    device = backends.get(backend).machine_kind()
    if device is not None:
        return f"{backend.value}:{device}"
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
               backend: Backend, runner: str, drafts: Sequence[str] = (), devices: dict[str, int] | None = None) -> str:
    """``<study>-<model stem>-<10 hex>``: stable for the same models, device, budget (`devices`: what each --rpc
    device may hold), runner and study definition."""
    payload: dict[str, Any] = {
        "models": [_file_id(m) for m in models], "drafts": [_file_id(d) for d in drafts],
        "device": device_id(backend), "budget": budget_bytes, "margin": margin_bytes, "runner": runner,
        "study": study_def.model_dump(mode="json"),
    }
    if devices:  # a budget per device (optimise --rpc); names of the studies without one unchanged
        payload["devices"] = devices
    if study_def.speed_cut == SPEED_CUT:  # the default leaves the names of studies made before it unchanged
        del payload["study"]["speed_cut"]
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
        elif (t.state == TrialState.FAIL and t.user_attrs.get("status") in ("running", "interrupted", "terminated")
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
    history = [*(t.system_attrs.get("retry_history") or []), t.number]
    if max_retry is not None and len(history) > max_retry:
        return False
    sa: dict[str, Any] = {"failed_trial": t.number, "retry_history": history}
    if "fixed_params" in t.system_attrs:
        sa["fixed_params"] = t.system_attrs["fixed_params"]
    study.add_trial(create_trial(state=TrialState.WAITING, params=t.params, distributions=t.distributions,
                                 system_attrs=sa))
    return True


def cut_short(e: BaseException) -> tuple[str, str]:
    """(status, reason) of a trial that Ctrl-C (``interrupted``) or SIGTERM (``terminated``) cut short."""
    if isinstance(e, Terminated):
        return "terminated", "terminated (SIGTERM) mid-trial; run again"
    return "interrupted", "interrupted (Ctrl-C) mid-trial; run again"


class StudyInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (``terminated``) during `run_study`: the trial it cut short (``trial``, or None) is queued to
    run again on resume."""

    def __init__(self, trial: int | None = None, terminated: bool = False):
        super().__init__(trial)
        self.trial, self.terminated = trial, terminated

    def hint(self) -> str:
        again = f" (trial #{self.trial} runs again first)" if self.trial is not None else ""
        how = "terminated (SIGTERM)" if self.terminated else "interrupted"
        return f"{how}; run the same command to resume{again}"


def _interrupted(study, trial_id: int | None, e: BaseException | None = None) -> int | None:
    """After Ctrl-C or SIGTERM (`e`): the trial that was running is failed (Optuna has usually done it; the objective
    labelled it ``interrupted`` or ``terminated``) and queued again, so resuming loses nothing. Returns its number, or
    None when no trial was cut short."""
    if trial_id is None:
        return None
    storage = study._storage
    t = storage.get_trial(trial_id)
    if t.state == TrialState.RUNNING:  # Ctrl-C outside the objective (the sampler, the storage)
        with contextlib.suppress(UpdateFinishedTrialError):
            if e is not None and t.user_attrs.get("status") == "running":
                status, reason = cut_short(e)
                storage.set_trial_user_attr(trial_id, "status", status)
                storage.set_trial_user_attr(trial_id, "reason", reason)
            storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        t = storage.get_trial(trial_id)
    if t.state != TrialState.FAIL or t.number in _rerun_numbers(study.get_trials(deepcopy=False)):
        return None  # it had finished (the Ctrl-C came between trials), or it is queued again already
    _retry(study, t)
    return t.number


def running_elsewhere(study, trials, me: int | None = None) -> list:
    """The RUNNING trials of other live workers (not trial `me`; heartbeat-stale ones and dead local workers' are
    left out: they are not running)."""
    stale: set[int] = set()
    if is_heartbeat_enabled(study._storage):  # RDBStorage with heartbeats only
        stale = set(study._storage._get_stale_trial_ids(study._study_id))
    host = socket.gethostname()
    out = []
    for t in trials:
        if t.state != TrialState.RUNNING or t.number == me:
            continue
        w = t.user_attrs.get("worker") or {}
        if t._trial_id in stale or (w.get("host") == host and not _alive(w)):
            continue
        out.append(t)
    return out


def worker_text(t) -> str:
    """``#12 (worker host:pid)``: a running trial and who runs it."""
    w = t.user_attrs.get("worker") or {}
    return f"#{t.number}" + (f" (worker {w.get('host')}:{w.get('pid')})" if w else "")


def _probing_elsewhere(study, trials, me: int) -> int:
    """Probes other live workers are running now (RUNNING trials marked ``probing``; heartbeat-stale ones and dead
    local workers' are not counted)."""
    return sum(1 for t in running_elsewhere(study, trials, me) if t.user_attrs.get("probing"))
