"""The buffers an mmproj allocates: its weights and the compute buffer of its warmup graph.

clip_ctx (tools/mtmd/clip.cpp): the CLIP backend is the first GPU (ggml_backend_init_by_type GPU, else IGPU)
unless --no-mmproj-offload (mtmd_context_params.use_gpu false), else the CPU. load_tensors allocates every tensor
it loads in one buffer of that backend's default buffer type (ggml_backend_alloc_ctx_tensors_from_buft: each
tensor's alloc size padded to the alignment). warmup builds the graph of one dummy image of warmup_image_size
a side (get_dummy_batch) and reserves it on a scheduler of [the backend, the CPU] (reserve_compute_meta):
"compute buffer size" per backend. With -fa auto, flash attention is tried first and kept where the backend
runs it (the CPU runs every FLASH_ATTN_EXT).

llama-server with --fit (its default) first measures the same context (mtmd_get_memory_usage: the tensors'
ggml_nbytes, unpadded, plus the compute buffers) and frees it again; only the second, real context stays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from fitter.cache import CACHES
from fitter.ggml import backends
from fitter.ggml.alloc import SIZE_MAX, Gallocr
from fitter.ggml.backends.base import Backend, BackendImpl
from fitter.ggml.graph import Segment
from fitter.ggml.sched import Placement, split_graph
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import pad
from fitter.gguf.reader import GGUFHeader
from fitter.mtmd.graph import ClipGraph
from fitter.mtmd.hparams import ClipHparams, MmprojError, check_text_model, load_clip_hparams
from fitter.mtmd.models import BUILDERS


@dataclass(frozen=True)
class MmprojBuffer:
    device: str  # llama.cpp's buffer type name: CPU, CUDA0, MTL0
    kind: Literal["model", "compute"]
    bytes: int
    on_device: bool  # in the GPU's own memory (else host memory)
    detail: str
    grows_to: int = 0  # compute: the size clip_encode grows it to for the largest image (0: never larger), not counted


def mirrored(proj_type: str) -> bool:
    return proj_type in BUILDERS


def warmup_graph(hp: ClipHparams, flash_attn: bool, size: int = 0) -> ClipGraph:
    """clip_model_loader::warmup's graph: one dummy image of warmup_image_size x warmup_image_size (or size x size)."""
    sz = size or hp.warmup_image_size
    c = ClipGraph(hp, sz, sz, flash_attn)
    c.ctx.track = []  # every tensor created: the scheduler's segment
    out = BUILDERS[hp.proj_type](c)
    c.g.expand(out)
    return c


def weight_bytes(hp: ClipHparams, backend: Backend, on_gpu: bool) -> int:
    """load_tensors' buffer: every tensor, its alloc size padded to the buffer type's alignment."""
    impl = backends.get(backend) if on_gpu else backends.get(Backend.CPU)
    return sum(pad(impl.tensor_alloc_size(int(t.ggml_type), t.shape, t.nbytes), impl.alignment)
               for t in hp.tensors.values())


def mmproj_buffers(header: GGUFHeader, path: str, backend: Backend, *, offload: bool = True,
                   flash_attn: str = "auto", n_embd_text: int = 0) -> list[MmprojBuffer]:
    """The mmproj's buffers on `backend` (the text model's): weights, then compute. A projector type whose graph is
    not mirrored gets its weights only (and says so in the row's detail). `n_embd_text`: the text model's input
    width (llama_model_n_embd_inp), which the projector's must be (0: not checked)."""
    hp = load_clip_hparams(header, path)
    check_text_model(hp, n_embd_text)
    impl = backends.get(backend)
    on_gpu = offload and impl.is_gpu
    dev = impl.name if on_gpu else "CPU"
    what = f"{len(hp.tensors)} tensors, {hp.proj_type} projector"
    if hp.has_audio:  # mtmd's second clip context: its own weight buffer (the same padded bytes), its own compute
        what += "; with an audio encoder, whose compute buffer is not modelled"
    out = [MmprojBuffer(dev, "model", weight_bytes(hp, backend, on_gpu), on_gpu, what)]
    if not mirrored(hp.proj_type):
        out[0] = MmprojBuffer(dev, "model", out[0].bytes, on_gpu,
                              out[0].detail + f"; its compute buffer is not modelled ({hp.proj_type} graph)")
        return out
    sz = hp.warmup_image_size
    if not on_gpu:
        fa = flash_attn != "off"  # -fa auto: tried first, and the CPU runs it
        size = _cpu_size(hp, fa)
        what = f"warmup image {sz}x{sz}, flash attention {'on' if fa else 'off'}"
        grows = _cpu_size(hp, fa, hp.largest_image_size) if hp.largest_image_size > sz else 0
        out.append(MmprojBuffer("CPU", "compute", size, False, what + _larger(hp, grows), max(grows, size) if grows else 0))
        return out
    # clip_model_loader::warmup with -fa auto: reserve with flash attention; when the GPU lacks a FLASH_ATTN_EXT of
    # the graph, reserve again without it. ggml_gallocr_reserve_n only grows a buffer: each keeps the larger size.
    sizes, fa_on = _gpu_reserve(hp, impl, flash_attn != "off")
    if flash_attn == "auto" and not fa_on:
        sizes = [max(a, b) for a, b in zip(sizes, _gpu_reserve(hp, impl, False)[0])]
    used = flash_attn == "on" or (flash_attn == "auto" and fa_on)
    what = f"warmup image {sz}x{sz}, flash attention {'on' if used else 'off'}"
    if flash_attn == "auto" and not fa_on:
        what += f" (not on {impl.name} for these heads: reserved with it, then without)"
    grows = _gpu_reserve(hp, impl, used, hp.largest_image_size)[0][0] if hp.largest_image_size > sz else 0
    grows = max(grows, sizes[0]) if grows else 0
    out.append(MmprojBuffer(dev, "compute", sizes[0], True, what + _larger(hp, grows), grows))
    if sizes[1] > 1:  # reserve_compute_meta prints (and allocates) only buffers above 1 byte
        out.append(MmprojBuffer("CPU", "compute", sizes[1], False, "the graph's inputs (image, positions, masks)"))
    return out


