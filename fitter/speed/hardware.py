"""Hardware profiles for the speed model: the published figures of a chip (memory bandwidth, FP16 compute, GPU cores,
memory sizes, each with its source; the data lives in fitter.speed.hardware_specs), which one this machine is
(`--hardware auto`), and this host's memory bandwidth, measured once and cached.

Profiles are named `apple-m<gen>[-pro|-max|-ultra]-<gpu cores>`, `nvidia-<model>` and `cpu`. `detect()` never raises:
without sysctl, ioreg, system_profiler, NVML or nvidia-smi it answers `cpu`, and `detected_by` says how it decided."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from fitter.cache import cache_root
from fitter.errors import GGFitError
from fitter.ggml.backends.base import Backend
from fitter.record import Record

CPU = "cpu"
UNKNOWN_NVIDIA = "nvidia-unknown"  # detect(): an NVIDIA GPU no profile names (no figures; not a profile get_profile knows)
_TOOL_TIMEOUT_S = 5.0  # sysctl, ioreg, system_profiler, nvidia-smi: a hung tool must not hang ggfit
BANDWIDTH_CACHE = "host-bandwidth.json"  # under fitter.cache.cache_root()


class HardwareError(GGFitError):
    """An unknown hardware profile or a bandwidth ggfit cannot read (the message says which, in one line)."""


class HardwareProfile(Record):
    """One chip's published figures (fitter.speed.hardware_specs), and the host side of partial offload."""

    name: str  # apple-m4-pro-20, nvidia-rtx-4090, cpu
    chip: str  # "Apple M4 Pro", "NVIDIA GeForce RTX 4090", or this machine's CPU model
    backend: Backend
    unified: bool = False  # the GPU and the CPU share one memory (Apple): moving weights to the CPU frees nothing
    memory_bandwidth_gbs: float | None = None  # the device memory's, GB/s (1e9 bytes/s); None for cpu
    fp16_tflops: float | None = None
    int8_tops: float | None = None  # NVIDIA's tensor cores (dense)
    gpu_cores: int | None = None  # Apple's GPU cores, NVIDIA's SMs as the specs give them
    # the share of the tensor figures that mma.sync reaches (llama.cpp's MMQ and flash-attention kernels): Hopper's
    # datasheet figures need wgmma, which only cuBLAS issues
    mma_sync_share: float = 1.0
    memory_gib: tuple[float, ...] = ()  # the memory sizes the chip ships with
    pcie_gbs: float | None = None  # host <-> GPU, GB/s one way (NVIDIA discrete)
    nvml_names: tuple[str, ...] = ()  # what NVML / nvidia-smi call it
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> URL of the figure
    host_bandwidth_gbs: float | None = None  # the host memory's (CPU side of partial offload), GB/s
    host_bandwidth_source: str = ""  # how host_bandwidth_gbs was had: measured (date), --host-bandwidth, unified, ...
    # this CPU's matrix rates in llama.cpp's kernels, GFLOP/s per thread by type class (fitter.speed.cpu_rate):
    # a ubatch's (prefill) and a decoded token's (in-cache, compute alone); empty where not measured
    cpu_prefill_gflops: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_decode_gflops: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_rate_source: str = ""
    n_devices: int = 1  # GPUs of this profile found on this machine (detect); 1 for a named profile
    detected_by: str = ""  # detect(): how this machine was recognised


def _specs() -> tuple[dict[str, object], ...]:
    """hardware_specs.SPECS, imported here: the data module is only read where a profile is asked for."""
    import importlib

    try:
        specs = importlib.import_module("fitter.speed.hardware_specs")
    except ModuleNotFoundError as e:
        if e.name != "fitter.speed.hardware_specs":
            raise
        return ()
    return tuple(specs.SPECS)


def _tuple(v: object) -> tuple:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(v)
    return (v,)


def profile_of(spec: dict[str, object]) -> HardwareProfile:
    """A HardwareProfile from one hardware_specs.SPECS entry (a key it lacks takes the field's default)."""
    def num(key: str) -> float | None:
        v = spec.get(key)
        return None if v is None else float(v)  # type: ignore[arg-type]

    cores = spec.get("gpu_cores")
    return HardwareProfile(
        name=str(spec["name"]), chip=str(spec.get("chip") or spec["name"]), backend=Backend(str(spec["backend"])),
        unified=bool(spec.get("unified", False)), memory_bandwidth_gbs=num("memory_bandwidth_gbs"),
        fp16_tflops=num("fp16_tflops"), int8_tops=num("int8_tops"), mma_sync_share=num("mma_sync_share") or 1.0,
        gpu_cores=None if cores is None else int(cores),  # type: ignore[call-overload]
        memory_gib=tuple(float(x) for x in _tuple(spec.get("memory_gib"))), pcie_gbs=num("pcie_gbs"),
        nvml_names=tuple(str(x) for x in _tuple(spec.get("nvml_names"))),
        sources={str(k): str(v) for k, v in dict(spec.get("sources") or {}).items()},  # type: ignore[call-overload]
    )


