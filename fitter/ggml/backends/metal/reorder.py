"""The Metal reorder's state, relative to an instance (fitter.ggml.backends.metal.segments): the recurrent states'
layout, what a pack reads or writes qualified at its instance, the reorder walk over the instances, and the keys its
work is kept and replayed by. `ReorderKeys` is a part of segments._Plan, kept here by what it does."""

from __future__ import annotations

from typing import Callable

from fitter.ggml.backends.metal.chunks import ChunkPlanning, Ref, Unsupported
from fitter.ggml.backends.metal.common import (
    N_FORWARD,
    Qual,
    reorder_walk,
)
from fitter.ggml.graph import Segment
from fitter.ggml.tensor import CacheTensor, Tensor


class ReorderKeys(ChunkPlanning):
    """_Plan's reorder walk and its state keys (the attributes below are _Plan's, set in its __init__ and run)."""

    n: int
    alloc_size: Callable[[Tensor], int]
    alignment: int
    _local_index: dict[int, dict[int, int]]
    _bits: dict[object, int]
    _idents: list[object]
    starts: list[int]
    owner: list[int]
    rs_off: dict[tuple, int]
    rs_base: list[int]

    def _local(self, seg: Segment, t: Tensor) -> int:
        """t's index among the tensors of its segment (made in it, its nodes, its placeholder)."""
        return self._local_index_of(seg)[id(t)]

    def _local_index_of(self, seg: Segment) -> dict[int, int]:
        """_local's index of a segment: tensor id -> its index."""
        index = self._local_index.get(id(seg))
        if index is None:
            index = self._local_index[id(seg)] = {}
            for x in (*seg.created, *seg.nodes, seg.inp):
                if x is not None:
                    index.setdefault(id(x), len(index))
        return index

    # ---- recurrent state layout ------------------------------------------------------------------------------------

    def _rs_layout(self) -> None:
        """common.cache_ranges' offsets of r_l / s_l, each layer's at its own place: a layer's segment stands for
        every layer that runs it, so its recurrent tensors are those of the layer it was built for."""
        segs = [self.pro] + [seg for seg, _ in self.layers] + [self.epi]
        last = len(segs) - 1
        of_seg: dict[int, dict[tuple, int]] = {}  # segment -> (be, layer built for, slot) -> size
        touched: dict[tuple, int] = {}  # (be, layer, slot) -> size
        for q, seg in enumerate(segs):
            rs = of_seg.get(id(seg))
            if rs is None:
                rs = of_seg[id(seg)] = {}
                for t in seg.nodes:
                    for x in (t, *t.src):
                        if x is None:
                            continue
                        b = x.vs if x.vs is not None else x
                        if isinstance(b, CacheTensor) and b.buf and b.buf[0] == "rs":
                            rs[(b.be, b.buf[1], b.buf[2])] = self.alloc_size(b)
                if len({il for _, il, _ in rs}) > 1 and 0 < q < last:
                    raise Unsupported  # a layer reading another layer's recurrent state
            for (be, il, slot), size in rs.items():
                touched[(be, il if q in (0, last) else q - 1, slot)] = size
        if len({be for be, _, _ in touched}) > 1:
            raise Unsupported
        a = self.alignment
        self.rs_off: dict[tuple, int] = {}
        off = 0
        first_at: dict[int, int] = {}  # layer -> the offset of its first recurrent tensor
        for key in sorted(touched):
            self.rs_off[key] = off
            first_at.setdefault(key[1], off)
            off += (touched[key] + a - 1) // a * a
        # per instance, where the recurrent state of its layer and the ones after it starts (the reorder's states are
        # kept relative to it)
        self.rs_base = [0] * (self.n + 2)
        self.rs_base[-1] = nxt = off
        for il in range(self.n - 1, -1, -1):
            nxt = first_at.get(il, nxt)
            self.rs_base[il + 1] = nxt

    # ---- the reorder -----------------------------------------------------------------------------------------------

    def _qual(self, q: int, ref: Ref) -> tuple[int, list | None]:
        """A pack's Ref at instance q: its identities as a bit set (_bit: local tensors as (instance, id), global ones
        by id) and its buffer ranges (common.Range)."""
        loc, prev, glob, kv, rs = ref
        bit = self._bit
        mask = 0
        for dq, x in loc:
            mask |= bit((q + dq, x))
        if prev:
            out = self.insts[q - 1][0].out
            assert out is not None  # a placeholder stands for a layer's output
            mask |= bit((q - 1, self._local(self.insts[q - 1][0], out)))
        for x in glob:
            mask |= bit(x)
        iv: list | None = list(kv) if kv else None
        if rs:
            iv = iv or []
            last = len(self.insts) - 1
            for dq, bl, slot, size, be in rs:
                q1 = q + dq
                p0 = self.rs_off[(be, bl if q1 in (0, last) else q1 - 1, slot)]
                iv.append((("rs", be), p0, p0 + size))
        return mask, iv

    def _bit(self, ident: object) -> int:
        """The bit that stands for a tensor in the reorder's sets."""
        b = self._bits.get(ident)
        if b is None:
            b = self._bits[ident] = 1 << len(self._idents)
            self._idents.append(ident)
        return b

    def _idents_of(self, mask: int) -> list:
        out = []
        idents = self._idents
        while mask:
            low = mask & -mask
            out.append(idents[low.bit_length() - 1])
            mask ^= low
        return out

    def _reorder(self) -> list[tuple]:
        """ggml_metal_graph_optimize_reorder (common.reorder's loop) over the packs of every instance in turn,
        each instance's work kept by the state it starts from (relative to it) and replayed where that repeats.
        Returns, per instance, the work kept for it: the packs it emits ((instance offset, pack) each) and the state it
        leaves; equal work is the same object."""
        kinds = self.kind_of
        m = len(kinds)
        # every pack in the split, in order, by its number g: its instance (owner), whether it is empty or movable, its
        # Refs qualified at its instance (worked out when first read); an instance's packs run from starts[q]
        self.starts: list[int] = [0]
        self.owner: list[int] = []
        starts, owner = self.starts, self.owner
        for q, kind in enumerate(kinds):
            starts.append(starts[-1] + len(kind.parts))
            owner += [q] * len(kind.parts)
        n = starts[-1]
        empty = [e for kind in kinds for e in kind.empty]
        safe = [s for kind in kinds for s in kind.safe]
        qual: list[Qual | None] = [None] * n

        def packed(g: int) -> Qual:
            q = owner[g]
            kind = kinds[q]
            k = g - starts[q]
            e = qual[g] = (*self._qual(q, kind.rd[k]), *self._qual(q, kind.wr[k]))
            return e

        chunks: list[tuple] = []
        memo: dict[tuple, tuple] = {}
        state: list = [0, 0, {}]
        used: set[int] = set()
        for q in range(m):
            key = self._key(q, state, used)
            hit = memo.get(key)
            if hit is None:
                emitted: list[int] = []
                mains = range(starts[q], starts[q + 1])
                state = reorder_walk(mains, n, used, state, empty, safe, qual, packed, emitted)
                rel = [(owner[g] - q, g - starts[owner[g]]) for g in emitted]
                used = {g for g in used if g >= starts[q + 1]}
                hit = memo[key] = (rel, self._relative(q, state, used))
            else:
                rel, exit_state = hit
                state, used = self._absolute(q, exit_state)
            chunks.append(hit)
        return chunks

    def _key(self, q: int, state: list, used: set) -> tuple:
        """The reorder's state entering instance q, relative to q, and the kinds of the instances its look-ahead can
        reach."""
        kinds = self.kind_of
        ahead = [id(kinds[q])]
        reach = 0
        q1 = q + 1
        while q1 < len(kinds) and reach < N_FORWARD:
            ahead.append(id(kinds[q1]))
            reach += len(kinds[q1].parts)
            q1 += 1
        return (tuple(ahead), self._relative(q, state, used))

    def _relative(self, q: int, state: list, used: set) -> tuple:
        base = self.rs_base[q]
        s, d, iv = state
        rel_iv = frozenset((pb, p0 - base, p1 - base, dst) if pb[0] == "rs" else (pb, p0, p1, dst)
                           for pb, rs in iv.items() for p0, p1, dst in rs)
        return (frozenset((x[0] - q, x[1]) if type(x) is tuple else x for x in self._idents_of(s)),
                frozenset((x[0] - q, x[1]) if type(x) is tuple else x for x in self._idents_of(d)),
                rel_iv, frozenset((self.owner[g] - q, g - self.starts[self.owner[g]]) for g in used))

    def _absolute(self, q: int, rel: tuple) -> tuple[list, set]:
        """A state kept relative to an instance, made the one entering instance q + 1 after q's work."""
        base = self.rs_base[q]
        s, d, rel_iv, used = rel
        iv: dict = {}
        for pb, p0, p1, dst in rel_iv:
            if pb[0] == "rs":
                p0, p1 = p0 + base, p1 + base
            iv.setdefault(pb, set()).add((p0, p1, dst))
        bit = self._bit
        ms = md = 0
        for x in s:
            ms |= bit((x[0] + q, x[1]) if type(x) is tuple else x)
        for x in d:
            md |= bit((x[0] + q, x[1]) if type(x) is tuple else x)
        return [ms, md, iv], {self.starts[q1 + q] + k for q1, k in used}
