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
from fitter.ggml.alloc import SIZE_MAX, AllocResult, Gallocr, flat_graph
from fitter.ggml.backends.base import Backend, BackendImpl
from fitter.ggml.backends.metal.backend import METAL_FA_KV_F16_TYPES
from fitter.ggml.graph import Graph, Segment
from fitter.ggml.replay import SegmentPlan, replay_chunks, replay_plan
from fitter.ggml.sched import GGML_SCHED_MAX_COPIES, Placement, split_graph
from fitter.ggml.symbolic import holds, trace
from fitter.ggml.tensor import HOST, Context, Tensor, header_types_read
from fitter.ggml.types import F16, type_name
from fitter.gguf.constants import GGMLQuantizationType
from fitter.llama.cparams import ContextParams, reserve_ubatch
from fitter.llama.graph import WEIGHT_OF as _WEIGHT_OF
from fitter.llama.graph import GraphContext
from fitter.llama.graph_details import TYPE_FIELDS, GraphDetails
from fitter.llama.hparams import ModelSpec
from fitter.llama.models import default_details, has_mtp_graph, model_of
from fitter.llama.traced_graph import _TRACED, _TRACED_BY_CONTENT, _TRACED_MAX, _TRACING, _Traced
from fitter.llama.weights import CPU_DEV, WeightPlacement, device_buffer_name, weight_placement
from fitter.record import Record

# the ops that read a norm or bias weight (named after the op: fitter.ggml.tensor.add / mul) -> the weight's GGUF
# name, for the tensor overrides (-ot attn_.*=CPU moves attention norms and biases too)
_SMALL_WEIGHT_OF = {
    "attn_out_b": "attn_output", "wqkv_b": "attn_qkv", "Qcur_normed": "attn_q_norm", "Kcur_normed": "attn_k_norm",
    "result_norm": "output_norm", "attn_post_norm": "post_attention_norm",
}


def _build_full(spec: ModelSpec, cp: ContextParams, details: GraphDetails | None = None) -> GraphContext:
    """The whole graph, layer after layer, exactly as llama_model::build_graph emits it."""
    c = GraphContext(spec, cp, details or default_details(spec))
    m = model_of(spec.architecture)
    assert m is not None  # compute_buffers and its callers check the architecture first
    gen = m.build_graph(c)
    x = next(gen)
    for il in range(spec.n_layer):
        c.ctx0.layer = il  # the layer being built (LoRA pairs are found by it)
        x = gen.send((il, x))
    c.ctx0.layer = None
    try:
        gen.send((None, x))
    except StopIteration:
        pass
    return c


def _emulate_full(spec: ModelSpec, cp: ContextParams, details: GraphDetails | None = None, align: int = 32):
    """Reference path: build every node, allocate the whole graph (slow for deep models)."""
    c = _build_full(spec, cp, details)
    ga = Gallocr(align)
    return ga.run(c.g.nodes, c.g.leafs)


def _layer_keys(c: GraphContext) -> list[tuple]:
    """A key per layer: layers with equal keys build identical sub-graphs (up to weights and names)."""
    sp = c.spec
    n = sp.n_layer
    n_all = len(sp.layers)
    partial = [(k, v) for k, v in c.d.layer_tensors.items() if len(v) != n_all]
    lora: dict[int, list] = {}  # the LoRA pairs of each layer's weights (ranks and types shape its sub-graph)
    for name, pairs in c.d.lora_graph.items():
        if name.startswith("blk."):
            _, num, rest = name.split(".", 2)
            lora.setdefault(int(num), []).append((rest, pairs))
    keys = []
    for il in range(n):
        l = sp.layers[il]
        keys.append((
            il == n - 1, il < sp.n_layer_dense_lead, l.kind, l.has_kv, l.n_head, l.n_head_kv, l.n_embd_head_k,
            l.n_embd_head_v, l.n_ff, l.n_ff_exp, l.n_expert_used, tuple(k for k, v in partial if il in v),
            tuple(sorted(lora.get(il, ()))),
        ))
    return keys