def _cpu_size(hp: ClipHparams, flash_attn: bool, size: int = 0) -> int:
    c = warmup_graph(hp, flash_attn, size)
    return Gallocr(backends.get(Backend.CPU).alignment).run(c.g.nodes, c.g.leafs)


def _larger(hp: ClipHparams, grows: int) -> str:
    """A note (not counted, as llama.cpp's own estimate does not count it): clip_encode grows the compute buffer for
    an image larger than the warmup's (ggml_backend_sched_alloc_graph -> ggml_gallocr_reserve_n, which only grows);
    `grows`: its size for the largest square image."""
    if not grows:
        return ""
    side = hp.largest_image_size
    return (f"; an image up to {side}x{side} grows it to {grows / 2**20:,.1f} MiB when encoded "
            "(not counted: llama.cpp reserves the warmup's)")


def _gpu_reserve(hp: ClipHparams, impl: BackendImpl, flash_attn: bool, size: int = 0) -> tuple[list[int], bool]:
    """reserve_compute_meta on clip's scheduler [the GPU, the CPU] (the CPU's own buffer type, not the pinned host
    one): the warmup graph placed and split (fitter.ggml.sched), the backend's graph_optimize, then ggml-alloc per
    buffer. Returns (the GPU's and the CPU's sizes, whether the GPU runs every FLASH_ATTN_EXT)."""
    c = warmup_graph(hp, flash_attn, size)
    created = list(c.ctx.track or ())
    seg = Segment(c.g.nodes, c.g.leafs, created, None, None, 0)
    pl = Placement(layer_dev=[0], dev_in=0, dev_out=0, supports=impl.supports_op, offload=impl.offload_op,
                   graph_optimize=impl.graph_optimize, every_input=impl.build.has("sched_copies_every_input"))

    def dev_size(t: Tensor) -> int:
        return impl.copy_size(t) if t.op == "NONE" else impl.alloc_size(t)

    fa_ok = all(impl.supports_op(n) for n in c.g.nodes if n.op == "FLASH_ATTN_EXT")
    split_graph([seg], pl, dev_size, {})
    pl.graph_optimize([seg])
    cpu = backends.get(Backend.CPU)
    ga = Gallocr([impl.alignment, cpu.alignment], [dev_size, Tensor.nbytes],
                 max_buffer_size=[impl.max_size(), SIZE_MAX])
    ga.run(seg.nodes, seg.leafs)
    return ga.sizes(), fa_ok


_CACHE: dict[tuple, list[MmprojBuffer]] = CACHES.keep({}, "mmproj")


def mmproj_buffers_of_file(path: str, backend: Backend, *, offload: bool = True,
                           flash_attn: str = "auto", n_embd_text: int = 0) -> list[MmprojBuffer]:
    """mmproj_buffers for the file at `path` (its header read once per file version; a missing, truncated or
    foreign file is one MmprojError line naming --mmproj)."""
    from fitter.errors import GGFitError
    from fitter.gguf.reader import read_header

    try:
        st = os.stat(path)
    except OSError as e:
        raise MmprojError(f"--mmproj {path}: {'no such file' if isinstance(e, FileNotFoundError) else e.strerror or e}") from None
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns, backend, offload, flash_attn, n_embd_text)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    try:
        header = read_header(path)
    except MmprojError:
        raise
    except GGFitError as e:
        raise MmprojError(f"--mmproj {path}: {str(e).removeprefix(f'{path}: ')}") from None
    rows = mmproj_buffers(header, path, backend, offload=offload, flash_attn=flash_attn, n_embd_text=n_embd_text)
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[key] = rows
    return rows


def check_mmproj_models(path: str, backend: Backend, models: list[str], *, offload: bool = True) -> None:
    """--mmproj beside each of `models` (resolved paths): a bad file, or a projector mtmd_context refuses beside a
    model (check_text_model), as one MmprojError line before anything runs (optimise: before its first trial)."""
    from fitter.llama.model import load_model_spec, n_embd_inp

    for m in models:
        header, spec = load_model_spec(m)
        mmproj_buffers_of_file(path, backend, offload=offload, n_embd_text=n_embd_inp(header, spec.n_embd))

