"""ggml-alloc.c: the dynamic allocator and the graph allocator.

DynAllocator is ggml_dyn_tallocr (best fit over free blocks, chunks for a maximum buffer size);
Gallocr is ggml_gallocr (ggml_gallocr_allocate_node / free_node and the passes of
ggml_gallocr_alloc_graph_impl, one dynamic allocator per buffer type). What it decides while it walks a program
it tells a Recorder (ALLOC, REUSE, FREE): a program that runs again from the same state replays those events
(fitter.ggml.memo), and where it meets the same sizes in buffers whose upper part moved since, takes that outcome
moved (fitter.ggml.shifted).
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from fitter.errors import GGFitError
from fitter.ggml.graph import Program, program
from fitter.ggml.tensor import FLAG_INPUT, FLAG_OUTPUT, Tensor
from fitter.record import Record

SIZE_MAX = (1 << 64) - 1
MAX_CHUNKS = 16  # GGML_VBUFFER_MAX_CHUNKS
_MAX_TENSOR = 1 << 56
_OFFSET = (1 << 56) - 1  # an address's offset in its chunk (the chunk is in bits 56-63)

ALLOC, REUSE, FREE = 0, 1, 2  # the events a Recorder is told of (fitter.ggml.memo.RecordedRun.ops)


class Recorder(Protocol):
    """What Gallocr tells of the decisions it makes while it walks a program (fitter.ggml.memo.RecordedRun)."""

    outside: bool  # a source placed in place of a parent: decided by a tensor the program may not reach

    def check(self, t: Tensor, p: Tensor, same: bool) -> None: ...  # a layout test and its answer

    def event(self, op: int, t: Tensor, p: Tensor) -> None: ...  # ALLOC t, REUSE t of parent p, FREE t


class DynAllocator:
    """ggml_dyn_tallocr: per chunk, free blocks sorted by offset; best fit, the last block grows a chunk.

    An address is chunk << 56 | offset. Backends without a maximum buffer size (CPU, CUDA) only ever
    have one chunk; Metal splits a buffer into chunks of at most maxBufferLength.
    """

    __slots__ = ("align", "max_chunk", "chunks", "maxes", "max_size")

    def __init__(self, align: int, max_buffer_size: int = SIZE_MAX) -> None:
        self.align = align
        self.max_chunk = min(max_buffer_size, SIZE_MAX // 2)
        self.chunks: list[list[list[int]]] = []  # free blocks [offset, size] per chunk
        self.maxes: list[int] = []  # max_size per chunk
        self.max_size = 0  # sum(maxes), kept as they grow (ggml_dyn_tallocr's total, read after every allocation)

    def _new_chunk(self, min_size: int) -> int:  # ggml_dyn_tallocr_new_chunk
        size = max(min_size, self.max_chunk)
        if len(self.chunks) == MAX_CHUNKS - 1:
            size = SIZE_MAX // 2
        self.chunks.append([[0, size]])
        self.maxes.append(0)
        return len(self.chunks) - 1

    def alloc(self, size: int) -> int:  # ggml_dyn_tallocr_alloc
        a = self.align
        size = (size + a - 1) // a * a
        chunks = self.chunks
        if len(chunks) == 1:  # the usual case (no maximum buffer size): the loops below for one chunk
            blocks = chunks[0]
            best_b = -1
            best_fit = SIZE_MAX
            last = len(blocks) - 1
            for i in range(last):  # best fit among all blocks but the last
                bs = blocks[i][1]
                if size <= bs <= best_fit:
                    best_b, best_fit = i, bs
            if best_b == -1 and last >= 0 and blocks[last][1] >= size:
                best_b = last
            if best_b != -1:
                b = blocks[best_b]
                off = b[0]
                b[0] = off + size
                b[1] -= size
                if not b[1]:
                    del blocks[best_b]
                end = off + size
                if end > self.maxes[0]:
                    self.max_size += end - self.maxes[0]
                    self.maxes[0] = end
                return off
        return self._alloc_chunks(size)

    def _alloc_chunks(self, size: int) -> int:
        """alloc past its one-chunk case: best fit over every chunk's blocks, then each chunk's last, then a new one."""
        chunks = self.chunks
        best_c = best_b = -1
        for c, blocks in enumerate(chunks):  # best fit among all blocks but each chunk's last
            best_fit = SIZE_MAX
            for i in range(len(blocks) - 1):
                bs = blocks[i][1]
                if bs >= size and bs <= best_fit:
                    best_c, best_b, best_fit = c, i, bs
        if best_b == -1:  # the last block of some chunk: least growth, or the tightest fit
            best_reuse = None
            for c, blocks in enumerate(chunks):
                if not blocks:
                    continue
                last = blocks[-1]
                reuse = self.maxes[c] - last[0] - size
                better_reuse = (best_reuse is None or best_reuse < 0) and (best_reuse is None or reuse > best_reuse)
                better_fit = reuse >= 0 and best_reuse is not None and reuse < best_reuse
                if last[1] >= size and (better_reuse or better_fit):
                    best_c, best_b, best_reuse = c, len(blocks) - 1, reuse
        if best_b == -1:
            best_c = self._new_chunk(size)
            best_b = 0
        blocks = chunks[best_c]
        b = blocks[best_b]
        off = b[0]
        b[0] += size
        b[1] -= size
        if b[1] == 0:
            del blocks[best_b]
        end = off + size
        if end > self.maxes[best_c]:
            self.max_size += end - self.maxes[best_c]
            self.maxes[best_c] = end
        return best_c << 56 | off

    def free(self, addr: int, size: int) -> None:  # ggml_dyn_tallocr_free_bytes
        a = self.align
        size = (size + a - 1) // a * a
        c = addr >> 56
        blocks = self.chunks[c]
        off = addr & _OFFSET if c else addr
        end = off + size
        # ggml's loop in full: a zero-size tensor's free inserts a zero-size block, so the blocks need not be disjoint
        # (one may sit inside another, two tensors share an address) and the first block in order that ends at off or
        # starts at end takes the range, however far down the list
        j = -1  # where a new block goes: the first that starts at or past off
        for i, b in enumerate(blocks):
            b0 = b[0]
            if b0 + b[1] == off:
                b[1] += size
                if i + 1 < len(blocks) and blocks[i + 1][0] == end:
                    b[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if b0 == end:
                b[0] = off
                b[1] += size
                if i and blocks[i - 1][0] + blocks[i - 1][1] == off:
                    blocks[i - 1][1] += b[1]
                    del blocks[i]
                return
            if j < 0 and b0 >= off:
                j = i
        blocks.insert(j if j >= 0 else len(blocks), [off, size])

    def state(self) -> tuple:
        return tuple(tuple(map(tuple, blocks)) for blocks in self.chunks)


class Gallocr:
    """ggml_gallocr: allocate_node / free_node and the passes of ggml_gallocr_alloc_graph_impl.

    One dynamic allocator per buffer type (`Tensor.be` picks it: 0 the device, 1 the host CPU when a GPU
    backend is used), each with its alignment and its `get_alloc_size`.
    """

    def __init__(self, align: int | list[int], alloc_size: Callable[[Tensor], int] | list | None = None,
                 trace: bool = False, max_buffer_size: int | list[int] = SIZE_MAX) -> None:
        aligns = align if isinstance(align, list) else [align]
        maxes = max_buffer_size if isinstance(max_buffer_size, list) else [max_buffer_size] * len(aligns)
        sizes = alloc_size if isinstance(alloc_size, list) else [alloc_size or Tensor.nbytes] * len(aligns)
        self.tallocs = [DynAllocator(a, m) for a, m in zip(aligns, maxes)]
        self.talloc = self.tallocs[0]
        self.aligns = aligns
        self.alloc_sizes = [f or Tensor.nbytes for f in sizes]
        self.trace = trace
        self.live: dict[Tensor, Tensor] = {}  # keyed by the tensor itself (identity), in allocation order
        self.peaks = [0] * len(aligns)
        self.peak_lives: list[list[tuple[str, int]]] = [[] for _ in aligns]
        self._rec: Recorder | None = None  # where process_program records its events (fitter.ggml.memo)

    def _allocate(self, t: Tensor) -> None:  # ggml_gallocr_allocate_node
        if t.own or t.ext or t.vs is not None:
            return
        self._place(t)

    def _place(self, t: Tensor) -> None:
        """_allocate for a tensor known to be neither allocated, external nor a view."""
        t.own = True
        rec = self._rec
        if t.inpl:
            # try to reuse a parent's buffer. A view parent is never "own" (views are not allocated),
            # so the view branch of ggml_gallocr_allocate_node cannot fire.
            for p in t.src:
                if p is None or not p.own or p.flags & FLAG_OUTPUT:
                    continue
                if p.nc == 1 and p.nv == 0:
                    same = p.type == t.type and p.ne == t.ne and p.nb == t.nb  # ggml_are_same_layout, inlined
                    if rec is not None:
                        rec.check(t, p, same)
                    if same:
                        if rec is not None:
                            rec.event(REUSE, t, p)
                        self._reuse(t, p)
                        return
        if rec is not None:
            rec.event(ALLOC, t, t)
        self._fresh(t)

    def _reuse(self, t: Tensor, p: Tensor) -> None:
        """ggml_gallocr_allocate_node's in-place branch: t takes over its dying parent p's memory."""
        t.addr = p.addr
        t.be = be = p.be  # hn->buffer_id = p_hn->buffer_id
        if not t.size:
            self._size(t, be)
        p.own = False
        if self.trace and self.live.pop(p, None) is not None:  # _handover
            self.live[t] = t
        # ggml_gallocr_free_extra_space
        a = self.aligns[be]
        ps = (p.size + a - 1) // a * a
        ns = (t.size + a - 1) // a * a
        if ps > ns:
            self.tallocs[be].free(p.addr + ns, ps - ns)

    def _fresh(self, t: Tensor) -> None:
        """ggml_gallocr_allocate_node's ggml_dyn_tallocr_alloc: new memory for t in its buffer."""
        be = t.be
        if not t.size:
            m = t.memo
            if m is not None and m[0] == be:
                t.size = m[1]
            else:
                self._size(t, be)
        talloc = self.tallocs[be]
        t.addr = talloc.alloc(t.size)
        if self.trace:
            self.live[t] = t
            hw = talloc.max_size
            if hw > self.peaks[be]:
                self.peaks[be] = hw
                self.peak_lives[be] = [(x.name, x.size) for x in self.live.values() if x.be == be]

    def _size(self, t: Tensor, be: int) -> None:
        """t's alloc size in buffer be: the buffer type's get_alloc_size, or what it gave before (Tensor.memo)."""
        m = t.memo
        if m is not None and m[0] == be:
            t.size = m[1]
            return
        t.size = size = self.alloc_sizes[be](t)
        if size >= _MAX_TENSOR:  # a header's sizes beyond any machine (the addresses keep the chunk in bits 56-63)
            raise GGFitError(f"a compute tensor ({t.name}) of {size:,} bytes: the file's sizes are not plausible")
        t.memo = (be, size)

    def _handover(self, old: Tensor, new: Tensor) -> None:
        if self.trace and self.live.pop(old, None) is not None:
            self.live[new] = new

    def _free(self, t: Tensor) -> None:  # ggml_gallocr_free_node
        if t.flags & FLAG_OUTPUT:
            return
        self.tallocs[t.be].free(t.addr, t.size)
        t.own = False
        if self.trace:
            self.live.pop(t, None)

    def sizes(self) -> list[int]:
        return [t.max_size for t in self.tallocs]

    def run(self, nodes: list[Tensor], leafs: list[Tensor]) -> int:
        """ggml_gallocr_alloc_graph_impl over a whole graph; returns the high-water mark."""
        for leaf in leafs:
            self._allocate(leaf)
        for node in nodes:
            vs = node.vs
            if vs is not None and node.op != "NONE":
                vs.nv += 1
            if node.flags & FLAG_INPUT:
                self._allocate(node)
            for s in node.src:
                if s is None:
                    continue
                s.nc += 1
                if s.flags & FLAG_INPUT:
                    self._allocate(s)
        self.process(nodes)
        return self.talloc.max_size

    def run_flat(self, g: FlatGraph) -> None:
        """`run` over a graph compiled by flat_graph: the same allocations and frees, in the same order."""
        for t, nc, nv in g.counts:
            t.nc = nc
            t.nv = nv
        allocate = self._allocate
        for t in g.first:
            allocate(t)
        self.process_program(g.prog)

    def process(self, nodes: list[Tensor]) -> None:
        """The allocation pass of ggml_gallocr_alloc_graph_impl (children and views already counted).

        The hot loop of every prediction: _allocate's own early return (allocated, external or a view)
        is tested here first, so most sources cost no call."""
        allocate = self._allocate
        free = self._free
        for node in nodes:
            src = node.src
            for p in src:
                if p is not None and not p.own and not p.ext and p.vs is None:
                    allocate(p)
            if not node.own and not node.ext and node.vs is None:
                allocate(node)
            for p in src:
                if p is None:
                    continue
                nc = p.nc - 1
                p.nc = nc
                if nc == 0 and p.nv == 0:
                    vs = p.vs
                    if vs is not None:
                        nv = vs.nv - 1
                        vs.nv = nv
                        if nv == 0 and vs.nc == 0 and vs.own:
                            free(vs)
                    elif p.own:
                        free(p)


    def process_program(self, prog: Program) -> None:
        """`process` over a segment's nodes as fitter.ggml.graph.program lists them: the same calls in the same
        order, without the sources no branch of `process` acts on (none, external, views to allocate)."""
        allocate = self._place  # the program holds no external tensor or view to allocate
        tallocs = self.tallocs
        live = self.live if self.trace else None
        rec = self._rec
        for node, can, allocs, uses in zip(*prog):
            for p in allocs:
                if not p.own:
                    if rec is not None and p.inpl:
                        rec.outside = True
                    allocate(p)
            if can and not node.own:
                allocate(node)
            for p in uses:
                nc = p.nc - 1
                p.nc = nc
                if nc == 0 and p.nv == 0:
                    vs = p.vs
                    if vs is not None:
                        nv = vs.nv - 1
                        vs.nv = nv
                        if nv == 0 and vs.nc == 0 and vs.own:
                            p = vs
                        else:
                            continue
                    elif not p.own:
                        continue
                    if not p.flags & FLAG_OUTPUT:  # _free, inlined
                        tallocs[p.be].free(p.addr, p.size)
                        p.own = False
                        if live is not None:
                            live.pop(p, None)
                        if rec is not None:
                            rec.event(FREE, p, p)

    def _events(self, events: Iterable[tuple[int, Tensor, Tensor]]) -> None:
        tallocs = self.tallocs
        live = self.live if self.trace else None
        fresh, reuse = self._fresh, self._reuse
        for op, t, p in events:
            if op == FREE:
                tallocs[t.be].free(t.addr, t.size)
                t.own = False
                if live is not None:
                    live.pop(t, None)
            else:
                t.own = True
                if op == ALLOC:
                    fresh(t)
                else:
                    reuse(t, p)