def _track_weights(c: GraphContext, ctx: Context, layer_only: int | None = None, pl: Placement | None = None) -> None:
    """Let ops read their weights (the scheduler places ops by them), typed as the header says, placed where the
    tensor overrides put them."""
    lt, gt, dflt = c.d.layer_types, c.d.global_types, _default_weight_type(c.spec)
    override = pl.weight_override if pl else None
    if override is not None:
        def wdev(name: str, default: int) -> int:
            il = ctx.layer if layer_only is None else layer_only
            base = name.split("-", 1)[0].removesuffix("op_weight")  # an op's name: "attn_norm-3op_weight"
            be = override(_WEIGHT_OF.get(base, _SMALL_WEIGHT_OF.get(base, base)), il)
            return default if be is None else be

        ctx.wdev = wdev

    def wtype(name: str) -> int:
        suffix = _WEIGHT_OF.get(name, name)
        il = ctx.layer if layer_only is None else layer_only
        if il is None:
            if suffix == "output" and suffix not in gt:  # load_tensors: no output.weight, token_embd DUPLICATED
                return gt.get("token_embd", dflt)
            return gt.get(suffix, dflt)
        return lt.get(suffix, {}).get(il, dflt)

    ctx.weights = True
    ctx.wtype = wtype


def _begin_segment(c: GraphContext, dev: int, layer: int | None) -> None:
    ctx = c.ctx0
    ctx.track = []
    ctx.dev = dev
    ctx.layer = layer
    c.g = Graph()


def _end_build(ctx: Context) -> None:
    ctx.wdev = None
    ctx.kv_dev = None
    ctx.track = None
    ctx.dev = 0
    ctx.layer = None
    ctx.weights = False


def _placeholder(ctx: Context, like: Tensor) -> Tensor:
    """Stands for the previous layer's output at the start of a template segment."""
    t = ctx.add(Tensor("NONE", like.type, list(like.ne), list(like.nb), (), None, "inpL"))
    t.vis = True
    return t


def _segment_keys(c: GraphContext, pl: Placement | None, dev: Callable[[int], int]) -> list[tuple]:
    keys = _layer_keys(c)
    if not pl:
        return keys
    # a layer's sub-graph also depends on where it, its neighbours and (if offloaded) its weights are
    n = c.spec.n_layer
    lt = c.d.layer_types

    override = pl.weight_override

    def wkey(il: int) -> tuple:
        if override is not None:  # which weights the overrides moved, and their types (their copies' sizes)
            return tuple(sorted((k, v[il], override(k, il)) for k, v in lt.items() if il in v))
        if dev(il) != HOST:
            return ()
        return tuple(sorted((k, v[il]) for k, v in lt.items() if il in v))

    return [k + (dev(il), dev(il - 1) if il else pl.dev_in, dev(il + 1) if il + 1 < n else pl.dev_out, wkey(il))
            for il, k in enumerate(keys)]


