"""The backends: each one's buffer types, alloc sizes and op support (ggml-cpu, ggml-cuda, ggml-metal, ggml-rpc).

One protocol, `BackendImpl` (fitter.ggml.backends.base: alignment, max size, get_alloc_size,
supports_op and the reasons behind it, offload_op, graph_optimize, buffer names, whether weights map
host memory, host or device, how free memory is read), one folder per backend (cpu/, cuda/, metal/, as upstream's
ggml-cpu, ggml-cuda, ggml-metal), and this registry. Adding a backend: one folder and one line in BACKENDS.
"""

from __future__ import annotations

from typing import Any

from fitter.ggml.backends.base import Backend, BackendError, BackendImpl
from fitter.ggml.backends.cpu import CPUBackend
from fitter.ggml.backends.cuda import CUDABackend
from fitter.ggml.backends.metal import MetalBackend
from fitter.ggml.backends.rpc import RPCBackend, RPCLocalCUDABackend

BACKENDS: dict[Backend, BackendImpl] = {
    Backend.CPU: CPUBackend(),
    Backend.CUDA: CUDABackend(),
    Backend.METAL: MetalBackend(),
    Backend.RPC: RPCBackend(),
    Backend.RPC_CUDA: RPCLocalCUDABackend(),
}


def get(backend: Backend | str) -> BackendImpl:
    """The backend named by a Backend or its value ("cpu", "cuda", "metal"; any case)."""
    if isinstance(backend, Backend):
        return BACKENDS[backend]
    try:
        return BACKENDS[Backend(str(backend).lower())]
    except ValueError:
        raise BackendError(f"backend '{backend}': use cpu, cuda, metal, rpc or rpc-cuda") from None


def tensor_info_alloc_size(t: Any, backend: Backend | str | BackendImpl) -> int:
    """The `alloc_size(tensor, backend)` hook of fitter.llama.weights.weight_buffers for a gguf TensorInfo (the
    backend, or the device's own BackendImpl where devices differ).

    Unaligned (the caller pads to the alignment): ggml_nbytes, plus MATRIX_ROW_PADDING on CUDA.
    """
    impl = backend if isinstance(backend, BackendImpl) else get(backend)
    return impl.tensor_alloc_size(t.ggml_type, t.shape, t.nbytes)


__all__ = ["BACKENDS", "BackendError", "BackendImpl", "get", "tensor_info_alloc_size"]
