"""fitter.ggml.alloc.DynAllocator against ggml_dyn_tallocr_alloc / ggml_dyn_tallocr_free_bytes as ggml-alloc.c writes
them: every loop in full, transcribed line by line (the reference below, the allocator as it was before its fast paths).

The fast paths must leave the very same free blocks, in the same order, after every call: zero-size tensors leave
zero-size blocks behind, so the blocks are not always sorted and disjoint, and a shortcut that assumes they are drifts
from ggml in states a prediction reaches (a lockstep run over the prediction grid's models found one)."""

from __future__ import annotations

import random

import pytest

from fitter.ggml.alloc import MAX_CHUNKS, SIZE_MAX, DynAllocator


class _Reference:
    """ggml_dyn_tallocr: free blocks [offset, size] per chunk, each chunk's high-water mark."""

    def __init__(self, align: int, max_buffer_size: int = SIZE_MAX) -> None:
        self.align, self.max_chunk = align, min(max_buffer_size, SIZE_MAX // 2)
        self.chunks: list[list[list[int]]] = []
        self.maxes: list[int] = []

    def _new_chunk(self, min_size: int) -> int:  # ggml_dyn_tallocr_new_chunk
        size = max(min_size, self.max_chunk)
        if len(self.chunks) == MAX_CHUNKS - 1:
            size = SIZE_MAX // 2
        self.chunks.append([[0, size]])
        self.maxes.append(0)
        return len(self.chunks) - 1

    def alloc(self, size: int) -> int:  # ggml_dyn_tallocr_alloc
        size = (size + self.align - 1) // self.align * self.align
        best_c = best_b = -1
        for c, blocks in enumerate(self.chunks):  # best fit among all blocks but each chunk's last
            best_fit = SIZE_MAX
            for i in range(len(blocks) - 1):
                bs = blocks[i][1]
                if bs >= size and bs <= best_fit:
                    best_c, best_b, best_fit = c, i, bs
        if best_b == -1:  # the last block of some chunk: least growth, or the tightest fit
            best_reuse = None
            for c, blocks in enumerate(self.chunks):
                if not blocks:
                    continue
                last = blocks[-1]
                reuse = self.maxes[c] - last[0] - size
                better_reuse = (best_reuse is None or best_reuse < 0) and (best_reuse is None or reuse > best_reuse)
                better_fit = reuse >= 0 and best_reuse is not None and reuse < best_reuse
                if last[1] >= size and (better_reuse or better_fit):
                    best_c, best_b, best_reuse = c, len(blocks) - 1, reuse
        if best_b == -1:
            best_c, best_b = self._new_chunk(size), 0
        blocks = self.chunks[best_c]
        b = blocks[best_b]
        off = b[0]
        b[0] += size
        b[1] -= size
        if b[1] == 0:
            del blocks[best_b]
        self.maxes[best_c] = max(self.maxes[best_c], off + size)
        return best_c << 56 | off

    def free(self, addr: int, size: int) -> None:  # ggml_dyn_tallocr_free_bytes
        size = (size + self.align - 1) // self.align * self.align
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


@pytest.mark.parametrize("max_buffer_size", [SIZE_MAX, 1 << 20])
@pytest.mark.parametrize("seed", range(8))
def test_every_call_leaves_the_blocks_ggml_leaves(seed: int, max_buffer_size: int) -> None:
    """Random graphs' worth of allocations and frees (a third of them zero-size, as views of nothing and empty
    tensors are): the same addresses, the same free blocks in the same order, the same marks, call after call."""
    rng = random.Random(seed)
    ours, ref = DynAllocator(32, max_buffer_size), _Reference(32, max_buffer_size)
    live: list[tuple[int, int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.48:
            addr, size = live.pop(rng.randrange(len(live)))
            ours.free(addr, size)
            ref.free(addr, size)
        else:
            size = 0 if rng.random() < 0.3 else rng.choice((32, 100, 4096, 65536, 300000))
            addr = ours.alloc(size)
            assert addr == ref.alloc(size)
            live.append((addr, size))
        assert ours.chunks == ref.chunks and ours.maxes == ref.maxes
        assert ours.max_size == sum(ref.maxes)


def test_the_early_stop_that_drifted_is_caught() -> None:
    """The state a lockstep check met: a zero-size block ahead of the block a free merges into. ggml's loop goes on to
    that block; a loop that stops at the first block past the freed range inserts a new one instead."""
    ours, ref = DynAllocator(32), _Reference(32)
    for a in (ours, ref):
        a.chunks = [[[1056, 0], [0, 2048], [2080, 1024], [8224, 11264], [27808, 1 << 60]]]
        a.maxes = [27808]
    ours.max_size = 27808
    ours.free(0, 2048)
    ref.free(0, 2048)
    assert ours.chunks == ref.chunks
