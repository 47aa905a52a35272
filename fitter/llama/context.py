"""The compute buffers llama.cpp reserves, to the byte: llama_context::sched_reserve + graph_reserve.

llama.cpp sizes its compute buffers by building the worst-case graph (`llama_context::sched_reserve`
-> `graph_reserve`: n_tokens = min(n_ctx, n_ubatch) rounded up to a multiple of n_seq_max, n_seqs =
n_seq_max, n_outputs = min(n_tokens, n_outputs_max), attention over the whole KV cache), letting the
scheduler assign every op a backend and split the graph (`ggml_backend_sched_split_graph`), and
running ggml's graph allocator over it without allocating (`ggml_gallocr_reserve_n_size`): best fit
in graph order, in-place reuse of a dying parent, a tensor freed after its last use. Each buffer is
that allocator's high-water mark.

Here, from ModelSpec + ContextParams (+ GraphDetails, the few header facts ModelSpec lacks): the
architecture's graph builder (fitter.llama.models, over fitter.llama.graph's shared builders and
fitter.ggml's miniature ggml) is run one segment per distinct layer; for GPU backends the scheduler
(fitter.ggml.sched) and CUDA's graph_optimize alloc deps (fitter.ggml.backends.cuda.fusion) place
and split it; ggml-alloc (fitter.ggml.alloc) replays the segments layer by layer. Once the
allocator's state at a layer boundary repeats with the same layers ahead, the rest of the period
cannot raise the high-water mark and is skipped: ~1-3 ms per call for real models of 24-94 layers,
memoized on (spec, context, backend). The built, placed and split graph is traced with the KV caches' cell
counts and the ubatch's tokens symbolic (fitter.ggml.symbolic) and reused for another n_ctx or n_ubatch of the same
model and context where the trace's guards hold (fitter.llama.traced_graph): only the shapes they reach are evaluated
again before the allocator runs. A caller that asks each graph once (`predict_once`: `ggfit fit -c`) skips the trace.

Checked against llama.cpp (tests/test_compute.py, benchmarks/compute_error.py): byte-exact on the
CPU for the 15 architectures ggfit models (real-size sparse GGUFs and small variants, n_ctx 256 to
262144, n_ubatch 1 to 4096, every KV type, FA on/off, 1-4 sequences split or unified, MTP); CUDA
recorded from an H200 (full, partial and zero offload, MTP) exact to the printed 0.01 MiB. Metal
uses the same scheduler with Metal's alloc sizes (fitter.ggml.backends.metal) and Metal's graph_optimize
(fitter.ggml.backends.metal.common), whose reorder crosses layers: the distinct layers' segments are reordered as the
whole graph would be and allocated as repeating chunks (fitter.ggml.backends.metal.segments, replay.replay_chunks);
where the layers are not one Metal split, every layer is built and the graph is allocated whole (`_flatten`).
"""

from __future__ import annotations

import functools
import gc
from dataclasses import field
from typing import Callable

from fitter.cache import CACHES
from fitter.errors import UnsupportedModelError
from fitter.ggml import backends
from fitter.ggml.alloc import SIZE_MAX, AllocResult, Gallocr
from fitter.ggml.backends.base import Backend, BackendImpl
from fitter.ggml.backends.metal.backend import METAL_FA_KV_F16_TYPES
from fitter.ggml.sched import GGML_SCHED_MAX_COPIES, Placement
from fitter.ggml.symbolic import holds, trace
from fitter.ggml.tensor import HOST, Tensor, header_types_read
from fitter.ggml.types import type_name
from fitter.llama.cparams import ContextParams, reserve_ubatch
from fitter.llama.graph import GraphContext
from fitter.llama.graph_details import TYPE_FIELDS, GraphDetails
from fitter.llama.hparams import ModelSpec
from fitter.llama.layer_segments import (  # noqa: F401  (_emulate_full, _flatten, _simulate: tests and benchmarks)
    _build_full,
    _default_weight_type,
    _emulate_full,
    _flatten,
    _prepare,
    _prepare_mtp,
    _simulate,
)
from fitter.llama.models import default_details, has_mtp_graph, model_of
from fitter.llama.traced_graph import _TRACED, _TRACED_BY_CONTENT, _TRACED_MAX, TRACING, _Traced
from fitter.llama.weights import CPU_DEV, WeightPlacement, device_buffer_name, weight_placement
from fitter.record import Record


