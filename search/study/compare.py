"""The comparison with llama.cpp's defaults: the best config and the defaults probed alternately, judged by their
measured spreads."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from pathlib import Path
from typing import Callable, Sequence

from sqlalchemy.exc import SQLAlchemyError

from fitter.fit.budget import MiB
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.progress import Progress
from search.probe import ProbeResult, Spread
from search.space import Candidate
from search.study.define import DIRECTIONS, UNITS, ServedShare, StudyDef
from search.study.objective import Predictor, Prober, _metrics
from search.study.results import Measurement, StudyResult, _spreads


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
    = on ...), the model side (-ngl, mmap, repack), the devices (--rpc, -ts), the thread count run_probe passes (-t,
    default os.cpu_count()) and the drafter."""
    threads = os.cpu_count() or 1  # run_probe's default

    def run(c: Candidate):
        cp = resolve_context(spec, c.config, frontend).model_dump(exclude={"defaults_applied"})
        cf = c.config
        return (c.model_path, cp, c.threads or threads, cf.n_gpu_layers, cf.no_mmap, cf.no_repack, cf.rpc,
                cf.tensor_split, cf.spec_type, cf.draft_model, cf.draft_type_k, cf.draft_type_v,
                c.draft_p_min if cf.spec_type != "none" else None)

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


def compare_with_defaults(result: StudyResult, study, best_t, best: Candidate, d: StudyDef, model0: str,
                          predictor: Predictor, avail: int, prober: Prober, rounds: int, share: ServedShare,
                          say: Callable[[str], None], live: Progress | None) -> None:
    """Probe llama.cpp's defaults (-m MODEL -c <best's context>) and the best config, alternating, and compare them
    with their measured spreads. When the best config is the defaults' own run, say so: nothing to compare."""
    # --rpc stays (the devices are the setup, not a choice), -ts not: llama.cpp splits by the devices' free memory
    base = Candidate(model_path=model0, config=RunConfig(n_ctx=best.config.n_ctx, rpc=best.config.rpc,
                                                         rpc_backends=best.config.rpc_backends), threads=None)
    base_flags = base.short(model_label=Path(model0).name) + " (llama-server defaults)"
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
        bp = predictor.device_bytes(predictor.predict(base))
    except ConfigError as e:
        bp = None
        baseline.status, baseline.reason = "invalid", str(e)
    baseline.predicted_bytes = bp
    mine.predicted_bytes = result.config.get("predicted_bytes") if result.config else None
    base_fits = bp is not None and bp <= avail
    if bp is not None and not base_fits:
        baseline.status = "skipped"
        baseline.reason = f"llama.cpp's defaults are predicted at {bp / MiB:,.1f} MiB, over the {avail / MiB:,.1f} MiB available"
    runs = _alternate(base, best, base_fits, prober, rounds, say, live)
    result.compare_probes = len(runs["base"]) + len(runs["best"])
    for which, meas, cand in (("base", baseline, base), ("best", mine, best)):
        _measured(meas, runs[which], cand, share)
    result.baseline, result.best_measured = baseline, mine
    if baseline.status == "ok" and mine.status == "ok":
        result.ratio, result.outcome, result.verdict = compare_verdict(d.objectives, mine, baseline,
                                                                       where=f", -c {best.config.n_ctx}")
    elif baseline.status != "ok":
        result.verdict = f"llama.cpp's defaults were not measured: {baseline.status}: {baseline.reason}"
    else:
        result.verdict = f"the best config failed when probed again: {mine.status}: {mine.reason}"
    _save_final(study, result)


def _alternate(base: Candidate, best: Candidate, base_fits: bool, prober: Prober, rounds: int,
               say: Callable[[str], None], live: Progress | None) -> dict[str, list[ProbeResult]]:
    """The defaults and the best config probed in turn, `rounds` times each (the defaults only where they fit)."""
    runs: dict[str, list[ProbeResult]] = {"best": [], "base": []}
    plan = [(r, which, cand) for r in range(rounds) for which, cand in (("base", base), ("best", best))
            if which == "best" or base_fits]
    for i, (r, which, cand) in enumerate(plan, 1):
        what = "llama.cpp's defaults" if which == "base" else "the best config"
        if live is not None:
            live.step(i, len(plan), f"comparing with llama.cpp's defaults: probing {what} (round {r + 1} of {rounds})")
        else:
            say(f"[ggfit] comparing: {what} (round {r + 1}/{rounds})")
        runs[which].append(prober(cand))
    return runs


def _measured(meas: Measurement, rs: list[ProbeResult], cand: Candidate, share: ServedShare) -> None:
    """`meas` from the probes of one config: their status, each metric's median and spread."""
    if not rs:
        return
    meas.probes = len(rs)
    ok = [x for x in rs if x.ok]
    meas.status = "ok" if ok else rs[-1].status
    if not ok:
        meas.reason = rs[-1].message
        return
    meas.spread = _spreads(ok)
    for k in DIRECTIONS:
        if k in meas.spread:
            meas.metrics[k] = meas.spread[k].median
            continue
        vals = [v for v in (_metrics(x, cand, share).get(k) for x in ok) if v is not None]
        if vals:
            meas.metrics[k] = statistics.median(vals)


def _save_final(study, result: StudyResult) -> None:
    """The comparison into the study's user attrs, for `ggfit report` (a storage that fails now loses only that)."""
    with contextlib.suppress(SQLAlchemyError):
        study.set_user_attr("final", {"baseline": result.baseline.model_dump(mode="json") if result.baseline else None,
                                      "best": result.best_measured.model_dump(mode="json") if result.best_measured else None,
                                      "ratio": result.ratio, "outcome": result.outcome, "verdict": result.verdict,
                                      "best_trial": result.best.number if result.best else None})
