"""`ggfit hardware`: the profile table (and --sources, --json), one profile, this machine (auto, --detect), and a
mistyped name as one line with exit code 2. The profiles are tests/speed/fake_specs.py's four."""

from __future__ import annotations

import json

import pytest

import cli
from fitter.speed import hardware as hw
from tests.speed import fake_specs


@pytest.fixture(autouse=True)
def _fake(monkeypatch, tmp_path):
    fake_specs.use(monkeypatch)
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hw, "_copy_rate", lambda *a: 41.5)  # the host bandwidth, without measuring it
    monkeypatch.setattr(hw, "_tool", lambda argv: None)  # this machine: no sysctl, no nvidia-smi: the CPU
    monkeypatch.setattr(hw, "_detect_nvidia", lambda known: None)


def run(capfd, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(["hardware", *args])
    out, err = capfd.readouterr()
    return e.value.code, out, err


def test_the_table_lists_every_profile(capfd):
    code, out, err = run(capfd)
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0].split() == ["name", "backend", "bandwidth", "GB/s", "FP16", "TFLOPS", "GPU", "cores", "memory", "GiB"]
    assert lines[1].split() == ["apple-m4-pro-20", "metal", "273", "9.2", "20", "24,", "48,", "64"]
    assert lines[2].split() == ["nvidia-rtx-4090", "cuda", "1,008", "165.2", "128", "24"]
    assert lines[3].split() == ["nvidia-h200", "cuda", "4,800", "989.5", "-", "141"]
    assert lines[4].split() == ["cpu", "cpu", "-", "-", "-", "-"]
    assert "https://" not in out


def test_sources(capfd):
    code, out, _ = run(capfd, "--sources")
    assert code == 0
    assert "    memory_bandwidth_gbs: https://example.org/m4-pro" in out.splitlines()
    assert "    memory_bandwidth_gbs: https://example.org/4090" in out.splitlines()


def test_json(capfd):
    code, out, _ = run(capfd, "--json")
    assert code == 0
    ps = json.loads(out)["profiles"]
    assert [p["name"] for p in ps] == ["apple-m4-pro-20", "nvidia-rtx-4090", "nvidia-h200", "cpu"]
    assert ps[2]["backend"] == "cuda" and ps[2]["memory_gib"] == [141.0] and ps[2]["nvml_names"][0] == "NVIDIA H200"


def test_one_profile_with_its_sources(capfd):
    code, out, _ = run(capfd, "apple-m4-pro-20")
    assert code == 0
    rows = [ln.split("  ", 1)[0:1] + [ln.split("  ", 1)[1].strip()] for ln in out.splitlines()]
    assert ["backend", "metal, unified memory"] in rows
    assert ["memory bandwidth GB/s", "273  (https://example.org/m4-pro)"] in rows
    assert ["GPU cores", "20  (https://example.org/m4-pro)"] in rows


@pytest.mark.parametrize("args", [("auto",), ("--detect",)])
def test_this_machine(capfd, args):
    code, out, _ = run(capfd, *args)
    assert code == 0
    assert out.startswith("profile         cpu\n")
    assert "detected by     no Apple M chip (sysctl) and no NVIDIA GPU" in out
    assert "host bandwidth  41.50 GB/s (measured here 20" in out
    assert "threads         " in out


def test_this_machine_json(capfd):
    code, out, _ = run(capfd, "auto", "--json")
    d = json.loads(out)
    assert code == 0 and d["name"] == "cpu" and d["host_bandwidth_gbs"] == 41.5 and d["threads"] >= 1


def test_a_mistyped_profile_is_one_line_exit_2(capfd):
    code, out, err = run(capfd, "nvidia-h20")
    assert code == 2 and not out
    assert err == ("ggfit: error: ggfit hardware nvidia-h20: no such hardware profile; did you mean "
                   "nvidia-h200, nvidia-rtx-4090? `ggfit hardware` lists them; auto is this machine\n")


def test_shared_options_resolve(monkeypatch):
    """cli_options' --hardware/--host-bandwidth/-t helpers: a bad rate or thread count is a GGFitError (one line)."""
    from cli_options import BackendName, backend_of_hardware, hardware_of, threads_of
    from fitter.errors import GGFitError
    from fitter.ggml.backends.base import Backend

    p = hardware_of("nvidia-h200", "90GB/s")
    assert (p.name, p.host_bandwidth_gbs) == ("nvidia-h200", 90.0)
    with pytest.raises(GGFitError, match="^--host-bandwidth 90 fast: use a rate"):
        hardware_of("nvidia-h200", "90 fast")
    with pytest.raises(GGFitError, match="^--hardware h100: no such hardware profile"):
        hardware_of("h100")
    assert backend_of_hardware(None, p) == Backend.CUDA
    assert backend_of_hardware(BackendName.cpu, p) == Backend.CPU
    assert threads_of(8) == 8 and threads_of(None) >= 1
    with pytest.raises(GGFitError, match="^-t 0: use 1 or more threads"):
        threads_of(0)