def profiles() -> dict[str, HardwareProfile]:
    """Every profile by name, in hardware_specs' order; `cpu` always (a bare one where the specs lack it)."""
    out = {str(s["name"]): profile_of(s) for s in _specs()}
    out.setdefault(CPU, HardwareProfile(name=CPU, chip="CPU", backend=Backend.CPU))
    return out


def get_profile(name: str, flag: str = "--hardware") -> HardwareProfile:
    """The profile called `name` (case-insensitive); an unknown name is a HardwareError naming the closest ones
    (the message starts with `flag` and the name)."""
    known = profiles()
    key = name.strip().lower()
    if key in known:
        return known[key]
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise HardwareError(f"{flag} {name}: no such hardware profile; {hint}`ggfit hardware` lists them; auto "
                        "is this machine")


# --- what this machine is ------------------------------------------------------------------------------------


def _tool(argv: Sequence[str]) -> str | None:
    """A tool's stdout, or None when it is absent, fails or takes longer than _TOOL_TIMEOUT_S."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo, sysctl on macOS), else platform's answer."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        out = _tool(("sysctl", "-n", "machdep.cpu.brand_string"))
        if out and out.strip():
            return out.strip()
    import platform

    return platform.processor() or platform.machine() or "CPU"


def apple_name(chip: str, gpu_cores: int) -> str | None:
    """The profile name of an Apple chip as sysctl's machdep.cpu.brand_string gives it ("Apple M3 Max", 40 ->
    apple-m3-max-40); None when the string is not an Apple M chip."""
    m = re.fullmatch(r"\s*Apple\s+M(\d+)(?:\s+(Pro|Max|Ultra))?\s*", chip, re.IGNORECASE)
    if not m:
        return None
    variant = f"-{m.group(2).lower()}" if m.group(2) else ""
    return f"apple-m{m.group(1)}{variant}-{gpu_cores}"


def _apple_gpu_cores() -> tuple[int | None, str]:
    """The GPU's core count: ioreg's gpu-core-count (AGXAccelerator), else system_profiler's "Total Number of
    Cores"; and which said it."""
    out = _tool(("ioreg", "-rd1", "-c", "AGXAccelerator"))
    m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', out or "")
    if m:
        return int(m.group(1)), "ioreg gpu-core-count"
    out = _tool(("system_profiler", "SPDisplaysDataType"))
    m = re.search(r"Total Number of Cores:\s*(\d+)", out or "")
    if m:
        return int(m.group(1)), "system_profiler Total Number of Cores"
    return None, "no GPU core count (ioreg, system_profiler)"


def _detect_apple(known: dict[str, HardwareProfile]) -> HardwareProfile | None:
    chip = (_tool(("sysctl", "-n", "machdep.cpu.brand_string")) or "").strip()
    if not chip.lower().startswith("apple m"):
        return None
    cores, how = _apple_gpu_cores()
    said = f"sysctl machdep.cpu.brand_string: {chip!r}; {how}" + (f": {cores}" if cores else "")
    name = apple_name(chip, cores or 0)
    if name is None:
        return None
    if name in known:
        return known[name].model_copy(update={"detected_by": said})
    stem = name.rsplit("-", 1)[0] + "-"  # the same chip with another GPU core count: the closest one
    same = [p for n, p in known.items() if n.startswith(stem) and n[len(stem):].isdigit()]
    if same:
        best = min(same, key=lambda p: abs((p.gpu_cores or 0) - (cores or 0)))
        return best.model_copy(update={"detected_by": f"{said}; no profile {name}, the closest is {best.name}"})
    return HardwareProfile(name=name, chip=chip, backend=Backend.METAL, unified=True, gpu_cores=cores,
                           detected_by=f"{said}; no profile for {chip}: its figures are unknown (`ggfit hardware` "
                                       "lists the profiles, --hardware NAME picks one)")


def _nvidia_names() -> tuple[list[str], str]:
    """The GPUs' names: NVML (pynvml) where it is installed, else nvidia-smi; and which said it."""
    import importlib.util

    try:
        has_nvml = importlib.util.find_spec("pynvml") is not None
    except (ImportError, ValueError):  # a broken install, a module without a spec
        has_nvml = False
    if has_nvml:
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            try:
                names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                         for i in range(pynvml.nvmlDeviceGetCount())]
            finally:
                pynvml.nvmlShutdown()
            return [n.decode() if isinstance(n, bytes) else str(n) for n in names], "NVML"
        except Exception:  # no driver, no device: as without NVML  # noqa: BLE001
            pass
    out = _tool(("nvidia-smi", "--query-gpu=name", "--format=csv,noheader"))
    return ([ln.strip() for ln in out.splitlines() if ln.strip()] if out else []), "nvidia-smi"


