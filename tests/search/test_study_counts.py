"""Counting a study's trials, judging the best config against llama.cpp's defaults, and the report's plots.

No llama.cpp here: studies are built from recorded trials (optuna.trial.create_trial, in memory), and the
comparison works on recorded probe numbers (medians and spreads as search.probe.Spread gives them), so these tests
check the arithmetic and the wording, not any timing.
"""

from __future__ import annotations

import os
import re

import pytest

optuna = pytest.importorskip("optuna")
from optuna.distributions import CategoricalDistribution  # noqa: E402
from optuna.trial import TrialState, create_trial  # noqa: E402

from fitter.llama.cparams import RunConfig  # noqa: E402
from search.probe import Spread  # noqa: E402
from search.space import Candidate  # noqa: E402
from search.study import COUNT_PARTS, Measurement, compare_verdict, count_trials, load_study, same_run  # noqa: E402
from search.study.results import _summarise  # noqa: E402

MiB = 2**20
UB = CategoricalDistribution([64, 128, 256, 512])


def _trial(hint: int, state: TrialState, status: str | None, *, probed: bool = False, value: float | None = None,
           ub: int = 512, system: dict | None = None, **attrs):
    """A recorded trial as ggfit leaves it (`hint` varies the predicted size)."""
    ua = {"status": status, "probed": probed, "flags": f"-ub {ub}", "predicted_bytes": (200 + hint) * MiB, **attrs}
    if value is not None:
        ua["prefill_tps"] = value
    return create_trial(state=state, value=value if state == TrialState.COMPLETE else None,
                        params={"n_ubatch": ub}, distributions={"n_ubatch": UB}, user_attrs=ua,
                        system_attrs=system or {})


def _study():
    """A resumed study with one trial of every kind: 13 trials (what a real study leaves in its storage)."""
    s = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    s.set_user_attr("ggfit", {"objectives": ["prefill_tps"], "budget_bytes": 512 * MiB, "available_bytes": 352 * MiB,
                              "margin_bytes": 160 * MiB, "budget_source": "--budget 512MiB", "runner": "python",
                              "device": "cpu:test"})
    rows = [
        (TrialState.COMPLETE, "ok", True, 410.0, {}),
        (TrialState.COMPLETE, "ok", True, 395.0, {}),
        (TrialState.PRUNED, "oom", True, None, {"model_miss": True}),
        (TrialState.PRUNED, "crash", True, None, {}),
        (TrialState.PRUNED, "skipped", False, None, {}),
        (TrialState.PRUNED, "invalid", False, None, {}),
        (TrialState.COMPLETE, "ok", False, 410.0, {"duplicate_of": 0}),  # reused trial 0's probe
        (TrialState.FAIL, "stale", False, None, {}),  # a killed worker's trial, run again as trial 11
        (TrialState.FAIL, "interrupted", False, None, {}),  # Ctrl-C, run again as trial 12
        (TrialState.FAIL, "running", False, None, {}),  # an exception, not run again
        (TrialState.FAIL, "unneeded", False, None, {}),  # another worker's probe reached the goal
    ]
    for i, (state, status, probed, value, extra) in enumerate(rows):
        s.add_trial(_trial(i, state, status, probed=probed, value=value, **extra))
    s.add_trial(_trial(11, TrialState.COMPLETE, "ok", probed=True, value=400.0,
                       system={"failed_trial": 7, "retry_history": [7]}))
    s.add_trial(create_trial(state=TrialState.WAITING, params={"n_ubatch": 256}, distributions={"n_ubatch": UB},
                             system_attrs={"failed_trial": 8, "retry_history": [8]}))
    return s


def test_counts_parts_add_up_and_name_every_trial():
    s = _study()
    c = count_trials(s.get_trials(deepcopy=False))
    assert c.total == 13
    assert (c.ok, c.oom, c.failed, c.skipped, c.invalid, c.duplicate, c.retried, c.unneeded, c.running) == \
        (3, 1, 2, 1, 1, 1, 2, 1, 1)
    assert sum(getattr(c, k) for k in COUNT_PARTS) == c.total
    assert c.probes == 5  # ok + oom + crash probes that gave a result: the duplicate and the failed trials are not
    text = c.text()
    assert text.startswith("13 trials: ")
    assert sum(int(n) for n in re.findall(r"(\d+) [a-z]", text.split(": ", 1)[1])) == 13


def test_optimise_and_report_count_alike():
    """After a resume (stale, interrupted and queued trials) `optimise`'s result and `report`'s summary give the same
    total and parts; before, one counted finished trials only (19) and the other every trial (20)."""
    from search.report import _summary

    s = _study()
    res = _summarise(s, load_study("prefill"), "memory", 512 * MiB, 160 * MiB, 352 * MiB, [], [])
    assert res.n_trials == 13 and res.n_probed == 5 and res.model_misses == [2]
    summary = _summary(s)
    assert any(line.startswith(res.counts.text()) for line in summary), summary
    assert res.counts.text() in res.text()


# --- the best config against llama.cpp's defaults ----------------------------------------------------------------


