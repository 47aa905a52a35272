"""`run_study`: the study's setup (models, budget, space, storage), the optimisation, the summary and the comparison
with llama.cpp's defaults.

run_study's arguments:
`model`: a GGUF path (or bundled name), or several GGUF files of one model (quantisations: the ``quant``
parameter; the first one is used for the defaults). `budget`: bytes, a `Budget`, or --budget text; `margin`:
bytes or --margin text (default 1024 MiB, llama.cpp's --fit-target). `n_trials`: probes to spend (default: the
study file's ``trials``), counted over the whole study, so a resumed or shared study stops at the same total.
`workload` replaces the study file's. `name` replaces the derived study name. `compare_defaults`: probe
llama.cpp's defaults (with the best config's -c) and the best config again, `confirm_rounds` times each,
alternating, and report the ratio (not counted in `n_trials`; skipped when the best config is the defaults).
`progress` receives the lasting lines (each trial's outcome); `live` (a `fitter.progress.Progress`) shows what
runs now: the probe in flight, the best so far. `llama_build`: the llama.cpp build whose memory rules decide
which configs are feasible (the one `llama_server` is, when the study probes a user's binary).

For benchmarks: ``feasibility=False`` probes every valid proposal whatever its prediction (the sampler then learns
the budget from OOMs only); ``probe`` replaces `run_probe` (same signature), e.g. a lookup in measured results;
``enqueue_defaults=False`` leaves out the first trial, llama.cpp's defaults projected into the space.

`hardware` (a `fitter.speed` profile) makes the speed model the study's prior: the predicted-fastest configs
are enqueued first (before llama.cpp's defaults, which are left out when the prior's picks use up the probes) and a config predicted below `speed_cut` (default: the study
file's ``speed_cut``, 0.5; 0 disables) times the best predicted is pruned unprobed (status ``slow``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import optuna

from fitter.bundled import resolve_model
from fitter.fit.budget import Budget, MiB, available_bytes, parse_budget, parse_margin
from fitter.ggml import backends
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import ConfigError, Frontend
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.progress import Progress
from fitter.speed.hardware import HardwareProfile
from search.probe import DEFAULT_TIMEOUT, ProbeResult, run_probe
from search.signals import Terminated
from search.space import Candidate, SearchSpace, StudyError
from search.study.compare import compare_with_defaults
from search.study.define import LengthDistribution, ServedShare, StudyDef, load_study
from search.study.objective import Objective, Predictor, Prober, TrialLines, _Unneeded, quiet_trial_failures
from search.study.prior import DEFAULT_FIRST, SpeedPrior
from search.study.results import StudyResult, _summarise, count_trials
from search.study.storage import (
    StudyInterrupted,
    _interrupted,
    _redact,
    _worker,
    default_storage_url,
    device_id,
    open_storage,
    recover_stale,
    study_name,
)
from search.workload import Workload


class _Say:
    """A lasting line: the live line (if any) is cleared first and redrawn by its next step."""

    def __init__(self, progress: Callable[[str], None] | None, live: Progress | None):
        self.progress, self.live = progress, live

    def __call__(self, line: str) -> None:
        if self.live is not None:
            self.live.close()
        if self.progress is not None:
            self.progress(line)


@dataclass
class _Plan:
    """What the study runs on: the study file, the models, the budget, the search space."""

    d: StudyDef
    models: list[str]
    drafts: list[str]
    budget: Budget
    margin_bytes: int
    avail: int
    trials_goal: int
    cap: int
    predictor: Predictor
    space: SearchSpace
    share: ServedShare
    notes: list[str] = field(default_factory=list)


def _as_budget(budget: Budget | int | str, backend: Backend) -> Budget:
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, int):
        if budget <= 0:
            raise StudyError(f"budget must be positive, not {budget}")
        return Budget(bytes=budget, source=f"{budget} bytes")
    return parse_budget(str(budget), backend.value)


def _same_model(predictor: Predictor, models: list[str]) -> Any:
    """The first model's spec; every other file must be the same model (another quantisation)."""
    _, spec0 = predictor.spec(models[0])
    for m in models[1:]:
        _, s = predictor.spec(m)
        same = (s.architecture, s.n_layer, s.n_embd, s.n_vocab) == (spec0.architecture, spec0.n_layer, spec0.n_embd, spec0.n_vocab)
        if not same:
            raise StudyError(f"{Path(m).name} is not the same model as {Path(models[0]).name} "
                             f"({s.architecture}/{s.n_layer} layers vs {spec0.architecture}/{spec0.n_layer})")
    return spec0