class FlatGraph(Record, frozen=False, kw_only=False):
    """A whole graph as Gallocr.run walks it, worked out once: the tensors allocated before the first node (the
    leafs, then the graph inputs in the order `run` meets them), every tensor's n_children / n_views, the nodes'
    program (fitter.ggml.graph.program)."""

    first: list[Tensor]
    counts: list[tuple[Tensor, int, int]]
    prog: Program


def flat_graph(nodes: list[Tensor], leafs: list[Tensor]) -> FlatGraph:
    first = list(leafs)
    counts: dict[int, list] = {}

    def entry(t: Tensor) -> list:
        e = counts.get(id(t))
        if e is None:
            e = counts[id(t)] = [t, 0, 0]
        return e

    for node in nodes:  # the first loop of ggml_gallocr_alloc_graph_impl (Gallocr.run)
        vs = node.vs
        if vs is not None and node.op != "NONE":
            entry(vs)[2] += 1
        if node.flags & FLAG_INPUT:
            first.append(node)
        for s in node.src:
            if s is None:
                continue
            entry(s)[1] += 1
            if s.flags & FLAG_INPUT:
                first.append(s)
    return FlatGraph(first, [(t, nc, nv) for t, nc, nv in counts.values()], program(nodes))


class AllocResult(Record, frozen=False, kw_only=False):
    sizes: list[int]  # high-water mark per buffer (0: device or the only CPU buffer, 1: host)
    peaks: list[list[tuple[str, int]]]  # per buffer: (tensor name, bytes) alive when its mark was last raised
    layers_simulated: int

    @property
    def size(self) -> int:
        return self.sizes[0]

    @property
    def peak(self) -> list[tuple[str, int]]:
        return self.peaks[0]
