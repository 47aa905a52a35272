"""An RPC device served by a CUDA rpc-server (`ggml-rpc-server -d CUDA0`): RPC's ops, the remote CUDA buffer type.

ggml-rpc.cpp asks the server once for its default buffer type's alignment and max size (RPC_CMD_GET_ALIGNMENT /
GET_MAX_SIZE: CUDA's 128 and SIZE_MAX), and asks it for a tensor's alloc size (RPC_CMD_GET_ALLOC_SIZE) only where
ggml_backend_rpc_buffer_type_get_alloc_size says so: a quantized non-view tensor with ne[0] % 512 != 0 (CUDA pads its
last row: weights, a quantized KV cache, a split input copy) or an op whose size may expand
(ggml_op_alloc_size_may_expand: FLASH_ATTN_EXT, MUL_MAT, MUL_MAT_ID, CUMSUM, ARGSORT, TOP_K; CUDA adds FA's f16 K/V
copies), never below ggml_nbytes; every other tensor is ggml_nbytes. The client keeps each answer keyed by the
output's type, op, op_params, ne and nb, not its sources: later tensors of the same key get the first answer (the
reservation graph's). The device's ops are RPC's: supports_op true for every op (the remote is not asked, so -fa auto
keeps flash attention on even where CUDA has no kernel: the remote then aborts), offload_op NULL.
In a placement (fitter.llama.weights) such a device's id is rpc.backend.REMOTE_GPU + its RPC number.
"""

from __future__ import annotations

from typing import Any

from fitter.ggml.backends.base import _nbytes_of, _op
from fitter.ggml.backends.cuda.backend import CUDA_ALIGNMENT, CUDABackend, cuda_tensor_alloc_size
from fitter.ggml.backends.rpc.backend import RPCBackend
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import BLCK

# ggml_op_alloc_size_may_expand (ggml-backend.cpp): the ops whose alloc size the RPC client asks of the remote
MAY_EXPAND = frozenset({"FLASH_ATTN_EXT", "MUL_MAT", "MUL_MAT_ID", "CUMSUM", "ARGSORT", "TOP_K"})


class RPCRemoteCUDABackend(RPCBackend):
    """An RPC device whose server's default buffer type is CUDA0's (ggml_backend_rpc_buffer_type_get_alloc_size)."""

    alignment = CUDA_ALIGNMENT  # RPC_CMD_GET_ALIGNMENT: ggml_backend_cuda_buffer_type_get_alignment
    remote_backend = "CUDA"  # the server's backend, in llama.cpp's registry names

    def __init__(self) -> None:
        self.cuda = CUDABackend()

    def _asks(self, t: Any) -> bool:
        """Whether the client asks the remote for this tensor's alloc size."""
        view = getattr(t, "vs", None) or getattr(t, "view_src", None)
        return (BLCK[t.type] > 1 and t.ne[0] % 512 != 0 and view is None) or _op(t) in MAY_EXPAND

    def alloc_size(self, t: Any) -> int:
        size = _nbytes_of(t)
        return max(self.cuda.for_build(self.build).alloc_size(t), size) if self._asks(t) else size

    sized_ops = MAY_EXPAND

    def compute_size(self, t: Tensor) -> int:
        return self.alloc_size(t) if self._asks(t) else t.nbytes()

    def tensor_alloc_size(self, t: Any, ne: tuple[int, ...], size: int | None = None) -> int:
        return cuda_tensor_alloc_size(t, ne, size)  # a quantized weight or cache with ne[0] % 512 != 0: padded

    def copy_size(self, t: Tensor) -> int:
        return self.cuda.copy_size(t) if self._asks(t) else super().copy_size(t)