def _allocated(c: GraphContext, ga: Gallocr, details: GraphDetails | None, key: tuple | None,
               pl: Placement | None = None, copy_size: Callable[[Tensor], int] | None = None,
               content_key: tuple | None = None) -> AllocResult:
    """The graph of `c` allocated by `ga`: a traced graph of the same key (the model, the context but its cache
    sizes and ubatch, the placement) reused where its guards hold for these values, else built and traced. `content_key`:
    the same by content (the model less its file's facts and weight types); a graph that never read a weight's type
    serves every model of that content (the quants of one model)."""
    if key is not None:
        hit = _TRACED.get(key)
        if hit is not None and hit.spec is c.spec and hit.details is details:
            _TRACED[key] = _TRACED.pop(key)  # the most recently used last
        elif content_key is not None:
            hit = _TRACED_BY_CONTENT.get(content_key)
            if hit is not None and hit.types_read:
                hit = None
        else:
            hit = None
        if hit is not None:
            values = _Traced.values(c)
            if holds(hit.guards, values):
                hit.apply(values)
                if hit.types_read:
                    header_types_read[0] = True
                return hit.run(ga)
    prepare = _prepare_mtp if c.mtp else _prepare
    if key is None or not TRACING.on:
        return prepare(c, pl, copy_size)[0](ga)
    read_before = header_types_read[0]
    header_types_read[0] = False
    values = _Traced.values(c)
    c.symbolic = True
    plain = c.n_tokens, c.n_outputs
    try:
        with trace() as guards:
            c.trace_tokens()
            run, segs = prepare(c, pl, copy_size)
    finally:
        c.symbolic = False
        c.n_tokens, c.n_outputs = plain
    traced = _Traced(c, details, guards, run, segs, header_types_read[0], values)
    if len(_TRACED) >= _TRACED_MAX:
        _TRACED.pop(next(iter(_TRACED)))
    _TRACED[key] = traced
    out = run(ga)
    traced.types_read = header_types_read[0]  # by the graph or by its allocation (a backend's alloc sizes)
    header_types_read[0] = read_before or traced.types_read
    if content_key is not None and not traced.types_read:
        if len(_TRACED_BY_CONTENT) >= _TRACED_MAX:
            _TRACED_BY_CONTENT.pop(next(iter(_TRACED_BY_CONTENT)))
        _TRACED_BY_CONTENT[content_key] = traced
    return out


class ComputeBuffer(Record):
    """One `sched_reserve: <buffer> compute buffer size = X MiB` line of llama.cpp."""

    device: str  # llama.cpp's buffer type name: CPU, CUDA0, CUDA_Host, MTL0 ...
    bytes: int  # the buffer size llama.cpp reserves (the graph allocator's high-water mark)
    terms: dict[str, int]  # what was alive when the high-water mark was set, by kind, + "fragmentation"
    peak_tensors: list[tuple[str, int]] = field(default_factory=list)  # the largest tensors alive then (name, bytes)


# what each tensor name (as llama.cpp's graph callback names them, more or less) is, for the terms
_TERM_PREFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logits", ("result_output",)),
    ("output_norm", ("result_norm",)),
    ("kq_mask", ("attn_inp_kq_mask",)),
    ("inputs", ("inp_", "attn_inp_", "out_ids", "rs_s_copy", "embd", "token_embd", "per_layer_token_embd")),
    ("kq_scores", ("kq-", "kq_")),
    ("v_transposed", ("v_cont",)),
    ("attention", ("fattn", "kqv", "Qcur", "Kcur", "Vcur", "q-", "q_", "k_", "kv", "wqkv", "attn_out", "gate", "q")),
    ("moe", ("ffn_moe", "group_scores", "shared_gate")),
    ("ffn", ("ffn_out", "ffn_up", "ffn_gate", "ffn_silu", "ffn_gelu", "ffn_relu", "ffn_sqr", "ffn_swiglu", "ffn_geglu", "ffn_reglu")),
    ("recurrent", ("gdn", "conv_", "ssm_", "qkv_mixed", "z", "beta", "alpha", "mixed_", "rs_states", "state")),
    ("per_layer_embd", ("per_layer", "ple_")),
)


