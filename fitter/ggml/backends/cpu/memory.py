"""The host's available memory as `--budget auto` and `--host-budget auto` read it (CPUBackend.free_memory):
MemAvailable from /proc/meminfo (Linux) or the free + inactive + speculative + purgeable pages of `vm_stat` (macOS).
llama.cpp's own CPU device reports all physical RAM as free (`ggml_backend_cpu_device_get_memory`), which no budget
should trust."""

from __future__ import annotations

import re
from pathlib import Path

from fitter.ggml.backends.probes import DeviceProbes, FreeMemory, ProbeError, Runner


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


def free_memory(probes: DeviceProbes) -> FreeMemory:
    run, system, meminfo = probes.run, probes.system, probes.meminfo
    if system == "Linux":
        avail = _meminfo_available(meminfo)
        if avail:
            return FreeMemory(bytes=avail, source=f"MemAvailable ({meminfo})",
                          note="memory other programs are using now is excluded; llama.cpp itself assumes all RAM is free")
    elif system == "Darwin":
        avail = _vm_stat_available(run)
        if avail:
            return FreeMemory(bytes=avail, source="vm_stat free + inactive + speculative + purgeable pages",
                          note="an estimate of what macOS can hand out without swapping")
    raise ProbeError(f"--budget auto: cannot read available memory on {system or 'this system'}; pass --budget, e.g. 16GiB")
