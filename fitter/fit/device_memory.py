"""`--budget auto` and `--host-budget auto`: what the device reports, the way llama.cpp's `ggml_backend_dev_memory`
does (auto_budget). fitter.fit.budget imports it only for `auto`.

* metal: `recommendedMaxWorkingSetSize` of the default Metal device: the "total" that
  `ggml_metal_device_get_memory` (ggml-metal-device.m) reports; llama.cpp's "free" is that minus
  its own `currentAllocatedSize`. Read through the Objective-C runtime with ctypes, else from
  `sysctl iogpu.wired_limit_mb` when that is set (Metal then reports exactly that many MiB), else
  from a table of Apple RAM sizes (a fallback that says so in `Budget.note`).
* cuda: free VRAM of the device, from `nvidia-smi --query-gpu=memory.free` or NVML.
* cpu: MemAvailable from /proc/meminfo (Linux) or the free + inactive + speculative + purgeable
  pages of `vm_stat` (macOS). llama.cpp's own CPU device reports all physical RAM as free
  (`ggml_backend_cpu_device_get_memory`), which no budget should trust.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Literal

from fitter.fit.sizes import Budget, BudgetError, GiB, MiB

# Apple Silicon recommendedMaxWorkingSetSize by RAM, in MiB, as seen in llama.cpp logs
# (research note anchors-memory.md section 6). Newer macOS reports more than older releases for
# the same RAM (32 GB: 25,559 vs 21,845 MiB); the values here are the newer ones where known.
APPLE_WORKING_SET_MIB: dict[int, tuple[int, str]] = {
    16: (12124, "M4, recent macOS"),
    24: (18186, "M4 Pro, inferred from free memory"),
    32: (25559, "M4 mini / M2 Max, recent macOS"),
    36: (27648, "3/4 of RAM, older macOS"),
    48: (38340, "M4 Max, inferred from free memory"),
    64: (49152, "3/4 of RAM, older macOS"),
    128: (110100, "M4/M5 Max, macOS 26"),
}

Runner = Callable[[list[str]], "str | None"]


def _run(cmd: list[str]) -> str | None:
    """Run a command; its stdout, or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def metal_recommended_max_working_set() -> int | None:
    """MTLCreateSystemDefaultDevice().recommendedMaxWorkingSetSize through the Objective-C runtime (macOS).

    The value ggml_metal_device_init stores as props.max_working_set_size. None when Metal or the
    runtime cannot be loaded, or there is no device.
    """
    try:
        objc = ctypes.CDLL("/usr/lib/libobjc.A.dylib")
        try:  # command-line processes on some Macs get no default device without CoreGraphics loaded
            ctypes.CDLL("/System/Library/Frameworks/CoreGraphics.framework/CoreGraphics")
        except OSError:
            pass
        metal = ctypes.CDLL("/System/Library/Frameworks/Metal.framework/Metal")
    except OSError:
        return None
    metal.MTLCreateSystemDefaultDevice.restype = ctypes.c_void_p
    metal.MTLCreateSystemDefaultDevice.argtypes = []
    objc.sel_registerName.restype = ctypes.c_void_p
    objc.sel_registerName.argtypes = [ctypes.c_char_p]
    device = metal.MTLCreateSystemDefaultDevice()
    if not device:
        return None
    send = objc.objc_msgSend  # not variadic on arm64: the argtypes below make ctypes call it correctly
    send.restype = ctypes.c_uint64
    send.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    size = int(send(device, objc.sel_registerName(b"recommendedMaxWorkingSetSize")))
    return size or None  # the device object is kept: one per process, as Metal itself does


# what a ctypes call into a library that is missing or not as expected raises (a missing symbol: AttributeError)
_CTYPES_FAILURES = (OSError, AttributeError, ctypes.ArgumentError, ValueError)


def _sysctl_int(name: str, run: Runner) -> int | None:
    out = run(["sysctl", "-n", name])
    if out is None:
        return None
    try:
        return int(out.strip())
    except ValueError:
        return None


def _apple_table(ram_bytes: int) -> tuple[int, str]:
    ram_gb = round(ram_bytes / 1000**3)
    for gb in (ram_gb, round(ram_bytes / GiB)):
        if gb in APPLE_WORKING_SET_MIB:
            mib, where = APPLE_WORKING_SET_MIB[gb]
            return mib * MiB, f"{gb} GB: {mib} MiB as logged on {where}"
    frac = (2, 3) if ram_bytes <= 36 * GiB else (3, 4)
    return ram_bytes * frac[0] // frac[1], f"{ram_gb} GB not in the table: {frac[0]}/{frac[1]} of RAM (the old macOS rule)"


