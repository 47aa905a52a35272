"""This CPU's matrix rates (fitter.speed.cpu_rate): a recorded measurement replayed (benchmarks/results/
cpu-rate-here.json, llama-cpp-python 0.3.36 on this machine), the cache, a failed measurement, and how the speed model
uses the rates (a decoded token's bytes and compute overlap; a ubatch's compute at the measured rate). No timing here:
the child never runs (tests/conftest.py refuses it unless a test replaces it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.ggml.backends.base import Backend
from fitter.gguf.reader import read_header
from fitter.llama.cparams import RunConfig
from fitter.llama.model import load_model_spec
from fitter.speed import cpu_rate
from fitter.speed.hardware import get_profile
from fitter.speed.machine import with_cpu_rate
from fitter.speed.model import decode_terms, parts_of, prefill_terms, seconds
from fitter.speed.work import work_of

RECORD = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/cpu-rate-here.json").read_text())


@pytest.fixture
def child(monkeypatch, tmp_path) -> list[int]:
    """The child replaced by the recorded seconds; each call's -t, in order."""
    calls: list[int] = []

    def run(models, threads):
        calls.append(threads)
        return RECORD["seconds"]
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_rate, "_child", run)
    return calls


def test_the_recorded_seconds_give_the_recorded_rates():
    pre, dec = cpu_rate.rates_of(RECORD["seconds"], RECORD["threads"])
    assert pre == RECORD["prefill_gflops"] and dec == RECORD["decode_gflops"]
    assert set(pre) == set(cpu_rate.CLASSES) and all(v > 0 for v in pre.values())
    assert "use_extra_bufts" in RECORD["method"] or "extra CPU buffer types off" in RECORD["method"]


def test_measured_once_per_thread_count_then_cached(child):
    a = cpu_rate.measure_cpu_rate(2)
    b = cpu_rate.measure_cpu_rate(2)
    assert child == [2] and a.prefill_gflops == b.prefill_gflops == RECORD["prefill_gflops"]
    assert "cached in" in b.source and "measured here" in b.source
    cpu_rate.measure_cpu_rate(4)  # another -t: measured again
    cpu_rate.measure_cpu_rate(2, refresh=True)
    assert child == [2, 4, 2]


def test_a_broken_cache_is_measured_again(child, tmp_path):
    cpu_rate.measure_cpu_rate(2)
    (tmp_path / "cache" / cpu_rate.RATE_CACHE).write_text("{not json")
    cpu_rate.measure_cpu_rate(2)
    assert child == [2, 2]


def test_a_failed_measurement_leaves_the_fitted_rate(monkeypatch, tmp_path):
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path))
    p = get_profile("cpu")
    q = with_cpu_rate(p, 2, True)  # conftest's child fails
    assert not q.cpu_prefill_gflops and q.cpu_rate_source.startswith("not measured: ")
    assert with_cpu_rate(p, 2, False) is p  # not needed (a GPU runs the model): not even tried


def test_with_cpu_rate_carries_the_measurement(child):
    q = with_cpu_rate(get_profile("cpu"), 2, True)
    assert q.cpu_prefill_gflops == RECORD["prefill_gflops"] and q.cpu_decode_gflops == RECORD["decode_gflops"]
    assert q.cpu_rate_source.endswith("(-t 2)") and child == [2]


def test_the_written_models_have_the_class_types(tmp_path):
    for cls, want in (("k", {"Q4_K", "Q6_K"}), ("q8", {"Q8_0"}), ("float", {"F16"})):
        h = read_header(str(cpu_rate.write_model(tmp_path / f"{cls}.gguf", cls, 2, (256, 512, 4, 2))))
        types = {t.ggml_type.name for t in h.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
        assert types == want, cls


@pytest.fixture(scope="module")
def cpu_work(gemma):
    header, spec = load_model_spec(gemma)
    return work_of(header, spec, RunConfig(n_gpu_layers=0), Backend.CPU)


def _cpu(**rates):
    return get_profile("cpu").model_copy(update={"host_bandwidth_gbs": 20.0, **rates})


def test_a_decoded_token_waits_for_the_longer_of_bytes_and_compute(cpu_work):
    slow = _cpu(cpu_decode_gflops={"k": 1.0, "q8": 1.0, "q4": 1.0, "float": 1.0})
    t = decode_terms(cpu_work, slow, Backend.CPU, 0, 2)
    assert "cpu" not in t and t["cpum.k"] > 0 and t["bw.k"] > 0
    coef = {"bw.k": 1.0}
    parts = parts_of(t, coef)
    assert parts["bw.k"] == 0.0 and parts["cpum.k"] == t["cpum.k"]  # compute-bound: the bytes overlap it
    assert seconds({"bw.k": t["bw.k"], "cpum.k": t["cpum.k"]}, coef) == pytest.approx(max(t["bw.k"], t["cpum.k"]))
    fast = decode_terms(cpu_work, _cpu(cpu_decode_gflops={"k": 1e6}), Backend.CPU, 0, 2)
    assert parts_of(fast, coef)["cpum.k"] == 0.0  # bandwidth-bound; an unmeasured class takes the median ("k")
    assert "cpu" in decode_terms(cpu_work, _cpu(), Backend.CPU, 0, 2)  # not measured: the fitted per-thread rate


def test_a_ubatch_computes_at_the_measured_rate(cpu_work):
    rates = {"k": 100.0, "q8": 50.0, "q4": 50.0, "float": 25.0}
    t = prefill_terms(cpu_work, _cpu(cpu_prefill_gflops=rates), Backend.CPU, 512, 512, 0, 2, op_offload=True)
    assert "cpu" not in t and t["cpum.k"] > 0
    t4 = prefill_terms(cpu_work, _cpu(cpu_prefill_gflops=rates), Backend.CPU, 512, 512, 0, 4, op_offload=True)
    assert t4["cpum.k"] == pytest.approx(t["cpum.k"] / 2)  # per thread: -t 4 twice -t 2's
    assert seconds({"cpum.k": 1.0}, {}) == 1.0  # a measured term's coefficient is 1, never fitted