def _ctx_choices(d: StudyDef, dist: LengthDistribution | None, n_ctx_train: int, ctx_need: int,
                 notes: list[str]) -> list[int] | None:
    """The contexts worth searching when the study gives prompt lengths: one per known length, up to the training
    context."""
    if dist is None or d.space.n_ctx is not None:
        return None
    raw = sorted({n + d.workload.gen_tokens for _, n in dist.lengths()})
    choices = [c for c in raw if c <= n_ctx_train]
    if len(choices) < len(raw):
        choices.append(n_ctx_train)  # the most the model was trained for serves the most it can
        notes.append(f"prompt lengths above the training context ({n_ctx_train}) are not searched; "
                     f"it serves {dist.share(n_ctx_train - d.workload.gen_tokens):.1%} of requests")
    return [max(c, ctx_need) for c in choices]


def _plan(model, study_def, *, budget, margin, backend: Backend, frontend: Frontend, n_trials: int | None,
          runner: str, drafts: Sequence[str | os.PathLike[str]], workload: Workload | None,
          confirm_rounds: int, build: LlamaBuild, per_device: dict[str, int] | None = None) -> _Plan:
    d = load_study(study_def)
    if workload is not None:
        d = d.model_copy(update={"workload": workload})
    trials_goal = n_trials if n_trials is not None else d.trials
    if trials_goal < 1:
        raise StudyError(f"--trials {trials_goal}: must be at least 1")
    if confirm_rounds < 0:
        raise StudyError("confirm_rounds must be >= 0")
    models = [resolve_model(str(m)) for m in ([model] if isinstance(model, (str, os.PathLike)) else list(model))]
    if not models:
        raise StudyError("no model file given")
    drafts_l = [str(Path(x).expanduser()) for x in drafts]
    b = _as_budget(budget, backend)
    margin_bytes = margin if isinstance(margin, int) else parse_margin(margin, backend.value)
    avail = available_bytes(b, margin_bytes)
    predictor = Predictor(backend, frontend, build, per_device=per_device, avail=avail)
    spec0 = _same_model(predictor, models)
    for dr in drafts_l:
        predictor.spec(dr)
    ctx_need = d.workload.prompt_tokens + d.workload.gen_tokens
    dist = LengthDistribution(d.prompt_lengths) if d.prompt_lengths else None
    notes: list[str] = []
    if per_device:  # optimise --rpc: the budget above is the first device's
        notes.append("each device against its own budget less its margin: " + ", ".join(
            f"{name} {a / MiB:,.0f} MiB" for name, a in per_device.items()) + "; each trial's -ts the split ggfit "
            "proposes at its context")
    ctx_choices = _ctx_choices(d, dist, spec0.n_ctx_train, ctx_need, notes)
    space = SearchSpace(d.space, models=models, n_ctx_train=spec0.n_ctx_train, ctx_need=ctx_need, fixed=d.fixed,
                        drafts=drafts_l, has_mtp=bool(getattr(spec0, "has_mtp", False)), runner=runner,
                        ctx_choices=ctx_choices)
    notes += space.notes
    return _Plan(d=d, models=models, drafts=drafts_l, budget=b, margin_bytes=margin_bytes, avail=avail,
                 trials_goal=trials_goal, cap=max(d.total_cap, trials_goal), predictor=predictor, space=space,
                 share=ServedShare(dist, d.workload.gen_tokens), notes=notes)


class NothingFits(Exception):  # noqa: N818 - not an error of the input: `optimise` exits 1, as `fit` does
    """No config of the study can fit: the weights alone are over the budget minus the margin. Nothing was written."""


_DEFAULTS = {"n_ubatch": 512, "n_batch_factor": 4, "flash_attn": "auto", "kv_type": "f16", "type_k": "f16",
             "type_v": "f16", "threads": os.cpu_count(), "draft": "none", "n_ctx": 0}  # llama-server's


