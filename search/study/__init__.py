"""`ggfit optimise`: an Optuna study over the settings that the memory model says fit, each proven by a real probe.

    run_study(model, "prefill", budget="8GiB") -> StudyResult   (best config as a llama-server command and JSON,
                                                                   measured against llama.cpp's defaults)

The study is plain Optuna: an RDB storage, a TPE sampler, an objective. What ggfit adds is inside the objective:

0. Before anything is written: a budget the weights alone exceed (every model file, at the fewest layers on the
   device the space allows) ends the run at once (`NothingFits`, exit 1).
1. The trial's parameters (search/space.py) become a `RunConfig`; `fitter.fit.memory.predict` sizes it. A config llama.cpp
   would refuse (a K cache type whose block does not divide the head size ...; the space itself never offers a
   quantized V cache without flash attention) is labelled ``invalid``; one predicted over the
   budget minus the margin is labelled ``skipped``. Neither is probed.
2. A config that fits is probed (`search.probe.run_probe`, in its own process, under the budget where the OS can
   enforce it). ``ok`` gives the objective value(s). ``oom`` means the memory model was wrong: it is counted and
   listed as a model miss. ``crash``/``timeout``/``error`` keep llama.cpp's reason.
3. A config already measured in this study (the same llama.cpp run, e.g. two n_batch factors clamped to one n_batch)
   reuses that measurement instead of probing again (``duplicate_of``); one that another worker is probing at
   that moment is waited for.

The speed model as prior (prior.py; `run_study(hardware=...)`, `optimise` uses this machine's profile): before the
sampler proposes anything, the three predicted-fastest configs of the space (by the study's objective: prefill at
the workload's prompt, decode after it, a request's rate for both) are enqueued, then llama.cpp's defaults; a config
predicted below ``speed_cut`` (study file, --speed-cut; default 0.5, 0 disables) times the best predicted is PRUNED
unprobed with status ``slow`` and a violated ``predicted_slow`` constraint. Every trial keeps
``predicted_prefill_tps`` and ``predicted_decode_tps`` beside the measured rates.

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
failed and retried at once. Ctrl-C (or SIGTERM, through `search.signals`) fails the running trial (status
``interrupted``, ``terminated``) and queues a copy, which the next run (of any worker) runs first. Completed trials are never lost; at most the running one is run again.

Counting (`count_trials`, for `optimise` and `report` alike): every trial is in one part (probed ok / oom / failed /
skipped / invalid / duplicate / stale or interrupted and run again / not probed because the goal was reached /
running or queued), so the parts add up to the total. ``--trials N`` is N probes that gave a result; a worker about
to probe counts the probes other live workers are running, so several workers stop at N too (short of proposals
made within the same instant). The comparison with llama.cpp's defaults is counted and reported separately.

The study name is ``<study>-<model>-<hash>``, the hash over the model files (names and sizes), the device, the
budget and margin, the runner and the study definition, so the same run on the same kind of machine resumes the
same study and any change starts a new one. ``optuna-dashboard <storage URL>`` shows it live.

The package: define.py (the study file, prompt lengths), storage.py (storage, names, workers, recovery), objective.py
(the objective class and the trial callback), prior.py (the speed prior), engine_speed.py (compare-engines'
predicted ratio), results.py (counts, result, best trial), compare.py (the comparison
with llama.cpp's defaults), run.py (`run_study`: setup, optimisation, summary).
"""

from search.space import StudyError
from search.study.compare import compare_verdict, compare_with_defaults, same_run
from search.study.define import (
                                 DIRECTIONS,
                                 UNITS,
                                 LengthDistribution,
                                 PickDef,
                                 PromptLengths,
                                 StudyDef,
                                 load_study,
                                 named_studies,
)
from search.study.objective import Objective, Predictor
from search.study.results import (
                                 COUNT_PARTS,
                                 Measurement,
                                 StudyResult,
                                 TrialCounts,
                                 TrialInfo,
                                 count_trials,
                                 model_misses,
                                 pick_best,
                                 trial_part,
)
from search.study.run import NothingFits, run_study
from search.study.storage import StudyInterrupted, default_storage_url, open_storage, study_name

__all__ = ["COUNT_PARTS", "DIRECTIONS", "UNITS", "LengthDistribution", "Measurement", "NothingFits", "Objective", "PickDef",
           "Predictor", "PromptLengths", "StudyDef", "StudyError", "StudyInterrupted", "StudyResult", "TrialCounts",
           "TrialInfo", "compare_verdict", "compare_with_defaults", "count_trials", "default_storage_url",
           "load_study", "model_misses", "named_studies", "open_storage", "pick_best", "run_study", "same_run",
           "study_name", "trial_part"]
