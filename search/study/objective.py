"""The study's objective, Optuna's callable-class idiom: one trial is a prediction, then a probe (or the reuse of an
earlier trial's probe), recorded in the trial's user attrs and constraints (see search/study/__init__.py)."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState
from sqlalchemy.exc import SQLAlchemyError

from fitter.fit.budget import MiB
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import ConfigError, Frontend
from fitter.llama.model import load_model_spec
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.progress import Progress
from search.probe import ProbeResult
from search.space import Candidate, SearchSpace
from search.study.define import DIRECTIONS, ServedShare, StudyDef
from search.study.prior import SpeedPrior
from search.study.results import STATUS_LABELS, _fmt, _spreads, best_text, count_trials
from search.study.storage import GRACE_S, _probing_elsewhere, cut_short
from search.workload import Workload


class Predictor:
    """A candidate's plan (fitter.fit.plan.predict_plan), each model file read once. `per_device` (optimise --rpc): what
    each device may hold (its budget less its margin) by llama.cpp's name, `avail` the study's available bytes."""

    def __init__(self, backend: Backend, frontend: Frontend, build: LlamaBuild = PINNED,
                 per_device: dict[str, int] | None = None, avail: int = 0):
        self.backend, self.frontend, self.build = backend, frontend, build
        self.per_device, self.avail = per_device, avail
        self._specs: dict[str, Any] = {}
        self._splits: dict[str, tuple[float, ...] | None] = {}

    def spec(self, path: str):
        if path not in self._specs:
            self._specs[path] = load_model_spec(path)
        return self._specs[path]

    def placed(self, cand: Candidate) -> Candidate:
        """With a budget per device and no -ts given: the candidate with the -ts ggfit proposes at its own context, -ub
        and K/V types (fitter.fit.split.split_at), else llama.cpp's split by the budgets (none fits: the trial is then
        predicted over and skipped). A candidate the space did not propose (no params: llama.cpp's defaults, the
        compare's baseline) gets llama.cpp's split by free memory, here the budgets."""
        cfg = cand.config
        if not self.per_device or not cfg.rpc or cfg.tensor_split is not None:
            return cand
        key = f"{cand.model_path}|{cfg.model_dump_json()}"
        if cand.params and key not in self._splits:
            from fitter.fit.split import split_at

            header, spec = self.spec(cand.model_path)
            self._splits[key] = split_at(header, spec, cfg, self.backend, self.frontend, self.per_device,
                                         build=self.build)
        proposed = self._splits.get(key) if cand.params else None
        ts = proposed or tuple(float(max(a, 0)) for a in self.per_device.values())
        return cand.model_copy(update={"config": cfg.model_copy(update={"tensor_split": ts})})

    def plan(self, cand: Candidate):
        """The trial's plan (fitter.fit.plan.predict_plan): its config as given, held to the study's budgets."""
        from fitter.fit.plan import predict_plan
        from fitter.fit.request import Budgets, FitRequest

        cand = self.placed(cand)
        req = FitRequest.trial(cand.model_path, cand.config, self.backend, self.frontend, self.build,
                               Budgets.held(self.avail, self.per_device))
        return predict_plan(req, model=self.spec(cand.model_path),
                            draft=self.spec(req.model_draft) if req.model_draft else None)

    def predict(self, cand: Candidate):
        return self.plan(cand).pred

    def device_bytes(self, pred) -> int:
        """What the one --budget holds: the device total; with --rpc and one budget for every device the fullest
        device's; with a budget per device, `avail` plus the excess of the device furthest over its own (negative:
        the least headroom), so that comparing it with `avail` compares every device with its own budget."""
        from fitter.ggml import backends

        if self.per_device:
            totals = pred.device_totals()
            return self.avail + max(totals.get(d, 0) - a for d, a in self.per_device.items())
        if backends.get(self.backend).remote:
            return max(pred.device_totals().values(), default=0)
        return pred.total_device_bytes


@dataclass(frozen=True)
class Prober:
    """`run_probe` (or a replacement with its signature) with the study's options: a candidate in, a result out."""

    probe: Callable[..., ProbeResult]
    workload: Workload
    runner: str
    budget_bytes: int | None
    timeout: float
    llama_server: str | None

    def __call__(self, cand: Candidate, **kw: Any) -> ProbeResult:
        return self.probe(cand.model_path, cand.config, self.workload, runner=self.runner,
                          budget_bytes=self.budget_bytes, timeout=self.timeout, llama_server=self.llama_server,
                          threads=cand.threads, draft_p_min=cand.draft_p_min, **kw)


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


def _values(attrs: dict[str, Any], objectives: Sequence[str]) -> float | list[float]:
    vals = [float(attrs[m]) for m in objectives]
    return vals[0] if len(vals) == 1 else vals


