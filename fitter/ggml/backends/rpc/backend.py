"""The RPC backend's device and buffer type as a CPU rpc-server answers them (ggml-rpc.cpp; rules in __init__.py).

Each `--rpc` endpoint is one device, RPC0, RPC1, ... in the order given, before any local GPU. The buffer type's
alignment, max size and alloc sizes are the remote default buffer type's: a CPU server's are the CPU's (32,
SIZE_MAX, ggml_nbytes). supports_op is true for every op and offload_op is NULL, so no op of a host weight moves to
an RPC device; there is no host buffer type, so inputs, outputs and CPU ops use the CPU's.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fitter.ggml.backends.base import HOST_ALIGNMENT, Backend, BackendError, BackendImpl, Overhead
from fitter.ggml.tensor import Tensor
from fitter.llama_builds import LlamaBuild

if TYPE_CHECKING:
    from fitter.ggml.backends.probes import DeviceProbes, FreeMemory

_DEVICE = r"RPC\d+"  # compiled on first use (re's cache), not at every command's import
# A placement's device id of an RPC device (fitter.llama.weights): its RPC number plus the offset of its server's
# backend (llama.cpp's registry names), so each device answers with its server's buffer type (rpc/remote.py); the
# main host's own GPU after them is rpc.local.LOCAL (128)
SLOT = 32
REMOTE_GPU = 32  # a CUDA rpc-server's device
REMOTE_METAL = 64  # a Metal rpc-server's device (a Mac: rpc-server -d MTL0)
REMOTE_IDS = {"CPU": 0, "CUDA": REMOTE_GPU, "MTL": REMOTE_METAL}


def _server_offset(name: str) -> int:
    """The id offset of a server's backend by llama.cpp's registry name (METAL: MTL, as --rpc-backend takes it)."""
    key = {"METAL": "MTL"}.get(name.strip().upper(), name.strip().upper())
    if key not in REMOTE_IDS:
        raise BackendError(f"rpc-server backend '{name}': CPU, CUDA or MTL (a Mac's Metal)")
    return REMOTE_IDS[key]


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

    def on(self, device: int) -> BackendImpl:
        """A device a GPU rpc-server serves (id REMOTE_GPU or REMOTE_METAL + n) has that GPU's buffer type
        (rpc/remote.py)."""
        served = self.remote_servers.get(device - device % SLOT)
        return served.for_build(self.build) if served is not None else self

    # the devices of GPU rpc-servers by their id offset (rpc/remote.py; set by rpc/__init__)
    remote_servers: dict[int, BackendImpl] = {}

    def device_ids(self, n_gpus: int, remote: tuple[str, ...] = ()) -> list[int]:
        return [i + (_server_offset(remote[i]) if i < len(remote) else 0) for i in range(n_gpus)]

    def buffer_name(self, device: int) -> str:
        return f"RPC{device % SLOT}"

    def fa_alloc_reads_kv_type(self, build: LlamaBuild, queries_per_stream: int) -> bool:
        """A GPU server's FLASH_ATTN_EXT alloc size may read the K/V type (CUDA's f16 copies, Metal's strides): the
        compute graph keeps the cache types as given (exact for CPU servers too, one cached graph fewer)."""
        return True

    def free_memory(self, probes: DeviceProbes) -> FreeMemory:
        raise NotImplementedError("an RPC device's memory is asked of its server: fitter.ggml.backends.rpc.protocol")

    def is_device_buffer(self, buffer: str) -> bool:
        return bool(re.fullmatch(_DEVICE, buffer))

    def supports_op(self, t: Tensor) -> bool:
        return True  # ggml_backend_rpc_device_supports_op: the remote is not asked

    def offload_op(self, t: Tensor) -> bool:
        return False  # offload_op NULL: ggml_backend_dev_offload_op answers false
