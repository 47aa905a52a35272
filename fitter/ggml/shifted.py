"""A recorded run's allocator outcome, taken again where the buffers it touches moved up or down (ggfit's own).

ggml-alloc's dynamic allocator (fitter.ggml.alloc.DynAllocator) decides from sizes alone which free block a tensor
takes (best fit), and from equal offsets alone which blocks a free joins; it keeps them in offset order. So a run of
allocations, reuses and frees (a recorded fitter.ggml.memo.RecordedRun) that meets the same sizes decides the same, however
far each buffer's upper part has moved, provided nothing below the move touches anything above it. That is what a
larger cache does to the compute buffers: the mask (n_ctx x n_tokens) is among the first tensors placed, and every
tensor placed after it sits one shift higher; a chunk of layers that runs above it, with the same ubatch, runs as it
did at another n_ctx.

`entry` reads what decides a run: the sizes (its key: the free blocks', those of the tensors it places, those of the
tensors placed before it that it frees or reuses) and the addresses (each buffer's free blocks, those tensors'). A
buffer's high-water mark decides nothing where the buffer is one chunk: the run raises it or not. `Shifted` keeps one
run's outcome: `match` finds the shift of each buffer (its last block's, which runs to the buffer's end) under which
every address of the entry is either where it was (below) or moved by the shift (above), with everything below
ending before anything above starts, in both; `apply` places the tensors and sets the blocks as they were, the upper
ones moved, and raises each mark to the run's highest end there, moved alike, where that is higher. An allocation
whose size the key cannot hold (it moves with n_ctx too: Metal's FLASH_ATTN_EXT output) may still be taken at its
size here, where the run showed it changes nothing but its own end (`Shifted`'s elastic allocations).
"""

from __future__ import annotations

from itertools import islice
from operator import attrgetter
from typing import TYPE_CHECKING, Iterator, Protocol

from fitter.ggml.alloc import ALLOC, FREE, REUSE
from fitter.ggml.types import pad

if TYPE_CHECKING:
    from fitter.ggml.alloc import Gallocr
    from fitter.ggml.tensor import Tensor

_UNLIMITED = ((1 << 64) - 1) // 2  # a buffer without a maximum size: one chunk, its last block past any tensor
_TOP = 1 << 64  # above every address
_SIZE = attrgetter("size")
_MEMO = attrgetter("memo")
_ADDR = attrgetter("addr")
_BE = attrgetter("be")
_TRIES = 4  # misses before a run that never hit stops keeping outcomes (a size below the move changes with n_ctx)
_UNSIZED = 4  # placements unsized at the entry, at most, for a miss to count and its allocations among them watched
_KEPT = 12  # keys a run keeps outcomes by: a sweep of n_ctx over a few ubatches, one or two each


class _Run(Protocol):
    """What this module reads and keeps of a recorded run (fitter.ggml.memo.RecordedRun, once closed)."""

    ops: tuple[list[int], list[Tensor], list[Tensor]]  # its events (ALLOC t / REUSE t of parent p / FREE t)
    placed: list[Tensor]  # the tensors it places, in order
    at: list[int]  # each placement's event
    before: list[Tensor]  # those placed before it that it frees or whose memory it reuses
    owns: tuple[list[Tensor], list[bool]]  # each tensor's `own` after it
    buffers: list[int]  # the buffers it touches
    shifts: dict[tuple, Shifted] | None  # its outcomes by their entry's key (None once given up)
    misses: int  # outcomes missed in a row before the first hit (-1 after it)


def replay(ga: Gallocr, run: _Run) -> None:
    """fitter.ggml.memo.replay's events (its counts aside): the outcome of an earlier replay from this entry, moved, where one
    matches; else replayed, and its outcome kept (until _TRIES misses without a hit)."""
    shifts = run.shifts
    assert shifts is not None  # (RecordedRun.close)
    now = entry(ga, run)
    if now is None:
        ga._events(zip(*run.ops))
        return
    seen = shifts.get(now.key)
    if seen is not None and seen.decided(ga, run):
        moved = seen.match(ga, run, now)
        if moved is not None:
            seen.apply(ga, run, *moved)
            run.misses = -1
            return
    # the placements the key holds no size for (no memo: a few at most but at a ubatch's first run), watched
    _, sizes, memos = now.key
    unsized = [i for i, (size, memo) in enumerate(zip(sizes, memos)) if not size and memo is None] \
        if memos.count(None) <= 2 * _UNSIZED else None
    steady = unsized is not None and len(unsized) <= _UNSIZED
    watch = [i for i in unsized if run.ops[0][run.at[i]] == ALLOC] if steady and unsized else []
    watched = _watched(ga, run, watch) if watch else {}
    if not watch:
        ga._events(zip(*run.ops))
    if run.misses >= 0 and steady:  # (a ubatch's first run counts no miss)
        run.misses += 1
        if run.misses == _TRIES:
            run.shifts = None
            return
    outcome = Shifted(ga, run, now, watched)
    for key in outcome.keys:
        shifts.pop(key, None)
        if len(shifts) >= _KEPT:
            shifts.pop(next(iter(shifts)))
        shifts[key] = outcome


