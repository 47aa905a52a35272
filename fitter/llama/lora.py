"""LoRA adapters (`--lora FILE`, `--lora-scaled FILE:SCALE`): their buffers and what they add to the graph.

Mirrors src/llama-adapter.cpp `llama_adapter_lora_init_impl`: the adapter's GGUF must say general.type "adapter",
adapter.type "lora" and the base model's architecture; its tensors are `<base tensor>.lora_a` / `.lora_b` pairs
(`*_norm.weight` tensors are skipped). Each pair is copied into a buffer of the buffer type of the base tensor it
modifies (one buffer per buffer type, `ggml_backend_alloc_ctx_tensors_from_buft`; the log line
`<buf> LoRA buffer size = X MiB`), so the adapter's bytes land per device like the base weights (-ngl, -ot,
--n-cpu-moe). The graph side (build_lora_mm, build_lora_mm_id, build_inp_embd in src/llama-graph.cpp) reads
`lora_graph`, a GraphDetails field (see fitter.llama.graph.GraphContext.lora_mm).
"""

from __future__ import annotations

import os
from typing import Sequence

from fitter.cache import CACHES
from fitter.errors import GGFitError, GGUFError, SourceError
from fitter.ggml import backends
from fitter.ggml.backends import tensor_info_alloc_size
from fitter.ggml.types import pad
from fitter.gguf.reader import GGUFHeader, TensorInfo, read_header
from fitter.llama.cparams import Backend
from fitter.llama.graph_details import GraphDetails
from fitter.llama.hparams import ModelSpec
from fitter.llama.weights import CPU_DEV, WeightPlacement, device_buffer_name, tensor_instances
from fitter.record import Record


class LoraError(GGFitError):
    """An adapter file llama.cpp refuses (llama_adapter_lora_init_impl's reasons, in its words)."""


class LoraAdapter(Record):
    """One adapter file as llama_adapter_lora_init_impl reads it."""

    path: str
    arch: str  # general.architecture: must be the base model's
    scale: float  # --lora-scaled's SCALE (1.0 for --lora); 0 loads the weights but leaves the graph alone
    alpha: float  # adapter.lora.alpha (0: the scale alone)
    pairs: tuple[tuple[str, TensorInfo, TensorInfo], ...]  # (base tensor name, lora_a, lora_b), by name (std::map)
    alora_invocation_tokens: int = 0  # adapter.alora.invocation_tokens: host memory only (a std::vector)


_ADAPTERS: dict[tuple, LoraAdapter] = CACHES.keep({}, "lora")


