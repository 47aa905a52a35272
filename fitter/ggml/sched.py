"""ggml-backend.cpp's scheduler: which backend runs each op, where the graph splits, which inputs are copied.

ggml_backend_sched_split_graph for one GPU plus the CPU, one function per pass as upstream has
them: pass 1 (pre-allocated tensors, inputs, ops with weights: ggml_backend_sched_backend_id_from_cur),
pass 2 (expand the assignments up and down), pass 3 (upgrade unassigned ops to the backend with the
most inputs), pass 4 (views follow their source, sources their consumer) and pass 5 (splits and
the copies of their inputs). It runs over the segments of fitter.ggml.graph, each distinct layer once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from fitter.ggml.graph import Segment
from fitter.ggml.tensor import (
    FLAG_INPUT,
    FLAG_OUTPUT,
    HOST,
    IS_WEIGHT,
    LAYER_PIN,
    ON_HOST,
    VIEW_OPS,
    Tensor,
    nbytes_strided,
)
from fitter.record import Record

GGML_SCHED_MAX_COPIES = 4  # ggml-backend.h: copies of the inputs with pipeline parallelism
GPU = 0  # backend index of the first GPU (the highest-priority backend); more GPUs are 2, 3, ... (HOST stays 1)


class Placement(Record, frozen=False):
    """Which backend runs each op: a port of ggml_backend_sched_split_graph for a GPU plus the CPU.

    Backend 0 is the GPU, 1 the CPU (the lowest-priority backend, whose buffer type is the host one).
    Weights, KV caches and recurrent states live on their layer's device (`layer_dev`; the token
    embeddings always on the CPU). `supports(node)` says whether the GPU runs an op, `offload(node)`
    whether it takes an op whose weight is in host memory (ggml_backend_dev_offload_op, op_offload).
    `graph_optimize` is the backend's (CUDA's keeps some tensors alive longer around fusible patterns:
    fitter.ggml.backends.cuda.fusion; Metal's reorders each split: fitter.ggml.backends.metal.common).
    """

    layer_dev: list[int]
    dev_in: int  # the prologue's weights (layer 0's device)
    dev_out: int  # the output layer
    supports: Callable[[Tensor], bool]
    offload: Callable[[Tensor], bool]
    graph_optimize: Callable[[list[Segment]], None]  # the backend's graph_optimize (alloc deps of fusions)
    op_offload: bool = True  # llama_context_params.op_offload (--no-op-offload: False)
    kv_host: bool = False  # -nkvo (offload_kqv false): every KV cache and recurrent state in host memory
    # tensor overrides: (GGUF tensor name without ".weight", layer or None) -> the backend holding it, or None
    # where no override applies (the layer's device then)
    weight_override: Callable[[str, "int | None"], "int | None"] | None = None
    n_gpus: int = 1  # GPU backends: 0, then 2, 3, ... (in llama.cpp's priority order, the CPU last)
    n_copies: int = 1  # pipeline parallelism (several GPUs, every layer offloaded): GGML_SCHED_MAX_COPIES
    every_input: bool = True  # pass 6 copies every graph input, used or not (else only those a split reads)
    pin_layer_norms: bool = False  # LAYER_PIN nodes preset to their layer's device (a real load's scheduler)
    flat: bool = False  # graph_optimize moves nodes across layers (Metal): one segment for the whole graph
    # where `flat`: the backend's graph_optimize over the segments of distinct layers (n, pro, seg0, templates, keys,
    # epi): the chunks to allocate (fitter.ggml.backends.metal.segments), or None: the graph is built whole
    optimize_segments: Callable[..., Any] | None = None
    # devices of several backends (RPC devices beside a local GPU): each GPU backend id's supports_op and offload_op
    by_id: dict[int, tuple[Callable[[Tensor], bool], Callable[[Tensor], bool]]] | None = None

    @property
    def order(self) -> tuple[int, ...]:
        """Backend ids in the scheduler's priority order: the GPUs, then the CPU."""
        return (GPU, *range(2, self.n_gpus + 1), HOST)

    def sup(self, b: int, node: Tensor) -> bool:  # ggml_backend_supports_op
        if self.by_id is not None and b != HOST:
            return self.by_id[b][0](node)
        return b == HOST or self.supports(node)

    def offload_to(self, t: Tensor) -> int:
        """The first backend before the CPU that takes an op on a host weight (ggml_backend_sched_backend_id_from_cur:
        supports_op and offload_op), or HOST."""
        if self.by_id is None:
            return GPU if self.sup(GPU, t) and self.offload(t) else HOST
        return next((b for b in self.order[:-1] if self.sup(b, t) and self.by_id[b][1](t)), HOST)


