"""Model weights by placement: which buffer each tensor lands in and each buffer's size.

Mirrors `llama_model::load_tensors` (src/llama-model.cpp): the input layer (token embeddings) stays
on the CPU, repeating layers and the output layer go to the GPU from `i_gpu_start` on, and a
backend that can wrap host memory (CPU, Metal) maps the mmapped file range of its tensors
(`llama_model_loader::get_mapping_range`) instead of allocating a copy.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from fitter.config import Backend, pad
from fitter.gguf_reader import GGUFHeader, TensorInfo

# LLM_TENSOR_INFOS entries of kind LLM_TENSOR_LAYER_INPUT (src/llama-arch.cpp)
INPUT_TENSORS = ("token_embd", "position_embd", "token_types", "per_layer_token_embd")
_BLOCK = re.compile(r"^blk\.(\d+)\.")

DEVICE_NAME = {Backend.CPU: "CPU", Backend.CUDA: "CUDA0", Backend.METAL: "MTL0"}
# ggml_backend_dev_get_props(...).caps.buffer_from_host_ptr
MAPS_HOST_MEMORY = {Backend.CPU: True, Backend.CUDA: False, Backend.METAL: True}
ALIGNMENT = {Backend.CPU: 32, Backend.CUDA: 128, Backend.METAL: 32}  # each default buffer type's get_alignment


class WeightBuffer(BaseModel):
    """One "model buffer size" line of llama.cpp's load log."""

    model_config = ConfigDict(frozen=True)

    buffer: str  # llama.cpp's buffer name: CPU_Mapped, CPU, CUDA0, MTL0_Mapped, ...
    on_device: bool  # counts against the GPU's memory (Metal's mapped buffers do)
    bytes: int
    tensor_bytes: int  # the tensors' own bytes (llama_model_size counts these; a mapped range adds padding)
    n_tensors: int
    shard: int


def gpu_layer_start(n_layer_all: int, n_gpu_layers: int) -> int:
    """i_gpu_start in llama_model::load_tensors; a negative n_gpu_layers offloads everything."""
    n_gpu = n_layer_all + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer_all + 1)
    return max(n_layer_all + 1 - n_gpu, 0)


def tensor_on_gpu(t: TensorInfo, n_layer_all: int, i_gpu_start: int) -> bool:
    base = t.name.rsplit(".", 1)[0]
    if base in INPUT_TENSORS:
        return False  # dev_input is always the CPU
    m = _BLOCK.match(t.name)
    if m:
        return int(m.group(1)) >= i_gpu_start
    return n_layer_all >= i_gpu_start  # output layer and other model-level tensors: dev_output


def weight_buffers(
    header: GGUFHeader,
    n_layer_all: int,
    backend: Backend,
    *,
    n_gpu_layers: int = -1,
    use_mmap: bool = True,
    n_layer: int | None = None,
    load_mtp: bool = False,
    alloc_size=None,
) -> list[WeightBuffer]:
    """The model buffers llama.cpp creates. `alloc_size(tensor, backend)` may inflate tensor sizes
    (CUDA pads quantized rows); by default a tensor takes its ggml_nbytes. Tensors of NextN layers
    (index >= n_layer) are skipped unless `load_mtp` (TENSOR_SKIP in the arch's load_tensors)."""
    i_gpu_start = gpu_layer_start(n_layer_all, n_gpu_layers)
    groups: dict[tuple[bool, int], list[TensorInfo]] = {}
    for t in header.tensors:
        if n_layer is not None and not load_mtp:
            m = _BLOCK.match(t.name)
            if m and int(m.group(1)) >= n_layer:
                continue
        gpu = backend != Backend.CPU and tensor_on_gpu(t, n_layer_all, i_gpu_start)
        groups.setdefault((gpu, t.shard), []).append(t)

    out: list[WeightBuffer] = []
    for gpu in (False, True):
        dev_backend = backend if gpu else Backend.CPU
        dev = DEVICE_NAME[dev_backend]
        shards = sorted(s for (g, s) in groups if g == gpu)
        if not shards:
            continue
        if use_mmap and MAPS_HOST_MEMORY[dev_backend]:
            # one buffer per file, spanning the file range of its tensors (get_mapping_range)
            for s in shards:
                ts = groups[(gpu, s)]
                first = min(t.offset for t in ts)
                last = max(t.offset + t.nbytes for t in ts)
                out.append(WeightBuffer(buffer=f"{dev}_Mapped", on_device=gpu, bytes=last - first,
                                       tensor_bytes=sum(t.nbytes for t in ts), n_tensors=len(ts), shard=s))
        else:
            # ggml_backend_alloc_ctx_tensors_from_buft: every tensor padded to the buffer's alignment
            align = ALIGNMENT[dev_backend]
            ts = [t for s in shards for t in groups[(gpu, s)]]
            size = sum(pad(alloc_size(t, dev_backend) if alloc_size else t.nbytes, align) for t in ts)
            out.append(WeightBuffer(buffer=dev, on_device=gpu, bytes=size, tensor_bytes=sum(t.nbytes for t in ts),
                                   n_tensors=len(ts), shard=shards[0]))
    return out