def _check_weights(p: _Plan) -> None:
    """Refuse at once a study whose every model file's weights alone are over what is available: each of its trials
    would be skipped. Each file is sized with the fewest weights on the device the space allows (the lowest
    n_gpu_layers, the highest n_cpu_moe it searches)."""
    labels = [Path(m).name for m in p.models]  # the space's ``quant`` values
    lightest: tuple[int, str] | None = None
    for label in labels:
        params = {**p.space.nearest(_DEFAULTS), "quant": label}
        for name, pick in (("n_gpu_layers", min), ("n_cpu_moe", max)):
            spec = p.space.dims.get(name)
            if spec is not None:
                params[name] = pick(spec) if isinstance(spec, list) else getattr(spec, "low" if pick is min else "high")
        try:
            pred = p.predictor.predict(p.space.candidate(params))
        except ConfigError:
            return  # a config llama.cpp refuses says nothing about the weights: let the trials judge
        weights = [b for b in pred.buffers if b.counts and b.kind in ("model", "lora")]
        w = p.predictor.device_bytes(pred.model_copy(update={"buffers": weights}))  # --rpc: the fullest device's
        if lightest is None or w < lightest[0]:
            lightest = (w, label)
    if lightest is not None and lightest[0] > p.avail:
        w, label = lightest
        which = f"of {label}" if len(labels) == 1 else f"of the smallest file, {label},"
        placed = " with the fewest layers on the device the space allows" if {"n_gpu_layers", "n_cpu_moe"} & set(p.space.dims) else ""
        raise NothingFits(f"nothing to search: the weights {which} alone are {w / MiB:,.0f} MiB{placed}, the budget "
                          f"minus margin {p.avail / MiB:,.0f} MiB ({p.budget.bytes / MiB:,.0f} - {p.margin_bytes / MiB:,.0f} "
                          f"MiB); no trial was run")


def _storage(storage: str | Any | None) -> tuple[Any, str]:
    """(the storage, its URL for messages): an optuna storage object as it is (benchmarks: in memory), else the
    RDB storage of the URL (default: ggfit's SQLite file)."""
    if storage is not None and not isinstance(storage, str):
        return storage, type(storage).__name__
    url = storage or default_storage_url()
    return open_storage(url), url


def _open_study(p: _Plan, sname: str, st, url: str, seed: int | None, backend: Backend, runner: str) -> optuna.Study:
    """Create or load the study (its sampler seeded past the trials it has), and record what it runs on."""
    d = p.d
    sampler_seed = seed if seed is not None else d.sampler.seed
    try:
        n_before = len(optuna.load_study(study_name=sname, storage=st).get_trials(deepcopy=False))
    except KeyError:
        n_before = 0
    sseed = None if sampler_seed is None else sampler_seed + n_before
    if d.sampler.kind == "random":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=sseed)
    else:
        sampler = optuna.samplers.TPESampler(seed=sseed, n_startup_trials=d.sampler.n_startup_trials,
                                             multivariate=True, group=p.space.conditional)
    directions = [optuna.study.StudyDirection.MAXIMIZE if x == "maximize" else optuna.study.StudyDirection.MINIMIZE
                  for x in d.directions]
    study = optuna.create_study(study_name=sname, storage=st, sampler=sampler, directions=directions,
                                load_if_exists=True)
    if study.directions != directions:
        raise StudyError(f"study {sname} exists in {_redact(url)} with other objectives; pass another name")
    if not study.user_attrs.get("ggfit"):
        study.set_metric_names(list(d.objectives))
        study.set_user_attr("ggfit", {
            "study": d.model_dump(mode="json"), "models": p.models, "drafts": p.drafts,
            "budget_bytes": p.budget.bytes, "budget_source": p.budget.source, "margin_bytes": p.margin_bytes,
            "available_bytes": p.avail, "backend": backend.value, "runner": runner, "device": device_id(backend),
            "objectives": list(d.objectives), "space": p.space.describe(),
        })
    return study


def _speed_prior(p: _Plan, hardware: HardwareProfile | None) -> SpeedPrior | None:
    """The speed model on `hardware` as the study's prior (None: no profile, or no speed objective)."""
    if hardware is None:
        return None
    prior = SpeedPrior(p.predictor, hardware, p.d, avail=p.avail, cut=p.d.speed_cut)
    if not prior.active:
        return None
    ranked = prior.rank(p.space)
    if prior.best is None:
        return None
    cut = sum(1 for s, _ in ranked if s < prior.cut * prior.best) if prior.cuts else 0
    p.notes.append(f"speed prior ({hardware.name}): {len(ranked)} configs predicted to fit, the fastest first; "
                   + (f"{cut} predicted below {prior.cut:g} x the best predicted are skipped unprobed (--speed-cut)"
                      if prior.cuts else "no --speed-cut"))
    return prior


