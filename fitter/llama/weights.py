"""Model weights by placement: which buffer each tensor lands in and each buffer's size.

Mirrors `llama_model::load_tensors` (src/llama-model.cpp): the input layer (token embeddings) stays
on the CPU, repeating layers and the output layer go to the GPU from `i_gpu_start` on, and a
backend that can wrap host memory (CPU, Metal) maps the mmapped file range of its tensors
(`llama_model_loader::get_mapping_range`) instead of allocating a copy.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from fitter.ggml import backends
from fitter.ggml.types import pad
from fitter.gguf.reader import GGUFHeader, TensorInfo
from fitter.llama.cparams import Backend
from fitter.llama.hparams import GENERIC_RULES, LayerKind, ModelSpec
from fitter.llama.models import rules_of

# LLM_TENSOR_INFOS entries of kind LLM_TENSOR_LAYER_INPUT (src/llama-arch.cpp)
INPUT_TENSORS = ("token_embd", "position_embd", "token_types", "per_layer_token_embd")
_BLOCK = re.compile(r"^blk\.(\d+)\.")



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


# Tensors the architectures' load_tensors create once per layer: the first normally, the rest with
# TENSOR_DUPLICATED (llama, mistral3, phi3: every trunk layer; gemma4: full-attention layers only).
# (Which architectures tie the output, and where: ArchRules in fitter.llama.models.)
PER_LAYER_GLOBALS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


class TensorInstance(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    tensor: TensorInfo
    where: int | str  # "input", "output" or a layer index
    duplicated: bool = False  # created with TENSOR_DUPLICATED
    created_first: bool = False  # a duplicate created before the original (it cannot reuse it)


def tensor_instances(header: GGUFHeader, spec: ModelSpec, *, load_mtp: bool = False) -> list[TensorInstance]:
    """Every tensor llama.cpp creates, with its layer.

    A tied output (no output.weight) is token_embd created again for the output layer, and per-layer
    globals once per using layer (TENSOR_DUPLICATED). llama_model_loader::create_tensor reuses a
    duplicate's original when it already sits in the same buffer type's context; otherwise the
    duplicate gets its own memory in an allocating buffer (with mmap it shares the file's bytes).
    """
    names = {t.name for t in header.tensors}
    rules = rules_of(spec.architecture) or GENERIC_RULES
    out: list[TensorInstance] = []
    for t in header.tensors:
        base = t.name.rsplit(".", 1)[0]
        m = _BLOCK.match(t.name)
        if m:
            il = int(m.group(1))
            if il >= spec.n_layer and not load_mtp:
                continue  # NextN layers: TENSOR_SKIP unless load_mtp
            out.append(TensorInstance(tensor=t, where=il))
        elif base in INPUT_TENSORS:
            out.append(TensorInstance(tensor=t, where="input"))
            if base == "token_embd" and "output.weight" not in names and rules.tied_output:
                out.append(TensorInstance(tensor=t, where="output", duplicated=True,
                                          created_first=rules.output_before_tok_embd))
        elif base in PER_LAYER_GLOBALS:
            users = [lay.index for lay in spec.layers[: spec.n_layer]
                     if not rules.per_layer_globals_full_only or lay.kind == LayerKind.FULL]
            out.extend(TensorInstance(tensor=t, where=il, duplicated=i > 0) for i, il in enumerate(users))
        else:
            out.append(TensorInstance(tensor=t, where="output"))
    return out


def weight_buffers(
    header: GGUFHeader,
    spec: ModelSpec,
    backend: Backend,
    *,
    n_gpu_layers: int = -1,
    use_mmap: bool = True,
    load_mtp: bool = False,
    alloc_size=None,
) -> list[WeightBuffer]:
    """The model buffers llama.cpp creates. `alloc_size(tensor, backend)` may inflate tensor sizes
    (CUDA pads quantized rows); by default a tensor takes its ggml_nbytes."""
    n_layer_all = len(spec.layers)
    i_gpu_start = gpu_layer_start(n_layer_all, n_gpu_layers)
    device = backends.get(backend)

    def on_gpu(where: int | str) -> bool:
        if not device.is_gpu or where == "input":
            return False  # dev_input is always the CPU
        if where == "output":
            return n_layer_all >= i_gpu_start
        return int(where) >= i_gpu_start

    groups: dict[tuple[bool, int], list[TensorInfo]] = {}
    created: set[tuple[bool, str]] = set()
    for inst in tensor_instances(header, spec, load_mtp=load_mtp):
        gpu = on_gpu(inst.where)
        key = (gpu, inst.tensor.name)
        if inst.duplicated and key in created and not inst.created_first:
            continue  # create_tensor found the original in this buffer type's context and reused it
        created.add(key)
        groups.setdefault((gpu, inst.tensor.shard), []).append(inst.tensor)

    out: list[WeightBuffer] = []
    for gpu in (False, True):
        dev_backend = backend if gpu else Backend.CPU
        impl = backends.get(dev_backend)
        dev = impl.name
        shards = sorted(s for (g, s) in groups if g == gpu)
        if not shards:
            continue
        if use_mmap and impl.maps_host_memory:
            # one buffer per file, spanning the file range of its tensors (get_mapping_range)
            for s in shards:
                ts = list({t.name: t for t in groups[(gpu, s)]}.values())
                first = min(t.offset for t in ts)
                last = max(t.offset + t.nbytes for t in ts)
                out.append(WeightBuffer(buffer=f"{dev}_Mapped", on_device=gpu, bytes=last - first,
                                        tensor_bytes=sum(t.nbytes for t in ts), n_tensors=len(ts), shard=s))
        else:
            # ggml_backend_alloc_ctx_tensors_from_buft: every instance padded to the buffer's alignment;
            # without mmap the CPU side uses the GPU's pinned host buffer type (CUDA_Host)
            align = impl.alignment
            if not gpu:
                dev = device.host_buffer_name
            ts = [t for s in shards for t in groups[(gpu, s)]]
            size = sum(pad(alloc_size(t, dev_backend) if alloc_size else t.nbytes, align) for t in ts)
            out.append(WeightBuffer(buffer=dev, on_device=gpu, bytes=size, tensor_bytes=sum(t.nbytes for t in ts),
                                    n_tensors=len(ts), shard=shards[0]))
    return out