def _be_of(t: Tensor) -> int:
    if t.be == -1 and t.vs is not None:
        return t.vs.be
    return t.be


def _backend_id_from_cur(pl: Placement, t: Tensor) -> int:  # ggml_backend_sched_backend_id_from_cur
    vs = t.vs
    if vs is not None and vs.ext:  # a view of a pre-allocated tensor (KV cache, state) stays with it
        return vs.be if pl.sup(vs.be, t) else -1
    if t.flags & FLAG_INPUT:
        return HOST
    if t.op not in ("ROPE", "FLASH_ATTN_EXT"):
        for src in t.src:
            if src is not None and src.w == IS_WEIGHT:
                b = src.be
                if b == HOST and pl.op_offload and (off := pl.offload_to(t)) != HOST:
                    return off  # "1.off"
                return b if pl.sup(b, t) else -1
    return -1


def _pass1_assign(seq: list[Segment], nodes: list[Tensor], pl: Placement) -> None:
    """Pass 1: pre-allocated inputs, graph inputs, ops with weights."""
    for seg in seq:
        for leaf in seg.leafs:
            leaf.be = HOST if leaf.flags & FLAG_INPUT else -1
    for node in nodes:
        # a user assignment is kept ("do not overwrite user assignments"): -nkvo's attention output (llama-graph.cpp)
        if node.be == -1:
            node.be = HOST if node.flags & ON_HOST else _backend_id_from_cur(pl, node)


def _expand(pl: Placement, order: Iterable[Tensor], gpu_only: bool) -> None:
    cur = -1
    for node in order:
        if node.op in VIEW_OPS:
            continue
        if node.be != -1:
            cur = -1 if (gpu_only and node.be == HOST) else node.be
        elif cur != -1 and pl.sup(cur, node):
            node.be = cur


def _pass2_expand(nodes: list[Tensor], pl: Placement) -> None:
    """Pass 2: expand the GPU assignments down and up over unassigned ops, then any backend."""
    _expand(pl, nodes, True)
    _expand(pl, reversed(nodes), True)
    _expand(pl, nodes, False)
    _expand(pl, reversed(nodes), False)


def _placeholders(seq: list[Segment], src_of: dict[int, Segment]) -> None:
    """Placeholders stand for the previous layer's output: its backend."""
    for seg in seq:
        if seg.inp is not None:
            out = src_of[id(seg)].out
            assert out is not None  # the previous layer's segment
            seg.inp.be = out.be


def _pass3_upgrade(nodes: list[Tensor], pl: Placement) -> None:
    """Pass 3: an op left unassigned goes to the backend with the most usable inputs."""
    for node in nodes:
        if node.op in VIEW_OPS or node.be != -1:
            continue
        best = -1
        for b in pl.order:
            if not pl.sup(b, node):
                continue
            n = sum(1 for src in node.src if src is not None and _be_of(src) != -1 and _be_of(src) == b)
            if n > best:
                best = n
                node.be = b


def _pass4_views_and_sources(nodes: list[Tensor], pl: Placement) -> None:
    """Pass 4: views follow their source; unassigned sources follow their consumer."""
    for node in nodes:
        if node.vs is not None and node.be == -1:
            node.be = node.vs.be
        for src in node.src:
            if src is not None and src.be == -1:
                src.be = src.vs.be if src.vs is not None else node.be
        if node.be == -1:
            node.be = GPU if pl.sup(GPU, node) else HOST