def read_lora(path: str, scale: float = 1.0) -> LoraAdapter:
    """The adapter at `path`, checked as llama_adapter_lora_init_impl checks it (not yet against a base model)."""
    try:
        st = os.stat(path)
        key: tuple = (path, scale, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        key = ()
    hit = _ADAPTERS.get(key) if key else None
    if hit is not None:
        return hit
    where = f"--lora {path}"
    try:
        header = read_header(path)
    except (SourceError, GGUFError) as e:  # a missing file; a truncated or hostile GGUF
        raise LoraError(f"{where}: {str(e).removeprefix(f'{path}: ')}") from None
    md = header.metadata
    if md.get("general.type") != "adapter":
        raise LoraError(f"{where}: expect general.type to be 'adapter', but got: '{md.get('general.type') or ''}' "
                        "(not a LoRA adapter)")
    if md.get("adapter.type") != "lora":
        raise LoraError(f"{where}: expect adapter.type to be 'lora', but got: '{md.get('adapter.type') or ''}'")
    alpha = md.get("adapter.lora.alpha", 0.0)
    alora = md.get("adapter.alora.invocation_tokens")
    a_of: dict[str, TensorInfo] = {}
    b_of: dict[str, TensorInfo] = {}
    for t in header.tensors:
        if t.name.endswith(".lora_a"):
            a_of[t.name.removesuffix(".lora_a")] = t
        elif t.name.endswith(".lora_b"):
            b_of[t.name.removesuffix(".lora_b")] = t
        elif not t.name.endswith("_norm.weight"):  # norm vectors: skipped ("TODO: add support for norm vector")
            raise LoraError(f"{where}: LoRA tensor '{t.name}' has unexpected suffix")
    pairs = []
    for name in sorted(a_of.keys() | b_of.keys()):
        a, b = a_of.get(name), b_of.get(name)
        if a is None or b is None:
            raise LoraError(f"{where}: LoRA tensor pair for '{name}' is missing one component")
        pairs.append((name, a, b))
    out = LoraAdapter(path=path, arch=header.architecture or "", scale=scale, alpha=float(alpha) if isinstance(alpha, (int, float)) else 0.0,
                      pairs=tuple(pairs), alora_invocation_tokens=len(alora) if isinstance(alora, list) else 0)
    if key:
        if len(_ADAPTERS) >= 32:
            _ADAPTERS.clear()
        _ADAPTERS[key] = out
    return out


def check_lora(adapter: LoraAdapter, header: GGUFHeader, spec: ModelSpec) -> None:
    """llama_adapter_lora_init_impl's checks against the base model: its architecture, each pair's base tensor and
    shapes (token_embd's pair is flipped: lora_b non-transposed, as build_inp_embd reads it)."""
    where = f"--lora {adapter.path}"
    arch = adapter.arch
    if arch != spec.architecture:
        raise LoraError(f"{where}: model arch and LoRA arch mismatch (adapter {arch or 'none'}, model "
                        f"{spec.architecture})")
    for name, a, b in adapter.pairs:
        t = header.tensor(name)
        if t is None:
            raise LoraError(f"{where}: LoRA tensor '{name}' does not exist in base model (hint: maybe wrong base model?)")
        ne, na, nb = t.shape, a.shape, b.shape
        if name.endswith("token_embd.weight"):
            ok = ne[0] == nb[1] and ne[1] == na[1]
        else:
            ok = ne[0] == na[0] and ne[1] == nb[1]
            if ok and na[1] != nb[0]:
                raise LoraError(f"{where}: lora_a tensor is not transposed (hint: adapter from \"finetune\" example "
                                "is no longer supported)")
        if not ok:
            raise LoraError(f"{where}: tensor '{name}' has incorrect shape (hint: maybe wrong base model?)")


class LoraBuffer(Record):
    """One `<buf> LoRA buffer size = X MiB` line."""

    buffer: str
    on_device: bool
    bytes: int
    n_tensors: int


def lora_buffers(adapter: LoraAdapter, header: GGUFHeader, spec: ModelSpec, backend: Backend,
                 placement: WeightPlacement, *, use_mmap: bool = True) -> list[LoraBuffer]:
    """The adapter's buffers: each pair in the buffer type of its base tensor (`ggml_backend_buffer_get_type(
    model_tensor->buffer)`), sized as ggml_backend_alloc_ctx_tensors_from_buft sizes it: every tensor's
    get_alloc_size padded to the buffer type's alignment. A base tensor on the CPU sits in a mapped buffer with mmap
    (CPU_Mapped: the adapter's buffer takes that buffer type's name), else in the CPU's (or the GPU's pinned host)
    buffer type."""
    key = (id(adapter), id(header), backend, placement, use_mmap)
    hit = _BUFFERS.get(key)
    if hit is not None and hit[0] is adapter and hit[1] is header:  # the solver asks again and again
        return hit[2]
    check_lora(adapter, header, spec)
    impl = backends.get(backend)
    where_of: dict[str, int | str] = {}
    for inst in tensor_instances(header, spec, load_mtp=False):
        where_of.setdefault(inst.tensor.name, inst.where)
    groups: dict[int, list[TensorInfo]] = {}
    for name, a, b in adapter.pairs:
        where = where_of.get(name)
        if where is None:  # a tensor llama.cpp skips (a NextN layer without load_mtp): get_tensor finds none
            raise LoraError(f"--lora {adapter.path}: LoRA tensor '{name}' does not exist in base model "
                            "(hint: maybe wrong base model?)")
        d = placement.device_of(name, where) if impl.is_gpu else CPU_DEV
        groups.setdefault(d, []).extend((a, b))
    out = []
    for d in sorted(groups, key=lambda d: (d == CPU_DEV, d)):
        gpu = d != CPU_DEV
        dev_backend = backend if gpu else Backend.CPU
        dev_impl = backends.get(dev_backend)
        if gpu:
            name = device_buffer_name(impl, d)
            if use_mmap and dev_impl.maps_host_memory:  # Metal maps the file: ggml_backend_metal_buffer_type_mapped
                name += "_Mapped"
        elif use_mmap and dev_impl.maps_host_memory:
            name = f"{dev_impl.name}_Mapped"  # ggml_backend_cpu_buffer_from_ptr_type: "CPU_Mapped"
        else:
            name = impl.host_buffer_name if impl.is_gpu else dev_impl.name
        ts = groups[d]
        size = sum(pad(tensor_info_alloc_size(t, dev_backend), dev_impl.alignment) for t in ts)
        out.append(LoraBuffer(buffer=name, on_device=gpu, bytes=size, n_tensors=len(ts)))
    if len(_BUFFERS) >= 32:
        _BUFFERS.clear()
    _BUFFERS[key] = (adapter, header, out)
    return out


_BUFFERS: dict[tuple, tuple[LoraAdapter, GGUFHeader, list[LoraBuffer]]] = CACHES.keep({}, "lora")


def lora_details(details: GraphDetails, adapters: Sequence[LoraAdapter]) -> GraphDetails:
    """`details` with the adapters' graph (GraphDetails.lora_graph): per base tensor name, one (rank, lora_a type,
    lora_b type) per adapter the context applies, in the order build_lora_mm meets them. llama_context's `loras`
    is an std::unordered_map keyed by the adapter's pointer, filled in the given order by set_adapters_lora
    (zero scales left out); libstdc++ iterates it newest first (each new node goes to the front of the list).
    The same object for the same inputs (the compute caches key on its identity)."""
    live = [a for a in adapters if a.scale != 0.0][::-1]
    if not live:
        return details
    key = (id(details), tuple(id(a) for a in live))
    hit = _DETAILS.get(key)
    if hit is not None and hit[0] is details:
        return hit[1]
    graph: dict[str, list[tuple[int, int, int]]] = {}
    for a in live:
        for name, ta, tb in a.pairs:
            # get_scale: rank = lora_b ne[0]; the ranks and types shape the graph, the scale does not
            graph.setdefault(name, []).append((tb.shape[0], int(ta.ggml_type), int(tb.ggml_type)))
    out = details.model_copy(update={"lora_graph": {k: tuple(v) for k, v in graph.items()}})
    if len(_DETAILS) >= 32:
        _DETAILS.clear()
    _DETAILS[key] = (details, out, live)  # live: keeps the ids in the key from being reused
    return out


_DETAILS: dict[tuple, tuple] = CACHES.keep({}, "lora")
