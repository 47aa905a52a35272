"""A recorded run's allocator outcome, taken again where the buffers it touches moved up or down (ggfit's own).

ggml-alloc's dynamic allocator (fitter.ggml.alloc.DynAllocator) decides from sizes alone which free block a tensor
takes (best fit), and from equal offsets alone which blocks a free joins; it keeps them in offset order. So a run of
allocations, reuses and frees (a recorded fitter.ggml.alloc._Run) that meets the same sizes decides the same, however
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
ones moved, and raises each mark to the run's highest end there, moved alike, where that is higher.
"""

from __future__ import annotations

from itertools import islice
from operator import attrgetter
from typing import TYPE_CHECKING, Iterator

from fitter.ggml.alloc import _ALLOC as ALLOC
from fitter.ggml.alloc import _FREE as FREE

if TYPE_CHECKING:
    from fitter.ggml.alloc import Gallocr, _Run
    from fitter.ggml.tensor import Tensor

_UNLIMITED = ((1 << 64) - 1) // 2  # a buffer without a maximum size: one chunk, its last block past any tensor
_TOP = 1 << 64  # above every address
_SIZE = attrgetter("size")
_MEMO = attrgetter("memo")
_ADDR = attrgetter("addr")
_BE = attrgetter("be")
_TRIES = 4  # misses before a run that never hit stops keeping outcomes (a size in it moves with n_ctx: Metal's FA)
_KEPT = 8  # sizes a run keeps an outcome for: a sweep of n_ctx over a few ubatches, one each


def replay(ga: Gallocr, run: _Run) -> None:
    """Gallocr.replay's events (its counts aside): the outcome of an earlier replay from this entry, moved, where one
    matches; else replayed, and its outcome kept (until _TRIES misses without a hit)."""
    shifts = run.shifts
    assert shifts is not None  # (_Run.close)
    now = entry(ga, run)
    if now is None:
        ga._replay(run)
        return
    seen = shifts.get(now.key)
    if seen is not None and seen.decided(ga, run):
        moved = seen.match(now)
        if moved is not None:
            seen.apply(ga, run, *moved)
            run.misses = -1
            return
    ga._replay(run)
    if run.misses >= 0:
        run.misses += 1
        if run.misses == _TRIES:
            run.shifts = None
            return
    outcome = Shifted(ga, run, now)
    shifts.pop(outcome.key, None)
    if len(shifts) >= _KEPT:
        shifts.pop(next(iter(shifts)))
    shifts[outcome.key] = outcome


