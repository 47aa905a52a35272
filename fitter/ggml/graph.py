"""The graph: ggml_cgraph (ggml_build_forward_expand) and the segments the simulator cuts it into.

Mirrors ggml/src/ggml.c ggml_build_forward_expand / ggml_visit_parents. A Segment is ggfit's own:
the nodes one layer (or the prologue / epilogue) adds to the graph, so that a layer repeated N
times is built once and replayed (fitter.ggml.replay.replay_segments).
"""

from __future__ import annotations

from fitter.ggml.tensor import FLAG_OUTPUT, IS_WEIGHT, Tensor


class Graph:
    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []

    def expand(self, t: Tensor) -> None:
        """ggml_build_forward_expand: depth-first over src[0..], post-order, each tensor once."""
        if t.vis:
            return
        t.vis = True
        stack = [(t, 0)]
        nodes, leafs = self.nodes, self.leafs
        while stack:
            node, i = stack[-1]
            src = node.src
            if i < len(src):
                stack[-1] = (node, i + 1)
                s = src[i]
                if s is not None and not s.vis:
                    s.vis = True
                    stack.append((s, 0))
                continue
            stack.pop()
            if node.op == "NONE":
                if not node.ext:
                    leafs.append(node)
            else:
                nodes.append(node)


Program = tuple[list[Tensor], list[bool], list[tuple], list[tuple]]


def program(nodes: list[Tensor]) -> Program:
    """The nodes as fitter.ggml.alloc.Gallocr.process_program walks them, in parallel lists (a graph a search keeps
    is walked by the cyclic collector: few objects): per node, whether it can be allocated (neither external nor a
    view), its sources that can be (in order, repeats kept) and its sources the allocator counts down (all but the
    external ones: weights and caches are never allocated, so never freed); its own src where that is all of them."""
    cans, allocs, uses = [], [], []
    for n in nodes:
        src = n.src
        u = [p for p in src if p is not None and not p.ext]
        a = [p for p in u if p.vs is None]
        cans.append(not n.ext and n.vs is None)
        allocs.append(src if len(a) == len(src) else tuple(a))
        uses.append(src if len(u) == len(src) else tuple(u))
    return nodes, cans, allocs, uses


class Segment:
    """The nodes one layer (or the prologue / epilogue) adds to the graph, ready to be re-allocated."""

    __slots__ = ("nodes", "steady", "leafs", "inp", "out", "created", "locals", "first_counts", "steady_counts",
                 "glob_first", "glob_steady", "dev", "prog_first", "prog_steady")

    def __init__(self, nodes: list[Tensor], leafs: list[Tensor], created: list[Tensor], inp: Tensor | None, out: Tensor | None, dev: int = 0):
        self.nodes = nodes
        self.leafs = leafs
        self.created = created
        self.inp = inp
        self.out = out
        self.dev = dev

    def finalize(self) -> None:
        nodes = self.nodes
        self.steady = [n for n in nodes if not n.glob]  # prologue tensors are emitted once, at their first use
        local = {id(t): t for t in self.created if not t.glob and not t.ext}
        for n in nodes:  # scheduler copies are created after the segment
            if not n.glob and not n.ext:
                local[id(n)] = n
        if self.inp is not None:
            local[id(self.inp)] = self.inp
        self.locals = list(local.values())
        self.first_counts, self.glob_first = self._counts(nodes)
        self.prog_first = program(nodes)
        if len(self.steady) == len(nodes):  # no prologue tensor emitted here: both variants count the same
            self.steady_counts, self.glob_steady = self.first_counts, self.glob_first
            self.prog_steady = self.prog_first
        else:
            self.steady_counts, self.glob_steady = self._counts(self.steady)
            self.prog_steady = program(self.steady)

    @staticmethod
    def _counts(nodes: list[Tensor]) -> tuple[list[tuple[Tensor, int, int]], list[tuple[Tensor, int, int]]]:
        """n_children / n_views these nodes add, split into (segment-local, prologue-global) tensors."""
        nc: dict[int, list] = {}
        get = nc.get
        for node in nodes:
            vs = node.vs
            if vs is not None and node.op != "NONE" and not vs.ext:
                e = get(id(vs))
                if e is None:
                    nc[id(vs)] = [vs, 0, 1]
                else:
                    e[2] += 1
            for t in node.src:
                if t is not None and not t.ext:
                    e = get(id(t))
                    if e is None:
                        nc[id(t)] = [t, 1, 0]
                    else:
                        e[1] += 1
        local = [(t, a, b) for t, a, b in nc.values() if not t.glob]
        glob = [(t, a, b) for t, a, b in nc.values() if t.glob]
        return local, glob


def can_fuse_subgraph(sub: list[Tensor], ops: tuple[str, ...] | list[str], outputs: tuple[Tensor, ...],
                      uses: dict[int, int]) -> bool:
    """ggml.c ggml_can_fuse_subgraph_ext over the subgraph's nodes: the ops match, and every node that is not an
    output is used only inside the subgraph (ggml_node_get_use_count, `uses` by id), is not a graph output, and views
    nothing outside it but weights (ggml_is_constant; ggfit keeps a view's base only)."""
    for i, node in enumerate(sub):
        if node.op != ops[i]:
            return False
        if any(node is o for o in outputs):
            continue
        if node.flags & FLAG_OUTPUT:
            return False
        n_uses = sum(1 for other in sub[i + 1:] for s in other.src if s is node)
        if n_uses != uses.get(id(node), 0):
            return False
        vs = node.vs
        if vs is not None and all(vs is not x for x in sub) and vs.w != IS_WEIGHT:
            return False
    return True
