"""ggml-metal's device memory as `--budget auto` reads it (MetalBackend.free_memory).

`recommendedMaxWorkingSetSize` of the default Metal device: the "total" that `ggml_metal_device_get_memory`
(ggml-metal-device.m) reports; llama.cpp's "free" is that minus its own `currentAllocatedSize`. Read through the
Objective-C runtime with ctypes, else from `sysctl iogpu.wired_limit_mb` when that is set (Metal then reports exactly
that many MiB), else from a table of Apple RAM sizes (a fallback that says so in its note).
"""

from __future__ import annotations

import ctypes

from fitter.ggml.backends.probes import CTYPES_FAILURES, DeviceProbes, FreeMemory, GiB, MiB, ProbeError, Runner

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


def free_memory(probes: DeviceProbes) -> FreeMemory:
    if probes.system != "Darwin" and not probes.given:
        raise ProbeError("--budget auto for metal needs the Mac itself; pass its budget, e.g. --budget 25559MiB for a 32 GB Mac")
    run = probes.run
    size = None
    try:
        size = (probes.metal_probe or metal_recommended_max_working_set)()
    except CTYPES_FAILURES:  # the Objective-C runtime or Metal not as expected: ask another way
        size = None
    if size:
        return FreeMemory(bytes=size, source="Metal recommendedMaxWorkingSetSize",
                      note="llama.cpp's free memory is this minus what its own process has allocated (about 2 MiB at start)")
    wired = _sysctl_int("iogpu.wired_limit_mb", run)
    if wired:
        return FreeMemory(bytes=wired * MiB, source="sysctl iogpu.wired_limit_mb",
                      note="Metal reports the wired limit as its working set when it is set; Metal itself could not be queried")
    ram = _sysctl_int("hw.memsize", run)
    if ram:
        size, why = _apple_table(ram)
        return FreeMemory(bytes=size, source="table of Apple working-set sizes",
                      note=f"fallback, Metal could not be queried; {why}; pass --budget if you know better")
    raise ProbeError("--budget auto: cannot read Metal's working-set size here (needs macOS); pass --budget, e.g. 25559MiB for a 32 GB Mac")