def _metal_budget(run: Runner, metal_probe: Callable[[], int | None]) -> Budget:
    size = None
    try:
        size = metal_probe()
    except _CTYPES_FAILURES:  # the Objective-C runtime or Metal not as expected: ask another way
        size = None
    if size:
        return Budget(bytes=size, source="Metal recommendedMaxWorkingSetSize",
                      note="llama.cpp's free memory is this minus what its own process has allocated (about 2 MiB at start)")
    wired = _sysctl_int("iogpu.wired_limit_mb", run)
    if wired:
        return Budget(bytes=wired * MiB, source="sysctl iogpu.wired_limit_mb",
                      note="Metal reports the wired limit as its working set when it is set; Metal itself could not be queried")
    ram = _sysctl_int("hw.memsize", run)
    if ram:
        size, why = _apple_table(ram)
        return Budget(bytes=size, source="table of Apple working-set sizes",
                      note=f"fallback, Metal could not be queried; {why}; pass --budget if you know better")
    raise BudgetError("--budget auto: cannot read Metal's working-set size here (needs macOS); pass --budget, e.g. 25559MiB for a 32 GB Mac")


def _visible_cuda_index(device: int | None) -> int:
    if device is not None:
        return device
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def nvml_free_bytes(index: int) -> int | None:
    """nvmlDeviceGetMemoryInfo(...).free through ctypes, or None without NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            return None
        mem = Memory()
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.free)
    finally:
        nvml.nvmlShutdown()


# measured on an H200 (benchmarks/results/gpu-load-h200.json): llama.cpp's CUDA context 527 MiB, then
# 84..245 MiB of CUDA pool and cuBLAS workspace after the first decode; none of it is a ggml buffer
_CUDA_NOTE = ("free before llama.cpp creates its CUDA context; the context (about 530 MiB) and the CUDA pool "
              "(up to about 250 MiB once decoding) come out of the margin")


def _cuda_budget(run: Runner, nvml: Callable[[int], int | None], device: int | None) -> Budget:
    index = _visible_cuda_index(device)
    out = run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
    if out is not None:
        lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
        if index < len(lines):
            try:
                mib = int(float(lines[index]))
            except ValueError:
                mib = None
            if mib is not None:
                return Budget(bytes=mib * MiB, source=f"nvidia-smi memory.free (GPU {index})", note=_CUDA_NOTE)
    try:
        free = nvml(index)
    except _CTYPES_FAILURES:  # NVML not as expected: no answer from it
        free = None
    if free:
        return Budget(bytes=free, source=f"NVML free memory (GPU {index})", note=_CUDA_NOTE)
    raise BudgetError(f"--budget auto: cannot read free memory of CUDA device {index} (no nvidia-smi, no NVML); pass --budget, e.g. 80GiB")


def _meminfo_available(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _vm_stat_available(run: Runner) -> int | None:
    out = run(["vm_stat"])
    if out is None:
        return None
    m = re.search(r"page size of (\d+) bytes", out)
    if not m:
        return None
    page = int(m.group(1))
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        km = re.search(rf"^{key}:\s+(\d+)", out, re.MULTILINE)
        if km:
            pages += int(km.group(1))
    return pages * page or None


def _cpu_budget(run: Runner, system: str, meminfo: Path) -> Budget:
    if system == "Linux":
        avail = _meminfo_available(meminfo)
        if avail:
            return Budget(bytes=avail, source=f"MemAvailable ({meminfo})",
                          note="memory other programs are using now is excluded; llama.cpp itself assumes all RAM is free")
    elif system == "Darwin":
        avail = _vm_stat_available(run)
        if avail:
            return Budget(bytes=avail, source="vm_stat free + inactive + speculative + purgeable pages",
                          note="an estimate of what macOS can hand out without swapping")
    raise BudgetError(f"--budget auto: cannot read available memory on {system or 'this system'}; pass --budget, e.g. 16GiB")


def auto_budget(
    backend: Literal["cpu", "cuda", "metal"] | str,
    *,
    run: Runner | None = None,
    metal_probe: Callable[[], int | None] | None = None,
    nvml: Callable[[int], int | None] | None = None,
    system: str | None = None,
    meminfo: str | Path = "/proc/meminfo",
    device: int | None = None,
) -> Budget:
    """The device's own limit. `run`, `metal_probe`, `nvml`, `system`, `meminfo` replace the real probes (tests)."""
    be = str(getattr(backend, "value", backend)).lower()
    probes_given = run is not None or metal_probe is not None
    run = run or _run
    system = platform.system() if system is None else system
    if be == "metal":
        if system != "Darwin" and not probes_given:
            raise BudgetError("--budget auto for metal needs the Mac itself; pass its budget, e.g. --budget 25559MiB for a 32 GB Mac")
        return _metal_budget(run, metal_probe or metal_recommended_max_working_set)
    if be == "cuda":
        return _cuda_budget(run, nvml or nvml_free_bytes, device)
    if be == "cpu":
        return _cpu_budget(run, system, Path(meminfo))
    raise BudgetError(f"--budget auto: unknown backend '{backend}'; use metal, cuda or cpu")