@functools.lru_cache(maxsize=4096)  # a few hundred names a model, asked again at every prediction's peak
def _term(name: str) -> str:
    base = name.split("#", 1)[0]
    for term, prefixes in _TERM_PREFIXES:
        if base.startswith(prefixes):
            return term
    return "residual" if base else "other"


def _terms(peak: list[tuple[str, int]], total: int, align: int) -> tuple[dict[str, int], list[tuple[str, int]]]:
    terms: dict[str, int] = {}
    used = 0
    for name, size in peak:
        size = (size + align - 1) // align * align
        used += size
        k = _term(name)
        terms[k] = terms.get(k, 0) + size
    if total > used:
        terms["fragmentation"] = total - used
    terms = dict(sorted(terms.items(), key=lambda kv: -kv[1]))
    top = sorted(((n or "(unnamed)", s) for n, s in peak), key=lambda x: -x[1])[:8]
    return terms, top


_CACHE: dict[tuple, tuple] = CACHES.keep({}, "compute")
_CACHE_MAX = 512

# The compute buffers by content, so that the quants of one model (a new header, spec and details each) share
# them: keyed on the spec less the file's facts, the details less the weights' types, the whole context and the
# backend. The weights' types are left out only when the graph never read them (tensor.header_types_read):
# then any types give the same graph, placement and allocation. Weights on the CPU next to a GPU shape the
# segments (_segment_keys), so their types stay in the key.
_BY_CONTENT: dict[tuple, list[ComputeBuffer]] = CACHES.keep({}, "compute")
_CONTENT_KEYS: dict[int, tuple[object, str]] = CACHES.keep({}, "content-keys")  # id(spec or details) -> (it, its content key)
# ModelSpec fields no graph builder, scheduler or allocator reads (the file and its weights' bytes);
# bytes_by_type only gives _default_weight_type, a weight type like the header's
_NOT_GRAPH_SPEC = {"name", "file_type", "file_type_name", "file_size", "header_size", "tensor_bytes",
                    "n_tensors", "n_params", "bytes_by_type", "params_by_type"}