class _Queue:
    """The first trials (the prior's predicted-fastest configs, then llama.cpp's defaults), queued one at a time: the
    next goes in only when no trial is waiting, so that a trial cut short and queued again (storage.retry) still runs
    first on resume, before any of these (Optuna runs the waiting trials by number)."""

    def __init__(self, points: list[dict[str, Any]]) -> None:
        self.points = points

    def next(self, study: optuna.Study) -> None:
        if self.points and not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            study.enqueue_trial(self.points.pop(0), skip_if_exists=True)

    def __call__(self, study: optuna.Study, trial: Any) -> None:  # an optimize callback: after each trial
        self.next(study)


def _first_points(p: _Plan, prior: SpeedPrior | None, defaults: bool) -> list[dict[str, Any]]:
    """The predicted-fastest configs first (the sampler then learns from their measurements), no more than the probes
    to spend, then llama.cpp's defaults where room is left."""
    first = prior.first(p.space, min(DEFAULT_FIRST, p.trials_goal)) if prior is not None else []
    if defaults and len(first) < p.trials_goal:
        seed_point = p.space.nearest({**_DEFAULTS, "quant": Path(p.models[0]).name})
        if seed_point:
            first.append(seed_point)
    return first


def _announce(say: _Say, p: _Plan, sname: str, url: str, retried: list[int]) -> None:
    if retried:
        one = len(retried) == 1
        say(f"[ggfit] trial{'' if one else 's'} {', '.join(map(str, retried))} {'was' if one else 'were'} cut short "
            f"({'its' if one else 'their'} process died or was interrupted): retried first")
    say(f"[ggfit] study {sname} in {_redact(url)}: {p.trials_goal} probes, budget {p.budget.bytes / MiB:,.0f} MiB "
        f"- margin {p.margin_bytes / MiB:,.0f} MiB = {p.avail / MiB:,.0f} MiB; {len(p.space.dims)} searched parameters")
    for n in p.notes:
        say(f"[ggfit] note: {n}")