def _watched(ga: Gallocr, run: _Run, unsized: list[int]) -> dict[int, tuple[bool, int]]:
    """The run replayed, and for each placement in `unsized` (its index), whether its allocation took the last block
    of its buffer and the largest other free block then (-1: none)."""
    events = zip(*run.ops)
    done = 0
    out: dict[int, tuple[bool, int]] = {}
    for i in unsized:
        k = run.at[i]
        ga._events(islice(events, k - done))
        event = next(events)
        t = event[1]
        chunks = ga.tallocs[t.be].chunks
        blocks = chunks[0] if chunks else [[0, 0]]
        other = max([b[1] for b in blocks[:-1]], default=-1)
        last = blocks[-1][0]
        ga._events((event,))
        out[i] = (t.addr == last, other)
        done = k + 1
    ga._events(events)
    return out


class Entry:
    """A run's entry state: what decides it but addresses (`key`, hashable: each buffer's alignment and free blocks,
    the sizes of the tensors placed before it that it reads, and the sizes set on those it places with their memos,
    whence Gallocr._size gives the others), and per address its place, extent and buffer; each touched buffer's last
    block's offset (`tails`, -1 for the others)."""

    __slots__ = ("key", "addrs", "ends", "bufs", "tails")

    def __init__(self, key: tuple, addrs: list[int], ends: list[int], bufs: list[int], tails: list[int]) -> None:
        self.key, self.addrs, self.ends, self.bufs, self.tails = key, addrs, ends, bufs, tails


def entry(ga: Gallocr, run: _Run) -> Entry | None:
    """The state `run` starts from in `ga`; None where a buffer it touches has several chunks or a maximum size (a
    new chunk or a full last block would decide)."""
    tallocs = ga.tallocs
    tails = [-1] * len(tallocs)
    shape: list[int] = []
    addrs: list[int] = []
    ends: list[int] = []
    bufs: list[int] = []
    for be in run.buffers:
        talloc = tallocs[be]
        if talloc.max_chunk != _UNLIMITED or len(talloc.chunks) > 1:
            return None
        shape.append(talloc.align)
        if not talloc.chunks:  # nothing placed yet: the run makes its one chunk
            tails[be] = 0
            shape.append(0)
            continue
        blocks = talloc.chunks[0]
        tails[be] = blocks[-1][0]
        shape.append(len(blocks))
        for off, size in blocks:
            shape.append(size)
            addrs.append(off)
            ends.append(off + size)
            bufs.append(be)
        shape.pop()  # the last block's size: to the buffer's end
        ends[-1] = addrs[-1]
    aligns = ga.aligns
    for x in run.before:
        be = x.be
        if tails[be] < 0:
            return None
        size = x.size
        shape.append(size)
        addrs.append(x.addr)
        ends.append(x.addr + pad(size, aligns[be]))
        bufs.append(be)
    placed = run.placed
    return Entry((tuple(shape), tuple(map(_SIZE, placed)), tuple(map(_MEMO, placed))), addrs, ends, bufs, tails)


