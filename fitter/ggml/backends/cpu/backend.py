"""The CPU backend: ggml-cpu's buffer type (ggml_backend_cpu_buffer_type) and device.

TENSOR_ALIGNMENT 32 (ggml/src/ggml-impl.h), no get_max_size, no get_alloc_size (ggml_nbytes), every
op supported; mmapped weights are wrapped in place (CPU_Mapped). Not a buffer, so not predicted:
the graph plan's work buffer (`ggml_graph_plan` -> cplan.work_size), malloc'd outside the compute
buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitter.ggml.backends.base import Backend, BackendImpl, Overhead

if TYPE_CHECKING:
    from fitter.ggml.backends.probes import DeviceProbes, FreeMemory


class CPUBackend(BackendImpl):
    """The CPU alone (the defaults of BackendImpl are the CPU's)."""

    kind = Backend.CPU
    # llama-server's resident memory beyond its buffers after a decode, measured here (pinned build, gemma3-270m:
    # 12 MiB of program text, 30 MiB of heap and thread stacks)
    overhead = Overhead(48 << 20, "llama-server's program and heap beyond its buffers (measured here)")

    def free_memory(self, probes: DeviceProbes) -> FreeMemory:
        """The host's available RAM: MemAvailable, vm_stat (cpu/memory.py)."""
        from fitter.ggml.backends.cpu import memory  # (its probes import ctypes: only for `auto`)

        return memory.free_memory(probes)
