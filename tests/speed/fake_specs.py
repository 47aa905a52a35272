"""A small hardware_specs stand-in: four profiles in the format of fitter.speed.hardware_specs.SPECS (some keys
absent, as the format allows), so that these tests do not depend on the real table's figures."""

from __future__ import annotations

import sys
import types

SPECS: tuple[dict[str, object], ...] = (
    {"name": "apple-m4-pro-20", "chip": "Apple M4 Pro", "backend": "metal", "unified": True,
     "memory_bandwidth_gbs": 273.0, "fp16_tflops": 9.2, "gpu_cores": 20, "memory_gib": (24, 48, 64),
     "sources": {"memory_bandwidth_gbs": "https://example.org/m4-pro", "gpu_cores": "https://example.org/m4-pro"}},
    {"name": "nvidia-rtx-4090", "chip": "NVIDIA GeForce RTX 4090", "backend": "cuda", "unified": False,
     "memory_bandwidth_gbs": 1008.0, "fp16_tflops": 165.2, "int8_tops": 660.6, "gpu_cores": 128, "memory_gib": (24,),
     "pcie_gbs": 32.0, "nvml_names": ["NVIDIA GeForce RTX 4090"],
     "sources": {"memory_bandwidth_gbs": "https://example.org/4090"}},
    {"name": "nvidia-h200", "chip": "NVIDIA H200", "backend": "cuda", "memory_bandwidth_gbs": 4800.0,
     "fp16_tflops": 989.5, "memory_gib": (141,), "pcie_gbs": 64.0, "nvml_names": ("NVIDIA H200", "NVIDIA H200 NVL")},
    {"name": "cpu", "chip": "CPU", "backend": "cpu", "unified": False, "memory_bandwidth_gbs": None},
)


def use(monkeypatch) -> tuple[dict[str, object], ...]:
    """fitter.speed.hardware_specs replaced by SPECS for one test (hardware imports it lazily, by name)."""
    monkeypatch.setitem(sys.modules, "fitter.speed.hardware_specs", types.SimpleNamespace(SPECS=SPECS))
    return SPECS
