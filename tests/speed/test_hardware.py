"""fitter.speed.hardware: profiles from hardware_specs' format, the closest names for a typo, what this machine is
(every tool's answer faked: Apple's sysctl/ioreg/system_profiler, NVML, nvidia-smi; and none at all), llama.cpp's
default -t, the host bandwidth's cache and its STREAM byte count, and --host-bandwidth's units."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from fitter.errors import GGFitError
from fitter.ggml.backends.base import Backend
from fitter.speed import hardware as hw
from tests.speed import fake_specs


@pytest.fixture(autouse=True)
def _specs(monkeypatch, tmp_path):
    fake_specs.use(monkeypatch)
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))


def test_profiles_read_the_specs_format_and_absent_keys_take_defaults():
    ps = hw.profiles()
    assert list(ps) == ["apple-m4-pro-20", "nvidia-rtx-4090", "nvidia-h200", "cpu"]
    m4 = ps["apple-m4-pro-20"]
    assert (m4.backend, m4.unified, m4.memory_bandwidth_gbs, m4.gpu_cores, m4.memory_gib) == (
        Backend.METAL, True, 273.0, 20, (24.0, 48.0, 64.0))
    assert m4.int8_tops is None and m4.pcie_gbs is None and m4.nvml_names == ()
    assert m4.sources["gpu_cores"] == "https://example.org/m4-pro"
    h200 = ps["nvidia-h200"]
    assert h200.backend == Backend.CUDA and not h200.unified and h200.gpu_cores is None and h200.sources == {}
    assert h200.nvml_names == ("NVIDIA H200", "NVIDIA H200 NVL")
    assert ps["cpu"].backend == Backend.CPU and ps["cpu"].memory_bandwidth_gbs is None


def test_without_the_specs_module_only_cpu_is_known(monkeypatch):
    monkeypatch.setattr(hw, "_specs", lambda: ())
    assert list(hw.profiles()) == ["cpu"]


def test_get_profile_is_case_insensitive_and_a_typo_names_the_closest():
    assert hw.get_profile("NVIDIA-RTX-4090").name == "nvidia-rtx-4090"
    with pytest.raises(GGFitError) as e:
        hw.get_profile("nvidia-h20")
    msg = str(e.value)
    assert msg.startswith("--hardware nvidia-h20: no such hardware profile; did you mean nvidia-h200")
    assert msg.endswith("`ggfit hardware` lists them; auto is this machine") and "\n" not in msg
    with pytest.raises(hw.HardwareError, match="^--hardware zzz: no such hardware profile; `ggfit hardware`"):
        hw.get_profile("zzz")


def _fake_tools(monkeypatch, answers: dict[str, str | None], platform: str) -> None:
    """_tool answers by the tool's name (None: absent or failed); sys.platform and shutil.which as on `platform`."""
    monkeypatch.setattr(hw, "_tool", lambda argv: answers.get(argv[0]))
    monkeypatch.setattr(hw, "sys", types.SimpleNamespace(platform=platform))
    monkeypatch.setattr(hw, "shutil", types.SimpleNamespace(which=lambda n: f"/usr/bin/{n}" if n in answers else None))


IOREG = '''+-o AGXAcceleratorG16X  <class AGXAcceleratorG16X, id 0x1000003b5, registered, matched, active, busy 0>
    {
      "gpu-core-count" = 20
      "model" = "Apple M4 Pro"
    }
'''
PROFILER = "Graphics/Displays:\n\n    Apple M4 Pro:\n\n      Chipset Model: Apple M4 Pro\n      Type: GPU\n" \
           "      Bus: Built-In\n      Total Number of Cores: 16\n      Vendor: Apple (0x106b)\n"


def test_apple_by_sysctl_and_ioreg(monkeypatch):
    _fake_tools(monkeypatch, {"sysctl": "Apple M4 Pro\n", "ioreg": IOREG}, "darwin")
    p = hw.detect()
    assert p.name == "apple-m4-pro-20" and p.backend == Backend.METAL
    assert p.detected_by == "sysctl machdep.cpu.brand_string: 'Apple M4 Pro'; ioreg gpu-core-count: 20"


