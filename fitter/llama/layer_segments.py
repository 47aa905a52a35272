"""The compute graph built one segment per distinct layer, placed and split (fitter.llama.context's first half).

An architecture's graph builder (fitter.llama.models) is a generator that builds one layer per step; here each
distinct layer (by its shape, its device and the types of its host weights: `_segment_keys`) is built once, the
segments are placed and split by the scheduler (fitter.ggml.sched) for GPU backends, and the allocation then replays
them layer by layer (fitter.ggml.replay). A backend whose graph_optimize reorders across layers (Metal) reorders the
segments (fitter.ggml.backends.metal.segments) or, where that cannot stand for the whole graph, the graph built
whole (`_flatten`).
"""

from __future__ import annotations

from typing import Callable

from fitter.ggml.alloc import AllocResult, Gallocr, flat_graph
from fitter.ggml.graph import Graph, Segment
from fitter.ggml.replay import SegmentPlan, replay_chunks, replay_plan
from fitter.ggml.sched import Placement, split_graph
from fitter.ggml.tensor import HOST, Context, Tensor
from fitter.ggml.types import F16
from fitter.gguf.constants import GGMLQuantizationType
from fitter.llama.cparams import ContextParams
from fitter.llama.graph import WEIGHT_OF as _WEIGHT_OF
from fitter.llama.graph import GraphContext
from fitter.llama.graph_details import GraphDetails
from fitter.llama.hparams import ModelSpec
from fitter.llama.models import default_details, model_of


def _default_weight_type(spec: ModelSpec) -> int:
    """The ggml type of most of the model's bytes (for weights whose type the header did not give)."""
    for name in spec.bytes_by_type:
        try:
            return int(GGMLQuantizationType[name])
        except KeyError:
            continue
    return F16


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
    n = c.spec.n_layer
    if whole:
        distinct = frozenset(range(n))  # every layer built: the graph is reordered and allocated whole
    b = _Built(c, pl, distinct)
    if pl:
        # a placeholder sits where the previous layer's output was computed
        src_of = {id(t): (b.seg0 if b.prev_of[k] == 0 else b.templates[b.keys[b.prev_of[k]]])
                  for k, t in b.templates.items()}
        src_of[id(b.epi)] = b.last_seg
        split_graph(b.order, pl, copy_size or Tensor.nbytes, src_of)
        if pl.flat and whole:  # every layer has a segment of its own: no input copy can be misplaced
            return _whole_graph(b.order, pl, n)
        if pl.flat:
            assert pl.optimize_segments is not None  # set with flat
            chunked = pl.optimize_segments(n, b.pro, b.seg0, b.templates, b.keys, b.epi)
            if chunked is None:
                return _prepare(c, pl, copy_size, distinct, whole=True)
            return (lambda ga: replay_chunks(chunked[0], ga)), chunked[1]
        move = _misplaced_input_copies(b.order, b.seg0, b.epi, b.templates, b.keys, n)
        if move - distinct:
            return _prepare(c, pl, copy_size, distinct | move)
        pl.graph_optimize(b.order)
    for seg in b.order:
        seg.finalize()
    plan = SegmentPlan(n, b.pro, b.seg0, b.templates, b.keys, b.epi)
    return (lambda ga: replay_plan(plan, ga)), b.order


class _Built:
    """The graph of `c` built as segments: the prologue (`pro`, up to the first layer's input), layer 0 (`seg0`),
    one template per distinct layer key after it (`templates`, `prev_of`: the layer before each one's first), the
    epilogue (`epi`, after `last_seg`), all in graph order (`order`)."""

    def __init__(self, c: GraphContext, pl: Placement | None, distinct: frozenset[int]) -> None:
        m = model_of(c.spec.architecture)
        assert m is not None  # compute_buffers checks the architecture first
        self.c, self.pl, self.ctx = c, pl, c.ctx0
        self.gen = m.build_graph(c)
        self.dev: Callable[[int], int] = (lambda il: pl.layer_dev[il]) if pl else (lambda il: 0)
        if pl:
            _track_weights(c, self.ctx, pl=pl)
            self.ctx.kv_dev = HOST if pl.kv_host else None
        try:
            self._build(distinct)
        finally:
            _end_build(self.ctx)

    def _build(self, distinct: frozenset[int]) -> None:
        c, ctx, pl, n = self.c, self.ctx, self.pl, self.c.spec.n_layer
        _begin_segment(c, pl.dev_in if pl else 0, None)
        x0 = next(self.gen)
        c.g.expand(x0)
        assert ctx.track is not None  # _begin_segment set it
        for t in ctx.track:
            t.glob = True
        self.pro = Segment(c.g.nodes, c.g.leafs, [], None, None, ctx.dev)
        keys = self.keys = [k + (("own", il),) if il in distinct else k
                            for il, k in enumerate(_segment_keys(c, pl, self.dev))]
        seg0 = self.seg0 = self.segment(0, x0, None)
        assert seg0.out is not None  # only the epilogue (il None) has no output
        templates: dict[tuple, Segment] = {}
        self.order = [self.pro, seg0]
        self.prev_of: dict[tuple, int] = {}
        for il in range(1, n):
            if keys[il] not in templates:
                ph = _placeholder(ctx, seg0.out)
                templates[keys[il]] = self.segment(il, ph, ph)
                self.order.append(templates[keys[il]])
                self.prev_of[keys[il]] = il - 1
        self.templates = templates
        last_seg = self.last_seg = templates[keys[n - 1]] if n > 1 else seg0
        assert last_seg.out is not None  # a layer segment, not the epilogue
        ph = _placeholder(ctx, last_seg.out)  # the epilogue reads the last layer's output
        self.epi = self.segment(None, ph, ph)
        self.order.append(self.epi)

    def segment(self, il: int | None, x: Tensor, placeholder: Tensor | None) -> Segment:
        """Layer `il`'s segment (None: the epilogue), from its input `x`."""
        c, ctx, pl = self.c, self.ctx, self.pl
        _begin_segment(c, self.dev(il) if il is not None else (pl.dev_out if pl else 0), il)
        out = None
        try:
            out = self.gen.send((il, x))
            c.g.expand(out)
        except StopIteration:
            pass
        assert ctx.track is not None  # _begin_segment set it
        return Segment(c.g.nodes, c.g.leafs, ctx.track, placeholder, out, ctx.dev)


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
