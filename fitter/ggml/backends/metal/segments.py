"""Metal's graph_optimize over a graph built one segment per distinct layer, allocated as repeating chunks (ggfit's own).

ggml_graph_optimize (fitter.ggml.backends.metal.common) reorders each Metal split, and its look-ahead crosses layers:
a node of the next layer moves up among this layer's, a fusion packs this layer's last add with the next one's norm.
Reordering the whole graph means building every layer (layer_segments._flatten); here each distinct layer is built once:

- Instances. The node sequence is the segments' instances in graph order: the prologue's part of the split, layer 0,
  each layer's segment in the variant it runs (a template's first instance also emits the prologue tensors it first
  reads), the epilogue's part. A tensor local to a segment is told apart by its instance; a placeholder stands for
  the previous instance's output; each layer's recurrent state sits at its own offset (cache_ranges' layout).
- Packs (`Kind`) are worked out per node list and what follows it: fusions see the next instance's first nodes, as
  copies that read this instance's output, and may take some of them.
- The reorder (`_reorder`) walks the instances in turn. Its state as it enters one (the concurrent set, the packs
  already moved up), relative to that instance, with the kinds its look-ahead can reach, decides what it emits there:
  the first answer for such a state is kept and reused, as the allocator's replay reuses a layer's.
- Chunks (fitter.ggml.backends.metal.chunks). What the reorder emitted while at one instance is a chunk
  (fitter.ggml.replay.Chunk): copies of the nodes, the alloc deps after their `until`, stand-ins for the tensors earlier
  chunks hand it. Chunks of the same nodes read the same way that are handed the same tensors are one; ggml-alloc then
  runs chunk after chunk and jumps over repeated periods (fitter.ggml.replay.replay_chunks), which is `Gallocr.run` over
  the reordered whole graph.

Where the layers are not one Metal split (an op or a weight on the CPU), a pack spans more than one boundary, or an
alloc dep would keep a tensor of an earlier layer, `optimize_segments` says so and the caller builds the graph whole.
"""

from __future__ import annotations

from typing import Callable

from fitter.cache import CACHES
from fitter.ggml.backends.metal.chunks import Kind, Ref, Unsupported
from fitter.ggml.backends.metal.common import (
    EMPTY_OPS,
    SAFE_OPS,
    _fuse_len,
    pack_ends,
)
from fitter.ggml.backends.metal.fusion import fusion_alloc_deps, fusion_max
from fitter.ggml.backends.metal.reorder import ReorderKeys
from fitter.ggml.graph import Segment
from fitter.ggml.replay import ChunkPlan
from fitter.ggml.sched import graph_uses
from fitter.ggml.tensor import VIEW_OPS, CacheTensor, Tensor
from fitter.llama_builds import LlamaBuild

_CONTEXT = 16  # nodes that are not empty a fusion looks ahead (GGML_METAL_FUSION_MAX)
# across graphs: each kind's fingerprint (what the reorder reads of it) -> a number, and the reorder's work by the
# fingerprints of every instance's kind and the recurrent layout
_FINGERPRINTS: dict[tuple, int] = CACHES.keep({}, "metal-reorder")
_WORK: dict[tuple, list] = CACHES.keep({}, "metal-reorder")
_MEMO_MAX = 64


def optimize_segments(n: int, pro: Segment, seg0: Segment, templates: dict[tuple, Segment], keys: list[tuple],
                      epi: Segment, build: LlamaBuild, alloc_size: Callable[[Tensor], int], alignment: int,
                      gpu: int) -> tuple[ChunkPlan, list[Segment]] | None:
    """ggml_backend_metal_graph_optimize over the graph these segments stand for (fitter.llama.context's _prepare),
    as chunks for fitter.ggml.replay.replay_chunks and the segments that hold their tensors; None where only the whole
    graph can be reordered."""
    try:
        return _Plan(n, pro, seg0, templates, keys, epi, build, alloc_size, alignment, gpu).run()
    except Unsupported:
        return None