# long because ggml_backend_sched_split_graph (ggml-backend.cpp, 540 lines): its pass 5
def _pass5_splits(seq: list[Segment], copy_size: Callable[[Tensor], int], n_copies: int = 1,
                  every_input: bool = True) -> None:
    """Pass 5: splits and the copies of their inputs (inserted before each split's first node). With pipeline
    parallelism (n_copies > 1) every input copy exists n_copies times, flagged input and output: graph leafs
    allocated first and never freed (pass 6 and the graph copy of ggml_backend_sched_split_graph)."""
    copies: dict[tuple[int, int], Tensor] = {}
    extra_leafs: list[Tensor] = []
    cur = -1
    n_inputs = 0
    pending: list[Tensor] = []
    start: tuple[Segment, int] | None = None
    inserts: list[tuple[Segment, int, list[Tensor]]] = []
    sid = 0
    for seg in seq:
        for i, node in enumerate(seg.nodes):
            node.sid = sid
            if node.op in VIEW_OPS:
                continue
            need_new = False
            if node.be == cur and n_inputs > 0:
                # a weight on another backend starts a new split, so that its copy can be freed early
                need_new = any(src is not None and src.w == IS_WEIGHT and src.be != cur for src in node.src)
            if node.be != cur or need_new:
                if pending:
                    assert start is not None  # pending fills only after the first split starts
                    inserts.append((start[0], start[1], pending))
                sid += 1
                node.sid = sid
                cur = node.be
                n_inputs = 0
                pending = []
                start = (seg, i)
            srcs = None
            for j, src in enumerate(node.src):
                if src is None or src is node:
                    continue
                sb = _be_of(src)
                if sb == cur:
                    continue
                cp = copies.get((id(src), cur))
                if cp is None:
                    dep, cp = _input_copy(src, cur, sb, copy_size)
                    copies[(id(src), cur)] = cp
                    if n_copies > 1:
                        cp.flags |= FLAG_INPUT | FLAG_OUTPUT
                        cp.glob = True  # allocated once, up front, for every layer
                        extra_leafs += [cp] + [_dup(cp) for _ in range(n_copies - 1)]
                    pending += [dep, cp]
                    n_inputs += 1
                if srcs is None:
                    srcs = list(node.src)
                srcs[j] = cp
            if srcs is not None:
                node.src = tuple(srcs)
    if pending:
        assert start is not None  # pending fills only after the first split starts
        inserts.append((start[0], start[1], pending))
    for seg, at, new in reversed(inserts):
        seg.nodes[at:at] = new
    if n_copies > 1:
        # the graph inputs' copies (pass 6: the original is one of them, input and output), then the split inputs'
        inputs = [leaf for seg in seq for leaf in seg.leafs if leaf.flags & FLAG_INPUT]
        if not every_input:
            # before pass 6 (llama.cpp 0.3.35's ggml-backend.cpp, pass 5): only an input some non-view node reads
            read = {id(src) for seg in seq for node in seg.nodes if node.op not in VIEW_OPS for src in node.src
                    if src is not None}
            inputs = [leaf for leaf in inputs if id(leaf) in read]
        first: list[Tensor] = []
        for leaf in inputs:
            leaf.flags |= FLAG_OUTPUT
            leaf.glob = True
            first += [leaf] + [_dup(leaf) for _ in range(n_copies - 1)]
        seq[0].leafs[0:0] = first + extra_leafs


def _dup(t: Tensor) -> Tensor:
    """One more copy of a pipeline-parallel input: same layout and backend, never freed."""
    d = Tensor("NONE", t.type, list(t.ne), list(t.nb), (), None, t.name + "#pp")
    d.flags = FLAG_INPUT | FLAG_OUTPUT
    d.be = t.be
    d.size = t.size
    d.glob = True
    return d


