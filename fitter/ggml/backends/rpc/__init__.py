"""ggml-rpc (ggml/src/ggml-rpc/ggml-rpc.cpp): devices on other hosts, served by `rpc-server`, used through `--rpc`.

The rules ggfit mirrors (pinned build 0c1e57098bba; RPC protocol 7.0.0):
- Registration. `--rpc HOST:PORT,...` (common/arg.cpp add_rpc_devices) calls ggml_backend_rpc_add_server once per
  endpoint, in the order given. Each server answers RPC_CMD_DEVICE_COUNT; its devices become `RPC<n>` with n counted
  over all servers (a static dev_id), description = the endpoint. rpc-server (tools/rpc/rpc-server.cpp get_devices)
  offers its non-CPU devices, or, with none, its CPU device alone; `-d` names them.
- Device order. llama_model_load (src/llama.cpp) puts the RPC devices at the FRONT of model->devices, then the local
  GPUs ("to minimize network transfers"): `--rpc a,b` with a local CUDA GPU gives RPC0, RPC1, CUDA0. The CPU is never
  in the list (dev_input and CPU layers use it).
- Device facts (ggml_backend_rpc_device_*): type GPU; caps async and events (so pipeline parallelism applies,
  llama_context), no host buffer type, no buffer_from_host_ptr (weights are copied, never mmapped on the device);
  supports_op true for every op (the remote is not asked); offload_op NULL (never takes a host weight's op).
- Buffer type (ggml_backend_rpc_buffer_type): named `RPC<i>[HOST:PORT]` with i the device's index on its server (not
  the global n). Alignment and max size are asked once from the remote's default buffer type (RPC_CMD_GET_ALIGNMENT /
  GET_MAX_SIZE): a CPU server 32 and SIZE_MAX, as the CPU's; a CUDA one 128 and SIZE_MAX; a Mac's Metal one 32 and
  maxBufferLength (rpc/remote.py). get_alloc_size asks the remote only for a quantized
  non-view tensor with ne[0] % 512 != 0 or an op whose size may expand (ggml_op_alloc_size_may_expand), and never
  returns below ggml_nbytes: a CPU server gives ggml_nbytes throughout.
- Memory (ggml_backend_rpc_get_device_memory): RPC_CMD_GET_DEVICE_MEMORY returns the remote device's free and total
  (a CPU server: all physical RAM as both, ggml_backend_cpu_device_get_memory on Linux). Without -ts,
  llama_model::load_tensors splits the layers by these free figures, as for local GPUs.
- Buffers. Each RPC device holds what a local GPU would: its layers' weights (RPC_CMD_ALLOC_BUFFER, one buffer per
  buffer type), its layers' KV cache and recurrent state, and its compute buffer (sched_reserve). The main host keeps
  the input layer (token embedding: CPU_Mapped with mmap), the layers -ngl leaves on the CPU, the output buffer
  (logits: no host buffer type, so CPU) and the CPU compute buffer.
- Wire format (send_rpc_cmd / recv_msg): request = cmd (1 byte) | size (u64 LE) | payload; response = size (u64 LE) |
  payload. HELLO (14) first, payload 24 zero bytes of conn_caps, answer major, minor, patch, pad, 24 caps bytes;
  DEVICE_COUNT (15) no payload, answer u32; GET_DEVICE_MEMORY (11) u32 device, answer u64 free, u64 total.
"""

from __future__ import annotations

from fitter.ggml.backends.rpc.backend import REMOTE_GPU, REMOTE_METAL, RPCBackend
from fitter.ggml.backends.rpc.local import RPCLocalCUDABackend
from fitter.ggml.backends.rpc.remote import RPCRemoteCUDABackend, RPCRemoteMetalBackend

# the devices of a server whose GPU is CUDA or a Mac's Metal (RunConfig.rpc_backends)
RPCBackend.remote_servers = {REMOTE_GPU: RPCRemoteCUDABackend(), REMOTE_METAL: RPCRemoteMetalBackend()}

__all__ = ["RPCBackend", "RPCLocalCUDABackend", "RPCRemoteCUDABackend", "RPCRemoteMetalBackend"]