def _meas(median: float, lo: float, hi: float, n: int = 3, metric: str = "prefill_tps", probes: int = 1) -> Measurement:
    return Measurement(flags="x", status="ok", probes=probes, metrics={metric: median},
                       spread={metric: Spread(median=median, min=lo, max=hi, n=n)})


def test_a_difference_inside_the_spread_is_a_tie():
    # 412 (403..421) vs 405 (394..416): 7 tok/s apart, the ranges overlap by far: a tie, whatever the ratio says
    ratio, outcome, verdict = compare_verdict(["prefill_tps"], _meas(412, 403, 421), _meas(405, 394, 416))
    assert outcome == {"prefill_tps": "tie"} and ratio["prefill_tps"] == pytest.approx(412 / 405)
    assert verdict.startswith("the best config ties llama.cpp's defaults")
    assert "412 ± 9 tok/s vs 405 ± 11 tok/s" in verdict and "within the spread" in verdict
    assert "beats" not in verdict and "NOT" not in verdict and "worse" not in verdict


def test_the_0_77x_case_from_noise_is_a_tie():
    # the reported case: the same config measured 0.77x of itself; its runs swung from 300 to 520 tok/s
    _, outcome, verdict = compare_verdict(["prefill_tps"], _meas(316, 300, 330), _meas(410, 300, 520))
    assert outcome == {"prefill_tps": "tie"} and "0.77x" in verdict and verdict.startswith("the best config ties")


def test_clear_differences_beat_or_lose():
    _, outcome, verdict = compare_verdict(["prefill_tps"], _meas(600, 590, 610), _meas(405, 394, 416))
    assert outcome == {"prefill_tps": "better"} and verdict.startswith("the best config beats llama.cpp's defaults")
    _, outcome, verdict = compare_verdict(["prefill_tps"], _meas(300, 295, 305), _meas(405, 394, 416))
    assert outcome == {"prefill_tps": "worse"} and "worse than llama.cpp's defaults" in verdict
    # time to first token: lower is better, and it reads in ms
    _, outcome, verdict = compare_verdict(["ttft_s"], _meas(0.100, 0.098, 0.102, metric="ttft_s"),
                                          _meas(0.200, 0.190, 0.210, metric="ttft_s"))
    assert outcome == {"ttft_s": "better"} and "100 ± 2 ms vs 200 ± 10 ms (2.00x)" in verdict


def test_mixed_objectives_name_each_outcome():
    mine = Measurement(flags="x", status="ok", probes=1, metrics={"prefill_tps": 600, "decode_tps": 51},
                       spread={"prefill_tps": Spread(median=600, min=590, max=610, n=3),
                               "decode_tps": Spread(median=51, min=49, max=53, n=3)})
    base = Measurement(flags="y", status="ok", probes=1, metrics={"prefill_tps": 400, "decode_tps": 50},
                       spread={"prefill_tps": Spread(median=400, min=390, max=410, n=3),
                               "decode_tps": Spread(median=50, min=48, max=52, n=3)})
    _, outcome, verdict = compare_verdict(["prefill_tps", "decode_tps"], mine, base)
    assert outcome == {"prefill_tps": "better", "decode_tps": "tie"}
    assert verdict.startswith("the best config beats llama.cpp's defaults on prefill_tps, ties them on decode_tps")


def test_single_runs_say_there_is_no_spread():
    _, outcome, verdict = compare_verdict(["prefill_tps"], _meas(412, 412, 412, n=1), _meas(405, 405, 405, n=1))
    assert outcome == {"prefill_tps": "better"} and "no spread" in verdict and "±" not in verdict


def test_same_run_fills_in_llama_server_defaults(gemma):
    from fitter.llama.model import load_model_spec

    spec = load_model_spec(gemma)[1]
    base = Candidate(model_path=gemma, config=RunConfig(n_ctx=2048))  # what `optimise` compares against
    # the seed trial (llama.cpp's defaults projected into a space without "auto"): the same llama.cpp run
    spelled = Candidate(model_path=gemma, config=RunConfig(n_ctx=2048, n_batch=2048, n_ubatch=512, flash_attn="on",
                                                           type_k="f16", type_v="f16"), threads=os.cpu_count())
    assert same_run(spelled, base, spec)
    assert not same_run(spelled.model_copy(update={"threads": (os.cpu_count() or 1) + 1}), base, spec)
    assert not same_run(Candidate(model_path=gemma, config=RunConfig(n_ctx=2048, flash_attn="off")), base, spec)
    assert not same_run(Candidate(model_path=gemma, config=RunConfig(n_ctx=2048, n_ubatch=256)), base, spec)
    assert not same_run(Candidate(model_path=gemma, config=RunConfig(n_ctx=4096)), base, spec)
    assert not same_run(Candidate(model_path=gemma, config=RunConfig(n_ctx=2048, n_parallel=1)), base, spec)


