"""The memory budget (`--budget`) and the margin kept free under it (`--margin`).

Sizes: a number with a unit (`25559MiB`, `26800000000B`); a bare number other than 0 is refused, since
`--budget 25559` is more likely MiB than bytes.

* Binary units: KiB, MiB, GiB, TiB (powers of 1024). Decimal units: KB, MB, GB, TB (powers of 1000),
  so `26800MB` is 26,800,000,000 bytes and `25559MiB` is 26,800,553,984. `B` is bytes.
* Units are case-insensitive (`mib`, `GB`); a space between number and unit is allowed.
* A unit may take a decimal fraction (`26.8GB`, `1.5GiB`); the result is rounded down to whole
  bytes. Bytes (`B`) must be a whole number. Single-letter units (`24G`) are refused as ambiguous.

`auto` asks the device, the way llama.cpp's `ggml_backend_dev_memory` does (`auto_budget`):

* metal: `recommendedMaxWorkingSetSize` of the default Metal device: the "total" that
  `ggml_metal_device_get_memory` (ggml-metal-device.m) reports; llama.cpp's "free" is that minus
  its own `currentAllocatedSize`. Read through the Objective-C runtime with ctypes, else from
  `sysctl iogpu.wired_limit_mb` when that is set (Metal then reports exactly that many MiB), else
  from a table of Apple RAM sizes (a fallback that says so in `Budget.note`).
* cuda: free VRAM of the device, from `nvidia-smi --query-gpu=memory.free` or NVML.
* cpu: MemAvailable from /proc/meminfo (Linux) or the free + inactive + speculative + purgeable
  pages of `vm_stat` (macOS). llama.cpp's own CPU device reports all physical RAM as free
  (`ggml_backend_cpu_device_get_memory`), which no budget should trust.

The margin defaults to 1024 MiB per device, like llama.cpp's `--fit-target` / `-fitt`
(`common_params::fit_params_target`, common/common.h: "margin per device in bytes for fitting
parameters to free memory", default 1024*1024*1024).
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

from fitter.errors import GGFitError
from fitter.fit.margin import default_margin
from fitter.record import Record

MiB = 1024**2
GiB = 1024**3

# common/common.h common_params::fit_params_target: 1024 MiB per device
DEFAULT_MARGIN_BYTES = 1024 * MiB
FIT_TARGET_NAME = "--fit-target"

UNITS: dict[str, int] = {
    "b": 1,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
ACCEPTED = "a number with a unit (25559MiB, 24GiB, 26800MB, 26.8GB; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
# the unit in ASCII letters, either case (IGNORECASE would also take the Kelvin sign for a k, and cost its case
# tables: ~0.4 ms a command)
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-zA-Z]*)$")
_MAX_BYTES = 2**63
_MAX_FRACTION = 100  # digits after the point

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


class BudgetError(GGFitError):
    """A --budget or --margin value ggfit cannot read, or an `auto` it cannot resolve here."""


class Budget(Record):
    """Bytes the prediction must fit into, and where the number came from."""

    bytes: int
    source: str  # e.g. "--budget 24GiB", "Metal recommendedMaxWorkingSetSize", "nvidia-smi memory.free (GPU 0)"
    note: str | None = None  # a caveat worth printing next to the number

    @property
    def mib(self) -> float:
        return self.bytes / MiB


# --- parsing ---------------------------------------------------------------------------------------


def parse_size(text: str, *, what: str = "--margin") -> int:
    """Bytes from `25559MiB`, `24GiB`, `26800MB`, `26.8GB`, `100B`; zero (`0`, `0MiB`) is allowed."""
    raw = str(text)
    s = raw.strip()
    if s.startswith("-"):
        raise BudgetError(f"{what} {raw!r}: must not be negative; use {ACCEPTED}")
    m = _SIZE.match(s)
    if not m:
        raise BudgetError(f"{what} {raw!r}: not a size; use {ACCEPTED}")
    number, unit = m.group(1), m.group(2).lower()
    if unit and unit not in UNITS:
        raise BudgetError(f"{what} {raw!r}: unknown unit '{m.group(2)}'; use {ACCEPTED}")
    whole, _, frac = number.partition(".")
    whole = whole.lstrip("0")
    if not unit and (whole or frac.strip("0")):  # zero is zero in every unit
        also = " or auto" if what == "--budget" else ""
        raise BudgetError(f"{what} {s}: a size needs a unit (did you mean {number}MiB?); use {ACCEPTED}{also}")
    if unit == "b" and "." in number:
        raise BudgetError(f"{what} {raw!r}: bytes must be a whole number; use {ACCEPTED}")
    if len(whole) > 20:  # 10**20 bytes and more: past _MAX_BYTES in every unit, however long the number
        raise BudgetError(f"{what} {raw!r}: too large")
    if len(frac) > _MAX_FRACTION:
        raise BudgetError(f"{what} {raw!r}: more than {_MAX_FRACTION} digits after the point; use {ACCEPTED}")
    # whole bytes, rounded down, in integers: exact for every fraction
    value = int(whole + frac or "0") * UNITS[unit or "b"] // 10 ** len(frac)
    if value >= _MAX_BYTES:
        raise BudgetError(f"{what} {raw!r}: too large")
    return value


def parse_margin(text: str | None, backend: str | None = None) -> int:
    """--margin: a size (zero allowed); None gives the backend's default (fitter.fit.margin: what the buffers leave
    out, plus a safety share), or without a backend DEFAULT_MARGIN_BYTES (llama.cpp's --fit-target default)."""
    if text is None:
        return default_margin(backend) if backend else DEFAULT_MARGIN_BYTES
    if str(text).strip().lower() == "auto":
        raise BudgetError(f"--margin 'auto': the margin is a size; use {ACCEPTED} (by default the backend's modelled "
                          f"overhead plus a safety share; llama.cpp's {FIT_TARGET_NAME} is 1024MiB)")
    return parse_size(text, what="--margin")


def parse_budget(text: str, backend: str = "cpu", **probes) -> Budget:
    """--budget: a positive size, or `auto` for the device's own limit (see auto_budget)."""
    raw = str(text)
    if raw.strip().lower() == "auto":
        return auto_budget(backend, **probes)
    value = parse_size(raw, what="--budget")
    if value == 0:
        raise BudgetError(f"--budget {raw!r}: must be more than zero; use {ACCEPTED} or auto")
    return Budget(bytes=value, source=f"--budget {raw.strip()}")


def parse_budgets(text: str, backend: str = "cpu", **probes) -> list[Budget]:
    """--budget for one GPU or several: one value, or one per GPU separated by commas (`24GiB,24GiB`); the number of
    values is the number of GPUs llama.cpp spreads the layers over (CUDA0, CUDA1, ... in order)."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) == 1:
        return [parse_budget(text, backend, **probes)]
    if backend == "metal" or backend == "cpu":
        raise BudgetError(f"--budget {text}: one value per GPU is for CUDA; {backend} has one device")
    if any(p.lower() == "auto" for p in parts):
        raise BudgetError(f"--budget {text}: auto reads one GPU; give a size per GPU ({ACCEPTED})")
    out = []
    for i, p in enumerate(parts):
        b = parse_budget(p, backend)
        out.append(b.model_copy(update={"source": f"--budget {p} (GPU {i})"}))
    return out


def parse_host_budget(text: str | None, **probes) -> Budget:
    """--host-budget: what may land in system RAM (weights left on the CPU, mapped or not, KV on the host, host
    compute and output buffers). Default (None or auto): the RAM available now (MemAvailable)."""
    if text is None or str(text).strip().lower() == "auto":
        b = auto_budget("cpu", **probes)
        return b.model_copy(update={"source": f"available RAM ({b.source})"})
    value = parse_size(text, what="--host-budget")
    if value == 0:
        raise BudgetError(f"--host-budget {text!r}: must be more than zero; use {ACCEPTED} or auto")
    return Budget(bytes=value, source=f"--host-budget {str(text).strip()}")


def available_bytes(budget: Budget | int, margin: int) -> int:
    """What the prediction may use: the budget minus the margin (which must leave something)."""
    total = budget.bytes if isinstance(budget, Budget) else int(budget)
    if margin >= total:
        raise BudgetError(f"--margin {margin / MiB:,.0f} MiB leaves nothing of the {total / MiB:,.0f} MiB budget")
    return total - margin


# --- auto ----------------------------------------------------------------------------------------------


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
