"""`--budget auto` and `--host-budget auto`: what the device reports, the way llama.cpp's `ggml_backend_dev_memory`
does (auto_budget), as a Budget. fitter.fit.budget imports it only for `auto`.

Each backend reads its own device (BackendImpl.free_memory): metal/memory.py (recommendedMaxWorkingSetSize, the
wired limit, a table of Apple RAM sizes), cuda/memory.py (nvidia-smi, NVML), cpu/memory.py (MemAvailable, vm_stat),
under fitter/ggml/backends/.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Literal

from fitter.fit.sizes import Budget, BudgetError
from fitter.ggml import backends
from fitter.ggml.backends.base import BackendError
from fitter.ggml.backends.probes import DeviceProbes, ProbeError, Runner


def _run(cmd: list[str]) -> str | None:
    """Run a command; its stdout, or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


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
    """The device's own limit (the backend's free_memory). `run`, `metal_probe`, `nvml`, `system`, `meminfo` replace
    the real probes (tests)."""
    try:
        impl = backends.get(str(getattr(backend, "value", backend)))
    except BackendError:
        raise BudgetError(f"--budget auto: unknown backend '{backend}'; use metal, cuda or cpu") from None
    probes = DeviceProbes(run=run or _run, system=platform.system() if system is None else system,
                          given=run is not None or metal_probe is not None, metal_probe=metal_probe, nvml=nvml,
                          meminfo=Path(meminfo), device=device)
    try:
        free = impl.free_memory(probes)
    except ProbeError as e:
        raise BudgetError(str(e)) from None
    return Budget(bytes=free.bytes, source=free.source, note=free.note)
