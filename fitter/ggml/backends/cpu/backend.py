"""The CPU backend: ggml-cpu's buffer type (ggml_backend_cpu_buffer_type) and device.

TENSOR_ALIGNMENT 32 (ggml/src/ggml-impl.h), no get_max_size, no get_alloc_size (ggml_nbytes), every
op supported; mmapped weights are wrapped in place (CPU_Mapped). Not a buffer, so not predicted:
the graph plan's work buffer (`ggml_graph_plan` -> cplan.work_size), malloc'd outside the compute
buffer.
"""

from __future__ import annotations

from fitter.ggml.backends.base import Backend, BackendImpl


class CPUBackend(BackendImpl):
    """The CPU alone (the defaults of BackendImpl are the CPU's)."""

    kind = Backend.CPU
