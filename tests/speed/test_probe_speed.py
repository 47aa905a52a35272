"""A probe's predicted rates beside its measured ones (issue 46): search.probe_speed for the probe's config on this
machine, the study's trial attributes and `ggfit report`'s predicted columns. Behaviour only (no rate is pinned:
the coefficients are refitted)."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from fitter.bundled import resolve_model
from fitter.llama.cparams import RunConfig
from fitter.speed import hardware as hw
from search.probe_result import ProbeResult
from search.probe_speed import predicted_rates
from search.workload import Workload
from tests.speed import fake_specs


@pytest.fixture(autouse=True)
def _machine(monkeypatch, tmp_path):
    fake_specs.use(monkeypatch)
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hw, "_tool", lambda argv: None)
    monkeypatch.setattr(hw, "_detect_nvidia", lambda known: None)  # this machine: the CPU
    monkeypatch.setattr(hw, "measure_host_bandwidth", lambda **kw: (41.5, "measured here (test)"))


def test_a_probes_config_is_predicted_on_this_machine():
    path = resolve_model("gemma3-270m")
    p = predicted_rates(path, RunConfig(n_ctx=1024), 128, threads=2)
    assert p is not None and p["hardware"] == "cpu" and p["backend"] == "cpu"
    assert p["prefill_tps"] > 0 and p["decode_tps"] > 0 and p["prompt_tokens"] == 128 and p["depth"] == 128
    deeper = predicted_rates(path, RunConfig(n_ctx=8192), 4096, threads=2)
    assert deeper is not None and deeper["decode_tps"] <= p["decode_tps"]  # decode after a longer prompt


def test_a_gpu_machine_running_a_cpu_build_is_predicted_as_the_cpu(monkeypatch):
    h200 = hw.get_profile("nvidia-h200")
    monkeypatch.setattr(hw, "_detect_nvidia", lambda known: h200)
    path = resolve_model("gemma3-270m")
    gpu = predicted_rates(path, RunConfig(n_ctx=1024), 128, threads=2, system_info="CUDA : ARCHS = 900 |")
    cpu = predicted_rates(path, RunConfig(n_ctx=1024), 128, threads=2, system_info="CPU : AVX2 = 1 |")
    assert gpu is not None and gpu["backend"] == "cuda" and gpu["hardware"] == "nvidia-h200"
    assert cpu is not None and cpu["backend"] == "cpu"


def test_a_model_ggfit_cannot_read_is_no_prediction(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    assert predicted_rates(bad, RunConfig(n_ctx=1024), 128, threads=2) is None


def test_the_probe_summary_says_the_predicted_rates():
    res = ProbeResult(status="ok", runner="python", model_path="m.gguf", config=RunConfig(),
                      workload=Workload(), prompt_tokens=128, generated_tokens=16, prefill_tps=600.0, decode_tps=40.0,
                      predicted={"prefill_tps": 500.0, "decode_tps": 45.0, "hardware": "cpu"})
    assert "predicted prefill 500.0 tok/s, decode 45.0 tok/s (cpu)" in res.summary()


def test_report_shows_predicted_beside_measured():
    from search.report import trial_table

    study = optuna.create_study(direction="maximize")
    dist = {"n_ubatch": IntDistribution(64, 4096)}
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=600.0, params={"n_ubatch": 512}, distributions=dist,
                                 user_attrs={"status": "ok", "probed": True, "prefill_tps": 600.0, "decode_tps": 40.0,
                                             "predicted_prefill_tps": 500.0, "predicted_decode_tps": 45.0,
                                             "flags": "-ub 512"}))
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=700.0, params={"n_ubatch": 1024},
                                 distributions=dist, user_attrs={"status": "ok", "probed": True, "prefill_tps": 700.0,
                                                                 "flags": "-ub 1024"}))
    head, first, second = trial_table(study).splitlines()
    assert "prefill_tps predicted" in head and "decode_tps predicted" in head
    assert "500.0 tok/s" in first and "45.0 tok/s" in first
    old = optuna.create_study(direction="maximize")  # a study of probes without predictions: no such columns
    old.add_trial(create_trial(state=TrialState.COMPLETE, value=700.0, params={"n_ubatch": 1024}, distributions=dist,
                               user_attrs={"status": "ok", "probed": True, "prefill_tps": 700.0, "flags": "-ub 1024"}))
    assert "predicted" in trial_table(old).splitlines()[0]  # the memory column
    assert "tps predicted" not in trial_table(old).splitlines()[0]