class Entry:
    """A run's entry state: what decides it but addresses (`key`, hashable: each buffer's alignment and free blocks,
    the sizes of the tensors placed before it that it reads, and of those it places, as set or as Gallocr._size would
    give them), and per address its place, extent and buffer; each touched buffer's last block's offset (`tails`, -1
    for the others)."""

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
        a = aligns[be]
        shape.append(size)
        addrs.append(x.addr)
        ends.append(x.addr + (size + a - 1) // a * a)
        bufs.append(be)
    placed = run.placed
    return Entry((tuple(shape), tuple(map(_SIZE, placed)), tuple(map(_MEMO, placed))), addrs, ends, bufs, tails)


class Shifted:
    """One run's outcome from an entry state: each tensor it placed with its place, buffer and size, each touched
    buffer's free blocks after it, and (`decided`) its highest end in each."""

    __slots__ = ("entry", "key", "addrs", "bes", "sizes", "blocks", "peaks")

    def __init__(self, ga: Gallocr, run: _Run, before: Entry) -> None:
        self.entry = before
        placed = run.placed
        # the entry's key as a later run meets it: with the memos the sizes left (the first run at a ubatch sizes its
        # tensors: Gallocr._size)
        self.key = (before.key[0], before.key[1], tuple(map(_MEMO, placed)))
        self.addrs = list(map(_ADDR, placed))
        self.bes = list(map(_BE, placed))
        self.sizes = list(map(_SIZE, placed))
        self.blocks = [[tuple(b) for b in ga.tallocs[be].chunks[0]] for be in run.buffers]
        self.peaks: list[tuple[int, int, int]] | None = None  # (worked out at the first use: decided)

    def decided(self, ga: Gallocr, run: _Run) -> bool:
        """Whether the entry's key held every size the run placed: each was set, or was Gallocr._size's memo in the
        buffer the tensor went to (another is computed from a shape the key does not hold). Once: per buffer the
        highest end the run allocated to and the first allocation that reached it (its index among the placements and
        among the events): the one that raises the mark there last, if any does (DynAllocator.alloc: `end > max`)."""
        if self.peaks is not None:
            return True
        _, sizes, memos = self.key
        for be, size, s0, m0 in zip(self.bes, self.sizes, sizes, memos):
            if not s0 and (m0 is None or m0[0] != be or m0[1] != size):
                return False
        self.peaks = peaks = [(-1, -1, -1)] * len(ga.tallocs)
        placements = zip(self.addrs, self.bes, self.sizes)
        i = 0
        for k, op in enumerate(run.ops[0]):
            if op == FREE:
                continue
            addr, be, size = next(placements)
            if op == ALLOC:
                a = ga.aligns[be]
                end = addr + (size + a - 1) // a * a
                if end > peaks[be][0]:
                    peaks[be] = (end, i, k)
            i += 1
        return True

    def match(self, now: Entry) -> tuple[list[int], list[int]] | None:
        """Per buffer, the shift of its upper part and where that part started then; None where `now` is not this
        entry with the upper part of each buffer moved, its lower part where it was and ending below it."""
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
        return shift, high

    def apply(self, ga: Gallocr, run: _Run, shift: list[int], high: list[int]) -> None:
        """`run`'s events as they came out here, the upper part of each buffer moved by its shift."""
        for t, addr, be, size in zip(run.placed, self.addrs, self.bes, self.sizes):
            t.addr = addr + shift[be] if addr >= high[be] else addr
            t.be = be
            t.size = size
        for t, own in zip(*run.owns):
            t.own = own
        if ga.trace:
            self._live(ga, run, shift, high)
        for be, blocks in zip(run.buffers, self.blocks):
            d, h = shift[be], high[be]
            moved = [[off + d if off >= h else off, size] for off, size in blocks]
            last = moved[-1]
            last[1] = blocks[-1][0] + blocks[-1][1] - last[0]  # the last block runs to the buffer's end
            talloc = ga.tallocs[be]
            talloc.chunks = [moved]
            end = self._peak(be, shift, high)
            if end > talloc.max_size:
                talloc.maxes = [end]
                talloc.max_size = end
                if ga.trace:
                    ga.peaks[be] = end
            elif not talloc.maxes:
                talloc.maxes = [0]

    def _peak(self, be: int, shift: list[int], high: list[int]) -> int:
        """The run's highest allocated end in buffer `be`, here (-1: none)."""
        assert self.peaks is not None  # decided
        end, i, _ = self.peaks[be]
        if i >= 0 and self.addrs[i] >= high[be]:
            end += shift[be]
        return end

    def _live(self, ga: Gallocr, run: _Run, shift: list[int], high: list[int]) -> None:
        """ga.live through the run's events as Gallocr keeps it, and ga.peak_lives where a mark rises (before the
        marks are set): the tensors alive at the allocation that raises it last."""
        live = ga.live
        rises = sorted((k, be) for be, (_, _, k) in enumerate(self.peaks or ())
                       if k >= 0 and self._peak(be, shift, high) > ga.tallocs[be].max_size)
        events = zip(*run.ops)
        done = 0
        for k, be in rises:
            _track(live, islice(events, k + 1 - done))
            done = k + 1
            ga.peak_lives[be] = [(x.name, x.size) for x in live.values() if x.be == be]
        _track(live, events)


def _track(live: dict, events: Iterator[tuple[int, Tensor, Tensor]]) -> None:
    """Gallocr's live tensors through events: an allocation joins, a free leaves, a reuse takes its parent's place."""
    for op, t, p in events:
        if op == FREE:
            live.pop(t, None)
        elif op == ALLOC:
            live[t] = t
        elif live.pop(p, None) is not None:
            live[t] = t
