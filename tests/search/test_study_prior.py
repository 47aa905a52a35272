"""The speed model as `optimise`'s prior (issue 46): the predicted-fastest configs are enqueued first, a config
predicted below the --speed-cut share of the best predicted is pruned unprobed with its reason, and every trial
records the predicted rates beside the measured ones. The probe is a fake that answers at once (no llama.cpp run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

from fitter.speed.hardware import get_profile  # noqa: E402
from search.probe import ProbeResult  # noqa: E402
from search.study import count_trials, load_study, run_study  # noqa: E402

MiB = 2**20
CPU = get_profile("cpu").model_copy(update={"host_bandwidth_gbs": 20.0})

STUDY = """
name = "prior"
objectives = ["{objective}"]
trials = {trials}
speed_cut = {cut}

[workload]
prompt_tokens = 128
gen_tokens = 8
repeats = 1
warmup = 0

[space]
n_ctx = [2048]
n_ubatch = [16, 64, 512]
n_batch_factor = [1]
threads = [1, 2]
type_k = ["f16"]
flash_attn = ["on"]

[sampler]
kind = "random"
n_startup_trials = 2
"""


def _fake_probe():
    calls: list = []

    def probe(model_path, config, workload, **kw):
        calls.append((config.n_ubatch, kw.get("threads")))
        return ProbeResult(status="ok", runner="python", model_path=str(model_path), config=config, workload=workload,
                           prefill_tps=100.0 + config.n_ubatch, decode_tps=10.0, ttft_s=0.1)

    probe.calls = calls  # type: ignore[attr-defined]
    return probe


def _run(tmp_path: Path, gemma: str, *, objective: str = "prefill_tps", trials: int = 6, cut: float = 0.0,
         speed_cut: float | None = None):
    f = tmp_path / "prior.toml"
    f.write_text(STUDY.format(objective=objective, trials=trials, cut=cut))
    probe = _fake_probe()
    storage = optuna.storages.InMemoryStorage()
    res = run_study(gemma, load_study(f), budget=4096 * MiB, margin=256 * MiB, storage=storage, probe=probe,
                    progress=None, compare_defaults=False, enqueue_defaults=False, seed=3, hardware=CPU,
                    speed_cut=speed_cut)
    trials_ = sorted(optuna.load_study(study_name=res.study_name, storage=storage).get_trials(deepcopy=False),
                     key=lambda t: t.number)
    return trials_, probe


@pytest.mark.parametrize("objective", ["prefill_tps", "decode_tps"])
def test_the_first_trials_are_the_predicted_fastest_in_order(tmp_path, gemma, objective):
    trials, _ = _run(tmp_path, gemma, objective=objective)
    pred = [t.user_attrs[f"predicted_{objective}"] for t in trials]
    assert all(p is not None and p > 0 for p in pred)
    first = pred[:3]  # the enqueued ones (one per distinct predicted rate)
    assert first == sorted(first, reverse=True)
    assert first[0] == max(pred)  # nothing the study tried later was predicted faster than its first trial


def test_a_config_below_the_cut_is_pruned_with_its_reason_and_never_probed(tmp_path, gemma):
    trials, probe = _run(tmp_path, gemma, cut=0.6, trials=6)
    slow = [t for t in trials if t.user_attrs.get("status") == "slow"]
    assert slow, "the space's -ub 16 configs are predicted far below -ub 512 at a 128-token prompt"
    best = max(t.user_attrs["predicted_prefill_tps"] for t in trials)
    for t in slow:
        assert t.state == TrialState.PRUNED
        assert not t.user_attrs["probed"]
        m = re.fullmatch(r"predicted at (\d+)% of the best predicted; below the --speed-cut 0.6", t.user_attrs["reason"])
        assert m, t.user_attrs["reason"]
        assert abs(int(m.group(1)) - 100 * t.user_attrs["predicted_prefill_tps"] / best) <= 1
        cfg = t.user_attrs["config"]
        assert (cfg["n_ubatch"], t.user_attrs["threads"]) not in probe.calls
    for t in trials:
        if t.user_attrs.get("probed"):
            assert t.user_attrs["predicted_prefill_tps"] >= 0.6 * best
    assert count_trials(trials).slow == len(slow)


def test_no_cut_probes_every_proposal_and_records_both_rates(tmp_path, gemma):
    trials, probe = _run(tmp_path, gemma, cut=0.6, speed_cut=0.0)
    assert not [t for t in trials if t.user_attrs.get("status") == "slow"]
    probed = [t for t in trials if t.user_attrs.get("probed")]
    assert len(probe.calls) == len(probed) > 0
    for t in probed:
        ua = t.user_attrs
        assert ua["prefill_tps"] == 100.0 + ua["config"]["n_ubatch"]  # measured (the fake's) beside predicted
        assert ua["predicted_prefill_tps"] > 0 and ua["predicted_decode_tps"] > 0


def test_speed_cut_out_of_range_is_one_line(tmp_path, gemma):
    from search.space import StudyError

    with pytest.raises(StudyError, match="--speed-cut 1.5"):
        _run(tmp_path, gemma, speed_cut=1.5)


def test_no_trial_is_left_queued_when_the_prior_uses_up_the_probes(tmp_path, gemma):
    """With 2 probes to spend, the prior queues its 2 fastest picks and not llama.cpp's defaults, which would stay
    queued ("running or queued") after the goal is reached."""
    f = tmp_path / "prior.toml"
    f.write_text(STUDY.format(objective="prefill_tps", trials=2, cut=0.0))
    storage = optuna.storages.InMemoryStorage()
    res = run_study(gemma, load_study(f), budget=4096 * MiB, margin=256 * MiB, storage=storage, probe=_fake_probe(),
                    progress=None, compare_defaults=False, seed=3, hardware=CPU)
    c = count_trials(optuna.load_study(study_name=res.study_name, storage=storage).get_trials(deepcopy=False))
    assert (c.probes, c.running) == (2, 0)