def _frozen(v: object) -> object:
    """A dump with its sets sorted (equal sets can iterate in different orders)."""
    if isinstance(v, dict):
        return sorted((k, _frozen(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return [_frozen(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return v


def _keyed_fields(cls: type) -> list[str]:
    """The fields a content key is made of (kept on the class)."""
    names = cls.__dict__.get("_content_key_fields")
    if names is None:
        skip = _NOT_GRAPH_SPEC if issubclass(cls, ModelSpec) else TYPE_FIELDS
        names = [f for f in cls.model_fields if f not in skip]  # type: ignore[attr-defined]
        type.__setattr__(cls, "_content_key_fields", names)
    return names


_LAST_KEYED: dict[type, tuple[tuple, str]] = CACHES.keep({}, "content-keys")  # per class: the last key made, and its fields' values (kept alive)


def _content_key(obj: ModelSpec | GraphDetails) -> str:
    hit = _CONTENT_KEYS.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    cls = type(obj)
    names = _keyed_fields(cls)
    values = tuple([getattr(obj, f) for f in names])
    last = _LAST_KEYED.get(cls)
    if last is not None and all(a is b for a, b in zip(last[0], values)):
        key = last[1]  # the very objects of the last one keyed (requantized_spec's copy, graph_details' share)
    else:
        if isinstance(obj, ModelSpec):  # no sets in it: the fields' repr is a faithful key
            key = repr(list(zip(names, values)))
        else:
            key = repr([(f, _frozen(v)) for f, v in zip(names, values)])
        _LAST_KEYED[cls] = (values, key)
    if len(_CONTENT_KEYS) >= _CACHE_MAX:
        _CONTENT_KEYS.clear()
    _CONTENT_KEYS[id(obj)] = (obj, key)
    return key


def _host_weight_types(d: GraphDetails, n_all: int, n_gpu_layers: int, placement: WeightPlacement | None,
                       kind: Backend) -> tuple:
    """The types of the layer weights a GPU backend leaves on the CPU (they key the segments); with tensor
    overrides (-ot, --n-cpu-moe) any layer may have some: then every layer's types."""
    wp = placement or weight_placement(n_all, kind, n_gpu_layers)
    host_layers = {il for il in range(n_all) if wp.layer_dev[il] == CPU_DEV}
    if wp.overrides:
        host_layers = set(range(n_all))
    if not host_layers:
        return ()
    return tuple((k, tuple(sorted((il, t) for il, t in v.items() if il in host_layers)))
                 for k, v in sorted(d.layer_types.items()))


def _cp_key(cp: ContextParams) -> tuple:
    # the whole ContextParams, so that a field added to it keys the cache too; less defaults_applied, which
    # says which values the user left unset, not what they are
    return tuple((k, v) for k, v in cp.__dict__.items() if k != "defaults_applied")


# The K/V types whose compute buffers are the same bytes on the CPU and Metal (_shared_kv_types): the quantized types
# Metal's flash attention has a kernel for, the ones ggml_metal_op_flash_attn_ext_use_kv_f16 dequantizes to f16 first
_SHARED_KV = METAL_FA_KV_F16_TYPES
_SHARED_KV_AS = "q8_0"  # the type they are all computed as


def _shared_kv_types(spec: ModelSpec, cp: ContextParams, impl: BackendImpl, n_gpu_layers: int,
                     placement: WeightPlacement | None, kv_host: bool) -> ContextParams:
    """`cp`, or `cp` with q8_0 K/V in place of another type whose compute buffers are the same bytes: both then share
    one graph, trace and cache entry (`fit`'s table asks q8_0 and q4_0 at the same contexts).

    With flash attention and K and V of one type of _SHARED_KV, the type reaches the compute graph only through the K
    and V views of the cache, which are never allocated. The graph builders read it for its block size (32 in all
    five: the Hadamard rotation) and against F32 (the cast before flash attention). On the CPU nothing else reads it
    (one buffer, alloc size ggml_nbytes). On Metal the scheduler reads it for FLASH_ATTN_EXT's support
    (metal_fa_unsupported_reason: all five), the reorder takes every tensor of a KV cache as one range
    (metal.common.cache_ranges), and FLASH_ATTN_EXT's alloc size reads the views' strides only where
    ggml_metal_op_flash_attn_ext_use_kv_f16 is false: under 32 queries per stream, and in builds before #27390
    (metal_fa_kv_f16_extra), which keep their own type. So do a cache or a layer on the CPU and tensor overrides
    (the scheduler's copies). CUDA keeps its own (its flash attention's scratch depends on the type)."""
    tk = type_name(cp.type_k)
    if not cp.flash_attn or tk == _SHARED_KV_AS or tk not in _SHARED_KV or type_name(cp.type_v) != tk:
        return cp
    shared = cp.model_copy(update={"type_k": _SHARED_KV_AS, "type_v": _SHARED_KV_AS})
    if not impl.is_gpu:
        return shared
    if kv_host:
        return cp
    n_tokens, _, n_seqs, _ = reserve_ubatch(cp)
    if impl.fa_alloc_reads_kv_type(cp.build, n_tokens // (1 if cp.kv_unified else n_seqs)):  # queries per stream
        return cp
    wp = placement or weight_placement(len(spec.layers), impl.kind, n_gpu_layers)
    return cp if wp.overrides or CPU_DEV in wp.layer_dev else shared


def compute_buffers(
    spec: ModelSpec,
    cp: ContextParams,
    backend: str = "cpu",
    n_gpu_layers: int = -1,
    *,
    details: GraphDetails | None = None,
    metal_max_buffer_length: int | None = None,
    mtp: bool = False,
    placement: WeightPlacement | None = None,
    kv_host: bool = False,
    op_offload: bool = True,
    terms: bool = True,
) -> list[ComputeBuffer]:
    """The compute buffers llama.cpp reserves for this model and context (llama_context::sched_reserve).

    backend "cpu": one CPU buffer, exact. "cuda" / "metal": the device buffer, then the host buffer
    that holds the graph inputs and the CPU-side ops (token embeddings); see `Placement` for what
    is and is not modelled there. Pass `details=graph_details(header)` for the exact graph of a file;
    without it the architecture's usual tensors are assumed (`default_details`). `mtp=True`: the
    draft context of native MTP speculative decoding (its graph is the NextN block alone). `placement`: where
    llama_model::load_tensors put the weights (-ngl, tensor overrides, one GPU), `kv_host` (-nkvo) the caches in
    host memory, `op_offload` False (--no-op-offload) keeps ops on host weights on the CPU. `terms` False: the same
    bytes without the terms and peak tensors (the allocator does not track the live tensors).
    """
    if model_of(spec.architecture) is None:
        raise UnsupportedModelError(f"compute buffers: architecture '{spec.architecture}' has no graph model")
    if mtp and (not has_mtp_graph(spec.architecture) or not spec.has_mtp):
        raise UnsupportedModelError(f"compute buffers: {spec.architecture} has no MTP draft graph")
    impl = backends.get(backend).for_build(cp.build)  # the backend's alloc sizes as cp.build's ggml has them
    cp = _shared_kv_types(spec, cp, impl, n_gpu_layers, placement, kv_host)
    key = (id(spec), id(details), _cp_key(cp), impl.kind, n_gpu_layers, metal_max_buffer_length, mtp, placement,
           kv_host, op_offload, terms)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is spec and hit[1] is details:
        return hit[2]
    d = details or default_details(spec)
    ckey = (_content_key(spec), _content_key(d), key[2:],
            _host_weight_types(d, len(spec.layers), n_gpu_layers, placement, impl.kind) if impl.is_gpu else ())
    out = _BY_CONTENT.get(ckey)
    if out is None:
        # the cyclic collector paused while the graph is built and allocated: its thousands of short-lived objects
        # would otherwise set off collections, now and then of the whole heap (~30 ms next to a read header)
        gc_was = gc.isenabled()
        gc.disable()
        try:
            out = _compute(spec, cp, d, details, key, ckey, impl, n_gpu_layers, metal_max_buffer_length, mtp,
                           placement, kv_host, op_offload, terms)
        finally:
            if gc_was:
                gc.enable()
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (spec, details, out)
    return out


def _compute(spec: ModelSpec, cp: ContextParams, d: GraphDetails, details: GraphDetails | None, key: tuple,
             ckey: tuple, impl: BackendImpl, n_gpu_layers: int, metal_max_buffer_length: int | None, mtp: bool,
             placement: WeightPlacement | None, kv_host: bool, op_offload: bool, terms: bool) -> list[ComputeBuffer]:
    """compute_buffers past its caches: build (or reuse) the graph, allocate it, keep the answer by content."""
    header_types_read[0] = False
    c = GraphContext(spec, cp, d)
    c.mtp = mtp
    # the traced graph's key: this one's but the cache sizes (n_ctx, n_ctx_seq), n_batch, which no graph builder
    # reads (llama_context::graph_reserve takes n_ubatch), and the ubatch where the tokens are traced (then their
    # unit instead: GraphContext.trace_tokens; else n_tokens and n_outputs, which follow from n_ctx too); the same
    # spec and details objects (the graph reads them); with terms or without (key[-1]), the graph is the same
    free = ("n_ctx", "n_ctx_seq", "n_batch", "n_ubatch") if c.tokens_unit else ("n_ctx", "n_ctx_seq", "n_batch")
    tokens = ("tokens", c.tokens_unit) if c.tokens_unit else (c.n_tokens, c.n_outputs)
    tkey = (id(spec), id(details), tuple((k, v) for k, v in key[2] if k not in free), tokens, *key[3:-1])
    ctkey = (ckey[0], ckey[1], tkey[2:], ckey[3])  # and by content: the quants of one model share it
    if impl.is_gpu:
        out = _gpu_buffers(c, impl, n_gpu_layers, metal_max_buffer_length, placement, kv_host, op_offload,
                           details=details, tkey=tkey, ctkey=ctkey, terms=terms)
    else:
        ga = Gallocr(impl.alignment, trace=terms)
        r = _allocated(c, ga, details, tkey, content_key=ctkey)
        out = [_compute_buffer(impl.name, r.sizes[0], r.peaks[0], impl.alignment, terms)]
    if not header_types_read[0]:
        if len(_BY_CONTENT) >= _CACHE_MAX:
            _BY_CONTENT.pop(next(iter(_BY_CONTENT)))
        _BY_CONTENT[ckey] = out
    return out


def _gpu_buffers(c: GraphContext, impl: BackendImpl, n_gpu_layers: int, metal_max_buffer_length: int | None,
                 placement: WeightPlacement | None = None, kv_host: bool = False,
                 op_offload: bool = True, *, details: GraphDetails | None = None,
                 tkey: tuple | None = None, ctkey: tuple | None = None, terms: bool = True) -> list[ComputeBuffer]:
    """The device's compute buffer and the host one next to it: the graph placed and split by the scheduler."""
    sp = c.spec
    n_all = len(sp.layers)
    wp = placement or weight_placement(n_all, impl.kind, n_gpu_layers)
    gpus = wp.gpus or [0]
    if impl.local_gpus:  # a local GPU is the scheduler's backend with or without layers (it takes offloaded ops)
        order = {d: i for i, d in enumerate(wp.devices)}  # llama_model::devices' order, not the ids'
        gpus = sorted(set(gpus) | {d for d in wp.devices if not impl.on(d).remote}, key=lambda d: order.get(d, d))
    # backend ids: the first GPU 0, the CPU (HOST) 1, the other GPUs 2, 3, ... (fitter.ggml.sched.Placement.order)
    be_of = {g: (0 if k == 0 else k + 1) for k, g in enumerate(gpus)}
    be_of[CPU_DEV] = HOST
    layer_dev = [be_of[d] for d in wp.layer_dev]

    subs = [impl.on(g) for g in gpus]  # each device's own backend (RPC devices beside a local GPU)
    mixed = any(sub is not impl for sub in subs)
    dev_size = _dev_sizer(impl)

    override = None
    if wp.overrides:
        def override(suffix: str, il: int | None) -> int | None:
            name = f"blk.{il}.{suffix}.weight" if il is not None else f"{suffix}.weight"
            for pattern, d in wp.overrides:
                if pattern.search(name):
                    return be_of.get(d, 0)
            return None

    # llama_context::llama_context: pipeline parallelism with several GPUs, every layer offloaded, -sm layer, the KV
    # cache offloaded and no tensor overrides (ggml_backend_sched_new(..., parallel) -> GGML_SCHED_MAX_COPIES copies)
    n_layer_all_on_gpu = n_gpu_layers < 0 or n_gpu_layers > n_all
    pipeline = len(wp.devices) > 1 and n_layer_all_on_gpu and not kv_host and not wp.overrides
    pl = Placement(layer_dev=layer_dev[:n_all], dev_in=layer_dev[0] if n_all else 0, dev_out=layer_dev[n_all],
                   supports=impl.supports_op, offload=impl.offload_op, graph_optimize=impl.graph_optimize,
                   op_offload=op_offload, kv_host=kv_host, weight_override=override, n_gpus=len(gpus),
                   n_copies=GGML_SCHED_MAX_COPIES if pipeline else 1,
                   every_input=c.build.has("sched_copies_every_input"), flat=impl.reorders_graph,
                   pin_layer_norms=impl.keeps_layer_pins and (n_layer_all_on_gpu or c.n_tokens < 32),
                   optimize_segments=getattr(impl, "optimize_segments", None))
    if mixed:
        _per_device(pl, impl, {be_of[g]: sub for g, sub in zip(gpus, subs)})
    ga, per_buffer = _gallocr(c, impl, [(sub, _dev_sizer(sub) if mixed else dev_size) for sub in subs],
                              metal_max_buffer_length, terms)
    r = _allocated(c, ga, details, tkey, pl, _copy_sizer(pl, per_buffer) if mixed else dev_size, content_key=ctkey)
    names = [(device_buffer_name(impl, gpus[0]), subs[0].alignment), (impl.host_buffer_name, impl.host_alignment)]
    names += [(device_buffer_name(impl, g), sub.alignment) for g, sub in zip(gpus[1:], subs[1:])]
    out = []
    for i in (0, *range(2, len(names)), 1):  # the GPUs, then the host
        name, align = names[i]
        if r.sizes[i] > 1:  # sched_reserve prints (and allocates) only buffers larger than 1 byte
            out.append(_compute_buffer(name, r.sizes[i], r.peaks[i], align, terms))
    return out


def _dev_sizer(sub: BackendImpl) -> Callable[[Tensor], int]:
    """A device's alloc size of a compute tensor in its buffer: split input copies by its copy_size."""
    def dev_size(t: Tensor) -> int:
        if t.op == "NONE":  # a split input copy
            return sub.copy_size(t)
        return sub.compute_size(t)
    return dev_size


def _gallocr(c: GraphContext, impl: BackendImpl, subs: list[tuple[BackendImpl, Callable[[Tensor], int]]],
             metal_max_buffer_length: int | None, terms: bool) -> tuple[Gallocr, list]:
    """The allocator of the scheduler's buffers (ids as its backends: the first GPU, the host, the other GPUs),
    each GPU's with its own backend's alignment and alloc sizes."""
    max_size = impl.max_size(metal_max_buffer_length=metal_max_buffer_length)
    if not c.build.has("gallocr_chunked_vbuffer"):
        max_size = SIZE_MAX  # 0.3.16 ggml-alloc.c: one buffer per backend, never split into chunks
    dev = [(sub.alignment, size, max_size) for sub, size in subs]
    per_buffer = [dev[0], (impl.host_alignment, Tensor.nbytes, SIZE_MAX), *dev[1:]]
    return Gallocr([a for a, _, _ in per_buffer], [f for _, f, _ in per_buffer], trace=terms,
                   max_buffer_size=[m for _, _, m in per_buffer]), per_buffer


def _per_device(pl: Placement, impl: BackendImpl, by_id: dict[int, BackendImpl]) -> None:
    """Devices of several backends (fitter.ggml.backends.rpc.local): each scheduler id's supports_op, offload_op and
    graph_optimize (over its own splits)."""
    pl.by_id = {b: (sub.supports_op, sub.offload_op) for b, sub in by_id.items()}
    pl.graph_optimize = impl.graph_optimize_on(frozenset(b for b, sub in by_id.items() if not sub.remote))


def _copy_sizer(pl: Placement, per_buffer: list[tuple[int, Callable[[Tensor], int], int]]) -> Callable[[Tensor], int]:
    """A split input copy's size in the buffer of the backend it is copied to (its `be`)."""
    return lambda t: per_buffer[t.be][1](t) if 0 <= t.be < len(per_buffer) else t.nbytes()


def _compute_buffer(device: str, size: int, peak: list[tuple[str, int]], align: int, terms: bool) -> ComputeBuffer:
    if not terms:  # the allocator did not track what was alive
        return ComputeBuffer(device=device, bytes=size, terms={})
    named, top = _terms(peak, size, align)
    return ComputeBuffer(device=device, bytes=size, terms=named, peak_tensors=top)