def _optimise(study: optuna.Study, p: _Plan, objective: Objective, say: _Say, finished0: int, queue: _Queue) -> None:
    try:
        with quiet_trial_failures():
            study.optimize(objective, n_trials=p.cap - finished0,
                           callbacks=[TrialLines(p.d, p.trials_goal, p.cap, say), queue],
                           gc_after_trial=False, catch=(_Unneeded,))
    except KeyboardInterrupt as e:
        again = _interrupted(study, objective.current, e)
        raise StudyInterrupted(again, terminated=isinstance(e, Terminated)) from None


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
    llama_build: LlamaBuild = PINNED,
    hardware: HardwareProfile | None = None,
    speed_cut: float | None = None,
    per_device: dict[str, int] | None = None,
) -> StudyResult:
    """Run (or resume, or join) the study and return its best config, measured against llama.cpp's defaults (the
    arguments: the module's docstring)."""
    backend = Backend(backend)
    p = _plan(model, study_def, budget=budget, margin=margin, backend=backend, frontend=frontend, n_trials=n_trials,
              runner=runner, drafts=drafts, workload=workload, confirm_rounds=confirm_rounds, build=llama_build,
              per_device=per_device)
    if speed_cut is not None:
        _set_speed_cut(p, speed_cut)
    d, say = p.d, _Say(progress, live)
    if feasibility:
        _check_weights(p)
    sname = name or study_name(d, p.models, budget_bytes=p.budget.bytes, margin_bytes=p.margin_bytes, backend=backend,
                               runner=runner, drafts=p.drafts, devices=per_device)
    st, url = _storage(storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    prober = Prober(probe, d.workload, runner, None if backends.get(backend).is_gpu else p.budget.bytes, timeout, llama_server)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message=".*constraint value is ignored.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
        study = _open_study(p, sname, st, url, seed, backend, runner)
        retried = recover_stale(study)
        _run_trials(study, p, sname, url, retried, say, prober, _speed_prior(p, hardware), enqueue_defaults, live,
                    feasibility)

    return _ending(study, p, url, retried, prober if compare_defaults else None, confirm_rounds, say, live)


def _ending(study: optuna.Study, p: _Plan, url: str, retried: list[int], prober: Prober | None, confirm_rounds: int,
            say: _Say, live: Progress | None) -> StudyResult:
    """The study's result: its counts and best, compared with llama.cpp's defaults (with `prober`; None: not)."""
    # one reading of the trials for the counts, the best and the comparison (another worker may add trials meanwhile)
    trials = study.get_trials(deepcopy=False)
    result = _summarise(study, p.d, url, p.budget.bytes, p.margin_bytes, p.avail, p.notes, retried, trials)
    best_t = next((t for t in trials if result.best and t.number == result.best.number), None)
    if best_t is not None:
        cand = _best(result, p, best_t)
        if prober is not None:
            compare_with_defaults(result, study, best_t, cand, p.d, p.models[0], p.predictor, p.avail, prober,
                                  confirm_rounds, p.share, say, live)
            if result.running_elsewhere or result.compare_probes:
                return _as_it_stands(result, study, p, url, retried, best_t.number)
    return result


def _set_speed_cut(p: _Plan, speed_cut: float) -> None:
    if not 0 <= speed_cut < 1:
        raise StudyError(f"--speed-cut {speed_cut:g}: use a share from 0 (off) to below 1")
    p.d = p.d.model_copy(update={"speed_cut": speed_cut})


def _run_trials(study: optuna.Study, p: _Plan, sname: str, url: str, retried: list[int], say: _Say, prober: Prober,
                prior: SpeedPrior | None, enqueue_defaults: bool, live: Progress | None, feasibility: bool) -> None:
    """The study's trials up to its goal: the first points queued in a new study, then the sampler's."""
    c0 = count_trials(study.get_trials(deepcopy=False))
    queue = _Queue(_first_points(p, prior, enqueue_defaults) if c0.total == 0 else [])
    queue.next(study)
    _announce(say, p, sname, url, retried)
    finished0 = c0.total - c0.running
    if c0.probes < p.trials_goal and finished0 < p.cap:
        objective = Objective(study, p.space, p.predictor, p.d, avail=p.avail, trials_goal=p.trials_goal,
                              prober=prober, share=p.share, worker=_worker(), live=live, feasibility=feasibility,
                              prior=prior)
        _optimise(study, p, objective, say, finished0, queue)
    else:
        say(f"[ggfit] study already has {c0.probes} probes ({c0.text()}): nothing to run")


def _as_it_stands(result: StudyResult, study: optuna.Study, p: _Plan, url: str, retried: list[int],
                  compared: int) -> StudyResult:
    """The study read again after the comparison, which another worker's trials may have outlasted: this worker's
    ending then shows the study's best as `ggfit report` would now, and says which trial the comparison was of."""
    now = _summarise(study, p.d, url, p.budget.bytes, p.margin_bytes, p.avail, p.notes, retried)
    if now.best is None or now.best.number == compared:
        result.counts, result.running_elsewhere = now.counts, now.running_elsewhere
        result.n_trials, result.n_probed, result.model_misses = now.n_trials, now.n_probed, now.model_misses
        return result
    best_t = next(t for t in study.get_trials(deepcopy=False) if t.number == now.best.number)
    _best(now, p, best_t)
    kept = {k: getattr(result, k) for k in ("best_measured", "baseline", "ratio", "outcome", "compare_probes")}
    for k, v in kept.items():
        setattr(now, k, v)
    now.verdict = (f"trial #{compared} (the best when this worker ended its search) against llama.cpp's defaults: "
                   f"{result.verdict}" if result.verdict else None)
    now.notes = [*now.notes, f"trial #{now.best.number} became the study's best while trial #{compared} was compared "
                             f"with llama.cpp's defaults"]
    return now


def _best(result: StudyResult, p: _Plan, best_t) -> Candidate:
    """The best trial's config into the result: the llama-server command and the JSON."""
    cand = p.predictor.placed(p.space.candidate(best_t.params))  # --rpc: the trial's -ts
    result.command = cand.command()
    result.config = {"model": cand.model_path, **cand.config.model_dump(mode="json", exclude_defaults=True),
                     "threads": cand.threads, "draft_p_min": cand.draft_p_min,
                     "predicted_bytes": best_t.user_attrs.get("predicted_bytes")}
    result.served_share = p.share(cand)
    return cand
