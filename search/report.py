"""`ggfit report STUDY`: a study's trial table and plots, read back from its Optuna storage.

    report("prefill-gemma-3-270m-q4_k_m-1f983e5d22", storage=None, out="ggfit-report") -> StudyReport

The table has one row per trial: Optuna's state, ggfit's status (ok / oom / crash / timeout / error / skipped /
invalid / stale), the objective values, the predicted total against the memory available, the searched flags and
the reason. Plots (each as HTML through plotly and PNG through matplotlib, whichever is installed):

- ``history``: optimisation history of each objective (optuna.visualization.plot_optimization_history);
- ``importances``: parameter importances per objective (plot_param_importances; needs a few completed trials, and
  with fewer than ``FEW_TRIALS`` completed ones the plot and the notes say they are a rough guess);
- ``pareto``: the Pareto front (plot_pareto_front), for studies with two or three objectives;
- ``memory``: each trial's predicted total against the budget and the budget minus margin, coloured by status
  (probed ok, out of memory, crash, skipped before probing, stale or interrupted ...).

Every axis says its unit (tok/s, s, MiB); trial-number axes have integer ticks.

The storage can also be watched live: ``pip install optuna-dashboard`` then ``optuna-dashboard <storage URL>``
(the default storage is ``sqlite:///${XDG_DATA_HOME:-~/.local/share}/ggfit/studies.db``).
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import optuna
from pydantic import BaseModel, Field

from fitter.fit.budget import MiB
from search.space import StudyError
from search.study.define import DIRECTIONS, PickDef
from search.study.results import _fmt, _info, count_trials, model_misses, pick_best, running_text
from search.study.storage import _redact, default_storage_url, open_storage, running_elsewhere, worker_text

# one colour per status, no two alike (a colour-blind-safe base: Okabe-Ito, then greys for the unprobed)
STATUS_COLOURS = {"ok": "#009e73", "oom": "#d55e00", "crash": "#cc79a7", "timeout": "#e69f00", "error": "#f0e442",
                  "skipped": "#999999", "invalid": "#000000", "stale": "#0072b2", "interrupted": "#56b4e9",
                  "running": "#7b3294", "unneeded": "#8c510a", "terminated": "#01665e"}
# what each objective is measured in, for axis titles
AXIS_UNITS = {"prefill_tps": "tok/s", "decode_tps": "tok/s", "ttft_s": "s", "acceptance": "accepted / drafted tokens",
              "served_share": "share of requests"}
FEW_TRIALS = 10  # parameter importances from fewer completed trials than this are a rough guess


class StudyReport(BaseModel):
    study_name: str
    storage: str
    table: str
    summary: list[str] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    def text(self) -> str:
        out = [f"study {self.study_name} ({self.storage})", *self.summary, "", self.table]
        if self.files:
            out += ["", "wrote:"] + [f"  {f}" for f in self.files]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def load(study: Any, storage: str | None = None):
    """An optuna.Study from a Study or a name in `storage` (StudyError when there is no such study)."""
    if isinstance(study, optuna.Study):
        return study
    url = storage or default_storage_url()
    st = open_storage(url, heartbeat=False)
    names = optuna.study.get_all_study_names(storage=st)
    if study not in names:
        near = [n for n in names if str(study) in n]
        hint = f"; matching: {', '.join(near[:5])}" if near else (f"; studies there: {', '.join(names[:8])}" if names else "; it has no studies")
        raise StudyError(f"no study {study!r} in {_redact(url)}{hint}")
    return optuna.load_study(study_name=study, storage=st)


def _meta(study) -> dict[str, Any]:
    return study.user_attrs.get("ggfit") or {}


def _objectives(study) -> list[str]:
    meta = _meta(study)
    return list(meta.get("objectives") or study.metric_names or [f"objective {i}" for i in range(len(study.directions))])


def trial_table(study) -> str:
    """The trial table as fixed-width text."""
    objectives = _objectives(study)
    trials = study.get_trials(deepcopy=False)
    rated = _predicted_rates(trials)
    workers = _workers(trials)
    rows = [["#", "state", "status", *objectives, *(f"{m} predicted" for m in rated), "predicted",
             *(["worker"] if workers else []), "flags", "reason"]]
    for t in trials:
        info = _info(t)
        ua = t.user_attrs
        vals = []
        for i, m in enumerate(objectives):
            v = info.metrics.get(m)
            if v is None and t.values and m not in DIRECTIONS:
                v = t.values[i]
            vals.append(_fmt(v, m) if m in DIRECTIONS else ("-" if v is None else f"{v:.4g}"))
        status = info.status + (f"=#{info.duplicate_of}" if info.duplicate_of is not None else "")
        if t.system_attrs.get("failed_trial") is not None:
            status += f" (rerun of #{t.system_attrs['failed_trial']})"
        if info.model_miss:
            status += " (model miss)"
        pred = f"{ua['predicted_bytes'] / MiB:,.0f} MiB" if ua.get("predicted_bytes") else "-"
        reason = "" if info.status == "ok" else (info.reason or "")
        vals += [_fmt(ua.get(f"predicted_{m}"), m) if ua.get(f"predicted_{m}") else "-" for m in rated]
        who = [workers.get(t.number, "-")] if workers else []
        rows.append([str(t.number), t.state.name, status, *vals, pred, *who, info.flags, reason[:90]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    return "\n".join(lines)


def _workers(trials) -> dict[int, str]:
    """Trial number -> the worker (host:pid) that ran it, when more than one worker ran the study's trials (several
    processes or hosts on one storage); empty otherwise, and the table has no worker column."""
    who = {t.number: f"{w.get('host')}:{w.get('pid')}" for t in trials if (w := t.user_attrs.get("worker"))}
    return who if len(set(who.values())) > 1 else {}


def _predicted_rates(trials) -> list[str]:
    """The rates the speed model predicted for some trial (search.probe_speed: predicted_prefill_tps, ...)."""
    return [m for m in ("prefill_tps", "decode_tps") if any(t.user_attrs.get(f"predicted_{m}") for t in trials)]


def _summary(study) -> list[str]:
    meta = _meta(study)
    objectives = _objectives(study)
    trials = study.get_trials(deepcopy=False)
    counts = count_trials(trials)
    misses = model_misses(trials)
    out = []
    if meta:
        out.append(f"budget {meta['budget_bytes'] / MiB:,.0f} MiB ({meta.get('budget_source', '')}) - margin "
                   f"{meta['margin_bytes'] / MiB:,.0f} MiB = {meta['available_bytes'] / MiB:,.0f} MiB available; "
                   f"runner {meta.get('runner')}; {meta.get('device')}")
    out.append(f"{counts.text()}; {counts.probes} probe{'s' if counts.probes != 1 else ''} of the search (--trials)")
    out.append(f"memory-model misses (predicted to fit, probe ran out of memory): {len(misses)}"
               + (f" (trials {', '.join(map(str, misses))})" if misses else ""))
    running = [worker_text(t) for t in running_elsewhere(study, trials)]
    best = None
    if all(m in DIRECTIONS for m in objectives):
        pick = PickDef.model_validate((meta.get("study") or {}).get("pick") or {})
        best, front = pick_best(trials, objectives, pick)
        if best is not None:
            out.append(f"best{' so far' if running else ''}: trial {best.number}: "
                       + ", ".join(f"{m} {_fmt(v, m)}" for m, v in zip(objectives, best.values))
                       + f" [{best.user_attrs.get('flags', '')}]")
            if len(objectives) > 1:
                out.append(f"Pareto front: trials {', '.join(str(t.number) for t in sorted(front, key=lambda t: t.number))}")
    final = study.user_attrs.get("final")
    if final and final.get("verdict"):
        was = final.get("best_trial")
        if best is not None and was is not None and was != best.number:  # a worker compared an earlier best
            out.append(f"trial #{was} (the best when a worker compared it) against llama.cpp's defaults: {final['verdict']}")
        else:
            out.append(final["verdict"])
    if running:
        out.append(running_text(running, study.study_name))
    return out


# --- plots -----------------------------------------------------------------------------------------------------


# how the memory plot's legend names each status
STATUS_LEGEND = {"ok": "probed ok", "oom": "probed: out of memory", "crash": "probed: crash", "timeout": "probed: timeout",
                 "error": "probed: error", "skipped": "skipped (predicted over budget)",
                 "invalid": "invalid (llama.cpp refuses)", "stale": "stale (worker died; run again)",
                 "interrupted": "interrupted (Ctrl-C; run again)", "terminated": "terminated (SIGTERM; run again)",
                 "running": "running",
                 "unneeded": "not probed (goal reached)"}


def axis_title(metric: str) -> str:
    """An objective's axis title with its unit: ``prefill_tps (tok/s)``."""
    unit = AXIS_UNITS.get(metric)
    return f"{metric} ({unit})" if unit else metric