def test_apple_by_system_profiler_takes_the_closest_core_count(monkeypatch):
    _fake_tools(monkeypatch, {"sysctl": "Apple M4 Pro\n", "ioreg": "", "system_profiler": PROFILER}, "darwin")
    p = hw.detect()
    assert p.name == "apple-m4-pro-20"
    assert "system_profiler Total Number of Cores: 16" in p.detected_by
    assert "no profile apple-m4-pro-16, the closest is apple-m4-pro-20" in p.detected_by


def test_an_apple_chip_without_a_profile_keeps_metal_without_figures(monkeypatch):
    _fake_tools(monkeypatch, {"sysctl": "Apple M3 Max\n", "ioreg": IOREG.replace("= 20", "= 40")}, "darwin")
    p = hw.detect()
    assert (p.name, p.chip, p.backend, p.unified, p.gpu_cores) == ("apple-m3-max-40", "Apple M3 Max", Backend.METAL,
                                                                   True, 40)
    assert p.memory_bandwidth_gbs is None and "no profile for Apple M3 Max: its figures are unknown" in p.detected_by


@pytest.mark.parametrize("chip, cores, name", [("Apple M1", 7, "apple-m1-7"), ("Apple M3 Max", 40, "apple-m3-max-40"),
                                               ("Apple M2 Ultra", 76, "apple-m2-ultra-76"),
                                               ("Apple M4 Pro", 20, "apple-m4-pro-20"), ("Intel Core i9", 8, None)])
def test_apple_names(chip, cores, name):
    assert hw.apple_name(chip, cores) == name


def test_nvidia_by_nvidia_smi_counts_the_gpus(monkeypatch):
    _fake_tools(monkeypatch, {"nvidia-smi": "NVIDIA H200\nNVIDIA H200\n"}, "linux")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # no pynvml
    p = hw.detect()
    assert (p.name, p.n_devices, p.detected_by) == ("nvidia-h200", 2, "nvidia-smi: NVIDIA H200, NVIDIA H200")


def test_nvidia_by_nvml(monkeypatch):
    _fake_tools(monkeypatch, {"nvidia-smi": "not asked\n"}, "linux")
    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)
    names = [b"NVIDIA GeForce RTX 4090"]  # older pynvml: bytes
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: len(names)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: names[h]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    p = hw.detect()
    assert (p.name, p.n_devices, p.detected_by) == ("nvidia-rtx-4090", 1, "NVML: NVIDIA GeForce RTX 4090")


def test_an_unknown_nvidia_gpu_keeps_cuda_without_figures(monkeypatch):
    _fake_tools(monkeypatch, {"nvidia-smi": "NVIDIA GeForce GT 710\n"}, "linux")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    p = hw.detect()
    assert (p.name, p.chip, p.backend, p.memory_bandwidth_gbs) == ("nvidia-unknown", "NVIDIA GeForce GT 710",
                                                                   Backend.CUDA, None)
    assert p.detected_by.startswith("nvidia-smi: NVIDIA GeForce GT 710; no profile has that NVML name")


def test_nvml_names_match_without_case_punctuation_or_the_nvidia_prefix():
    known = hw.profiles()
    assert hw.nvidia_profile("nvidia geforce rtx-4090", known).name == "nvidia-rtx-4090"  # type: ignore[union-attr]
    assert hw.nvidia_profile("GeForce RTX 4090", known).name == "nvidia-rtx-4090"  # type: ignore[union-attr]
    assert hw.nvidia_profile("NVIDIA GeForce RTX 4090 Laptop GPU", known) is None


def test_no_tools_at_all_is_the_cpu(monkeypatch):
    _fake_tools(monkeypatch, {}, "linux")
    p = hw.detect()
    assert p.name == "cpu" and p.backend == Backend.CPU and "no NVIDIA GPU" in p.detected_by and p.chip


def test_a_tool_that_breaks_detection_is_the_cpu(monkeypatch):
    _fake_tools(monkeypatch, {"sysctl": "Apple M4 Pro"}, "darwin")

    def broken(argv):
        raise RuntimeError("odd output")

    monkeypatch.setattr(hw, "_tool", broken)
    p = hw.detect()
    assert p.name == "cpu" and p.detected_by.startswith("detection failed (RuntimeError: odd output)")


