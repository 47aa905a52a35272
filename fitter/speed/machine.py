"""This machine's profile for a prediction that must stay cheap (`fit`, `quants`, each probe): detected once, its host
memory bandwidth measured (once, then cached by fitter.speed.hardware) only where a prediction reads weights from
host memory: weights on the CPU beside a GPU backend, or the CPU backend; and this CPU's matrix rates (measured once
per thread count, then cached by fitter.speed.cpu_rate) only where the CPU backend runs the model."""

from __future__ import annotations

from typing import Any

from fitter.ggml import backends
from fitter.ggml.backends.base import Backend
from fitter.llama.weights import CPU_DEV
from fitter.speed import hardware
from fitter.speed.hardware import HardwareProfile
from fitter.speed.work import Work, work_of


def weights_on_host(work: Work) -> bool:
    """Weights a token reads from host memory: a layer's, experts, or more than 1% of its bytes (the token
    embedding's one row always is on the CPU)."""
    w = work.devices.get(CPU_DEV)
    if w is None:
        return False
    total = sum(sum(d.bytes_token.values()) for d in work.devices.values())
    return bool(w.n_layers or w.expert_bytes or sum(w.bytes_token.values()) > 0.01 * total)


def host_needed(header: Any, spec: Any, config: Any, backend: Backend, n_gpus: int = 1) -> bool:
    """Whether this config's rates depend on the host memory's bandwidth."""
    return not backends.get(backend).is_gpu or weights_on_host(work_of(header, spec, config, backend, n_gpus))


def with_host(p: HardwareProfile, needed: bool) -> HardwareProfile:
    """This machine's profile `p` with its host bandwidth: on unified memory the chip's; else, where needed, measured
    here (cached); else as it is (unknown: the model assumes a desktop's)."""
    if p.host_bandwidth_gbs:
        return p
    if p.unified and p.memory_bandwidth_gbs:
        return p.model_copy(update={"host_bandwidth_gbs": p.memory_bandwidth_gbs,
                                    "host_bandwidth_source": "unified memory: the chip's memory bandwidth"})
    if needed:
        gbs, src = hardware.measure_host_bandwidth()
        return p.model_copy(update={"host_bandwidth_gbs": gbs, "host_bandwidth_source": src})
    return p


def with_cpu_rate(p: HardwareProfile, threads: int, needed: bool, *, refresh: bool = False) -> HardwareProfile:
    """This machine's profile `p` with its CPU's matrix rates at `threads` (fitter.speed.cpu_rate: measured once per
    thread count, then cached) where `needed` (the CPU backend runs the model); as it is where the measurement
    fails (the fitted per-thread rate stands) or where it carries rates already; `refresh` measures again."""
    if p.cpu_prefill_gflops or not needed or threads < 1:
        return p
    from fitter.speed.cpu_rate import CpuRateError, measure_cpu_rate

    try:
        r = measure_cpu_rate(threads, refresh=refresh)
    except CpuRateError as e:
        return p.model_copy(update={"cpu_rate_source": f"not measured: {e}"})
    return p.model_copy(update={"cpu_prefill_gflops": r.prefill_gflops, "cpu_decode_gflops": r.decode_gflops,
                                "cpu_rate_source": f"{r.source} (-t {threads})"})


def detect() -> HardwareProfile:
    return hardware.detect()


__all__ = ["detect", "host_needed", "weights_on_host", "with_cpu_rate", "with_host"]
