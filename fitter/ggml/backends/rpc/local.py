"""RPC devices beside the main host's own GPU (`llama-server --rpc A,B` on a CUDA machine): RPC0, RPC1, ..., CUDA0.

llama_model_load (src/llama.cpp) puts the RPC devices first and the local GPUs after them, so -ts lists RPC0, RPC1,
..., CUDA0 and the scheduler's priority order is the same, the CPU last. Each device keeps its own backend's rules:
an RPC device a CPU server's (fitter.ggml.backends.rpc.backend), CUDA0 ggml-cuda's (alloc sizes, op support, the
offload of ops on host weights, graph_optimize over its own splits). What the main host keeps:
- CPU weights without mmap: make_cpu_buft_list takes the first device's host buffer type that exists: CUDA_Host;
- the output buffer: llama_context::output_reserve takes dev_output's host buffer type (CUDA_Host when the output
  layer is on CUDA0, the CPU's when it is on an RPC device);
- the host compute buffer: llama_context takes model.devices[0]'s host buffer type, RPC0's, which has none: CPU.
In a placement (fitter.llama.weights) the local GPU's device id is LOCAL, after any RPC device's.
"""

from __future__ import annotations

from typing import Callable

from fitter.ggml.backends.base import Backend, BackendImpl, FlashAttnShape
from fitter.ggml.backends.cuda.backend import CUDABackend, cuda_fa_unsupported_reason
from fitter.ggml.backends.cuda.fusion import cuda_alloc_deps
from fitter.ggml.backends.rpc.backend import RPCBackend

LOCAL = 128  # the local GPU's device id in a placement: after every RPC device's (rpc.backend.REMOTE_IDS)


class RPCLocalCUDABackend(RPCBackend):
    """RPC devices (a CPU rpc-server each) and the main host's CUDA0 after them; the CPU beside them."""

    kind = Backend.RPC_CUDA
    label = "RPC+CUDA"
    local_gpus = 1
    has_host_buffer_type = True  # CUDA0's CUDA_Host takes the CPU weights before the extra buffer types
    cpu_weight_buffer = "CUDA_Host"
    host_buffer_name = "CPU"  # the host compute buffer: RPC0's host buffer type, none
    keeps_layer_pins = True  # a real load's scheduler, on every device
    # the margins: CUDA0's context and pool, and llama-server's resident memory on a CUDA host (the larger figures)
    overhead = CUDABackend.overhead
    host_overhead = CUDABackend.host_overhead

    def __init__(self) -> None:
        self.local: BackendImpl = CUDABackend()
        self.remote_impl: BackendImpl = RPCBackend()

    def on(self, device: int) -> BackendImpl:
        return (self.local.for_build(self.build) if device >= LOCAL
                else self.remote_impl.for_build(self.build).on(device))

    def device_ids(self, n_gpus: int, remote: tuple[str, ...] = ()) -> list[int]:
        return [*super().device_ids(n_gpus - self.local_gpus, remote), *(LOCAL + i for i in range(self.local_gpus))]

    def device_names(self, n_gpus: int) -> list[str]:
        return [self.buffer_name(i) for i in self.device_ids(n_gpus)]

    def buffer_name(self, device: int) -> str:
        return self.local.buffer_name(device - LOCAL) if device >= LOCAL else super().buffer_name(device)

    def is_device_buffer(self, buffer: str) -> bool:
        return super().is_device_buffer(buffer) or self.local.is_device_buffer(buffer)

    def fa_auto_unsupported_reason_on(self, shapes: list[FlashAttnShape]) -> str | None:
        """-fa auto (llama_context::resolve_fused_ops): an attention layer on CUDA0 whose FLASH_ATTN_EXT CUDA cannot
        run moves the node off its layer's device, and flash attention goes off; RPC devices take every op."""
        for s in shapes:
            why = cuda_fa_unsupported_reason(s)
            if why:
                return f"CUDA0: {why}"
        return None

    def graph_optimize_on(self, own: frozenset[int]) -> Callable[[list], None]:
        """ggml_backend_graph_optimize per split: CUDA's alloc deps over CUDA0's splits (scheduler ids `own`) only."""
        if not self.build.has("cuda_fusion_alloc_deps"):
            return lambda segments: None
        return lambda segments: cuda_alloc_deps(segments, own=own)
