"""An RPC device served by a GPU rpc-server: RPC's ops, the remote GPU's buffer type. A CUDA server
(`ggml-rpc-server -d CUDA0`, RPCRemoteCUDABackend) or a Mac's Metal one (`rpc-server -d MTL0`, RPCRemoteMetalBackend).

ggml-rpc.cpp asks the server once for its default buffer type's alignment and max size (RPC_CMD_GET_ALIGNMENT /
GET_MAX_SIZE: CUDA's 128 and SIZE_MAX), and asks it for a tensor's alloc size (RPC_CMD_GET_ALLOC_SIZE) only where
ggml_backend_rpc_buffer_type_get_alloc_size says so: a quantized non-view tensor with ne[0] % 512 != 0 (CUDA pads its
last row: weights, a quantized KV cache, a split input copy) or an op whose size may expand
(ggml_op_alloc_size_may_expand: FLASH_ATTN_EXT, MUL_MAT, MUL_MAT_ID, CUMSUM, ARGSORT, TOP_K; CUDA adds FA's f16 K/V
copies), never below ggml_nbytes; every other tensor is ggml_nbytes. The client keeps each answer keyed by the
output's type, op, op_params, ne and nb, not its sources: later tensors of the same key get the first answer (the
reservation graph's). The device's ops are RPC's: supports_op true for every op (the remote is not asked, so -fa auto
keeps flash attention on even where CUDA has no kernel: the remote then aborts), offload_op NULL.
In a placement (fitter.llama.weights) such a device's id is rpc.backend.REMOTE_GPU (CUDA) or REMOTE_METAL + its RPC
number.

A Metal server (tools/rpc/rpc-server.cpp on macOS serves MTL0, ggml-metal's registry "MTL"): its default buffer type
(ggml_backend_metal_device_get_buffer_type: shared on Apple Silicon, private otherwise) answers GET_ALIGNMENT 32 (as the
CPU's) and GET_MAX_SIZE the device's maxBufferLength (the CPU's SIZE_MAX): the finite max size is what tells a Metal
server from a CPU one over the protocol (protocol.RemoteDevice.backend). Its alloc sizes are
ggml_backend_metal_buffer_type_get_alloc_size's (fitter.ggml.backends.metal) where the client asks; Metal pads no
quantized row, so what the client asks for a weight is ggml_nbytes. GET_DEVICE_MEMORY is ggml_metal_device_get_memory:
total the Mac's recommendedMaxWorkingSetSize, free that less what Metal has allocated (the budget of a local Mac,
unified memory included). No graph_optimize: the RPC backend's is NULL, so Metal's concurrency reorder never runs on
a graph the client allocates. Not modelled: maxBufferLength (SIZE_MAX here, as the local Metal backend without it),
and the client's cache of answers (a later FLASH_ATTN_EXT of the same output key, e.g. a full-attention layer after
a sliding-window one, gets the first layer's answer: ggfit's figure is then the larger).
"""

from __future__ import annotations

from typing import Any

from fitter.ggml.backends.base import BackendImpl, _nbytes_of, _op
from fitter.ggml.backends.cuda.backend import CUDA_ALIGNMENT, CUDABackend, cuda_tensor_alloc_size
from fitter.ggml.backends.metal.backend import METAL_ALIGNMENT, MetalBackend
from fitter.ggml.backends.rpc.backend import RPCBackend
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import BLCK

# ggml_op_alloc_size_may_expand (ggml-backend.cpp): the ops whose alloc size the RPC client asks of the remote
MAY_EXPAND = frozenset({"FLASH_ATTN_EXT", "MUL_MAT", "MUL_MAT_ID", "CUMSUM", "ARGSORT", "TOP_K"})


def client_asks(t: Any) -> bool:
    """Whether the client asks the remote for this tensor's alloc size (ggml_backend_rpc_buffer_type_get_alloc_size)."""
    view = getattr(t, "vs", None) or getattr(t, "view_src", None)
    return (BLCK[t.type] > 1 and t.ne[0] % 512 != 0 and view is None) or _op(t) in MAY_EXPAND


class RPCRemoteGPU(RPCBackend):
    """An RPC device whose server's default buffer type is a GPU's (`served`): its answer where the client asks,
    never below ggml_nbytes (ggml_backend_rpc_buffer_type_get_alloc_size), ggml_nbytes elsewhere."""

    served: BackendImpl  # the server's own backend (set by each subclass)
    sized_ops = MAY_EXPAND
    _asks = staticmethod(client_asks)

    def alloc_size(self, t: Any) -> int:
        size = _nbytes_of(t)
        return max(self.served.for_build(self.build).alloc_size(t), size) if self._asks(t) else size

    def compute_size(self, t: Tensor) -> int:
        return self.alloc_size(t) if self._asks(t) else t.nbytes()


class RPCRemoteCUDABackend(RPCRemoteGPU):
    """An RPC device whose server's default buffer type is CUDA0's."""

    alignment = CUDA_ALIGNMENT  # RPC_CMD_GET_ALIGNMENT: ggml_backend_cuda_buffer_type_get_alignment
    remote_backend = "CUDA"  # the server's backend, in llama.cpp's registry names
    overhead = CUDABackend.overhead  # the server's CUDA context and pool, as a local GPU's (fitter.fit.margin)

    def __init__(self) -> None:
        self.cuda = self.served = CUDABackend()

    def tensor_alloc_size(self, t: Any, ne: tuple[int, ...], size: int | None = None) -> int:
        return cuda_tensor_alloc_size(t, ne, size)  # a quantized weight or cache with ne[0] % 512 != 0: padded

    def copy_size(self, t: Tensor) -> int:
        return self.cuda.copy_size(t) if self._asks(t) else super().copy_size(t)


class RPCRemoteMetalBackend(RPCRemoteGPU):
    """An RPC device whose server is a Mac's Metal device (MTL0): Metal's buffer type, RPC's ops."""

    alignment = METAL_ALIGNMENT  # RPC_CMD_GET_ALIGNMENT: ggml_backend_metal_buffer_type_shared_get_alignment
    remote_backend = "MTL"  # ggml-metal.cpp GGML_METAL_NAME
    unified_memory = True  # the Mac's RAM: its budget is Metal's working set, as on a local Mac
    # the margin of a local Mac (fitter.ggml.backends.metal.evidence): what Metal holds outside its buffers
    overhead = MetalBackend.overhead
    margin_safety = MetalBackend.margin_safety

    def __init__(self) -> None:
        self.served = MetalBackend()  # its copy_size and tensor_alloc_size: ggml_nbytes, as the CPU's