class Shifted:
    """One run's outcome from an entry state: each tensor it placed with its place, buffer and size, each touched
    buffer's free blocks after it, and (`decided`) its highest end in each.

    An allocation unsized at the entry (a size that moves with n_ctx: Metal's FLASH_ATTN_EXT output) is `elastic`
    where it took the last block, nothing was allocated above it before it was freed, and the run freed it: its memory
    went back into the last block, and its size decides nothing but its own end, provided no other free block fits it
    (the largest then is kept with it)."""

    __slots__ = ("entry", "key", "keys", "addrs", "bes", "sizes", "blocks", "elastic", "peaks", "net")

    def __init__(self, ga: Gallocr, run: _Run, before: Entry, watched: dict[int, tuple[bool, int]]) -> None:
        """After `ga` ran `run` from `before`; `watched`: _watched's answers."""
        self.entry = before
        placed = run.placed
        self.addrs = list(map(_ADDR, placed))
        self.bes = list(map(_BE, placed))
        self.sizes = list(map(_SIZE, placed))
        self.blocks = [[tuple(b) for b in ga.tallocs[be].chunks[0]] for be in run.buffers]
        self.elastic = [(i, other) for i, (last, other) in watched.items() if last and self._transient(ga, run, i)]
        # the entry's key as a later run meets it: with the memos the sizes left (the first run at a ubatch sizes its
        # tensors: Gallocr._size); and, where some allocation is elastic, also without those (a memo reset each time)
        memos = list(map(_MEMO, placed))
        self.key = (before.key[0], before.key[1], tuple(memos))
        self.keys = [self.key]
        if self.elastic:
            for i, _ in self.elastic:
                memos[i] = None
            self.keys.append((before.key[0], before.key[1], tuple(memos)))
        self.peaks: list[tuple[int, int]] | None = None  # (worked out at the first use: decided)
        self.net: _Net | None = None  # (_live's, at its first use)

    def _transient(self, ga: Gallocr, run: _Run, i: int) -> bool:
        """Whether placement i, an allocation from its buffer's last block, is freed in the run (not handed to a child
        in place) with nothing allocated above it in between."""
        ops, ts, ps = run.ops
        t, k, be = run.placed[i], run.at[i], self.bes[i]
        size = pad(self.sizes[i], ga.aligns[be])
        top = self.addrs[i] + size
        if not size:
            return False
        q = i + 1
        for j in range(k + 1, len(ops)):
            if ps[j] is t and ops[j] == REUSE:
                return False
            if ops[j] == FREE:
                if ts[j] is t:
                    return True
                continue
            if self.bes[q] == be and self.addrs[q] >= top:
                return False
            q += 1
        return False

    def decided(self, ga: Gallocr, run: _Run) -> bool:
        """Whether the entry's key held every size the run placed but the elastic ones: each was set, or was
        Gallocr._size's memo in the buffer the tensor went to (another is computed from a shape the key does not
        hold). Once: per buffer the highest end the run allocated to but the elastic allocations', and the first
        allocation that reached it (its index among the placements)."""
        if self.peaks is not None:
            return True
        _, sizes, memos = self.key
        elastic = {i for i, _ in self.elastic}
        for i, (be, size, s0, m0) in enumerate(zip(self.bes, self.sizes, sizes, memos)):
            if not s0 and (m0 is None or m0[0] != be or m0[1] != size) and i not in elastic:
                return False
        self.peaks = peaks = [(-1, -1)] * len(ga.tallocs)
        ops = run.ops[0]
        for i, (k, addr, be, size) in enumerate(zip(run.at, self.addrs, self.bes, self.sizes)):
            if ops[k] == ALLOC and i not in elastic:
                end = addr + pad(size, ga.aligns[be])
                if end > peaks[be][0]:
                    peaks[be] = (end, i)
        return True

    def match(self, ga: Gallocr, run: _Run, now: Entry) -> tuple[list[int], list[int], list[int]] | None:
        """Per buffer, the shift of its upper part and where that part started then, and the elastic allocations'
        sizes here; None where `now` is not this entry with the upper part of each buffer moved, its lower part where
        it was and ending below it, or where another free block would take an elastic allocation here."""
        then = self.entry
        shift = [a - b for a, b in zip(now.tails, then.tails)]
        low_end = [-1] * len(shift)
        high = [_TOP] * len(shift)
        for a, ra, re, be in zip(now.addrs, then.addrs, then.ends, then.bufs):
            if a == ra:
                if re > low_end[be]:
                    low_end[be] = re
            elif a - ra == shift[be]:
                if ra < high[be]:
                    high[be] = ra
            else:
                return None
        for end, start, d in zip(low_end, high, shift):
            if end >= start or end >= start + d:
                return None
        sizes = []
        for i, other in self.elastic:
            t, be = run.placed[i], self.bes[i]
            if not t.size:
                ga._size(t, be)
            if pad(t.size, ga.aligns[be]) <= other:
                return None
            sizes.append(t.size)
        return shift, high, sizes

    def apply(self, ga: Gallocr, run: _Run, shift: list[int], high: list[int], sizes: list[int]) -> None:
        """`run`'s events as they came out here, the upper part of each buffer moved by its shift, the elastic
        allocations of the sizes they have here."""
        placed = run.placed
        for t, addr, be, size in zip(placed, self.addrs, self.bes, self.sizes):
            t.addr = addr + shift[be] if addr >= high[be] else addr
            t.be = be
            t.size = size
        for (i, _), size in zip(self.elastic, sizes):
            placed[i].size = size
        for t, own in zip(*run.owns):
            t.own = own
        marks = self._marks(ga, run, shift, high)
        if ga.trace:
            self._live(ga, run, marks)
        for be, blocks in zip(run.buffers, self.blocks):
            d, h = shift[be], high[be]
            moved = [[off + d if off >= h else off, size] for off, size in blocks]
            last = moved[-1]
            last[1] = blocks[-1][0] + blocks[-1][1] - last[0]  # the last block runs to the buffer's end
            talloc = ga.tallocs[be]
            talloc.chunks = [moved]
            end = marks[be][0]
            if end > talloc.max_size:
                talloc.maxes = [end]
                talloc.max_size = end
                if ga.trace:
                    ga.peaks[be] = end
            elif not talloc.maxes:
                talloc.maxes = [0]

    def _marks(self, ga: Gallocr, run: _Run, shift: list[int], high: list[int]) -> list[tuple[int, int]]:
        """Per buffer, the run's highest allocated end here and the event of the first allocation that reached it
        ((-1, -1): none), the one that raises the mark there last if any does (DynAllocator.alloc: `end > max`)."""
        assert self.peaks is not None  # decided
        found = []
        for be, (end, i) in enumerate(self.peaks):
            if i >= 0 and self.addrs[i] >= high[be]:
                end += shift[be]
            found.append((end, i))
        for i, _ in self.elastic:  # placed (apply) at their sizes here
            t = run.placed[i]
            be = t.be
            end = t.addr + pad(t.size, ga.aligns[be])
            if end > found[be][0] or end == found[be][0] and i < found[be][1]:
                found[be] = (end, i)
        return [(end, run.at[i] if i >= 0 else -1) for end, i in found]

    def _live(self, ga: Gallocr, run: _Run, marks: list[tuple[int, int]]) -> None:
        """ga.live through the run's events as Gallocr keeps it, and ga.peak_lives where a mark rises (before the
        marks are set): the tensors alive at the allocation that raises it last."""
        live = ga.live
        rises = sorted((k, be) for be, (end, k) in enumerate(marks) if k >= 0 and end > ga.tallocs[be].max_size)
        if not rises:  # (most runs: the marks rose in the first layers) the run's net effect on the live tensors
            if self.net is None:
                self.net = _net(run)
            _take_net(live, self.net)
            return
        events = zip(*run.ops)
        done = 0
        for k, be in rises:
            _track(live, islice(events, k + 1 - done))
            done = k + 1
            ga.peak_lives[be] = [(x.name, x.size) for x in live.values() if x.be == be]
        _track(live, events)


