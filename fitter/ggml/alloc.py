"""ggml-alloc.c: the dynamic allocator, the graph allocator, and the replay of repeated layers.

DynAllocator is ggml_dyn_tallocr (best fit over free blocks, chunks for a maximum buffer size);
Gallocr is ggml_gallocr (ggml_gallocr_allocate_node / free_node and the passes of
ggml_gallocr_alloc_graph_impl, one dynamic allocator per buffer type). replay_segments runs the
allocator over a graph cut into segments, skipping whole periods of repeated layers; a segment that
runs again from the same state replays the allocations, reuses and frees it decided before
(ProgramMemo), without walking its nodes again.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Iterable

from fitter.errors import GGFitError
from fitter.ggml.graph import Program, Segment, program
from fitter.ggml.tensor import FLAG_INPUT, FLAG_OUTPUT, Tensor

SIZE_MAX = (1 << 64) - 1
MAX_CHUNKS = 16  # GGML_VBUFFER_MAX_CHUNKS
_MAX_TENSOR = 1 << 56


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
        best_c = best_b = -1
        if len(chunks) == 1:  # the usual case (no maximum buffer size), the loops below for one chunk
            blocks = chunks[0]
            n = len(blocks)
            best_fit = SIZE_MAX
            for i in range(n - 1):
                bs = blocks[i][1]
                if size <= bs <= best_fit:
                    best_b, best_fit = i, bs
            if best_b == -1 and n and blocks[-1][1] >= size:
                best_b = n - 1
            if best_b != -1:
                best_c = 0
        for c, blocks in enumerate(chunks if best_c == -1 else ()):  # best fit among all blocks but each chunk's last
            best_fit = SIZE_MAX
            for i in range(len(blocks) - 1):
                bs = blocks[i][1]
                if bs >= size and bs <= best_fit:
                    best_c, best_b, best_fit = c, i, bs
        if best_b == -1:  # the last block of some chunk: least growth, or the tightest fit
            best_reuse = None
            for c, blocks in enumerate(chunks):  # (one chunk: the tests above already failed, so a new one)
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
        blocks = self.chunks[addr >> 56]
        off = addr & ((1 << 56) - 1)
        n = len(blocks)
        for i in range(n):
            b = blocks[i]
            if b[0] + b[1] == off:
                b[1] += size
                if i < n - 1 and b[0] + b[1] == blocks[i + 1][0]:
                    b[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if off + size == b[0]:
                b[0] = off
                b[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == b[0]:
                    blocks[i - 1][1] += b[1]
                    del blocks[i]
                return
        j = 0
        while j < n and blocks[j][0] < off:
            j += 1
        blocks.insert(j, [off, size])

    def state(self) -> tuple:
        return tuple(tuple(map(tuple, blocks)) for blocks in self.chunks)


def same_layout(a: Tensor, b: Tensor) -> bool:  # ggml_are_same_layout
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


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
        self._rec: _Run | None = None  # where process_program records its events (ProgramMemo)

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
                    same = p.type == t.type and p.ne == t.ne and p.nb == t.nb  # same_layout, inlined
                    if rec is not None:
                        rec.check(t, p, same)
                    if same:
                        if rec is not None:
                            rec.event(_REUSE, t, p)
                        self._reuse(t, p)
                        return
        if rec is not None:
            rec.event(_ALLOC, t, t)
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
                            rec.event(_FREE, p, p)

    def replay(self, run: _Run) -> None:
        """process_program's run as recorded (ProgramMemo): its allocations, in-place reuses and frees, without the
        walk over nodes and sources that decided them; then the children / views counts it left."""
        tallocs = self.tallocs
        live = self.live if self.trace else None
        fresh, reuse = self._fresh, self._reuse
        for op, t, p in zip(*run.ops):
            if op == _FREE:
                tallocs[t.be].free(t.addr, t.size)
                t.own = False
                if live is not None:
                    live.pop(t, None)
            else:
                t.own = True
                if op == _ALLOC:
                    fresh(t)
                else:
                    reuse(t, p)
        for t, dnc, dnv in zip(*run.counts):
            t.nc += dnc
            t.nv += dnv


_ALLOC, _REUSE, _FREE = 0, 1, 2  # a recorded run's events (_Run.ops)
_STATE = attrgetter("own", "nc", "nv")


class _Run:
    """One recorded run of a program: the same_layout tests it made (child, parent, answer), in order; its events
    (_ALLOC t / _REUSE t of parent p / _FREE t, as event, t, p or t); the children / views counts it changed, of the
    tensors read after it. Each as parallel lists (a graph kept is walked by the cyclic collector: few objects).
    `outside`: it placed a source that may take a parent's memory, deciding from that parent's state (a tensor the
    program may not reach, so not in its key)."""

    __slots__ = ("checks", "ops", "counts", "outside")

    def __init__(self) -> None:
        self.outside = False
        self.checks: tuple[list[Tensor], list[Tensor], list[bool]] = ([], [], [])
        self.ops: tuple[list[int], list[Tensor], list[Tensor]] = ([], [], [])
        self.counts: tuple[list[Tensor], list[int], list[int]] = ([], [], [])

    def check(self, t: Tensor, p: Tensor, same: bool) -> None:
        ts, ps, answers = self.checks
        ts.append(t)
        ps.append(p)
        answers.append(same)

    def event(self, op: int, t: Tensor, p: Tensor) -> None:
        events, ts, ps = self.ops
        events.append(op)
        ts.append(t)
        ps.append(p)


class ProgramMemo:
    """A program run again and again (a layer's segment, a chunk of Metal's reordered layers), its runs recorded.

    process_program decides from its tensors' state alone (allocated or not, n_children, n_views, and same_layout where
    a node may run in place) what to allocate, reuse and free; sizes and addresses only follow those decisions. The
    caller resets the state of its own tensors before each run (`reset`, a segment's or chunk's, but for the `loose`
    placeholders it hands the previous output), so the decisions follow from the state of the others (`entry`: the
    global tensors it reads, the placeholders) and the same_layout answers. A run whose entry state was met before,
    and whose same_layout tests answer as they did then, replays the events recorded (Gallocr.replay): the same calls
    to the dynamic allocators, in the same order. The first run records nothing (a program run once, as by `fit -c`,
    costs nothing more). A recorded run that placed one of its sources in place of a parent (_Run.outside) decided
    from a tensor the key may not hold: the program is walked from then on."""

    __slots__ = ("prog", "reset", "loose", "kept", "ran", "walks", "entry", "watch", "runs")

    def __init__(self, prog: Program, reset: Iterable[Tensor], loose: Iterable[Tensor], kept: Iterable[Tensor]) -> None:
        # the tensors the caller resets before each run, those of them it then hands a state (placeholders), and the
        # tensors it reads after a run; iterables read once, at the second run (the first needs none of them)
        self.prog, self.reset, self.loose, self.kept = prog, reset, loose, kept
        self.ran = False
        self.walks = False  # a run was decided by a tensor outside the key (_Run.outside): every run is walked
        self.entry: list[Tensor] = []
        self.watch: list[Tensor] | None = None  # (worked out at the second run)
        self.runs: dict[tuple, _Run] = {}

    def _tensors(self) -> None:
        touched: dict[Tensor, None] = {}
        for node, _, allocs, uses in zip(*self.prog):
            touched[node] = None
            touched.update(dict.fromkeys(allocs))
            for p in uses:
                touched[p] = None
                if p.vs is not None:
                    touched[p.vs] = None
            if node.inpl:
                touched.update(dict.fromkeys(p for p in node.src if p is not None))
        # an external tensor is never allocated (its counts decide nothing), a fixed one is reset before each run
        fixed = set(self.reset).difference(self.loose)
        keep = set(self.kept)
        self.entry = [t for t in touched if not t.ext and t not in fixed]
        self.watch = [t for t in touched if t not in fixed or t in keep]  # the counts read after a run

    def run(self, ga: Gallocr) -> None:
        """ga.process_program(self.prog), replayed where its entry state was recorded."""
        if self.walks or not self.ran:
            self.ran = True
            ga.process_program(self.prog)
            return
        if self.watch is None:
            self._tensors()
        key = tuple(map(_STATE, self.entry))
        run = self.runs.get(key)
        if run is not None:
            for t, p, same in zip(*run.checks):
                if same_layout(p, t) is not same:
                    break
            else:
                ga.replay(run)
                return
        before = [(t, t.nc, t.nv) for t in self.watch or ()]
        ga._rec = run = _Run()
        try:
            ga.process_program(self.prog)
        finally:
            ga._rec = None
        if run.outside:
            self.walks = True
            self.runs.clear()
            return
        changed = [(t, t.nc - nc, t.nv - nv) for t, nc, nv in before if t.nc != nc or t.nv != nv]
        run.counts = ([t for t, _, _ in changed], [a for _, a, _ in changed], [b for _, _, b in changed])
        if len(self.runs) >= _RUNS_MAX:
            self.runs.pop(next(iter(self.runs)))
        self.runs[key] = run


_RUNS_MAX = 64  # entry states a program keeps runs for (one per place it runs in a graph, at most a few dozen)


@dataclass
class FlatGraph:
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


@dataclass
class AllocResult:
    sizes: list[int]  # high-water mark per buffer (0: device or the only CPU buffer, 1: host)
    peaks: list[list[tuple[str, int]]]  # per buffer: (tensor name, bytes) alive when its mark was last raised
    layers_simulated: int

    @property
    def size(self) -> int:
        return self.sizes[0]

    @property
    def peak(self) -> list[tuple[str, int]]:
        return self.peaks[0]


def state_key(ga: Gallocr, carried: Tensor) -> tuple:
    # The high-water marks are left out: with a single chunk they never steer a decision (the last
    # free block always fits), and a replayed period cannot raise them. Chunked allocators keep them.
    return (carried.addr, carried.size, carried.own, carried.be, *_talloc_states(ga))


def _talloc_states(ga: Gallocr) -> list[object]:
    """Each buffer's free blocks, and its chunks' high-water marks where it has a maximum buffer size."""
    key: list[object] = []
    for t in ga.tallocs:
        key.append(t.state())
        if t.max_chunk < SIZE_MAX // 2:
            key.append(tuple(t.maxes))
    return key


def _first_instances(keys: list[tuple], n: int) -> list[bool]:
    """Which layers run their template's first variant: a template's first instance also emits the
    prologue tensors it reaches first (views of inputs, gemma4's per-layer projection); later ones do not."""
    seen: set[tuple] = set()
    first = [False] * n
    for il in range(1, n):
        if keys[il] not in seen:
            seen.add(keys[il])
            first[il] = True
    return first


def _global_uses(entries: Iterable[tuple[list[tuple[Tensor, int, int]], int]]) -> tuple[dict[int, list], dict[int, set[int]]]:
    """Total n_children / n_views of the global (prologue) tensors over (counts, position) pairs in graph order, and
    per position the ones it uses for the last time."""
    totals: dict[int, list] = {}
    last: dict[int, int] = {}
    for counts, at in entries:
        for t, a, b in counts:
            e = totals.get(id(t))
            if e is None:
                totals[id(t)] = [t, a, b]
            else:
                e[1] += a
                e[2] += b
            last[id(t)] = at
    finals: dict[int, set[int]] = {}
    for tid, at in last.items():
        finals.setdefault(at, set()).add(tid)
    return totals, finals


def _prologue_uses(n: int, pro: Segment, seg0: Segment, epi: Segment,
                   glob_of: Callable[[int], list[tuple[Tensor, int, int]]]) -> tuple[dict[int, list], dict[int, set[int]]]:
    """Total n_children / n_views of prologue tensors, and per layer the ones it uses for the last time."""
    return _global_uses([(pro.glob_first, -1), (seg0.glob_first, 0), *((glob_of(il), il) for il in range(1, n)),
                         (epi.glob_first, n)])


def _run(ga: Gallocr, seg: Segment, variant: Program, counts: list[tuple[Tensor, int, int]],
         carried: Tensor | None, memos: dict[tuple, ProgramMemo]) -> None:
    """Allocate one segment: its local tensors reset, the previous output handed to its placeholder; its program
    replayed where it ran from the same state before (ProgramMemo, one per segment, variant and placeholder use)."""
    loose: tuple[Tensor, ...] = ()
    if carried is not None:
        own, addr, size, be = carried.own, carried.addr, carried.size, carried.be
    for t in seg.locals:
        t.own = False
        t.nc = 0
        t.nv = 0
    if carried is not None:
        p = seg.inp
        assert p is not None  # a segment handed the previous output has a placeholder for it
        p.own, p.addr, p.size, p.be = own, addr, size, be
        ga._handover(carried, p)
        loose = (p,)
    for t, a, b in counts:
        t.nc = a
        t.nv = b
    mkey = (id(seg), id(variant), carried is None)
    memo = memos.get(mkey)
    if memo is None:
        memo = memos[mkey] = ProgramMemo(variant, seg.locals, loose, () if seg.out is None else (seg.out,))
    memo.run(ga)


class _BoundaryState:
    """The state entering a boundary of replay_plan or replay_chunks, where a jump over part of a period lands: the
    buffers' free blocks and chunk marks, the fields of the tensors handed on (those the state key reads), the
    tensors alive (peaks).

    Restored where the layers (chunks) after boundary j, met again at il in the same state, repeat past il's whole
    periods for r more: those r ran from that state before, after j, and entered j + r in the state kept here.
    Free blocks and what is handed on are taken as they were; a mark only rises (one buffer chunk: the part allocates
    where it did, under the marks of later boundaries; several: the marks are in the key, equal at j and il)."""

    __slots__ = ("blocks", "maxes", "fields", "live")

    def __init__(self, ga: Gallocr, carried: list[Tensor]) -> None:
        self.blocks = [[[b[0], b[1]] for b in blocks] for t in ga.tallocs for blocks in t.chunks]
        self.maxes = [list(t.maxes) for t in ga.tallocs]
        self.fields = [(t.own, t.addr, t.size, t.be, t.nv) for t in carried]
        self.live = dict(ga.live) if ga.trace else None

    def restore(self, ga: Gallocr, carried: list[Tensor]) -> None:
        blocks = iter(self.blocks)
        for talloc, maxes in zip(ga.tallocs, self.maxes):
            talloc.chunks = [[list(b) for b in next(blocks)] for _ in maxes]
            now = talloc.maxes + [0] * (len(maxes) - len(talloc.maxes))
            talloc.maxes = [max(a, b) for a, b in zip(maxes, now)]
            talloc.max_size = sum(talloc.maxes)
        for t, (own, addr, size, be, nv) in zip(carried, self.fields):
            t.own, t.addr, t.size, t.be, t.nv = own, addr, size, be, nv
        if self.live is not None:
            ga.live.clear()
            ga.live.update(self.live)


def _jump(sigs: list[tuple], prev: list[int], il: int, n: int, states: dict[int, _BoundaryState]) -> tuple[int, int]:
    """How many layers (chunks) from il on repeat those after a boundary j < il with the same state, and where that
    leaves the state: (0, 0) for none; (whole periods, 0), the state unchanged; past whole periods, r more of the next
    period, (length, j + r), the state entering j + r (kept in `states`: only where it was)."""
    best = land = 0
    for j in prev:
        p = il - j
        t = il
        while t < n and sigs[t] == sigs[t - p]:
            t += 1
        whole = (t - il) // p * p
        r = t - il - whole
        if r and j + r in states and whole + r > best:
            best, land = whole + r, j + r
        elif whole > best:
            best, land = whole, 0
    return best, land


def replay_segments(n: int, ga: Gallocr, pro: Segment, seg0: Segment, templates: dict[tuple, Segment],
                    keys: list[tuple], epi: Segment) -> AllocResult:
    """Allocate the prologue, the n layers (each the segment of its key) and the epilogue, in graph order.

    Equivalent to `Gallocr.run` over the full graph: the allocator's state at a layer boundary (its
    free blocks and where the residual stream lives) fully determines what follows, given the layers
    still to come. When the state at the start of layer i equals the state at the start of layer
    j < i and the layers after i repeat those after j (same sub-graph, and no prologue tensor used
    for the last time), the allocator replays the same offsets: the high-water mark cannot move, so
    the replay jumps ahead by whole periods.
    """
    return replay_plan(SegmentPlan(n, pro, seg0, templates, keys, epi), ga)


class SegmentPlan:
    """What replay_segments needs that follows from the segments alone (not from sizes): which layers run which
    variant, the prologue tensors' total uses, the layers' signatures for the period test, the leafs."""

    __slots__ = ("n", "pro", "seg0", "templates", "keys", "epi", "first", "totals", "sigs", "leafs", "memos")

    def __init__(self, n: int, pro: Segment, seg0: Segment, templates: dict[tuple, Segment], keys: list[tuple],
                 epi: Segment) -> None:
        self.n, self.pro, self.seg0, self.templates, self.keys, self.epi = n, pro, seg0, templates, keys, epi
        self.first = first = _first_instances(keys, n)
        totals, finals = _prologue_uses(n, pro, seg0, epi, self.glob_of)
        self.totals = list(totals.values())
        self.sigs = [(keys[il], first[il], frozenset(finals.get(il, ()))) for il in range(n)]
        leafs = list(pro.leafs) + list(seg0.leafs)
        for t in templates.values():
            leafs += t.leafs
        leafs += epi.leafs
        self.leafs = leafs
        self.memos: dict[tuple, ProgramMemo] = {}  # _run's, kept with the plan (a traced graph's)

    def glob_of(self, il: int) -> list[tuple[Tensor, int, int]]:
        t = self.templates[self.keys[il]]
        return t.glob_first if self.first[il] else t.glob_steady


def replay_plan(plan: SegmentPlan, ga: Gallocr) -> AllocResult:
    """replay_segments over a plan (a traced graph keeps its plan between reuses)."""
    n, pro, seg0, templates, keys, epi = plan.n, plan.pro, plan.seg0, plan.templates, plan.keys, plan.epi
    first, sigs, glob_of = plan.first, plan.sigs, plan.glob_of

    # ggml_gallocr_alloc_graph_impl: leafs first (in graph order), then the children/views counts
    for leaf in plan.leafs:
        ga._allocate(leaf)
    for t, a, b in plan.totals:
        t.nc = a
        t.nv = b

    memos = plan.memos
    _run(ga, pro, pro.prog_first, pro.first_counts, None, memos)
    _run(ga, seg0, seg0.prog_first, seg0.first_counts, None, memos)
    carried = seg0.out
    simulated = 1
    hist: dict[tuple, list[int]] = {}
    states: dict[int, _BoundaryState] = {}  # boundary -> the state entering it, where a jump may land
    il = 1
    while il < n:
        if not first[il]:
            assert carried is not None  # a layer segment's output
            prev = hist.setdefault(state_key(ga, carried), [])
            best, land = _jump(sigs, prev, il, n, states)
            if best:
                for l2 in range(il, il + best):  # the skipped layers still use the prologue tensors
                    for g, a, b in glob_of(l2):
                        g.nc -= a
                        g.nv -= b
                il += best  # the history stays valid: skipped boundaries replay recorded states
                if land:  # past the whole periods, part of one: the state it left where it ran before
                    carried = templates[keys[land - 1]].out
                    assert carried is not None
                    states[land].restore(ga, [carried])
                if il >= n:
                    break
                continue
            prev.append(il)
            states[il] = _BoundaryState(ga, [carried])
        seg = templates[keys[il]]
        if first[il]:
            _run(ga, seg, seg.prog_first, seg.first_counts, carried, memos)
        else:
            _run(ga, seg, seg.prog_steady, seg.steady_counts, carried, memos)
        carried = seg.out
        simulated += 1
        il += 1
    _run(ga, epi, epi.prog_first, epi.first_counts, carried, memos)
    return AllocResult(ga.sizes(), ga.peak_lives, simulated)


class Chunk:
    """A stretch of a graph whose nodes another stretch repeats (Metal's reordered layers: fitter.ggml.backends
    .metal_segments), with the tensors it hands on: `inps` stand for tensors made before it (in the order the previous
    stretch's `outs` list them), `outs` are what later stretches read (each counted one use more, so that no count of
    this stretch frees it: ggml-alloc's own count has those later readers in it). A global tensor (the prologue's,
    emitted in some stretch) is the same object everywhere; every other one is the stretch's own."""

    __slots__ = ("nodes", "prog", "counts", "glob", "inps", "outs", "memo")

    def __init__(self, nodes: list[Tensor], inps: list[Tensor], outs: list[Tensor]) -> None:
        self.nodes, self.inps, self.outs = nodes, inps, outs
        local, self.glob = Segment._counts(nodes)
        counts: dict[int, tuple[Tensor, int, int]] = {id(t): (t, a, b) for t, a, b in local}
        for t in inps:
            counts.setdefault(id(t), (t, 0, 0))
        for t in outs:  # pinned: one use more than this chunk's
            _, a, b = counts.get(id(t), (t, 0, 0))
            counts[id(t)] = (t, a + 1, b)
        # every tensor of its own with its n_children / n_views (0 where none of its nodes reads it)
        for t in nodes:
            if not t.glob and not t.ext and id(t) not in counts:
                counts[id(t)] = (t, 0, 0)
        self.counts = list(counts.values())
        self.prog = program(nodes)
        # its runs (replay_chunks resets its own tensors but the placeholders before each)
        self.memo = ProgramMemo(self.prog, (t for t, _, _ in self.counts), inps, outs)


class ChunkPlan:
    """A graph as a sequence of chunks (`seq`: an index into `chunks` per position): what replay_chunks needs."""

    __slots__ = ("chunks", "seq", "first", "totals", "sigs")

    def __init__(self, chunks: list[Chunk], seq: list[int], first: list[Tensor]) -> None:
        self.chunks, self.seq, self.first = chunks, seq, first
        totals, finals = _global_uses((chunks[k].glob, pos) for pos, k in enumerate(seq))
        self.totals = list(totals.values())
        self.sigs = [(k, frozenset(finals.get(pos, ()))) for pos, k in enumerate(seq)]


def _carried_key(ga: Gallocr, carried: list[Tensor]) -> tuple:
    """state_key with every tensor handed on (and the view holds on it, which decide when it is freed)."""
    return (*((t.addr, t.size, t.own, t.be, t.nv) for t in carried), *_talloc_states(ga))


def replay_chunks(plan: ChunkPlan, ga: Gallocr) -> AllocResult:
    """Gallocr.run over the chunks in sequence, jumping over whole periods of repeated chunks where the allocator's
    state (and that of the tensors handed on) repeats, as replay_plan does for layers."""
    for t in plan.first:  # leafs, then the graph inputs, as Gallocr.run meets them
        ga._allocate(t)
    for t, a, b in plan.totals:
        t.nc = a
        t.nv = b
    seq, chunks, sigs = plan.seq, plan.chunks, plan.sigs
    m = len(seq)
    carried: list[Tensor] = []
    hist: dict[tuple, list[int]] = {}
    states: dict[int, _BoundaryState] = {}  # boundary -> the state entering it, where a jump may land
    simulated = 0
    pos = 0
    while pos < m:
        if pos:
            key = _carried_key(ga, carried)
            prev = hist.setdefault(key, [])
            best, land = _jump(sigs, prev, pos, m, states)
            if best:
                for p2 in range(pos, pos + best):  # the skipped chunks still use the global tensors
                    for g, a, b in chunks[seq[p2]].glob:
                        g.nc -= a
                        g.nv -= b
                pos += best
                if land:  # past the whole periods, part of one: the state it left where it ran before
                    carried = chunks[seq[land - 1]].outs
                    states[land].restore(ga, carried)
                continue
            prev.append(pos)
            states[pos] = _BoundaryState(ga, carried)
        ch = chunks[seq[pos]]
        saved = [(t.own, t.addr, t.size, t.be, t.nv) for t in carried]
        for t, a, b in ch.counts:  # its own tensors reset
            t.own = False
            t.nc = a
            t.nv = b
        for ph, (own, addr, size, be, nv), old in zip(ch.inps, saved, carried):
            ph.own, ph.addr, ph.size, ph.be = own, addr, size, be
            ph.nv += nv  # the views made before that still hold it
            ga._handover(old, ph)
        ch.memo.run(ga)
        carried = ch.outs
        simulated += 1
        pos += 1
    return AllocResult(ga.sizes(), ga.peak_lives, simulated)