def test_detect_on_this_machine_never_raises():
    p = hw.detect()
    assert p.name in hw.profiles() and p.detected_by


def test_default_threads_is_a_core_count():
    n = hw.default_threads()
    assert 1 <= n <= (__import__("os").cpu_count() or n)


@pytest.mark.parametrize("text, gbs", [("90GB/s", 90.0), ("90 GB/s", 90.0), ("900MB/s", 0.9), ("1.2TB/s", 1200.0),
                                       ("90gb/s", 90.0), ("80GiB/s", 80 * 2**30 / 1e9), ("90GB", 90.0),
                                       ("250 GBps", 250.0)])
def test_parse_bandwidth(text, gbs):
    assert hw.parse_bandwidth(text) == pytest.approx(gbs)


@pytest.mark.parametrize("text", ["90", "fast", "90GB/h", "-5GB/s", "0GB/s", "GB/s", ""])
def test_parse_bandwidth_refuses_in_one_line(text):
    with pytest.raises(GGFitError, match=r"^--host-bandwidth .*: (use a rate with its unit, e\.g\. 90GB/s|the rate must be above 0)"):
        hw.parse_bandwidth(text)


def test_copy_rate_counts_read_and_write_bytes_as_stream_copy():
    """A clock that moves 0.5 s a reading: every copy of 8 MiB takes 0.5 s, so the rate is 2 x 8 MiB / 0.5 s."""
    ticks = iter(range(1000))
    rate = hw._copy_rate(8, 0.0, 2, lambda: next(ticks) * 0.5)
    assert rate == pytest.approx(2 * 8 * 2**20 / 0.5 / 1e9)


def test_host_bandwidth_is_measured_once_and_cached_with_the_date(monkeypatch, tmp_path):
    gbs, src = hw.measure_host_bandwidth(mib=4, seconds=0.0, threads=1)
    assert gbs > 0 and src.startswith("measured here 20") and "STREAM copy" in src
    path = tmp_path / "cache" / hw.BANDWIDTH_CACHE
    stored = json.loads(path.read_text())
    assert stored["gbs"] == gbs and len(stored["date"]) == 10 and stored["machine"] == hw._machine_key()

    def no_measure(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(hw, "_copy_rate", no_measure)
    assert hw.measure_host_bandwidth()[0] == gbs  # cached
    monkeypatch.setattr(hw, "_copy_rate", lambda *a: 12.345)
    assert hw.measure_host_bandwidth(refresh=True)[0] == 12.35
    path.write_text(json.dumps(dict(stored, machine="another host")))
    assert hw.measure_host_bandwidth()[0] == 12.35  # another machine's figure is not this one's
    path.write_text("{not json")
    assert hw.measure_host_bandwidth()[0] == 12.35


def test_resolve_sets_the_host_side(monkeypatch):
    _fake_tools(monkeypatch, {}, "linux")  # this machine: the CPU
    measured = lambda: (55.5, "measured here")
    p = hw.resolve("auto", measure=measured)
    assert (p.name, p.host_bandwidth_gbs, p.host_bandwidth_source) == ("cpu", 55.5, "measured here")
    p = hw.resolve("nvidia-h200", "90GB/s", measure=measured)
    assert (p.host_bandwidth_gbs, p.host_bandwidth_source) == (90.0, "--host-bandwidth 90GB/s")
    p = hw.resolve("nvidia-rtx-4090", measure=measured)  # another machine's GPU: its host is unknown
    assert p.host_bandwidth_gbs is None and "--host-bandwidth sets it" in p.host_bandwidth_source
    p = hw.resolve("apple-m4-pro-20", measure=measured)  # unified: the chip's own bandwidth
    assert p.host_bandwidth_gbs == 273.0 and p.host_bandwidth_source.startswith("unified memory")
    p = hw.resolve("cpu", measure=measured)  # the profile this machine is
    assert p.host_bandwidth_gbs == 55.5
    with pytest.raises(GGFitError, match="^--host-bandwidth 90: use a rate"):
        hw.resolve("cpu", "90", measure=measured)
