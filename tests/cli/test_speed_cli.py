"""The speed model on the command line (issue 46): `fit`'s and `quants`' rates, their options and errors, and
`calibrate --bench` storing a scale that `fit` then applies. Behaviour only: the coefficients (fitter.speed.factors)
are refitted as the truth set grows, so no test pins a rate. The profiles are tests/speed/fake_specs.py's; this
machine is detected as the CPU, and its host bandwidth is never measured here (a counted stand-in)."""

from __future__ import annotations

import json
import os

import pytest

import cli
from fitter.ggml.backends.base import Backend
from fitter.speed import hardware as hw
from tests.speed import fake_specs

M = "gemma3-270m"
B = ("--budget", "2GiB", "-c", "4096")
PROBE = os.path.join(os.path.dirname(__file__), "..", "data", "llama-bench", "probe-gemma3-270m-cpu.json")
KEYS = {"prefill_tps", "decode_tps", "prompt_tokens", "depth", "low", "high", "bound", "hardware"}


@pytest.fixture(autouse=True)
def _machine(monkeypatch, tmp_path):
    fake_specs.use(monkeypatch)
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GGFIT_DATA", str(tmp_path / "data"))  # the memory calibrations: none
    monkeypatch.setattr(hw, "_tool", lambda argv: None)
    monkeypatch.setattr(hw, "_detect_nvidia", lambda known: None)  # this machine: the CPU


@pytest.fixture
def measured(monkeypatch) -> list[int]:
    """Each host bandwidth measurement, counted (41.5 GB/s)."""
    calls: list[int] = []

    def measure(**kw):
        calls.append(1)
        return 41.5, "measured here (test)"
    monkeypatch.setattr(hw, "measure_host_bandwidth", measure)
    return calls


