"""Model weights by placement: which buffer each tensor lands in and each buffer's size.

Mirrors `llama_model::load_tensors` (src/llama-model.cpp): the input layer (token embeddings) stays
on the CPU, repeating layers and the output layer go to the GPU from `i_gpu_start` on, and a
backend that can wrap host memory (CPU, Metal) maps the mmapped file range of its tensors
(`llama_model_loader::get_mapping_range`) instead of allocating a copy.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple, Sequence

from fitter.cache import CACHES
from fitter.ggml import backends
from fitter.ggml.types import pad
from fitter.gguf.reader import GGUFHeader, TensorInfo
from fitter.llama.cparams import Backend, ConfigError
from fitter.llama.hparams import GENERIC_RULES, LayerKind, ModelSpec
from fitter.llama.models import rules_of
from fitter.record import Record

# LLM_TENSOR_INFOS entries of kind LLM_TENSOR_LAYER_INPUT (src/llama-arch.cpp)
INPUT_TENSORS = ("token_embd", "position_embd", "token_types", "per_layer_token_embd")
_BLOCK = re.compile(r"^blk\.(\d+)\.")



class WeightBuffer(Record):
    """One "model buffer size" line of llama.cpp's load log."""

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


CPU_DEV = -1  # a tensor, layer or cache in host memory (the CPU device's buffer types)


def device_buffer_name(impl: backends.BackendImpl, i: int) -> str:
    """GPU number i's buffer type name (ggml_backend_cuda_buffer_type(i): CUDA0, CUDA1, ...)."""
    return impl.buffer_name(i)


class WeightPlacement(Record):
    """Where llama_model::load_tensors puts each tensor: the device of each layer (the output layer last;
    llama-model.cpp get_layer_buft_list), then the tensor overrides (llama_model_loader::create_tensor:
    the first pattern std::regex_search finds in the name wins). A device is a GPU index or CPU_DEV."""

    layer_dev: tuple[int, ...]  # n_layer_all + 1 entries
    overrides: tuple[tuple[re.Pattern[str], int], ...] = ()
    devices: tuple[int, ...] = ()  # llama_model::devices: the GPUs the model may use (-sm none: the main GPU alone)

    @property
    def gpus(self) -> list[int]:
        """The GPUs holding layers or overridden tensors, in llama_model::devices' order (the scheduler's backends:
        RPC devices' ids carry their server's backend, so id order is not device order)."""
        order = {d: i for i, d in enumerate(self.devices)}
        return sorted({d for d in self.layer_dev if d != CPU_DEV} | {d for _, d in self.overrides if d != CPU_DEV},
                      key=lambda d: (order.get(d, len(order)), d))

    def default_dev(self, where: int | str) -> int:
        if where == "input":
            return CPU_DEV  # dev_input is always the CPU
        return self.layer_dev[-1] if where == "output" else self.layer_dev[int(where)]

    def device_of(self, name: str, where: int | str) -> int:
        for pattern, dev in self.overrides:
            if pattern.search(name):
                return dev
        return self.default_dev(where)


def weight_placement(n_layer_all: int, backend: Backend, n_gpu_layers: int = -1, *,
                     overrides: Sequence[tuple[str, str]] = (), n_gpus: int = 1,
                     tensor_split: Sequence[float] | None = None, split_mode: str = "layer",
                     main_gpu: int = 0, remote: tuple[str, ...] = ()) -> WeightPlacement:
    """llama_model::load_tensors' layer assignment (llama-model.cpp) and the overrides' buffer types by name, as
    common/arg.cpp parse_tensor_buffer_overrides accepts them (each device's default buffer type: CPU, CUDA0, ...).
    Without -ts the layers split by free memory, taken as equal on every GPU."""
    key = (n_layer_all, backend, n_gpu_layers, tuple(map(tuple, overrides)), n_gpus,
           None if tensor_split is None else tuple(tensor_split), split_mode, main_gpu, remote)
    hit = _PLACEMENTS.get(key)
    if hit is None:  # every prediction asks (frozen: one answer can serve them all)
        hit = _weight_placement(n_layer_all, backend, n_gpu_layers, overrides, n_gpus, tensor_split, split_mode,
                                main_gpu, remote)
        if len(_PLACEMENTS) >= 64:
            _PLACEMENTS.clear()
        _PLACEMENTS[key] = hit
    return hit