class _Unneeded(Exception):
    """Ends a trial without a probe: the --trials goal was reached while it was being proposed (other workers)."""


class Objective:
    """One trial: the proposal becomes a candidate; a config llama.cpp refuses is ``invalid``, one predicted over the
    budget ``skipped`` (both PRUNED with a violated constraint); a run already measured is reused; else it is probed.
    ``current`` is the storage id of the trial this process runs now (for Ctrl-C)."""

    def __init__(self, study: optuna.Study, space: SearchSpace, predictor: Predictor, d: StudyDef, *, avail: int,
                 trials_goal: int, prober: Prober, share: ServedShare, worker: dict[str, Any],
                 live: Progress | None = None, feasibility: bool = True, prior: SpeedPrior | None = None):
        self.study, self.space, self.predictor, self.d = study, space, predictor, d
        self.prior = prior
        self.avail, self.trials_goal, self.prober, self.share = avail, trials_goal, prober, share
        self.worker, self.live, self.feasibility = worker, live, feasibility
        self.current: int | None = None

    def __call__(self, trial: optuna.Trial) -> float | list[float]:
        self.current = trial._trial_id
        try:
            return self._run(trial)
        except KeyboardInterrupt as e:
            # Optuna fails it next; attrs can only change before that (and a dying storage may refuse them)
            status, reason = cut_short(e)
            with contextlib.suppress(UpdateFinishedTrialError, SQLAlchemyError):
                trial.set_user_attr("status", status)
                trial.set_user_attr("reason", reason)
            raise

    def _run(self, trial: optuna.Trial) -> float | list[float]:
        cand = self.predictor.placed(self.space.candidate(self.space.suggest(trial)))  # --rpc: its -ts
        self._start(trial, cand)
        over = self._predict(trial, cand)
        self._speed(trial, cand)
        prev = self._known(cand.key(), trial.number)
        if prev is not None:
            return self._reuse(trial, prev)
        probe_kw = self._claim_probe(trial, cand)
        res = self.prober(cand, **probe_kw)
        return self._record(trial, cand, res, over)

    def _start(self, trial: optuna.Trial, cand: Candidate) -> None:
        ua = {"worker": self.worker, "key": cand.key(), "flags": cand.short(), "model": Path(cand.model_path).name,
              "config": cand.config.model_dump(mode="json"), "threads": cand.threads,
              "draft_p_min": cand.draft_p_min, "probed": False, "probing": False, "status": "running",
              "reason": None}
        # a retry queued by optuna's heartbeat callback inherits the dead trial's attrs: they are not this run's
        ua.update({k: None for k in trial.user_attrs if k not in ua})
        for k, v in ua.items():
            trial.set_user_attr(k, v)

    def _predict(self, trial: optuna.Trial, cand: Candidate) -> int:
        """The predicted bytes over the available (negative: headroom); prunes invalid and skipped configs."""
        try:
            pred = self.predictor.predict(cand)
        except ConfigError as e:
            trial.set_user_attr("status", "invalid")
            trial.set_user_attr("reason", str(e))
            trial.set_constraint("invalid", 1.0)
            raise optuna.TrialPruned(f"invalid: {e}") from None
        total = self.predictor.device_bytes(pred)
        over = total - self.avail
        trial.set_user_attr("predicted_bytes", total)
        trial.set_user_attr("available_bytes", self.avail)
        trial.set_user_attr("predicted_fits", over <= 0)
        trial.set_constraint("invalid", 0.0)
        if self.feasibility:
            trial.set_constraint("predicted_over_budget_mib", over / MiB)
        if over > 0 and self.feasibility:
            why = f"predicted {total / MiB:,.1f} MiB > {self.avail / MiB:,.1f} MiB available (budget - margin)"
            trial.set_user_attr("status", "skipped")
            trial.set_user_attr("reason", why)
            raise optuna.TrialPruned(why)
        return over

    def _speed(self, trial: optuna.Trial, cand: Candidate) -> None:
        """The speed model's rates into the user attrs (beside the measured ones); prunes a config predicted below
        the --speed-cut share of the best predicted, unprobed."""
        if self.prior is None:
            return
        rates = self.prior.predict(cand)
        for k in ("prefill_tps", "decode_tps"):
            trial.set_user_attr(f"predicted_{k}", None if rates is None else round(rates[k], 2))
        why = self.prior.below_cut(cand)
        trial.set_constraint("predicted_slow", 1.0 if why else 0.0)
        if why:
            trial.set_user_attr("status", "slow")
            trial.set_user_attr("reason", why)
            raise optuna.TrialPruned(why)

    def _known(self, key: str, number: int):
        """A finished trial that probed `key`. When an earlier trial (another worker's) is probing it right
        now, wait for its result rather than probe the same run twice; a dead worker's trial is failed by the
        heartbeat within GRACE_S, and after the probe timeout we stop waiting and probe ourselves."""
        deadline = time.monotonic() + self.prober.timeout + GRACE_S
        while True:
            in_flight = False
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
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

    def _reuse(self, trial: optuna.Trial, prev) -> float | list[float]:
        pua = prev.user_attrs
        for k in list(DIRECTIONS) + ["status", "reason", "peak_rss_bytes", "model_miss", "spread"]:
            if k in pua:
                trial.set_user_attr(k, pua[k])
        trial.set_user_attr("duplicate_of", prev.number)
        ok = pua.get("status") == "ok"
        trial.set_constraint("probe_failed", 0.0 if ok else 1.0)
        if not ok:
            raise optuna.TrialPruned(f"same run as trial {prev.number}: {pua.get('status')}")
        return _values(pua, self.d.objectives)

    def _claim_probe(self, trial: optuna.Trial, cand: Candidate) -> dict[str, Any]:
        """Mark the trial as probing, or end it unprobed when the --trials goal is reached; the probe's options."""
        # --trials N is N probes: with several workers, probes running elsewhere count before this one starts
        goal = self.trials_goal
        trials_now = self.study.get_trials(deepcopy=False)
        done, elsewhere = count_trials(trials_now).probes, _probing_elsewhere(self.study, trials_now, trial.number)
        if done + elsewhere >= goal:
            trial.set_user_attr("status", "unneeded")
            trial.set_user_attr("reason", f"not probed: {done} probes done and {elsewhere} running in other "
                                          f"workers reach the goal of {goal}")
            self.study.stop()
            raise _Unneeded(trial.user_attrs["reason"])
        trial.set_user_attr("probing", True)
        if self.live is None:
            return {}
        n = done + elsewhere + 1
        self.live.step(n, goal, f"trial {n} of {goal} (#{trial.number}), best so far "
                                f"{best_text(trials_now, self.d)}: probing {cand.short()}")  # the flags last: a terminal cuts there
        return {"progress": self.live.sub(f"trial {n} of {goal}")}  # the probe's stages on the same line

    def _record(self, trial: optuna.Trial, cand: Candidate, res: ProbeResult, over: int) -> float | list[float]:
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
        mets = _metrics(res, cand, self.share)
        for k, v in mets.items():
            trial.set_user_attr(k, v)
        for k, v in (res.predicted or {}).items():  # the speed model's rates beside the measured (issue 46)
            if k in ("prefill_tps", "decode_tps", "hardware"):
                trial.set_user_attr(f"predicted_{k}", v)
        missing = [m for m in self.d.objectives if m not in mets]
        if res.status == "ok" and missing:
            trial.set_user_attr("status", "error")
            trial.set_user_attr("reason", f"the probe measured no {', '.join(missing)}")
        if trial.user_attrs.get("status") != "ok":
            trial.set_user_attr("model_miss", res.status == "oom" and over <= 0)
            trial.set_constraint("probe_failed", 1.0)
            raise optuna.TrialPruned(f"{res.status}: {res.message}")
        trial.set_constraint("probe_failed", 0.0)
        return _values(mets, self.d.objectives)


