"""The allocator over a graph of repeated layers, layer after layer or chunk after chunk (ggfit's own).

replay_segments (replay_plan) runs fitter.ggml.alloc.Gallocr over a graph cut into segments, one per distinct
layer (fitter.llama.context), and replay_chunks over Metal's reordered layers cut into chunks
(fitter.ggml.backends.metal.segments); both jump over whole periods of layers (chunks) that repeat from a state met
before, and over the part of one more period that repeats (_BoundaryState). Each segment's or chunk's program runs
through its ProgramMemo.
"""

from __future__ import annotations

from typing import Callable, Iterable

from fitter.ggml.alloc import SIZE_MAX, AllocResult, Gallocr
from fitter.ggml.graph import Program, Segment, program
from fitter.ggml.memo import ProgramMemo
from fitter.ggml.tensor import Tensor


def state_key(carried: Tensor, tallocs: list[tuple]) -> tuple:
    """The state at a layer boundary: the tensor handed on, the buffers' state (_talloc_states)."""
    return (carried.addr, carried.size, carried.own, carried.be, *tallocs)


def _talloc_states(ga: Gallocr) -> list[tuple]:
    """Each buffer's free blocks, and its chunks' high-water marks where it has a maximum buffer size (with a single
    chunk they never steer a decision: the last free block always fits; and a replayed period cannot raise them)."""
    key: list[tuple] = []
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
    Free blocks and what is handed on are taken as they were. A buffer of one chunk keeps its high-water mark: the
    part allocates where it did, under the marks of later boundaries. Where a buffer has several, the marks are in
    the state (equal at j and il) and are taken as they were at j + r."""

    __slots__ = ("tallocs", "fields", "live")

    def __init__(self, ga: Gallocr, carried: list[Tensor], tallocs: list[tuple]) -> None:
        self.tallocs = tallocs  # _talloc_states(ga), as the state key holds them
        self.fields = [(t.own, t.addr, t.size, t.be, t.nv) for t in carried]
        self.live = dict(ga.live) if ga.trace else None

    def restore(self, ga: Gallocr, carried: list[Tensor]) -> None:
        state = iter(self.tallocs)
        for talloc in ga.tallocs:
            talloc.chunks = [[list(b) for b in blocks] for blocks in next(state)]
            if talloc.max_chunk < SIZE_MAX // 2:
                talloc.maxes = list(next(state))
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
    the replay jumps ahead by whole periods; and past them over the part of one more period that
    repeats, to the state that part left after j (_BoundaryState).
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
            held = _talloc_states(ga)
            prev = hist.setdefault(state_key(carried, held), [])
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
            states[il] = _BoundaryState(ga, [carried], held)
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
    .metal.segments), with the tensors it hands on: `inps` stand for tensors made before it (in the order the previous
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


def _carried_key(carried: list[Tensor], tallocs: list[tuple]) -> tuple:
    """state_key with every tensor handed on (and the view holds on it, which decide when it is freed)."""
    return (*((t.addr, t.size, t.own, t.be, t.nv) for t in carried), *tallocs)


def replay_chunks(plan: ChunkPlan, ga: Gallocr) -> AllocResult:
    """Gallocr.run over the chunks in sequence, jumping over periods of repeated chunks (whole ones, then part of one)
    where the allocator's state (and that of the tensors handed on) repeats, as replay_plan does for layers."""
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
            held = _talloc_states(ga)
            prev = hist.setdefault(_carried_key(carried, held), [])
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
            states[pos] = _BoundaryState(ga, carried, held)
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