def run(capfd, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out, err = capfd.readouterr()
    return int(e.value.code or 0), out, err


def fit_json(capfd, *argv: str) -> dict:
    code, out, err = run(capfd, "fit", M, *B, "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_fit_json_has_the_rates_and_hardware_sets_the_backend(capfd, measured):
    d = fit_json(capfd, "--hardware", "nvidia-h200")
    assert d["backend"] == "cuda"  # --hardware sets the backend when --backend is not given
    s = d["speed"]
    assert KEYS <= set(s) and s["hardware"] == "nvidia-h200" and s["prompt_tokens"] == 512 and s["depth"] == 0
    for k in ("prefill_tps", "decode_tps"):
        assert 0 < s["low"][k] <= s[k] <= s["high"][k]
    assert set(s["bound"]) == {"prefill", "decode"}
    assert not measured  # every weight on the GPU of another machine: no host bandwidth needed


def test_fit_prints_one_speed_line_after_the_totals(capfd, measured):
    code, out, err = run(capfd, "fit", M, *B, "--hardware", "nvidia-h200", "--speed-prompt", "1024",
                         "--speed-depth", "4096")
    assert code == 0, err
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("total against the budget"))
    speed = [ln for ln in lines if ln.startswith("speed")]
    assert len(speed) == 1 and lines.index(speed[0]) > at
    assert speed[0].startswith("speed (nvidia-h200, llama-bench pp1024 / tg at depth 4096")
    assert "prefill " in speed[0] and "decode " in speed[0] and "tok/s" in speed[0] and "bound by" in speed[0]


def test_depth_slows_decode_and_no_speed_leaves_it_out(capfd, measured):
    d0 = fit_json(capfd, "--hardware", "nvidia-h200")["speed"]
    d1 = fit_json(capfd, "--hardware", "nvidia-h200", "--speed-depth", "32768")["speed"]
    assert d1["depth"] == 32768 and d1["decode_tps"] < d0["decode_tps"]  # more KV read per token
    d = fit_json(capfd, "--hardware", "nvidia-h200", "--no-speed")
    assert d["speed"] is None
    code, out, _ = run(capfd, "fit", M, *B, "--no-speed", "--backend", "cpu")
    assert code == 0 and "speed" not in out


def test_host_bandwidth_is_measured_only_where_weights_are_on_the_cpu(capfd, measured, monkeypatch):
    h200 = hw.get_profile("nvidia-h200")
    monkeypatch.setattr(hw, "_detect_nvidia", lambda known: h200)  # this machine: an H200
    fit_json(capfd)  # auto: every layer on the GPU
    assert not measured
    d = fit_json(capfd, "-ngl", "4")  # layers on the CPU: the host side counts
    assert len(measured) == 1 and d["speed"]["hardware"] == "nvidia-h200"
    d = fit_json(capfd, "-ngl", "4", "--host-bandwidth", "90GB/s")  # given: not measured
    assert len(measured) == 1


def test_the_cpu_backend_uses_this_machines_host_bandwidth(capfd, measured):
    d = fit_json(capfd)  # auto on this machine: the CPU
    assert d["backend"] == "cpu" and d["speed"]["hardware"] == "cpu" and len(measured) == 1


def test_an_unknown_nvidia_gpu_is_predicted_and_said_rough(capfd, measured, monkeypatch):
    unknown = hw.HardwareProfile(name=hw.UNKNOWN_NVIDIA, chip="NVIDIA Mystery", backend=Backend.CUDA)
    monkeypatch.setattr(hw, "_detect_nvidia", lambda known: unknown)
    d = fit_json(capfd)
    assert d["backend"] == "cuda" and d["speed"]["decode_tps"] > 0
    assert any("no published figures for this GPU: rough" in n for n in d["speed"]["notes"])
    code, out, _ = run(capfd, "fit", M, *B)
    assert "(no published figures for this GPU: rough)" in next(ln for ln in out.splitlines() if ln.startswith("speed"))


def test_a_gpu_backend_on_a_machine_without_it_says_why_there_are_no_rates(capfd, measured):
    d = fit_json(capfd, "--backend", "cuda")
    assert d["speed"] is None and "--hardware NAME" in d["speed_note"]


@pytest.mark.parametrize("argv,phrase", [
    (("--speed-prompt", "0"), "--speed-prompt 0: use 1 or more tokens"),
    (("--speed-depth", "-1"), "--speed-depth -1: use 0 or more tokens"),
    (("--hardware", "nope"), "--hardware nope: no such hardware profile"),
    (("--host-bandwidth", "fast"), "--host-bandwidth fast: use a rate with its unit"),
    (("-t", "0"), "-t 0: use 1 or more threads"),
])
@pytest.mark.parametrize("command", ["fit", "quants"])
def test_bad_speed_values_are_one_line(capfd, command, argv, phrase):
    code, out, err = run(capfd, command, M, *B, *argv)
    assert code == 2 and not out and err.count("\n") == 1 and err.startswith("ggfit: error: ") and phrase in err, err


def test_quants_has_rate_columns_for_the_quants_that_fit(capfd, measured):
    code, out, err = run(capfd, "quants", M, "--budget", "1500MiB", "-c", "4096", "--hardware", "nvidia-h200")
    assert code == 0, err
    head = next(ln for ln in out.splitlines() if ln.strip().startswith("quant"))
    assert head.split()[:8] == ["quant", "file", "MiB", "device", "MiB", "prefill", "t/s", "decode"]
    assert "rates: llama-bench pp512 / tg at depth 0 on nvidia-h200" in out
    code, out, err = run(capfd, "quants", M, "--budget", "1500MiB", "-c", "4096", "--hardware", "nvidia-h200",
                         "--json")
    d = json.loads(out)
    assert d["speed"]["hardware"] == "nvidia-h200"
    for c in d["candidates"]:
        assert {"prefill_tps", "decode_tps"} <= set(c)
        assert (c["decode_tps"] is not None and c["decode_tps"] > 0) == c["fits"]  # rates where it fits only
    assert any(not c["fits"] for c in d["candidates"]) and any(c["fits"] for c in d["candidates"])
    code, out, _ = run(capfd, "quants", M, "--budget", "1500MiB", "-c", "4096", "--no-speed")
    assert code == 0 and "prefill" not in out


def test_calibrate_bench_stores_a_scale_that_fit_applies(capfd, measured):
    before = fit_json(capfd, "--hardware", "cpu")["speed"]
    assert before["calibrated"] is None
    code, out, err = run(capfd, "calibrate", "--bench", PROBE, M, "--hardware", "cpu", "--json")
    assert code == 0, err
    d = json.loads(out)
    cal = d["calibration"]
    assert cal["hardware"] == "cpu" and cal["prefill_rows"] == 1 and cal["decode_rows"] == 1
    assert cal["llama_cpp"].startswith("0c1e570")  # the probe's build: the pinned one
    assert d["stored"] and os.path.isfile(d["stored"])
    for row in d["rows"]:  # one row of each kind: the scale makes each exact
        assert row["calibrated"] == pytest.approx(row["measured"], rel=1e-6)
        assert row["fitted"] / row["measured"] == pytest.approx(cal[row["kind"]], rel=1e-6)
    after = fit_json(capfd, "--hardware", "cpu")["speed"]
    assert after["calibrated"].startswith("calibrated from 2 llama-bench rows (")
    # the scale multiplies every coefficient (time): each rate divides by it
    assert after["decode_tps"] == pytest.approx(before["decode_tps"] / cal["decode"], rel=1e-6)
    assert after["prefill_tps"] == pytest.approx(before["prefill_tps"] / cal["prefill"], rel=1e-6)
    code, out, _ = run(capfd, "fit", M, *B, "--hardware", "cpu")
    assert "calibrated from 2 llama-bench rows" in next(ln for ln in out.splitlines() if ln.startswith("speed"))
    other = fit_json(capfd, "--hardware", "nvidia-h200")["speed"]  # another hardware: not this calibration
    assert other["calibrated"] is None
    code, out, _ = run(capfd, "calibrate", "--list")
    assert code == 0 and "speed on cpu, llama.cpp 0c1e57098bba: prefill x" in out


def test_calibrate_bench_prints_measured_against_predicted(capfd, measured):
    code, out, err = run(capfd, "calibrate", "--bench", PROBE, M, "--hardware", "cpu", "--no-store")
    assert code == 0, err
    assert "measured" in out and "before" in out and "after" in out and "pp128" in out and "tg16 @ d128" in out
    assert "stored" not in out and not os.path.exists(os.environ["GGFIT_CACHE"] + "/speed-calibration.json")


def test_calibrate_bench_skips_rows_of_another_model_and_refuses_none(capfd, measured, tmp_path):
    md = os.path.join(os.path.dirname(PROBE), "h200.md")  # H200 rows of other models
    code, out, err = run(capfd, "calibrate", "--bench", md, M, "--hardware", "nvidia-h200")
    assert code == 2 and err.count("\n") == 1 and "no row to calibrate from" in err and "not MODEL" in err
    bad = tmp_path / "empty.md"
    bad.write_text("")
    code, _, err = run(capfd, "calibrate", "--bench", str(bad), "--hardware", "cpu")
    assert code == 2 and err.count("\n") == 1 and "empty" in err
    code, _, err = run(capfd, "calibrate", "--bench", PROBE, "--log", PROBE)
    assert code == 2 and "use one at a time" in err


def test_ggfits_placement_gets_its_own_rates(capfd, measured):
    argv = ("fit", M, "--budget", "200MiB", "--margin", "0", "-c", "8192", "--hardware", "nvidia-h200",
            "--host-budget", "8GiB", "--host-bandwidth", "50GB/s")
    code, out, err = run(capfd, *argv)
    assert code == 0, err  # not as given: ggfit's placement fits (exit 0)
    lines = out.splitlines()
    placed = next(i for i, ln in enumerate(lines) if ln.startswith("placement for -c 8192"))
    rated = [i for i, ln in enumerate(lines) if ln.startswith("speed with this placement (nvidia-h200")]
    assert len(rated) == 1 and rated[0] > placed
    code, out, _ = run(capfd, *argv, "--json")
    d = json.loads(out)
    assert KEYS <= set(d["speed"]) and KEYS <= set(d["placement"]["speed"])
    # layers moved to the CPU: decode reads them at host bandwidth, slower than with every layer on the H200
    assert d["placement"]["speed"]["decode_tps"] < d["speed"]["decode_tps"]
    assert not measured  # --host-bandwidth given
