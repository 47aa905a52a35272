"""Metal's reordered layers as chunks for ggml-alloc (ggfit's own): the second half of segments.py's plan.

fitter.ggml.backends.metal.segments works out each instance's packs and the reorder's work over them. What the reorder
emitted while at one instance becomes a chunk (fitter.ggml.replay.Chunk) here: copies of the nodes, the alloc deps after
their `until`, stand-ins for the tensors earlier chunks hand it. Instances whose work is the same and that are handed
the same tensors share one chunk (`ChunkPlanning._chunks`).
"""

from __future__ import annotations

from typing import Callable

from fitter.ggml.backends.metal.common import optimize_splits
from fitter.ggml.graph import Segment
from fitter.ggml.replay import Chunk, ChunkPlan
from fitter.ggml.sched import add_alloc_dep, insert_alloc_deps
from fitter.ggml.tensor import FLAG_INPUT, CacheTensor, Tensor
from fitter.llama_builds import LlamaBuild

# what a pack reads or writes, relative to its instance (segments._Plan._ref): local tensors ((instance offset,
# index in their segment), ...), whether it reads the previous instance's output, global tensors' indices, KV ranges,
# recurrent tensors ((instance offset, layer built for, slot, size, backend), ...)
Ref = tuple


class Kind:
    """One instance's packs: a segment's node list (one variant) followed by a given next instance. Per pack its raw
    node range, whether its op is empty / movable, and what it reads and writes (`Ref`)."""

    __slots__ = ("nodes", "parts", "empty", "safe", "rd", "wr", "deps", "spill", "over", "dover", "fp")

    def __init__(self, nodes: list[Tensor]) -> None:
        self.nodes = nodes
        # per pack: its raw nodes as (instance offset 0 or 1, start, end) ranges of those instances' node lists
        self.parts: list[tuple[tuple[int, int, int], ...]] = []
        self.empty: list[bool] = []
        self.safe: list[bool] = []
        self.rd: list[Ref] = []
        self.wr: list[Ref] = []
        self.deps: list[tuple[Tensor, Tensor]] = []  # alloc deps (tensor, until) of this instance's patterns
        self.spill: list[tuple[Tensor, Tensor]] = []  # and those of its last one, ending in the next instance
        self.over = 0  # how many nodes of the next instance its last pack takes
        self.dover = 0  # and its last alloc-dep pattern
        self.fp = -1  # what the reorder reads of it (parts, empty, safe, rd, wr), as an interned number


class Unsupported(Exception):
    """The segments cannot stand for the whole graph's reorder: build and reorder it whole."""