def test_best_config_that_is_the_defaults_is_not_compared_with_itself(gemma):
    """The seed trial (llama.cpp's defaults) won: say so, with its measured spread, and probe nothing more."""
    from fitter.ggml.backends.base import Backend
    from fitter.llama.cparams import Frontend
    from search.study import Predictor, compare_with_defaults
    from search.study.objective import Prober

    s = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    s.add_trial(_trial(0, TrialState.COMPLETE, "ok", probed=True, value=412.0,
                       spread={"prefill_tps": {"median": 412.0, "min": 403.0, "max": 421.0, "n": 3}}))
    best_t = s.trials[0]
    d = load_study("prefill")
    res = _summarise(s, d, "memory", 512 * MiB, 160 * MiB, 352 * MiB, [], [])
    best = Candidate(model_path=gemma, config=RunConfig(n_ctx=8192, n_batch=2048, n_ubatch=512, flash_attn="on"),
                     threads=os.cpu_count())

    def no_probe(*a, **k):
        raise AssertionError("the defaults' own run was probed again")

    prober = Prober(no_probe, d.workload, "python", None, 60.0, None)
    compare_with_defaults(res, s, best_t, best, d, gemma, Predictor(Backend.CPU, Frontend.SERVER), 352 * MiB, prober,
                          1, lambda c: None, lambda line: None, None)
    assert res.verdict.startswith("the best config is llama.cpp's defaults' own run (-c 8192")
    assert "prefill_tps 412 ± 9 tok/s (trial #0)" in res.verdict and "NOT" not in res.verdict
    assert res.compare_probes == 0 and res.ratio == {} and res.baseline.status == "same config"
    assert s.user_attrs["final"]["verdict"] == res.verdict


# --- plots: read the figures, not the pixels ----------------------------------------------------------------------


def _plot_study(n_ok: int):
    s = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    s.set_user_attr("ggfit", {"objectives": ["prefill_tps"], "budget_bytes": 512 * MiB, "available_bytes": 352 * MiB})
    ubs = [64, 128, 256, 512]
    for i in range(n_ok):
        s.add_trial(_trial(i, TrialState.COMPLETE, "ok", probed=True, value=300.0 + 10 * i + (i % 3), ub=ubs[i % 4]))
    s.add_trial(_trial(50, TrialState.PRUNED, "skipped", ub=512))
    s.add_trial(_trial(60, TrialState.PRUNED, "oom", probed=True, ub=512))
    s.add_trial(_trial(70, TrialState.PRUNED, "crash", probed=True, ub=256))
    s.add_trial(_trial(10, TrialState.FAIL, "stale", ub=64))
    s.add_trial(_trial(20, TrialState.FAIL, "interrupted", ub=128))
    return s


def test_memory_plot_units_integer_ticks_and_a_colour_per_status():
    pytest.importorskip("plotly")
    from search.report import STATUS_COLOURS, _memory_plotly

    fig = _memory_plotly(_plot_study(3))
    assert fig.layout.xaxis.tickformat == "d" and fig.layout.xaxis.dtick == 1
    assert "trial" in fig.layout.xaxis.title.text and "(MiB)" in fig.layout.yaxis.title.text
    colours = {tr.legendgroup: tr.marker.color for tr in fig.data}
    assert set(colours) == {"ok", "skipped", "oom", "crash", "stale", "interrupted"}
    assert len(set(colours.values())) == len(colours)  # no two statuses look alike
    assert all(colours[k] == STATUS_COLOURS[k] for k in colours)
    assert len(set(STATUS_COLOURS.values())) == len(STATUS_COLOURS)
    names = {tr.name for tr in fig.data}
    assert "skipped (predicted over budget)" in names and "stale (worker died; run again)" in names


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # matplotlib history plot
def test_history_plot_axes_say_trials_and_tok_s():
    pytest.importorskip("plotly")
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from search.report import _history_matplotlib, _history_plotly

    s = _plot_study(30)
    fig = _history_plotly(s, "prefill_tps")
    assert fig.layout.yaxis.title.text == "prefill_tps (tok/s)" and "trial" in fig.layout.xaxis.title.text
    assert fig.layout.xaxis.tickformat == "d" and isinstance(fig.layout.xaxis.dtick, int) and fig.layout.xaxis.dtick >= 1
    ax = _history_matplotlib(s, "prefill_tps")
    ax.figure.canvas.draw()
    assert ax.get_ylabel() == "prefill_tps (tok/s)" and "trial" in ax.get_xlabel()
    assert all(float(x).is_integer() for x in ax.get_xticks())
    plt.close("all")


@pytest.mark.parametrize("n_ok, caveat", [(4, True), (12, False)])
def test_importances_carry_a_caveat_below_ten_completed_trials(n_ok, caveat, tmp_path):
    pytest.importorskip("plotly")
    from search.report import FEW_TRIALS, _importances_plotly, write_plots

    s = _plot_study(n_ok)
    fig = _importances_plotly(s, "prefill_tps")
    texts = [a.text for a in fig.layout.annotations or ()]
    assert any("caveat" in t and f"fewer than {FEW_TRIALS}" in t for t in texts) == caveat
    assert "prefill_tps" in fig.layout.xaxis.title.text and "sum to 1" in fig.layout.xaxis.title.text
    _, notes = write_plots(s, tmp_path)
    assert any(n.startswith("importances: only") for n in notes) == caveat
