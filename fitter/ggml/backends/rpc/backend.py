"""The RPC backend's device and buffer type as a CPU rpc-server answers them (ggml-rpc.cpp; rules in __init__.py).

Each `--rpc` endpoint is one device, RPC0, RPC1, ... in the order given, before any local GPU. The buffer type's
alignment, max size and alloc sizes are the remote default buffer type's: a CPU server's are the CPU's (32,
SIZE_MAX, ggml_nbytes). supports_op is true for every op and offload_op is NULL, so no op of a host weight moves to
an RPC device; there is no host buffer type, so inputs, outputs and CPU ops use the CPU's.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fitter.ggml.backends.base import HOST_ALIGNMENT, Backend, BackendImpl, Overhead
from fitter.ggml.tensor import Tensor

if TYPE_CHECKING:
    from fitter.ggml.backends.probes import DeviceProbes, FreeMemory

_DEVICE = r"RPC\d+"  # compiled on first use (re's cache), not at every command's import


class RPCBackend(BackendImpl):
    """RPC devices served by CPU rpc-servers, the main host's CPU beside them (ggml_backend_rpc_device_i)."""

    kind = Backend.RPC
    name = "RPC0"  # ggml_backend_rpc_add_server: "RPC" + a device number counted over every server
    host_buffer_name = "CPU"  # get_host_buffer_type NULL: the CPU's buffer type for inputs and outputs
    registry = "RPC"
    alignment = HOST_ALIGNMENT  # RPC_CMD_GET_ALIGNMENT of a CPU server's default buffer type
    maps_host_memory = False  # caps.buffer_from_host_ptr false: the remote's weights are copied into its buffers
    is_gpu = True  # ggml_backend_rpc_device_get_type: GGML_BACKEND_DEVICE_TYPE_GPU
    remote = True
    label = "RPC"
    has_host_buffer_type = False
    keeps_layer_pins = True
    # the default margins (fitter.fit.margin), measured here (benchmarks/results/rpc-cpu-here.json)
    overhead = Overhead(45 << 20, "a CPU rpc-server's resident memory beyond its buffers (measured here)")
    host_overhead = Overhead(51 << 20, "the main llama-server's resident memory beyond its host buffers, beside CPU "
                                       "rpc-servers (measured here)")  # checked against real loads (an RPC dry run allocates nothing on the servers)

    def free_memory(self, probes: DeviceProbes) -> FreeMemory:
        raise NotImplementedError("an RPC device's memory is asked of its server: fitter.ggml.backends.rpc.protocol")

    def is_device_buffer(self, buffer: str) -> bool:
        return bool(re.fullmatch(_DEVICE, buffer))

    def supports_op(self, t: Tensor) -> bool:
        return True  # ggml_backend_rpc_device_supports_op: the remote is not asked

    def offload_op(self, t: Tensor) -> bool:
        return False  # offload_op NULL: ggml_backend_dev_offload_op answers false