class ChunkPlanning:
    """The chunks of one graph's reordered instances (segments._Plan plans with it: these are its fields)."""

    pro: Segment
    epi: Segment
    layers: list[tuple[Segment, bool]]
    insts: list[tuple[Segment, list[Tensor]]]
    kind_of: list[Kind]
    build: LlamaBuild
    gpu: int
    _by_id: dict[int, Tensor]  # the local tensors _resolve has met
    _uses_at: Callable[[int], dict[int, int]]

    def _chunks(self, work: list[tuple], n_copy: int, pro_tail: int, epi_head: int) -> tuple[ChunkPlan, list[Segment]]:
        """The reordered graph as chunks (fitter.ggml.replay.Chunk), one per instance: the nodes emitted while the
        reorder walked that instance's packs (some of them the next instances'), the alloc deps after their `until`.
        Instances whose work is the same object, and that hand on the same tensors (relative to them), share one chunk:
        its nodes are copies of the segments' (the global tensors themselves), its inputs stand for what it reads from
        earlier chunks."""
        m = len(self.insts)
        head, tail = self._outside(pro_tail, epi_head)
        at = self._stretches(work, head, n_copy, tail)
        carried = self._carried(at)
        chunks: list[Chunk] = []
        types: dict[tuple, int] = {}
        seq: list[int] = []
        for c, st in enumerate(at):
            cin = tuple(sorted((q - c, x) for q, x in carried[c]))
            cout = tuple(sorted((q - c, x) for q, x in carried[c + 1])) if c + 1 < m else ()
            tkey = (id(st), cin, cout)
            k = types.get(tkey)
            if k is None:
                k = types[tkey] = len(chunks)
                chunks.append(self._chunk(c, st, cin, cout))
            seq.append(k)
        first = self._first(chunks, seq)
        segs = [Segment(ch.nodes, [], ch.inps, None, None) for ch in chunks]
        segs[0].leafs = first
        return ChunkPlan(chunks, seq, first), segs

    def _outside(self, pro_tail: int, epi_head: int) -> tuple[list[Tensor], list[Tensor]]:
        """The prologue's nodes before the layers' split and the epilogue's after it, their own splits reordered apart
        (common.optimize_splits), their alloc deps in."""
        pro, epi = self.pro, self.epi
        head, tail = pro.nodes[:len(pro.nodes) - pro_tail], epi.nodes[epi_head:]
        for part in (head, tail):
            if any(isinstance(b, CacheTensor) for t in part for x in (t, *t.src) if x is not None
                   for b in (x.vs if x.vs is not None else x,)):
                raise Unsupported  # (the caches' ranges are worked out for the layers' split only)
        rest: dict[int, list[Tensor]] = {}
        head = optimize_splits(head, self._uses_at(0), {}, self.build, self.gpu, rest)
        tail = optimize_splits(tail, self._uses_at(len(self.insts) - 1), {}, self.build, self.gpu, rest)
        return insert_alloc_deps(head, rest), insert_alloc_deps(tail, rest)

    def _deps_at(self) -> list[dict[int, list[Tensor]]]:
        """Each instance's alloc-dep nodes by their `until` (shared by instances of one node list and deps)."""
        insts, kinds = self.insts, self.kind_of
        cache: dict[tuple, dict[int, list[Tensor]]] = {}
        out: list[dict[int, list[Tensor]]] = []
        for q in range(len(insts)):
            pairs = (kinds[q - 1].spill if q else []) + kinds[q].deps
            key = (id(insts[q][1]), tuple((id(t), id(u)) for t, u in pairs))
            d = cache.get(key)
            if d is None:
                keep: dict[int, list[Tensor]] = {}
                for t, until in pairs:
                    add_alloc_dep(keep, t, until)
                d = cache[key] = {}
                for until_id, kept in keep.items():
                    until = next(u for _, u in pairs if id(u) == until_id)
                    d[until_id] = insert_alloc_deps([until], {until_id: kept})[1:]
            out.append(d)
        return out

    def _stretches(self, work: list[tuple], head: list[Tensor], n_copy: int, tail: list[Tensor]) -> list["_Stretch"]:
        """Each chunk's nodes relative to it ((instance offset, node)), with what each reads, what it makes and what it
        reads from earlier chunks (_Stretch): worked out once per (work, kind of the instance before: its output is
        what the placeholders stand for), and one object for the same nodes read the same way."""
        insts, kinds = self.insts, self.kind_of
        m = len(insts)
        deps_at = self._deps_at()
        shapes: dict[tuple, _Stretch] = {}
        by_content: dict[tuple, _Stretch] = {}
        at: list[_Stretch] = []
        for c, hit in enumerate(work):
            skey = (id(hit), id(kinds[c - 1])) if 1 < c < m - 1 else (c, 0)
            st = shapes.get(skey)
            if st is None:
                r: list[tuple[int, Tensor]] = []
                if c == 0:
                    r = [(0, t) for t in head]
                elif c == 1:
                    r = [(0, t) for t in self.layers[0][0].nodes[:n_copy]]
                for dq, k in hit[0]:
                    for dq2, a0, b0 in kinds[c + dq].parts[k]:
                        q = c + dq + dq2
                        dmap = deps_at[q]
                        for t in insts[q][1][a0:b0]:
                            r.append((q - c, t))
                            extra = dmap.get(id(t))
                            if extra:
                                r += [(q - c, d) for d in extra]
                if c == m - 1:
                    r += [(0, t) for t in tail]
                st = self._stretch(c, r)
                # the same nodes read the same way (the look-ahead near the graph's end often moves nothing more)
                st = shapes[skey] = by_content.setdefault((tuple(r), tuple(st.wiring)), st)  # (tensors by identity)
            at.append(st)
        return at

    @staticmethod
    def _carried(at: list["_Stretch"]) -> list[set[tuple[int, int]]]:
        """What each chunk is handed: the tensors made before it and read in it or after it."""
        carried: list[set[tuple[int, int]]] = [set() for _ in range(len(at) + 1)]
        for c, st in enumerate(at):
            for dq, tid in st.reads:
                q = c + dq
                c0 = c - 1
                while c0 >= 0 and (q - c0, tid) not in at[c0].made:
                    c0 -= 1
                if c0 < 0:
                    raise Unsupported  # (a tensor no chunk makes)
                for b1 in range(c0 + 1, c + 1):
                    carried[b1].add((q, tid))
        return carried

    def _first(self, chunks: list[Chunk], seq: list[int]) -> list[Tensor]:
        """What Gallocr.run allocates before the first node: the leafs, then the graph inputs as it meets them."""
        first: list[Tensor] = []
        for seg in [self.pro, *(s for s, f in self.layers if f), self.epi]:
            for leaf in seg.leafs:
                if not leaf.glob:
                    raise Unsupported  # (a layer's own leaf: the segments' replay would allocate it once)
                first.append(leaf)
        seen_in: set[int] = set()
        for k in dict.fromkeys(seq):  # (later chunks meet the same ones)
            for t in chunks[k].nodes:
                for x in (t, *t.src):
                    if x is not None and x.flags & FLAG_INPUT and id(x) not in seen_in:
                        seen_in.add(id(x))
                        first.append(x)
        return first

    def _resolve(self, q: int, x: Tensor | None) -> tuple[int, int] | None:
        """The tensor a node of instance q reads as x: (instance, id), its placeholder followed back to the output it
        stands for; None for a global tensor."""
        if x is None:
            return None
        seg = self.insts[q][0]
        while seg.inp is not None and x is seg.inp:
            q -= 1
            seg = self.insts[q][0]
            assert seg.out is not None  # a placeholder stands for a layer's output
            x = seg.out
        if x.glob or x.ext:
            return None
        self._by_id[id(x)] = x
        return q, id(x)

    def _stretch(self, c: int, r: list[tuple[int, Tensor]]) -> "_Stretch":
        st = _Stretch(r)
        made = st.made
        for dq, t in r:
            if not (t.glob or t.ext):
                made.add((dq, id(t)))
        insts, by_id, resolve = self.insts, self._by_id, self._resolve
        wiring = st.wiring
        reads: dict[tuple[int, int], None] = {}

        def rel(q: int, x: Tensor | None) -> tuple[int, int] | None:  # _resolve, relative to the chunk
            if x is None:
                return None
            if x is insts[q][0].inp:
                hit = resolve(q, x)
                return None if hit is None else (hit[0] - c, hit[1])
            if x.glob or x.ext:
                return None
            by_id[id(x)] = x
            return q - c, id(x)

        for dq, t in r:
            q = c + dq
            inp = insts[q][0].inp
            src: list[tuple[int, int] | None] = []
            for x in t.src:  # rel(q, x) for each, inline but for the placeholder (rel resolves it)
                if x is None:
                    src.append(None)
                elif x is inp:
                    src.append(rel(q, x))
                elif x.glob or x.ext:
                    src.append(None)
                else:
                    i = id(x)
                    by_id[i] = x
                    src.append((dq, i))
            vs = rel(q, t.vs)
            wiring.append((tuple(src), vs))
            for x in (*src, vs):
                while x is not None and x not in made:  # read from an earlier chunk, with its base
                    reads[x] = None
                    base = by_id[x[1]].vs
                    x = rel(x[0] + c, base) if base is not None else None
        st.reads = list(reads)
        return st

    def _chunk(self, c: int, st: "_Stretch", cin: tuple, cout: tuple) -> Chunk:
        """Chunk c's own tensors: a copy of each node that is not global, a stand-in for each tensor it is handed
        (relative refs: (instance offset, id))."""
        objs: dict[tuple[int, int], Tensor] = {}
        by_id = self._by_id

        def obj(ref: tuple[int, int]) -> Tensor:
            o = objs.get(ref)
            if o is None:  # made in an earlier chunk: a stand-in, never a node here
                t = by_id[ref[1]]
                o = objs[ref] = t.clone()
                o.src = ()
                o.vs = None
                if t.vs is not None:
                    base = self._resolve(c + ref[0], t.vs)
                    o.vs = t.vs if base is None else obj((base[0] - c, base[1]))
            return o

        nodes: list[Tensor] = []
        pending: list[tuple[Tensor, Tensor, tuple]] = []
        for (dq, t), wiring in zip(st.nodes, st.wiring):
            if t.glob or t.ext:
                nodes.append(t)
                continue
            cl = t.clone()
            objs[(dq, id(t))] = cl
            pending.append((t, cl, wiring))
            nodes.append(cl)
        inps = [obj(ref) for ref in cin]
        get = objs.get
        for t, cl, (src, vs) in pending:
            cl.src = tuple([x if ref is None else (get(ref) or obj(ref)) for x, ref in zip(t.src, src)])
            if vs is not None:
                cl.vs = get(vs) or obj(vs)
        outs = [obj(ref) for ref in cout]
        return Chunk(nodes, inps, outs)


class _Stretch:
    """A chunk's nodes relative to it: (instance offset, node); per node where its sources and view base are ((offset,
    id), None for a global tensor); what it makes; what it reads from earlier chunks (view bases included)."""

    __slots__ = ("nodes", "wiring", "made", "reads")

    def __init__(self, nodes: list[tuple[int, Tensor]]) -> None:
        self.nodes = nodes
        self.wiring: list[tuple[tuple, tuple[int, int] | None]] = []
        self.made: set[tuple[int, int]] = set()
        self.reads: list[tuple[int, int]] = []