_PLACEMENTS: dict[tuple, WeightPlacement] = CACHES.keep({}, "weights")


def _weight_placement(n_layer_all: int, backend: Backend, n_gpu_layers: int, overrides: Sequence[tuple[str, str]],
                      n_gpus: int, tensor_split: Sequence[float] | None, split_mode: str,
                      main_gpu: int, remote: tuple[str, ...] = ()) -> WeightPlacement:
    impl = backends.get(backend)
    if not impl.is_gpu:
        return WeightPlacement(layer_dev=(CPU_DEV,) * (n_layer_all + 1), overrides=_overrides(overrides, impl, []))
    if split_mode in ("row", "tensor"):
        # make_gpu_buft_list: the pinned build's CUDA backend registers no split buffer type
        raise ConfigError(f"-sm {split_mode}: llama.cpp fails the load here (\"device {impl.name} does not support "
                          f"split buffers\"); use -sm layer or -sm none")
    if n_gpus > 1 and impl.single_device:
        raise ConfigError(f"{n_gpus} GPUs (-ts, -mg): {impl.label} has one device ({impl.name})")
    if main_gpu >= n_gpus:
        raise ConfigError(f"-mg {main_gpu}: there are {n_gpus} GPU(s) (0 to {n_gpus - 1})")
    if tensor_split is not None and len(tensor_split) > n_gpus:
        raise ConfigError(f"-ts {','.join(f'{x:g}' for x in tensor_split)}: {len(tensor_split)} proportions for "
                          f"{n_gpus} GPU(s)")
    # llama_model_load: -sm none keeps the main GPU alone
    ids = impl.device_ids(n_gpus, remote)  # RPC devices first, then a local GPU (fitter.ggml.backends.rpc)
    devices = [ids[main_gpu]] if split_mode == "none" else ids
    ts = list(tensor_split or ())[: len(devices)] if split_mode != "none" else []
    ts += [0.0] * (len(devices) - len(ts))
    splits = ts if any(x > 0 for x in ts) else [1.0] * len(devices)
    total, acc = sum(splits), 0.0
    points = []
    for x in splits:
        acc += x
        points.append(acc / total)
    i_gpu_start = gpu_layer_start(n_layer_all, n_gpu_layers)
    act = min(n_layer_all + 1 if n_gpu_layers < 0 else n_gpu_layers, n_layer_all + 1)
    layer_dev = []
    for il in range(n_layer_all + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            layer_dev.append(CPU_DEV)
            continue
        # std::upper_bound over the split points, in float as llama.cpp computes it
        x = _f32(float(il - i_gpu_start) / act)
        k = next((i for i, p in enumerate(points) if _f32(p) > x), len(points) - 1)
        layer_dev.append(devices[min(k, len(devices) - 1)])
    return WeightPlacement(layer_dev=tuple(layer_dev), overrides=_overrides(overrides, impl, ids),
                           devices=tuple(devices))


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _overrides(overrides: Sequence[tuple[str, str]], impl: backends.BackendImpl, gpu_ids: list[int]) -> tuple:
    known = {"CPU": CPU_DEV, **{impl.buffer_name(i): i for i in gpu_ids}}
    out = []
    for pattern, buft in overrides:
        if buft not in known:
            raise ConfigError(f"-ot {pattern}={buft}: unknown buffer type (llama.cpp's available buffer types here: "
                              f"{', '.join(sorted(known))})")
        out.append((re.compile(pattern), known[buft]))
    return tuple(out)


# Tensors the architectures' load_tensors create once per layer: the first normally, the rest with
# TENSOR_DUPLICATED (llama, mistral3, phi3: every trunk layer; gemma4: full-attention layers only).
# (Which architectures tie the output, and where: ArchRules in fitter.llama.models.)
PER_LAYER_GLOBALS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


class TensorInstance(NamedTuple):  # one per tensor and placement asked: a tuple is made faster than a frozen dataclass
    # (object.__setattr__ per field) or a pydantic model (~1 us each), and its class 4M instructions cheaper
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


# (device, shard) -> the header index of each tensor instance llama.cpp creates there, in creation order, and of
# each tensor once (the last of a name, at its first place: a mapped range counts a tensor made twice once)
_Groups = dict[tuple[int, int], tuple[list[int], list[int]]]
_CREATED: dict[tuple, _Groups] = CACHES.keep({}, "weights")


def _created(header: GGUFHeader, spec: ModelSpec, load_mtp: bool, pl: WeightPlacement | None) -> _Groups:
    """The tensors llama.cpp creates, by device and file (_Groups); pl None: all on the CPU. By the tensors' names and
    files, the layers and the placement: the quants of one model (a header each) share it."""
    tensors = header.tensors
    shards = tuple(t.shard for t in tensors) if len(header.shards) > 1 else None  # one file: every shard 0
    key = (tuple([t.name for t in tensors]), shards, spec.architecture, spec.n_layer,
           tuple(lay.kind for lay in spec.layers[: spec.n_layer]), load_mtp, pl)
    hit = _CREATED.get(key)
    if hit is not None:
        return hit
    index = {id(t): i for i, t in enumerate(tensors)}
    groups: dict[tuple[int, int], list[int]] = {}
    created: set[tuple[int, str]] = set()
    for inst in tensor_instances(header, spec, load_mtp=load_mtp):
        d = pl.device_of(inst.tensor.name, inst.where) if pl is not None else CPU_DEV
        k = (d, inst.tensor.name)
        if inst.duplicated and k in created and not inst.created_first:
            continue  # create_tensor found the original in this buffer type's context and reused it
        created.add(k)
        groups.setdefault((d, inst.tensor.shard), []).append(index[id(inst.tensor)])
    out = {g: (every, list({tensors[i].name: i for i in every}.values())) for g, every in groups.items()}
    if len(_CREATED) >= 16:
        _CREATED.pop(next(iter(_CREATED)))
    _CREATED[key] = out
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
    placement: WeightPlacement | None = None,
) -> list[WeightBuffer]:
    """The model buffers llama.cpp creates. `alloc_size(tensor, backend)` may inflate tensor sizes
    (CUDA pads quantized rows); by default a tensor takes its ggml_nbytes. `placement` (default: -ngl alone on one
    GPU) says which device holds each tensor."""
    device = backends.get(backend)
    pl = placement or weight_placement(len(spec.layers), backend, n_gpu_layers)

    tensors = header.tensors
    groups = _created(header, spec, load_mtp, pl if device.is_gpu else None)

    out: list[WeightBuffer] = []
    for d in [CPU_DEV] + sorted({g for g, _ in groups if g != CPU_DEV}):
        gpu = d != CPU_DEV
        impl = device.on(d) if gpu else backends.get(Backend.CPU)
        name = device.buffer_name(d) if gpu else impl.name
        shards = sorted(s for (g, s) in groups if g == d)
        if not shards:
            continue
        if use_mmap and impl.maps_host_memory:
            # one buffer per file, spanning the file range of its tensors (get_mapping_range)
            for s in shards:
                ts = [tensors[i] for i in groups[(d, s)][1]]
                first = min(t.offset for t in ts)
                last = max(t.offset + t.nbytes for t in ts)
                out.append(WeightBuffer(buffer=f"{name}_Mapped", on_device=gpu, bytes=last - first,
                                        tensor_bytes=sum(t.nbytes for t in ts), n_tensors=len(ts), shard=s))
        else:
            # ggml_backend_alloc_ctx_tensors_from_buft: every instance padded to the buffer's alignment;
            # without mmap the CPU side uses the GPU's pinned host buffer type (CUDA_Host)
            align = impl.alignment
            if not gpu:
                name = device.cpu_weight_buffer or device.host_buffer_name
            ts = [tensors[i] for s in shards for i in groups[(d, s)][0]]
            size = sum(pad(alloc_size(t, impl) if alloc_size else t.nbytes, align) for t in ts)
            out.append(WeightBuffer(buffer=name, on_device=gpu, bytes=size, tensor_bytes=sum(t.nbytes for t in ts),
                                    n_tensors=len(ts), shard=shards[0]))
    return out
