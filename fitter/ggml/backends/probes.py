"""What `--budget auto` reads a device's memory with (the backends' free_memory, fitter.fit.device_memory), and what
it answers. Imported only then: its probes' ctypes costs every other command 7M instructions."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from fitter.errors import GGFitError

MiB = 1024**2
GiB = 1024**3

Runner = Callable[[list[str]], "str | None"]  # a command's stdout, or None when it is missing or fails

# what a ctypes call into a library that is missing or not as expected raises (a missing symbol: AttributeError)
CTYPES_FAILURES = (OSError, AttributeError, ctypes.ArgumentError, ValueError)


@dataclass(frozen=True)
class DeviceProbes:
    """How to ask this machine: run a command, its OS, and the probes a test may replace."""

    run: Runner
    system: str  # platform.system()
    given: bool = False  # a test replaced run or metal_probe: the machine itself is not asked
    metal_probe: Callable[[], int | None] | None = None
    nvml: Callable[[int], int | None] | None = None
    meminfo: Path = Path("/proc/meminfo")
    device: int | None = None  # the CUDA device (default: the first of CUDA_VISIBLE_DEVICES, else 0)


class FreeMemory(NamedTuple):
    """What the device has for llama.cpp, and where the number came from."""

    bytes: int
    source: str  # e.g. "Metal recommendedMaxWorkingSetSize", "nvidia-smi memory.free (GPU 0)"
    note: str | None = None  # a caveat worth printing next to the number


class ProbeError(GGFitError):
    """The device's memory cannot be read here (the message says what to pass instead)."""