def _prepare(c: GraphContext, pl: Placement | None = None, copy_size: Callable[[Tensor], int] | None = None,
             distinct: frozenset[int] = frozenset(),
             whole: bool = False) -> tuple[Callable[[Gallocr], AllocResult], list[Segment]]:
    """Build one segment per distinct layer, place and split them (GPU backends); the allocation then runs layer
    after layer, jumping over repeats (fitter.ggml.replay.replay_segments says why that equals `Gallocr.run` over the
    full graph). `distinct`: layers that get a segment of their own (see _misplaced_input_copies). A backend whose
    graph_optimize reorders across layers (Metal) reorders the segments where that stands for the whole graph's
    reorder (Placement.optimize_segments); elsewhere, or `whole`, every layer is built and allocated whole."""
    sp = c.spec
    n = sp.n_layer
    ctx = c.ctx0
    m = model_of(sp.architecture)
    assert m is not None  # compute_buffers checks the architecture first
    if whole:
        distinct = frozenset(range(n))  # every layer built: the graph is reordered and allocated whole
    gen = m.build_graph(c)
    dev = (lambda il: pl.layer_dev[il]) if pl else (lambda il: 0)
    if pl:
        _track_weights(c, ctx, pl=pl)
        ctx.kv_dev = HOST if pl.kv_host else None
    try:
        _begin_segment(c, pl.dev_in if pl else 0, None)
        x0 = next(gen)
        c.g.expand(x0)
        assert ctx.track is not None  # _begin_segment set it
        for t in ctx.track:
            t.glob = True
        pro = Segment(c.g.nodes, c.g.leafs, [], None, None, ctx.dev)

        def build(il: int | None, x: Tensor, placeholder: Tensor | None) -> Segment:
            _begin_segment(c, dev(il) if il is not None else (pl.dev_out if pl else 0), il)
            out = None
            try:
                out = gen.send((il, x))
                c.g.expand(out)
            except StopIteration:
                pass
            assert ctx.track is not None  # _begin_segment set it
            return Segment(c.g.nodes, c.g.leafs, ctx.track, placeholder, out, ctx.dev)

        keys = [k + (("own", il),) if il in distinct else k for il, k in enumerate(_segment_keys(c, pl, dev))]
        seg0 = build(0, x0, None)
        assert seg0.out is not None  # only the epilogue (il None) has no output
        templates: dict[tuple, Segment] = {}
        order = [pro, seg0]
        prev_of: dict[tuple, int] = {}
        for il in range(1, n):
            if keys[il] not in templates:
                ph = _placeholder(ctx, seg0.out)
                templates[keys[il]] = build(il, ph, ph)
                order.append(templates[keys[il]])
                prev_of[keys[il]] = il - 1
        last_seg = templates[keys[n - 1]] if n > 1 else seg0
        assert last_seg.out is not None  # a layer segment, not the epilogue
        ph = _placeholder(ctx, last_seg.out)  # the epilogue reads the last layer's output
        epi = build(None, ph, ph)
        order.append(epi)
    finally:
        _end_build(ctx)
    if pl:
        # a placeholder sits where the previous layer's output was computed
        src_of = {id(t): (seg0 if prev_of[k] == 0 else templates[keys[prev_of[k]]]) for k, t in templates.items()}
        src_of[id(epi)] = last_seg
        split_graph(order, pl, copy_size or Tensor.nbytes, src_of)
        if pl.flat and whole:  # every layer has a segment of its own: no input copy can be misplaced
            return _whole_graph(order, pl, n)
        if pl.flat:
            assert pl.optimize_segments is not None  # set with flat
            chunked = pl.optimize_segments(n, pro, seg0, templates, keys, epi)
            if chunked is None:
                return _prepare(c, pl, copy_size, distinct, whole=True)
            return (lambda ga: replay_chunks(chunked[0], ga)), chunked[1]
        move = _misplaced_input_copies(order, seg0, epi, templates, keys, n)
        if move - distinct:
            return _prepare(c, pl, copy_size, distinct | move)
        pl.graph_optimize(order)
    for seg in order:
        seg.finalize()
    plan = SegmentPlan(n, pro, seg0, templates, keys, epi)
    return (lambda ga: replay_plan(plan, ga)), order


def _whole_graph(order: list[Segment], pl: Placement, n: int) -> tuple[Callable[[Gallocr], AllocResult], list[Segment]]:
    """Every layer built (a segment each): the graph joined, reordered by the backend and allocated whole."""
    flat = _flatten(order)
    pl.graph_optimize([flat])
    compiled = flat_graph(flat.nodes, flat.leafs)

    def run(ga: Gallocr) -> AllocResult:
        ga.run_flat(compiled)
        return AllocResult(ga.sizes(), ga.peak_lives, n)

    return run, [flat]