def _norm(s: str) -> str:
    """An NVML name without case, punctuation and the NVIDIA prefix ("NVIDIA A100-SXM4-80GB" -> "a100 sxm4 80gb")."""
    return re.sub(r"[^a-z0-9]+", " ", s.lower()).strip().removeprefix("nvidia ")


def nvidia_profile(gpu: str, known: dict[str, HardwareProfile]) -> HardwareProfile | None:
    """The NVIDIA profile whose nvml_names holds `gpu` (case and punctuation aside), else None."""
    key = _norm(gpu)
    for p in known.values():
        if any(_norm(n) == key for n in p.nvml_names):
            return p
    return None


def _detect_nvidia(known: dict[str, HardwareProfile]) -> HardwareProfile | None:
    if sys.platform == "darwin" or (shutil.which("nvidia-smi") is None and not os.path.exists("/proc/driver/nvidia")):
        return None  # no NVIDIA driver: NVML is not even loaded
    names, how = _nvidia_names()
    if not names:
        return None
    said = f"{how}: {', '.join(names)}"
    p = nvidia_profile(names[0], known)
    if p is None:  # a GPU without a profile: still CUDA (the backend decides the memory fit), without figures
        return HardwareProfile(name=UNKNOWN_NVIDIA, chip=names[0], backend=Backend.CUDA, n_devices=len(names),
                               detected_by=f"{said}; no profile has that NVML name: its figures are unknown "
                                           "(`ggfit hardware` lists the profiles, --hardware NAME picks one)")
    n = sum(1 for g in names if nvidia_profile(g, known) == p)
    return p.model_copy(update={"detected_by": said, "n_devices": n})


def _cpu(known: dict[str, HardwareProfile], said: str) -> HardwareProfile:
    return known[CPU].model_copy(update={"chip": _cpu_model(), "detected_by": said})


def detect() -> HardwareProfile:
    """This machine's profile (`--hardware auto`): an Apple M chip by sysctl's brand string and its GPU cores
    (ioreg, system_profiler); an NVIDIA GPU by its NVML name (pynvml, else nvidia-smi); else `cpu`. Never raises:
    a missing tool is a fallback, and `detected_by` says what decided. A chip no profile names keeps its backend
    (metal, cuda) with no figures: an Apple chip as apple_name names it, an NVIDIA GPU as `nvidia-unknown`."""
    known = profiles()
    try:
        if sys.platform == "darwin":
            p = _detect_apple(known)
            if p is not None:
                return p
        p = _detect_nvidia(known)
        if p is not None:
            return p
    except Exception as e:  # a tool's odd output must not stop a fit  # noqa: BLE001
        return _cpu(known, f"detection failed ({type(e).__name__}: {e}): the CPU profile")
    return _cpu(known, "no Apple M chip (sysctl) and no NVIDIA GPU (NVML, nvidia-smi): the CPU profile")