class TrialLines:
    """The lasting line each finished trial gets (an Optuna callback), and the stop once the goal is reached."""

    def __init__(self, d: StudyDef, trials_goal: int, cap: int, say: Callable[[str], None]):
        self.d, self.trials_goal, self.cap, self.say = d, trials_goal, cap, say

    def __call__(self, study: optuna.Study, ft) -> None:
        trials = study.get_trials(deepcopy=False)
        c = count_trials(trials)
        ua = ft.user_attrs
        status = ua.get("status", ft.state.name.lower())
        if status == "ok":
            what = ", ".join(f"{m} {_fmt(ua.get(m), m)}" for m in self.d.objectives)
        else:
            what = ua.get("reason") or ""
        label = STATUS_LABELS.get(status, status)
        if ua.get("duplicate_of") is not None:
            label = f"duplicate of #{ua['duplicate_of']} ({label})"
        self.say(f"[ggfit] trial #{ft.number}: {label}: {what[:110]} | best {best_text(trials, self.d)} | "
                 f"probes {c.probes}/{self.trials_goal} | {ua.get('flags', '')}")
        if c.probes >= self.trials_goal or c.total - c.running >= self.cap:
            study.stop()


@contextlib.contextmanager
def quiet_trial_failures():
    """Optuna logs every failed trial as a warning with a traceback; for a Ctrl-C (we say it in one line) and for a
    trial that ends unprobed because the goal was reached, that is noise. Other failures are still logged."""

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