def _flatten(order: list[Segment]) -> Segment:
    """The segments (every layer its own) as one graph: each layer's placeholder input replaced by the previous
    layer's output, in the nodes and views that read it."""
    nodes: list[Tensor] = []
    leafs: list[Tensor] = []
    created: list[Tensor] = []
    prev: Tensor | None = None
    for seg in order:
        ph = seg.inp
        if ph is not None:
            assert prev is not None  # a layer or the epilogue follows the layer before it
            for t in (*seg.nodes, *seg.created):
                if any(s is ph for s in t.src):
                    t.src = tuple(prev if s is ph else s for s in t.src)
                if t.vs is ph:
                    t.vs = prev
        nodes += seg.nodes
        leafs += seg.leafs
        created += seg.created
        if seg.out is not None:
            prev = seg.out
    return Segment(nodes, leafs, created, None, None, order[0].dev)


def _misplaced_input_copies(order: list[Segment], seg0: Segment, epi: Segment, templates: dict[tuple, Segment],
                            keys: list[tuple], n: int) -> frozenset[int]:
    """Layers that need a segment of their own for the copies of graph inputs to be made where llama.cpp makes them.

    ggml_backend_sched_split_graph (pass 5) copies a graph input (KQ mask, positions, output ids) into a backend
    once, at the start of the split that first reads it there; splits start where a layer's weight sits on another
    backend (experts on the CPU) or an op falls back to the CPU. split_graph walks each distinct layer once, so the
    copy lands in the segment where that walk last started a split, which is not the layer where the graph, layer
    after layer, last started one before the first reader (found with allocator traces of the pinned llama-server:
    --n-cpu-moe 4 makes the KQ mask's copy in layer 2, not in layer 1, which shares its graph; gpt-oss with the
    experts of layers 1, 3 and 5 on the CPU makes the output ids' copy in layer 5). The layers returned get their
    own segment, and the split is made again."""
    seg_of = [seg0] + [templates[keys[il]] for il in range(1, n)] + [epi]  # layer n: the epilogue
    layers: dict[int, list[int]] = {}
    for il, seg in enumerate(seg_of):
        layers.setdefault(id(seg), []).append(il)

    def real(seg: Segment) -> list[Tensor]:
        return [t for t in seg.nodes if t.sid >= 0 and not t.name.endswith(("#dep", "#copy"))]

    nodes = {id(seg): real(seg) for seg in seg_of}
    # where a split starts inside each layer (positions in its real nodes), layer after layer
    starts: list[list[int]] = []
    prev_be = None
    for seg in seg_of:
        ns = nodes[id(seg)]
        pos = [i for i in range(1, len(ns)) if ns[i].sid != ns[i - 1].sid]
        if ns and prev_be is not None and ns[0].be != prev_be:
            pos.insert(0, 0)
        starts.append(pos)
        if ns:
            prev_be = ns[-1].be
    move: set[int] = set()
    for seg in order:
        if id(seg) not in layers:
            continue  # the prologue's copies come first, as llama.cpp's
        for cp in seg.nodes:
            if not (cp.glob and cp.name.endswith("#copy")):
                continue
            first, at_pos = n + 1, 0
            for il, s_ in enumerate(seg_of):
                hit = next((i for i, t in enumerate(nodes[id(s_)]) if any(x is cp for x in t.src)), None)
                if hit is not None:
                    first, at_pos = il, hit
                    break
            at = next((il for il in range(min(first, n), -1, -1)
                       if any(p <= at_pos for p in starts[il]) or (il < first and starts[il])), None)
            if at is not None and layers[id(seg)] != [at]:
                move.add(at)
    return frozenset(move)