def default_threads() -> int:
    """llama.cpp's default -t: the physical cores (common_cpu_get_num_physical_cores: Linux's distinct
    thread_siblings, macOS's hw.perflevel0.physicalcpu), else half the logical CPUs above 4. Hybrid x86 CPUs'
    efficiency cores are not left out here as common_cpu_get_num_math does."""
    if sys.platform.startswith("linux"):
        siblings = set()
        cpu = 0
        while True:
            try:
                with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings", encoding="ascii") as f:
                    siblings.add(f.readline())
            except OSError:
                break
            cpu += 1
        if siblings:
            return len(siblings)
    elif sys.platform == "darwin":
        for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
            out = (_tool(("sysctl", "-n", key)) or "").strip()
            if out.isdigit() and int(out) > 0:
                return int(out)
    n = os.cpu_count() or 0
    return (n if n <= 4 else n // 2) if n > 0 else 4


# --- host memory bandwidth -----------------------------------------------------------------------------------

_UNITS = {"": 1e9, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# compiled where a rate is read (re's own cache), not at every command's import
_RATE = r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(k|m|g|t|ki|mi|gi|ti)b\s*(?:/\s*s|ps)?\s*"


def parse_bandwidth(text: str, flag: str = "--host-bandwidth") -> float:
    """A memory bandwidth as a user writes it ("90GB/s", "90 GB/s", "900MB/s", "1.2TB/s", "80GiB/s") -> GB/s
    (1e9 bytes per second, as vendors and STREAM state it); anything else is one line (HardwareError)."""
    m = re.fullmatch(_RATE, text, re.IGNORECASE)
    if not m:
        raise HardwareError(f"{flag} {text}: use a rate with its unit, e.g. 90GB/s, 900MB/s, 1.2TB/s")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()] / 1e9
    if not (value > 0 and math.isfinite(value)):
        raise HardwareError(f"{flag} {text}: the rate must be above 0")
    return value


def _machine_key() -> str:
    """What a cached measurement belongs to: the host's name, CPU model and memory size."""
    import platform

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    return f"{platform.node()}|{_cpu_model()}|{mem}"


def _copy_rate(mib: int, seconds: float, threads: int, clock: Callable[[], float]) -> float:
    """GB/s of the fastest of a few copies of a `mib` MiB float64 array into another, in `threads` slices at once
    (numpy releases the GIL in a contiguous copy), repeated until `seconds` have passed (at least 2 copies)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    n = mib * 2**20 // 8
    src = np.ones(n)  # touched: every page is mapped before the clock starts
    dst = np.zeros(n)
    step = -(-n // threads)
    parts = [(dst[i:i + step], src[i:i + step]) for i in range(0, n, step)]
    best = math.inf
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        start = clock()
        for rep in range(20):
            t0 = clock()
            list(pool.map(lambda p: np.copyto(p[0], p[1]), parts))
            best = min(best, clock() - t0)
            if rep >= 1 and clock() - start > seconds:
                break
    return 2 * n * 8 / best / 1e9  # read + write bytes, as STREAM's Copy counts them


def measure_host_bandwidth(*, refresh: bool = False, mib: int = 256, seconds: float = 0.5,
                           threads: int | None = None) -> tuple[float, str]:
    """This host's memory bandwidth in GB/s and where the figure comes from, measured once per machine and cached
    in ggfit's cache directory (`host-bandwidth.json` under fitter.cache.cache_root(), with the date).

    The measure is STREAM's Copy kernel done with numpy: a `mib` MiB array (256 MiB, far beyond any last-level cache)
    copied into another, in `threads` slices at once (default llama.cpp's default -t), the fastest of the copies
    made within about `seconds` (about 1 s in all with the arrays' first touch and numpy's import). As STREAM does,
    each copy counts the bytes read plus the bytes written (2 x 256 MiB), not the write-allocate reads the caches
    add. `refresh` measures again."""
    path = os.path.join(cache_root(), BANDWIDTH_CACHE)
    key = _machine_key()
    if not refresh:
        try:
            with open(path, encoding="utf-8") as f:
                cached = json.load(f)
            if cached.get("machine") == key and float(cached["gbs"]) > 0:
                return float(cached["gbs"]), f"measured here {cached['date']}, STREAM copy with numpy; cached in {path}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    n_threads = threads or default_threads()
    gbs = _copy_rate(mib, seconds, n_threads, time.perf_counter)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    record = {"gbs": round(gbs, 2), "date": date, "machine": key, "threads": n_threads, "mib": mib,
              "method": "STREAM copy with numpy: bytes read + written / the fastest copy's time"}
    return round(gbs, 2), f"measured here {date}, STREAM copy with numpy; {write_cache(path, record)}"


def write_cache(path: str, record: dict[str, Any]) -> str:
    """A measurement's record written to `path` (a temporary name, then renamed); "cached in PATH", or why not."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, path)
        return f"cached in {path}"
    except OSError as e:
        return f"not cached: {e.strerror or e}"


def resolve(name: str = "auto", host_bandwidth: str | None = None, *,
            measure: Callable[[], tuple[float, str]] | None = None) -> HardwareProfile:
    """`--hardware NAME|auto` with `--host-bandwidth RATE`: the profile, its host bandwidth set. The host side is the
    flag's; else, for this machine (auto, or the profile auto detects), the one measured here (cached; `measure`
    replaces measure_host_bandwidth); else, on unified memory, the chip's own memory bandwidth; else unknown (None),
    and the source says --host-bandwidth sets it."""
    auto = name.strip().lower() == "auto"
    p = detect() if auto else get_profile(name)
    gbs: float | None
    if host_bandwidth is not None:
        gbs, src = parse_bandwidth(host_bandwidth), f"--host-bandwidth {host_bandwidth}"
    elif auto or detect().name == p.name:
        gbs, src = (measure or measure_host_bandwidth)()
    elif p.unified and p.memory_bandwidth_gbs:
        gbs, src = p.memory_bandwidth_gbs, "unified memory: the chip's memory bandwidth (--host-bandwidth sets it)"
    else:
        gbs, src = None, f"not known for {p.name} on another machine: --host-bandwidth sets it"
    return p.model_copy(update={"host_bandwidth_gbs": gbs, "host_bandwidth_source": src})


def profile_dict(p: HardwareProfile) -> dict[str, Any]:
    """A profile as JSON-ready values (the backend by its value; tuples as lists)."""
    out: dict[str, Any] = {}
    for n in HardwareProfile._names:
        v = getattr(p, n)
        out[n] = v.value if isinstance(v, Backend) else list(v) if isinstance(v, tuple) else v
    return out