def _input_copy(src: Tensor, cur: int, sb: int, copy_size: Callable[[Tensor], int]) -> tuple[Tensor, Tensor]:
    """A split input's copy into backend `cur` (ggml_dup_tensor_layout) and a node that keeps `src` alive until it."""
    cp = Tensor("NONE", src.type, list(src.ne), list(src.nb), (), None, src.name + "#copy")
    cp.be = cur
    cp.glob = src.glob
    cp.size = copy_size(cp) if cur != HOST else nbytes_strided(cp)
    dep = Tensor("NONE", src.type, list(src.ne), list(src.nb), (src,), src.vs or src, src.name + "#dep")
    dep.be = sb
    dep.glob = src.glob
    return dep, cp


GGML_MAX_SRC = 10


def insert_alloc_deps(nodes: list[Tensor], deps: dict[int, list[Tensor]]) -> list[Tensor]:
    """graph_copy's dependency nodes (ggml_backend_sched_split_graph): after each `until` node (deps is keyed by its
    id), a GGML_OP_NONE view per GGML_MAX_SRC kept tensors, so that ggml-alloc frees none of them before it."""
    if not deps:
        return nodes
    out: list[Tensor] = []
    for n in nodes:
        out.append(n)
        keep = deps.get(id(n))
        if keep:
            for k in range(0, len(keep), GGML_MAX_SRC):
                d = Tensor("NONE", keep[k].type, list(keep[k].ne), list(keep[k].nb), tuple(keep[k:k + GGML_MAX_SRC]),
                           keep[k].vs or keep[k], "alloc_dep")
                d.be = n.be
                d.glob = n.glob
                out.append(d)
    return out


def add_alloc_dep(deps: dict[int, list[Tensor]], tensor: Tensor, until: Tensor) -> None:
    """ggml_backend_graph_optimize_params.add_alloc_dep: keep `tensor` until `until`, each tensor once per node."""
    keep = deps.setdefault(id(until), [])
    if all(x is not tensor for x in keep):
        keep.append(tensor)


def graph_uses(nodes: list[Tensor]) -> dict[int, int]:
    """cgraph->use_counts of the graph before it was split (ggml_visit_parents): how often each tensor is a source of
    a node, by id. A split input's copy stands for its original (pass 5 puts "<src>#dep", whose source is the original,
    right before "<src>#copy"); the scheduler's own nodes are not counted."""
    origin: dict[int, Tensor] = {}
    for a, b in zip(nodes, nodes[1:]):
        if a.name.endswith("#dep") and b.name.endswith("#copy"):
            origin[id(b)] = a.src[0]
    uses: dict[int, int] = {}
    for t in nodes:
        if t.sid < 0:
            continue
        for s in t.src:
            if s is not None:
                k = id(origin.get(id(s), s))
                uses[k] = uses.get(k, 0) + 1
    return uses


def split_graph(seq: list[Segment], pl: Placement, copy_size: Callable[[Tensor], int], src_of: dict[int, Segment]) -> None:
    """ggml_backend_sched_split_graph passes 1-5 over the segments (each distinct layer once, in order):
    assign every node a backend, split where it changes, copy foreign sources into the split's backend."""
    nodes: list[Tensor] = []
    for seg in seq:
        for leaf in seg.leafs:
            leaf.be = -1
        for node in seg.nodes:
            # llama_context::graph_get_cb's ggml_backend_sched_set_tensor_backend: a layer's norm on its device
            pin = pl.pin_layer_norms and node.flags & LAYER_PIN and pl.sup(seg.dev, node)
            node.be = seg.dev if pin else -1
        nodes += seg.nodes
    _pass1_assign(seq, nodes, pl)
    _pass2_expand(nodes, pl)
    _placeholders(seq, src_of)
    _pass3_upgrade(nodes, pl)
    _pass4_views_and_sources(nodes, pl)
    _placeholders(seq, src_of)
    _pass5_splits(seq, copy_size, pl.n_copies, pl.every_input)