class _Plan(ReorderKeys):
    """One graph's segments through the reorder and into chunks (see the module's docstring); `run` or Unsupported."""

    def __init__(self, n: int, pro: Segment, seg0: Segment, templates: dict[tuple, Segment], keys: list[tuple],
                 epi: Segment, build: LlamaBuild, alloc_size: Callable[[Tensor], int], alignment: int,
                 gpu: int) -> None:
        self.n, self.pro, self.epi, self.build, self.gpu = n, pro, epi, build, gpu
        self.alloc_size, self.alignment = alloc_size, alignment
        self._by_id: dict[int, Tensor] = {}  # the local tensors _resolve has met
        # packs away from a node list's end, the same in every kind of that list: (list, index) -> (length, empty,
        # movable, reads, writes)
        self._packs: dict[tuple[int, int], tuple] = {}
        self._inner_of: dict[int, int] = {}
        self._glob_index: dict[int, int] = {}  # global tensor id -> its index, in the order the packs meet them
        self._local_index: dict[int, dict[int, int]] = {}  # segment -> tensor id -> its index in the segment
        self._bits: dict[object, int] = {}  # the reorder's sets as bits: tensor identity -> its bit
        self._idents: list[object] = []
        self.table = build.has("metal_fusion_table")
        # the layers' instances: (segment, first): a template's first instance runs all its nodes, the later ones its
        # steady nodes (the prologue's tensors are emitted once, fitter.ggml.alloc)
        seen: set[int] = set()
        self.layers: list[tuple[Segment, bool]] = [(seg0, True)]
        for il in range(1, n):
            seg = templates[keys[il]]
            self.layers.append((seg, id(seg) not in seen))
            seen.add(id(seg))

    def run(self) -> tuple[ChunkPlan, list[Segment]]:
        pro, epi = self.pro, self.epi
        lists: dict[tuple[int, bool], list[Tensor]] = {}
        for seg, first in self.layers:
            if (id(seg), first) not in lists:
                lists[(id(seg), first)] = seg.nodes if first else [t for t in seg.nodes if not t.glob]
        seg0 = self.layers[0][0]
        # the Metal split the layers lie in, whole: layer 0 may start with the copies of the split's inputs
        n_copy = 0
        while n_copy < len(seg0.nodes) and seg0.nodes[n_copy].sid < 0:
            n_copy += 1
        sid = seg0.nodes[n_copy].sid if n_copy < len(seg0.nodes) else -1
        for (sid_of, _), nodes in lists.items():
            body = nodes[n_copy:] if sid_of == id(seg0) else nodes
            if any(t.sid != sid for t in body):
                raise Unsupported
            if any(t.be != self.gpu for t in body if t.op not in VIEW_OPS):
                raise Unsupported
        if sid < 0:
            raise Unsupported
        pro_tail = 0
        if not n_copy:
            while pro_tail < len(pro.nodes) and pro.nodes[len(pro.nodes) - 1 - pro_tail].sid == sid:
                pro_tail += 1
        epi_head = 0
        while epi_head < len(epi.nodes) and epi.nodes[epi_head].sid == sid:
            epi_head += 1
        # the instances in the split: (segment, its nodes there)
        self.insts: list[tuple[Segment, list[Tensor]]] = [(pro, pro.nodes[len(pro.nodes) - pro_tail:])]
        for k, (seg, first) in enumerate(self.layers):
            nodes = lists[(id(seg), first)]  # one list object per segment and variant (they key the kinds)
            self.insts.append((seg, nodes[n_copy:] if k == 0 else nodes))
        self.insts.append((epi, epi.nodes[:epi_head]))
        full = [pro.nodes] + [lists[(id(seg), first)] for seg, first in self.layers] + [epi.nodes]
        self._uses(full)
        self._kinds()
        self._rs_layout()
        # the reorder reads nothing but the kinds, which tensor each instance hands on and the recurrent layout, none
        # of it an object: graphs of one shape (another -ub or K/V type of the same model, as a `fit` table asks)
        # reorder alike
        outs = tuple(-1 if seg.out is None else self._local(seg, seg.out) for seg, _ in self.insts[:-1])
        wkey = (self.table, tuple(k.fp for k in self.kind_of), outs, tuple(sorted(self.rs_off.items())),
                tuple(self.rs_base))
        work = _WORK.get(wkey)
        if work is None:
            work = self._reorder()
            if len(_WORK) >= _MEMO_MAX:
                _WORK.pop(next(iter(_WORK)))
            _WORK[wkey] = work
        return self._chunks(work, n_copy, pro_tail, epi_head)

    # ---- use counts ------------------------------------------------------------------------------------------------

    def _locals(self, seg: Segment) -> set[int]:
        loc = {id(t) for t in seg.created if not t.glob and not t.ext}
        loc.update(id(t) for t in seg.nodes if not t.glob and not t.ext)
        if seg.inp is not None:
            loc.add(id(seg.inp))
        return loc

    def _uses(self, full: list[list[Tensor]]) -> None:
        """cgraph->use_counts (fitter.ggml.sched.graph_uses) of the whole graph: the global tensors' summed over every
        instance, each instance's own local ones, a layer's output counted where the next instance reads it."""
        segs = [self.pro] + [seg for seg, _ in self.layers] + [self.epi]
        self.local_ids: dict[int, set[int]] = {}
        for seg in segs:  # (a layer's segment stands for every layer that runs it)
            if id(seg) not in self.local_ids:
                self.local_ids[id(seg)] = self._locals(seg)
        glob: dict[int, int] = {}
        self.inst_uses: list[dict[int, int]] = []
        cache: dict[int, dict[int, int]] = {}
        for seg, nodes in zip(segs, full):
            u = cache.get(id(nodes))
            if u is None:
                u = cache[id(nodes)] = graph_uses(nodes)
            loc = self.local_ids[id(seg)]
            for k, v in u.items():
                if k not in loc:
                    glob[k] = glob.get(k, 0) + v
            self.inst_uses.append(u)
        self.glob_uses = glob

    def _uses_at(self, q: int) -> dict[int, int]:
        """The use counts an instance's fusion checks read: the global ones, its local ones, its output's readers."""
        seg = self.insts[q][0]
        uses = dict(self.glob_uses)
        loc = self.local_ids[id(seg)]
        for k, v in self.inst_uses[q].items():
            if k in loc:
                uses[k] = v
        out = seg.out
        if out is not None and q + 1 < len(self.insts) and id(out) in loc:
            nxt = self.insts[q + 1][0]
            uses[id(out)] = self.inst_uses[q].get(id(out), 0) + (
                self.inst_uses[q + 1].get(id(nxt.inp), 0) if nxt.inp is not None else 0)
        return uses

    # ---- packs -----------------------------------------------------------------------------------------------------

    def _kinds(self) -> None:
        """Each instance's packs (fitter.ggml.backends.metal.common.reorder's), worked out once per (node list, next
        node list, where the previous instance's last pack and last alloc-dep pattern ended in this one)."""
        kinds: dict[tuple, Kind] = {}
        self.kind_of: list[Kind] = []
        start = dstart = 0
        insts = self.insts
        for q, (_, nodes) in enumerate(insts):
            # one list object per segment and variant; the lists after it that a fusion could reach
            after = []
            q1 = q + 1
            while q1 < len(insts):
                after.append(id(insts[q1][1]))
                if self._inner(insts[q1][1]) > 0:  # long enough to hold every fusion from before it
                    break
                q1 += 1
            key = (id(nodes), tuple(after), start, dstart)
            kind = kinds.get(key)
            if kind is None:
                kind = kinds[key] = self._kind(q, nodes, start, dstart)
                if len(_FINGERPRINTS) > _MEMO_MAX * 64:
                    _FINGERPRINTS.clear()
                    _WORK.clear()
                fp = (tuple(kind.parts), tuple(kind.empty), tuple(kind.safe), tuple(kind.rd), tuple(kind.wr))
                kind.fp = _FINGERPRINTS.setdefault(fp, len(_FINGERPRINTS))
            self.kind_of.append(kind)
            start, dstart = kind.over, kind.dover

    def _context(self, q: int) -> tuple[list[Tensor], dict[int, int], dict[int, tuple[int, Tensor]]]:
        """The nodes after instance q that a fusion starting in it can reach (16 that are not empty), as copies that
        read q's output where they read their placeholder, with their use counts; copy id -> (instance offset, node)."""
        ctx: list[Tensor] = []
        uses: dict[int, int] = {}
        back: dict[int, tuple[int, Tensor]] = {}
        clone: dict[Tensor | None, Tensor] = {}  # (by identity)
        out = self.insts[q][0].out
        n_real = 0
        q1 = q + 1
        while q1 < len(self.insts) and n_real < _CONTEXT:
            seg, nodes = self.insts[q1]
            u = self._uses_at(q1)
            for t in nodes:
                if n_real == _CONTEXT:
                    break
                c = t.clone()
                c.src = tuple([out if x is seg.inp and x is not None else clone.get(x, x) for x in t.src])
                if t.vs is not None:
                    c.vs = out if t.vs is seg.inp else clone.get(t.vs, t.vs)
                clone[t] = c
                back[id(c)] = (q1 - q, t)
                if id(t) in u:
                    uses[id(c)] = u[id(t)]
                ctx.append(c)
                if t.op not in EMPTY_OPS:
                    n_real += 1
            out = clone.get(seg.out) if seg.out is not None else None
            q1 += 1
        return ctx, uses, back

    def _kind(self, q: int, nodes: list[Tensor], start: int, dstart: int) -> Kind:
        seg = self.insts[q][0]
        kind = Kind(nodes)
        ctx, ctx_uses, back = self._context(q)
        uses = self._uses_at(q)
        for k, v in ctx_uses.items():
            uses[k] = v
        win = nodes[start:] + ctx
        end = len(nodes) - start
        inner = self._inner(nodes) - start  # packs from before it see this node list alone (not its output's readers)
        memo = self._packs
        i = 0
        while i < end:
            hit = memo.get((id(nodes), start + i)) if i < inner else None
            if hit is None:
                f = fusion_max(win, i, uses) if self.table else _fuse_len(win, i, uses)
                pack = win[i:i + f]
                srcs, dsts = pack_ends(pack, self.table)
                hit = (f, pack[0].op in EMPTY_OPS, pack[0].op in SAFE_OPS, self._ref(q, srcs, back),
                       self._ref(q, dsts, back))
                if i < inner:
                    memo[(id(nodes), start + i)] = hit
            f, empty, safe, rd, wr = hit
            parts: list[tuple[int, int, int]] = [(0, start + i, start + min(i + f, end))]
            if i + f > end:
                over = [back[id(x)] for x in win[end:i + f]]
                if any(dq != 1 for dq, _ in over):
                    raise Unsupported  # a pack across two instance boundaries
                parts.append((1, 0, len(over)))
                kind.over = len(over)
            kind.parts.append(tuple(parts))
            kind.empty.append(empty)
            kind.safe.append(safe)
            kind.rd.append(rd)
            kind.wr.append(wr)
            i += f
        if self.table:
            dwin = nodes[dstart:] + ctx
            for t, until in fusion_alloc_deps(dwin, len(nodes) - dstart):
                if id(until) not in back:
                    kind.deps.append((t, until))
                    continue
                # a pattern that ends in the next instance: its dep goes there, keeping a global tensor, a node of that
                # instance, or this instance's output (that instance's placeholder)
                dq, u = back[id(until)]
                kept: Tensor | None = t
                if id(t) in back:
                    kept = back[id(t)][1]
                elif t is seg.out:
                    kept = self.insts[q + 1][0].inp
                elif not (t.glob or t.ext):
                    raise Unsupported
                if dq != 1 or kept is None:
                    raise Unsupported
                kind.spill.append((kept, u))
                kind.dover = max(kind.dover, self.insts[q + 1][1].index(u) + 1)
        return kind

    def _inner(self, nodes: list[Tensor]) -> int:
        """The first index of a node list from which a fusion could reach its last node: GGML_METAL_FUSION_MAX nodes
        that are not empty before it (fusion_max looks no further ahead)."""
        hit = self._inner_of.get(id(nodes))
        if hit is None:
            k, seen = len(nodes) - 1, 0
            while k > 0 and seen < _CONTEXT + 1:
                k -= 1
                if nodes[k].op not in EMPTY_OPS:
                    seen += 1
            hit = self._inner_of[id(nodes)] = k
        return hit

    def _ref(self, q: int, ts: list[Tensor], back: dict[int, tuple[int, Tensor]]) -> Ref:
        """What a pack of instance q reads or writes (ggml_mem_range_from_tensor of each tensor's base, as
        common._ranges), relative to the instance and with no object identity in it (so that graphs of the same
        shape have the same Refs): local tensors as (instance offset, index in their segment), whether it reads the
        previous instance's output, global tensors by their index in the graph, KV ranges, recurrent tensors as
        (instance offset, layer built for, slot, size, backend)."""
        seg = self.insts[q][0]
        loc: list[tuple[int, int]] = []
        prev = False
        glob: list[int] = []
        kv: list[tuple] = []
        rs: list[tuple] = []
        for t in ts:
            b = t.vs if t.vs is not None else t
            dq = 0
            hit = back.get(id(b))
            if hit is not None:  # a node of the next instance (never its placeholder: the copies read q's output)
                dq, b = hit
            if isinstance(b, CacheTensor) and b.buf:
                if b.buf[0] == "kv":
                    kv.append((("kv", b.be, b.buf[1]), 0, 1))
                else:
                    rs.append((dq, b.buf[1], b.buf[2], self.alloc_size(b), b.be))
            elif dq == 0 and b is seg.inp:
                prev = True
            elif b.glob or b.ext:
                glob.append(self._glob_index.setdefault(id(b), len(self._glob_index)))
            else:
                of = self.insts[q + dq][0]
                index = self._local_index.get(id(of)) or self._local_index_of(of)  # (_local, inline)
                loc.append((dq, index[id(b)]))
        return tuple(loc), prev, frozenset(glob), tuple(kv), tuple(rs)