def _trial_dtick(study) -> int:
    """A whole-number tick step for a trial-number axis: every trial up to 12, then at most ~12 ticks."""
    n = len(study.get_trials(deepcopy=False))
    return max(1, math.ceil(n / 12))


def _n_complete(study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def importance_caveat(study) -> str | None:
    """The caveat for parameter importances from few completed trials, or None."""
    n = _n_complete(study)
    if n >= FEW_TRIALS:
        return None
    return (f"only {n} completed trial{'s' if n != 1 else ''} (fewer than {FEW_TRIALS}): "
            f"these importances are a rough guess")


def _memory_points(study):
    meta = _meta(study)
    pts = []
    for t in study.get_trials(deepcopy=False):
        b = t.user_attrs.get("predicted_bytes")
        if b is None:
            continue
        pts.append((t.number, b / MiB, _info(t).status))
    return pts, meta.get("budget_bytes"), meta.get("available_bytes")


def _memory_plotly(study):
    import plotly.graph_objects as go  # plotly, matplotlib: the optional [plots] extra

    pts, budget, avail = _memory_points(study)
    fig = go.Figure()
    for status in sorted({p[2] for p in pts}):
        sel = [p for p in pts if p[2] == status]
        fig.add_trace(go.Scatter(x=[p[0] for p in sel], y=[p[1] for p in sel], mode="markers",
                                 name=STATUS_LEGEND.get(status, status), legendgroup=status,
                                 marker={"color": STATUS_COLOURS.get(status, "#444444"), "size": 9,
                                         "line": {"width": 0.5, "color": "#333333"}}))
    if budget:
        fig.add_hline(y=budget / MiB, line_dash="solid", annotation_text="budget")
    if avail:
        fig.add_hline(y=avail / MiB, line_dash="dash", annotation_text="budget - margin")
    fig.update_layout(title="Predicted memory per trial", xaxis_title="trial (number)",
                      yaxis_title="predicted total (MiB)")
    fig.update_xaxes(tick0=0, dtick=_trial_dtick(study), tickformat="d")
    return fig


def _memory_matplotlib(study):
    import matplotlib.pyplot as plt  # the optional [plots] extra

    pts, budget, avail = _memory_points(study)
    fig, ax = plt.subplots(figsize=(8, 5))
    for status in sorted({p[2] for p in pts}):
        sel = [p for p in pts if p[2] == status]
        ax.scatter([p[0] for p in sel], [p[1] for p in sel], label=STATUS_LEGEND.get(status, status),
                   color=STATUS_COLOURS.get(status, "#444444"), edgecolors="#333333", linewidths=0.5)
    if budget:
        ax.axhline(budget / MiB, color="black", label="budget")
    if avail:
        ax.axhline(avail / MiB, color="black", linestyle="--", label="budget - margin")
    ax.set_xlabel("trial (number)")
    ax.set_ylabel("predicted total (MiB)")
    ax.set_title("Predicted memory per trial")
    _integer_xticks(ax)
    ax.legend(loc="best", fontsize=8)
    return ax


def _integer_xticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator  # the optional [plots] extra

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _history_plotly(study, metric: str, **kw):
    import optuna.visualization as vis  # needs plotly (the optional [plots] extra)

    fig = vis.plot_optimization_history(study, target_name=metric, **kw)
    fig.update_layout(xaxis_title="trial (number)", yaxis_title=axis_title(metric))
    fig.update_xaxes(tick0=0, dtick=_trial_dtick(study), tickformat="d")
    return fig


def _history_matplotlib(study, metric: str, **kw):
    import optuna.visualization.matplotlib as vmat  # needs matplotlib (the optional [plots] extra)

    ax = vmat.plot_optimization_history(study, target_name=metric, **kw)
    ax.set_xlabel("trial (number)")
    ax.set_ylabel(axis_title(metric))
    _integer_xticks(ax)
    return ax


IMPORTANCE_AXIS = "importance for {m} (optuna's default evaluator, normalised: the bars sum to 1)"


def _importances_plotly(study, metric: str, **kw):
    import optuna.visualization as vis  # needs plotly (the optional [plots] extra)

    fig = vis.plot_param_importances(study, target_name=metric, **kw)
    fig.update_layout(xaxis_title=IMPORTANCE_AXIS.format(m=metric), yaxis_title="searched parameter")
    caveat = importance_caveat(study)
    if caveat:
        fig.add_annotation(text=f"caveat: {caveat}", xref="paper", yref="paper", x=0.5, y=1.0, yanchor="bottom",
                           showarrow=False, font={"color": "#b00020"})
    return fig


def _importances_matplotlib(study, metric: str, **kw):
    import optuna.visualization.matplotlib as vmat  # needs matplotlib (the optional [plots] extra)

    ax = vmat.plot_param_importances(study, target_name=metric, **kw)
    ax.set_xlabel(IMPORTANCE_AXIS.format(m=metric))
    ax.set_ylabel("searched parameter")
    caveat = importance_caveat(study)
    if caveat:
        ax.text(0.5, 1.01, f"caveat: {caveat}", transform=ax.transAxes, ha="center", va="bottom", color="#b00020",
                fontsize=9)
        ax.set_title(ax.get_title(), pad=18)
    return ax


def _plots(study) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(file stem, plotly figure factory, matplotlib axes factory) for every plot this study supports."""
    import optuna.visualization as vis  # needs plotly (the optional [plots] extra)
    import optuna.visualization.matplotlib as vmat  # needs matplotlib (the optional [plots] extra)

    objectives = _objectives(study)
    out: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = []
    multi = len(objectives) > 1
    for i, m in enumerate(objectives):
        suffix = f"-{m}" if multi else ""
        kw: dict[str, Any] = {}
        if multi:
            kw["target"] = (lambda t, i=i: t.values[i])
        out.append((f"history{suffix}", functools.partial(_history_plotly, study, m, **kw),
                    functools.partial(_history_matplotlib, study, m, **kw)))
        out.append((f"importances{suffix}", functools.partial(_importances_plotly, study, m, **kw),
                    functools.partial(_importances_matplotlib, study, m, **kw)))
    if len(objectives) in (2, 3):
        names = [axis_title(m) for m in objectives]
        out.append(("pareto", lambda: vis.plot_pareto_front(study, target_names=names),
                    lambda: vmat.plot_pareto_front(study, target_names=names)))
    out.append(("memory", lambda: _memory_plotly(study), lambda: _memory_matplotlib(study)))
    return out


def write_plots(study, out: str | Path) -> tuple[list[str], list[str]]:
    """Write every plot as HTML (plotly) and PNG (matplotlib) into `out`. Returns (files, notes)."""

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    notes: list[str] = []
    have_plotly = importlib.util.find_spec("plotly") is not None
    have_mpl = importlib.util.find_spec("matplotlib") is not None
    if not have_plotly:
        notes.append("no HTML plots: pip install plotly")
    if not have_mpl:
        notes.append("no PNG plots: pip install matplotlib")
    if not (have_plotly or have_mpl):
        return files, notes
    if have_mpl:
        import matplotlib  # the optional [plots] extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # the optional [plots] extra
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stem, fig_plotly, ax_mpl in _plots(study):
            if stem.startswith(("history", "importances", "pareto")) and not done:
                notes.append(f"{stem}: no completed trial to plot")
                continue
            if stem.startswith("importances") and importance_caveat(study):
                notes.append(f"{stem}: {importance_caveat(study)}")
            if have_plotly:
                try:
                    fig = fig_plotly()
                    path = out / f"{stem}.html"
                    fig.write_html(str(path), include_plotlyjs="directory")
                    files.append(str(path))
                except Exception as e:  # noqa: BLE001 - a plot optuna cannot draw for this study (e.g. too few trials)
                    notes.append(f"{stem}.html: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            if have_mpl:
                try:
                    ax = ax_mpl()
                    figm = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
                    figm.set_size_inches(9, 5.5)
                    figm.tight_layout()
                    path = out / f"{stem}.png"
                    figm.savefig(path, dpi=100)
                    files.append(str(path))
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{stem}.png: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                finally:
                    plt.close("all")
    return files, notes


def write_trials_csv(study, path: str | Path) -> str:
    objectives = _objectives(study)
    keys = ["number", "state", "status", "probed", *objectives, "predicted_bytes", "available_bytes", "model_miss",
            "duplicate_of", "flags", "model", "reason", "predicted_prefill_tps", "predicted_decode_tps",
            "predicted_hardware"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for t in study.get_trials(deepcopy=False):
            ua = t.user_attrs
            row = [t.number, t.state.name, ua.get("status"), ua.get("probed")]
            row += [ua.get(m) for m in objectives]
            row += [ua.get(k) for k in keys[4 + len(objectives):]]
            w.writerow(row)
    return str(path)


def _sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite storage URL or plain path (as open_storage reads it); None for other URLs."""
    if "://" not in url:
        return Path(url).expanduser().resolve()
    if url.startswith("sqlite:///"):
        db = url[len("sqlite:///"):].split("?", 1)[0]
        return None if db in ("", ":memory:") else Path(db)
    return None


def _check_inputs(study: Any, storage: str | None, out: str | Path | None) -> None:
    """Refuse, before anything is opened or written, a SQLite storage that does not exist (reading it would create
    an empty database, and its directory) and an --out that is not a directory that can be made."""
    if out is not None:
        o = Path(out)
        if o.exists() and not o.is_dir():
            raise StudyError(f"--out {out}: exists and is not a directory")
        parent = next((p for p in o.absolute().parents if p.exists()), None) if not o.exists() else o
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise StudyError(f"--out {out}: cannot create a directory there ({parent} is not a writable directory)")
    if isinstance(study, optuna.Study) or (storage is not None and not isinstance(storage, str)):
        return
    url = storage or default_storage_url()
    db = _sqlite_file(url)
    if db is None or db.is_file():
        return
    if db.exists():
        raise StudyError(f"--storage {_redact(url)}: {db} is not a SQLite database file")
    if storage is None:
        raise StudyError(f"no study {study!r}: there are no studies yet ({db} does not exist; ggfit optimise creates it)")
    if not db.parent.is_dir():
        raise StudyError(f"--storage {_redact(url)}: {db.parent} is not a directory" if db.parent.exists()
                         else f"--storage {_redact(url)}: directory {db.parent} does not exist")
    raise StudyError(f"no study {study!r}: --storage {_redact(url)} does not exist")


def report(study: Any, *, storage: str | None = None, out: str | Path | None = None, plots: bool = True,
           echo: Callable[[str], None] | None = print) -> StudyReport:
    """Print the trial table and a summary; with `out`, write trials.csv, summary.json and the plots there."""
    _check_inputs(study, storage, out)
    s = load(study, storage)
    where = "(study object)" if s is study else _redact(storage or default_storage_url())
    rep = StudyReport(study_name=s.study_name, storage=where, table=trial_table(s), summary=_summary(s))
    if out is not None:
        outd = Path(out)
        try:
            outd.mkdir(parents=True, exist_ok=True)
            rep.files.append(write_trials_csv(s, outd / "trials.csv"))
            (outd / "summary.json").write_text(json.dumps({"study": s.study_name, "summary": rep.summary,
                                                            "ggfit": _meta(s), "final": s.user_attrs.get("final")},
                                                           indent=2, default=str))
            rep.files.append(str(outd / "summary.json"))
            if plots:
                files, notes = write_plots(s, outd)
                rep.files += files
                rep.notes += notes
        except OSError as e:
            raise StudyError(f"--out {out}: cannot write there: {e.strerror or e}") from None
    if echo:
        echo(rep.text())
    return rep