def _prepare_mtp(c: GraphContext, pl: Placement | None = None,
                 copy_size: Callable[[Tensor], int] | None = None) -> tuple[Callable[[Gallocr], AllocResult], list[Segment]]:
    """The MTP draft graph: one NextN block, built and allocated whole."""
    sp = c.spec
    il = sp.n_layer
    ctx = c.ctx0
    dev = pl.layer_dev[il] if pl else 0
    if pl:
        _track_weights(c, ctx, layer_only=il, pl=pl)
        ctx.kv_dev = HOST if pl.kv_host else None
    try:
        _begin_segment(c, dev, il)
        m = model_of(sp.architecture)
        assert m is not None and ctx.track is not None  # compute_buffers checks the architecture first
        m.build_graph_mtp(c)
        seg = Segment(c.g.nodes, c.g.leafs, ctx.track, None, None, dev)
    finally:
        _end_build(ctx)
    if pl:
        split_graph([seg], pl, copy_size or Tensor.nbytes, {})
        pl.graph_optimize([seg])

    def run(ga: Gallocr) -> AllocResult:
        ga.run(seg.nodes, seg.leafs)
        return AllocResult(ga.sizes(), ga.peak_lives, 1)

    return run, [seg]


def _simulate(c: GraphContext, ga: Gallocr, pl: Placement | None = None,
              copy_size: Callable[[Tensor], int] | None = None) -> AllocResult:
    return _prepare(c, pl, copy_size)[0](ga)


def _simulate_mtp(c: GraphContext, ga: Gallocr, pl: Placement | None = None,
                  copy_size: Callable[[Tensor], int] | None = None) -> AllocResult:
    return _prepare_mtp(c, pl, copy_size)[0](ga)


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
    if key is None or not _TRACING.get():
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


def _default_weight_type(spec: ModelSpec) -> int:
    """The ggml type of most of the model's bytes (for weights whose type the header did not give)."""
    for name in spec.bytes_by_type:
        try:
            return int(GGMLQuantizationType[name])
        except KeyError:
            continue
    return F16


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


@functools.cache
def _keyed_fields(cls: type) -> list[str]:
    """The fields a content key is made of."""
    skip = _NOT_GRAPH_SPEC if issubclass(cls, ModelSpec) else TYPE_FIELDS
    return [f for f in cls.model_fields if f not in skip]  # type: ignore[attr-defined]


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
    # backend ids: the first GPU 0, the CPU (HOST) 1, the other GPUs 2, 3, ... (fitter.ggml.sched.Placement.order)
    be_of = {g: (0 if k == 0 else k + 1) for k, g in enumerate(gpus)}
    be_of[CPU_DEV] = HOST
    layer_dev = [be_of[d] for d in wp.layer_dev]

    def dev_size(t: Tensor) -> int:
        if t.op == "NONE":  # a split input copy
            return impl.copy_size(t)
        return impl.compute_size(t)

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
                   optimize_segments=getattr(impl, "optimize_segments", None))
    n_extra = len(gpus) - 1
    max_size = impl.max_size(metal_max_buffer_length=metal_max_buffer_length)
    if not c.build.has("gallocr_chunked_vbuffer"):
        max_size = SIZE_MAX  # 0.3.16 ggml-alloc.c: one buffer per backend, never split into chunks
    ga = Gallocr([impl.alignment, impl.host_alignment] + [impl.alignment] * n_extra,
                 [dev_size, Tensor.nbytes] + [dev_size] * n_extra, trace=terms,
                 max_buffer_size=[max_size, SIZE_MAX] + [max_size] * n_extra)
    r = _allocated(c, ga, details, tkey, pl, dev_size, content_key=ctkey)
    names = [(device_buffer_name(impl, gpus[0]), impl.alignment), (impl.host_buffer_name, impl.host_alignment)]
    names += [(device_buffer_name(impl, g), impl.alignment) for g in gpus[1:]]
    out = []
    for i in (0, *range(2, len(names)), 1):  # the GPUs, then the host
        name, align = names[i]
        if r.sizes[i] > 1:  # sched_reserve prints (and allocates) only buffers larger than 1 byte
            out.append(_compute_buffer(name, r.sizes[i], r.peaks[i], align, terms))
    return out


def _compute_buffer(device: str, size: int, peak: list[tuple[str, int]], align: int, terms: bool) -> ComputeBuffer:
    if not terms:  # the allocator did not track what was alive
        return ComputeBuffer(device=device, bytes=size, terms={})
    named, top = _terms(peak, size, align)
    return ComputeBuffer(device=device, bytes=size, terms=named, peak_tensors=top)
