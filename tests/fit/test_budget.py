"""--budget / --margin parsing, `auto` on this machine and (stubbed) on Metal and CUDA. (The backend
alloc-size rules are tested in tests/ggml/test_backends.py.)"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest

from fitter.errors import GGFitError
from fitter.fit.budget import (
    DEFAULT_MARGIN_BYTES,
    Budget,
    BudgetError,
    available_bytes,
    parse_budget,
    parse_margin,
    parse_size,
)
from fitter.fit.device_memory import auto_budget
from fitter.ggml import backends as cb
from fitter.ggml.backends.cuda.memory import nvml_free_bytes
from fitter.ggml.backends.metal.memory import metal_recommended_max_working_set

MiB = 2**20
GiB = 2**30

# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("25559MiB", 25559 * MiB),
        ("24GiB", 24 * GiB),
        ("26800MB", 26_800_000_000),
        ("26.8GB", 26_800_000_000),
        ("26800000000B", 26_800_000_000),
        ("0", 0),  # zero needs no unit
        ("1.5GiB", 3 * GiB // 2),
        ("24 gib", 24 * GiB),
        ("24gb", 24_000_000_000),
        ("512KiB", 512 * 1024),
        ("512kb", 512_000),
        ("2TiB", 2 * 1024**4),
        ("1TB", 10**12),
        ("100B", 100),
        ("  25559MiB  ", 25559 * MiB),
        ("0.0000001KiB", 0),  # rounds down to whole bytes
        ("1.0005KB", 1000),
        ("0.9999999999999999999999999999999GB", 999_999_999),  # exact past 28 digits (Decimal's precision)
        ("0" * 5000 + "1KB", 1000),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["24GB5", "-1MiB", "lots", "", "24G", "24M", "1.5", "1e9", "25559", "26800000000", "1.5B", "24 GiB extra", "GiB", "1,024MiB", "0x100", "24GiBs", "+5GB", "25\u212aiB"]
)
def test_parse_size_refuses(text):
    with pytest.raises(BudgetError) as e:
        parse_size(text, what="--budget")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--budget ")
    assert "MiB" in msg and "GB" in msg  # says what is accepted


def test_absurdly_long_numbers_get_one_line():
    with pytest.raises(BudgetError, match="too large"):
        parse_size("1" + "0" * 5000 + "GB")
    with pytest.raises(BudgetError, match="digits after the point"):
        parse_size("1." + "0" * 100 + "1GB")
    assert parse_size("1." + "0" * 99 + "1GB") == 10**9


def test_errors_are_ggfit_errors():
    assert issubclass(BudgetError, GGFitError)
    assert issubclass(cb.BackendError, GGFitError)


def test_bare_number_needs_a_unit():
    # issue 11: `--budget 25559` was read as 25,559 bytes; a unit is required, and the message suggests MiB
    with pytest.raises(BudgetError, match=r"^--budget 25559: a size needs a unit \(did you mean 25559MiB\?\).* or auto$"):
        parse_budget("25559", "cpu")
    with pytest.raises(BudgetError, match=r"^--margin 512: a size needs a unit \(did you mean 512MiB\?\)"):
        parse_margin("512")
    assert parse_margin("0") == 0


def test_negative_says_so():
    with pytest.raises(BudgetError, match="negative"):
        parse_size("-1MiB")


def test_unknown_unit_names_it():
    with pytest.raises(BudgetError, match="unknown unit 'G'"):
        parse_size("24G")


def test_parse_budget_explicit():
    b = parse_budget("24GiB", "metal")
    assert b == Budget(bytes=24 * GiB, source="--budget 24GiB")
    assert b.mib == 24 * 1024


def test_budget_zero_refused_margin_zero_allowed():
    with pytest.raises(BudgetError, match="more than zero"):
        parse_budget("0", "cpu")
    with pytest.raises(BudgetError):
        parse_budget("0MiB", "cpu")
    assert parse_margin("0") == 0
    assert parse_size("0MiB") == 0


def test_margin_default_is_fit_target():
    # common/common.h: fit_params_target = 1024*1024*1024 per device
    assert DEFAULT_MARGIN_BYTES == 1024 * MiB
    assert parse_margin(None) == DEFAULT_MARGIN_BYTES
    assert parse_margin("512MiB") == 512 * MiB
    with pytest.raises(BudgetError, match="--margin"):
        parse_margin("auto")
    with pytest.raises(BudgetError, match="--margin"):
        parse_margin("lots")


def test_available_bytes():
    b = Budget(bytes=25559 * MiB, source="x")
    assert available_bytes(b, DEFAULT_MARGIN_BYTES) == 24535 * MiB
    with pytest.raises(BudgetError, match="leaves nothing"):
        available_bytes(b, 25559 * MiB)


def test_auto_unknown_backend():
    with pytest.raises(BudgetError, match="unknown backend"):
        auto_budget("vulkan", run=lambda cmd: None)


# --- auto: CPU -----------------------------------------------------------------------------------


def _mem_available() -> int:
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    assert m
    return int(m.group(1)) * 1024


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/meminfo")
def test_auto_cpu_on_this_machine():
    before = _mem_available()
    b = parse_budget("auto", "cpu")
    after = _mem_available()
    assert b.source.startswith("MemAvailable")
    assert b.note
    lo, hi = min(before, after), max(before, after)
    assert lo - 256 * MiB <= b.bytes <= hi + 256 * MiB


def test_auto_cpu_meminfo_file(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32768000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    b = auto_budget("cpu", system="Linux", meminfo=f)
    assert b.bytes == 20_000_000 * 1024


def test_auto_cpu_meminfo_without_available(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32768000 kB\n")
    with pytest.raises(BudgetError, match="pass --budget"):
        auto_budget("cpu", system="Linux", meminfo=f)


def test_auto_cpu_macos_vm_stat():
    vm_stat = (
        "Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
        "Pages free:                               10000.\n"
        "Pages active:                            500000.\n"
        "Pages inactive:                          200000.\n"
        "Pages speculative:                         5000.\n"
        "Pages purgeable:                           1000.\n"
    )
    b = auto_budget("cpu", system="Darwin", run=lambda cmd: vm_stat if cmd == ["vm_stat"] else None)
    assert b.bytes == (10000 + 200000 + 5000 + 1000) * 16384
    assert "vm_stat" in b.source


def test_auto_cpu_unsupported_system():
    with pytest.raises(BudgetError, match="Windows"):
        auto_budget("cpu", system="Windows", run=lambda cmd: None)


# --- auto: CUDA (nvidia-smi / NVML stubbed) ------------------------------------------------------


def _smi(out: str | None):
    calls = []

    def run(cmd):
        calls.append(cmd)
        if cmd[0] == "nvidia-smi":
            assert cmd[1:] == ["--query-gpu=memory.free", "--format=csv,noheader,nounits"]
            return out
        return None

    return run, calls


def test_auto_cuda_nvidia_smi(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, calls = _smi("142311\n80000\n")
    b = auto_budget("cuda", run=run, nvml=lambda i: pytest.fail("NVML not needed"))
    assert b.bytes == 142311 * MiB
    assert b.source == "nvidia-smi memory.free (GPU 0)"
    assert "CUDA context" in b.note
    assert len(calls) == 1
    assert auto_budget("cuda", run=run, device=1).bytes == 80000 * MiB


def test_auto_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    run, _ = _smi("142311\n80000\n")
    b = parse_budget("auto", "cuda", run=run)
    assert b.bytes == 80000 * MiB and "GPU 1" in b.source


def test_auto_cuda_nvml_fallback(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, _ = _smi(None)
    b = auto_budget("cuda", run=run, nvml=lambda i: 150 * GiB if i == 0 else None)
    assert b.bytes == 150 * GiB and b.source.startswith("NVML")


def test_auto_cuda_garbage_then_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, _ = _smi("[N/A]\n")
    b = auto_budget("cuda", run=run, nvml=lambda i: 1234)
    assert b.bytes == 1234


def test_auto_cuda_nothing(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, _ = _smi(None)
    with pytest.raises(BudgetError, match="CUDA device 0"):
        auto_budget("cuda", run=run, nvml=lambda i: None)


def test_nvml_absent_here():
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert nvml_free_bytes(0) is None
    else:  # pragma: no cover - a machine with an NVIDIA driver
        pytest.skip("NVML present")


# --- auto: Metal (Metal runtime / sysctl stubbed) ------------------------------------------------


def _sysctl(values: dict[str, str]):
    def run(cmd):
        if cmd[:2] == ["sysctl", "-n"]:
            return values.get(cmd[2])
        return None

    return run


def test_auto_metal_device():
    b = auto_budget("metal", system="Darwin", metal_probe=lambda: 26_800_603_136,
                    run=_sysctl({"iogpu.wired_limit_mb": "0"}))
    assert b.bytes == 26_800_603_136
    assert b.source == "Metal recommendedMaxWorkingSetSize"


def test_auto_metal_wired_limit():
    b = auto_budget("metal", system="Darwin", metal_probe=lambda: None,
                    run=_sysctl({"iogpu.wired_limit_mb": "26000\n", "hw.memsize": str(32 * GiB)}))
    assert b.bytes == 26000 * MiB
    assert b.source == "sysctl iogpu.wired_limit_mb"


def test_auto_metal_probe_error_falls_back():
    def boom():
        raise OSError("no Metal")

    b = auto_budget("metal", system="Darwin", metal_probe=boom, run=_sysctl({"iogpu.wired_limit_mb": "12000"}))
    assert b.bytes == 12000 * MiB


def test_auto_metal_table_fallback():
    run = _sysctl({"iogpu.wired_limit_mb": "0", "hw.memsize": str(32 * GiB)})
    b = parse_budget("auto", "metal", system="Darwin", metal_probe=lambda: None, run=run)
    assert b.bytes == 25559 * MiB
    assert "fallback" in b.note and "table" in b.source


def test_auto_metal_table_unknown_size():
    run = _sysctl({"iogpu.wired_limit_mb": "0", "hw.memsize": str(8 * GiB)})
    b = auto_budget("metal", system="Darwin", metal_probe=lambda: None, run=run)
    assert b.bytes == 8 * GiB * 2 // 3
    assert "2/3" in b.note


def test_auto_metal_nothing():
    with pytest.raises(BudgetError, match="Metal"):
        auto_budget("metal", system="Darwin", metal_probe=lambda: None, run=lambda cmd: None)


def test_auto_metal_off_mac():
    if platform.system() == "Darwin":  # pragma: no cover
        pytest.skip("this is a Mac")
    with pytest.raises(BudgetError, match="25559MiB"):
        parse_budget("auto", "metal")


def test_metal_probe_absent_here():
    if platform.system() == "Darwin":  # pragma: no cover
        pytest.skip("this is a Mac")
    assert metal_recommended_max_working_set() is None
