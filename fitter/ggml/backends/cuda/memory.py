"""ggml-cuda's device memory as `--budget auto` reads it (CUDABackend.free_memory): free VRAM of the device, from
`nvidia-smi --query-gpu=memory.free` or NVML."""

from __future__ import annotations

import ctypes
import os

from fitter.ggml.backends.probes import CTYPES_FAILURES, DeviceProbes, FreeMemory, MiB, ProbeError


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


def free_memory(probes: DeviceProbes) -> FreeMemory:
    run, nvml = probes.run, probes.nvml or nvml_free_bytes
    index = _visible_cuda_index(probes.device)
    out = run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
    if out is not None:
        lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
        if index < len(lines):
            try:
                mib = int(float(lines[index]))
            except ValueError:
                mib = None
            if mib is not None:
                return FreeMemory(bytes=mib * MiB, source=f"nvidia-smi memory.free (GPU {index})", note=_CUDA_NOTE)
    try:
        free = nvml(index)
    except CTYPES_FAILURES:  # NVML not as expected: no answer from it
        free = None
    if free:
        return FreeMemory(bytes=free, source=f"NVML free memory (GPU {index})", note=_CUDA_NOTE)
    raise ProbeError(f"--budget auto: cannot read free memory of CUDA device {index} (no nvidia-smi, no NVML); pass --budget, e.g. 80GiB")