_Net = tuple[list["Tensor"], list[tuple["Tensor", "frozenset[Tensor] | None"]], set["Tensor"]]


def _net(run: _Run) -> _Net:
    """_track's effect over the whole run, whatever was live before it: the tensors it drops, then those it adds, in
    order, each with None or the tensors from before the run one of which being live then decides it (a reuse of a
    parent the run did not place), and all those tensors. Dropping those, then adding these, leaves the live dict (in
    insertion order) as the events one by one do: a tensor dropped and added again goes last, one added while it is
    there keeps its place."""
    # what the events so far left of a tensor: True, False, or live iff one of these tensors was before the run (a
    # tensor not met yet: itself)
    now: dict[Tensor, bool | frozenset[Tensor]] = {}
    drops: dict[Tensor, None] = {}
    adds: dict[Tensor, frozenset[Tensor] | None] = {}
    for op, t, p in zip(*run.ops):
        if op == FREE:
            drops[t] = None
            adds.pop(t, None)
            now[t] = False
            continue
        was: bool | frozenset[Tensor] = True
        if op == REUSE:  # the child joins where its parent was live
            was = now.get(p, frozenset((p,)))
            drops[p] = None
            adds.pop(p, None)
            now[p] = False
            if was is False:
                continue
        if t not in adds:
            adds[t] = None if was is True else was  # type: ignore[assignment]
        before = now.get(t, frozenset((t,)))  # (placed while it was live: it stays so)
        if was is True or before is True:
            now[t] = True
        elif before is False:
            now[t] = was
        else:
            now[t] = was | before  # type: ignore[operator]
    conds = set().union(*(c for c in adds.values() if c is not None))
    return list(drops), list(adds.items()), conds


def _take_net(live: dict, net: _Net) -> None:
    """_track over a run's events, by its net effect (_net)."""
    drops, adds, conds = net
    was = {c for c in conds if c in live} if conds else conds  # (before the drops)
    for t in drops:
        live.pop(t, None)
    for t, c in adds:
        if c is None or not c.isdisjoint(was):
            live[t] = t


def _track(live: dict, events: Iterator[tuple[int, Tensor, Tensor]]) -> None:
    """Gallocr's live tensors through events: an allocation joins, a free leaves, a reuse takes its parent's place."""
    for op, t, p in events:
        if op == FREE:
            live.pop(t, None)
        elif op == ALLOC:
            live[t] = t
        elif live.pop(p, None) is not None:
            live[t] = t
