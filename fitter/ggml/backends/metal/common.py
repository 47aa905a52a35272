"""Metal's graph_optimize: the concurrency reorder of each Metal split (ggml-metal-common.cpp ggml_graph_optimize).

ggml_backend_sched_split_graph hands each split to its backend's graph_optimize before it builds the graph copy
that ggml-alloc walks, so on Metal the compute buffer is that of the reordered graph. ggml_graph_optimize packs
fusable runs of nodes into one (they must stay together), then ggml_metal_graph_optimize_reorder walks the packs:
when a pack cannot run concurrently with the current set, it looks up to 63 packs ahead for ones that can (each
must be of an op it may move, read nothing the current set or the skipped packs write, and write nothing they
touch), moves them into the set and starts a new set. Tensors are told apart by the memory they occupy
(ggml_mem_range_from_tensor): a tensor the scheduler has not allocated yet is its own range; a tensor with a buffer
(the caches) is its byte range in that buffer, so that ranges of one buffer may overlap.

What the caches' ranges are is the dry run's (llama.cpp's own estimate, `fit --check`, the memory breakdown of
common_get_device_memory_data): a KV cache made with no_alloc has a dummy buffer and no data pointer, so every K and V
tensor of one cache spans [0, size) and all of them overlap (llama_kv_cache's constructor); the recurrent state is
allocated even then (llama_memory_recurrent), r_l and s_l of each layer one after the other, aligned. In a real run
the KV tensors have their own addresses; that difference is not modelled.

Eras (fitter.llama_builds.changes): no reorder before #15929 (metal_graph_optimize); 0.3.17-0.3.35 pack ADD / NORM / RMS_NORM
runs with ggml_can_fuse and let a pack's sources and last node stand for it; since 0.3.36 the packs come from the
fusion table (fitter.ggml.backends.metal.fusion) and every node of a pack is a destination, its internal sources
none (metal_fusion_table). The rules mirrored are #19555's (2026-02-12): builds from #15929 to then moved fewer op
types and looked less far ahead, and are predicted with the later rules.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from fitter.ggml.backends.metal.fusion import fusion_alloc_deps, fusion_max
from fitter.ggml.sched import add_alloc_dep, graph_uses, insert_alloc_deps
from fitter.ggml.tensor import FLAG_OUTPUT, VIEW_OPS, CacheTensor, Tensor
from fitter.llama_builds import LlamaBuild

EMPTY_OPS = VIEW_OPS | {"NONE"}  # ggml_op_is_empty
# ggml_metal_graph_optimize_reorder h_safe: the ops a node may be moved across
SAFE_OPS = EMPTY_OPS | {
    "MUL_MAT", "MUL_MAT_ID", "ROPE", "NORM", "RMS_NORM", "GROUP_NORM", "L2_NORM", "SUM_ROWS", "SSM_CONV", "SSM_SCAN",
    "CLAMP", "TRI", "DIAG", "MUL", "ADD", "SUB", "DIV", "GLU", "SCALE", "UNARY", "GET_ROWS", "SET_ROWS", "SET", "CPY",
    "CONT", "REPEAT",
}
N_FORWARD = 64  # ggml_metal_graph_optimize_reorder: how many packs ahead to look
_FUSE_START = ("ADD", "NORM", "RMS_NORM")  # 0.3.35 ggml_graph_optimize: ops a fused run starts with
_FUSE_NEXT = ("ADD", "MUL", "NORM", "RMS_NORM")  # and the ops it may continue with
MAX_FUSE = 16

Range = tuple[object, int, int]  # (buffer or tensor identity, p0, p1)


def cache_ranges(nodes: list[Tensor], alloc_size: Callable[[Tensor], int], alignment: int) -> dict[int, Range]:
    """The byte ranges of the cache tensors the nodes touch, as the dry run has them (see the module's docstring):
    every tensor of one KV cache at [0, size); the recurrent state's r_l, s_l packed in layer order
    (ggml_backend_alloc_ctx_tensors_from_buft: offsets padded to the buffer's alignment, ranges not)."""
    caches: dict[int, CacheTensor] = {}
    for t in nodes:
        for x in (t, *t.src):
            if x is None:
                continue
            b = x.vs if x.vs is not None else x
            if isinstance(b, CacheTensor) and b.buf:
                caches[id(b)] = b
    out: dict[int, Range] = {}
    offset: dict[int, int] = {}
    for b in sorted(caches.values(), key=lambda c: (c.be, c.buf)):
        if b.buf[0] == "kv":
            # [0, size): any two overlap whatever their sizes, so 1 stands for every size (the cell counts stay free)
            out[id(b)] = (("kv", b.be, b.buf[1]), 0, 1)
        else:
            size = alloc_size(b)
            p0 = offset.get(b.be, 0)
            out[id(b)] = (("rs", b.be), p0, p0 + size)
            offset[b.be] = p0 + (size + alignment - 1) // alignment * alignment
    return out


def _ranges(ts: list[Tensor], caches: dict[int, Range], bits: dict[int, int]) -> tuple[int, list[Range] | None]:
    """ggml_mem_range_from_tensor of each tensor (its base): a tensor not allocated yet is its own range and overlaps
    only itself, so those are a set of identities (a bit each, `bits` by id); the caches' ranges in their buffers are
    (buffer, p0, p1)."""
    mask = 0
    iv: list[Range] | None = None
    for t in ts:
        b = t.vs if t.vs is not None else t
        r = caches.get(id(b))
        if r is None:
            bit = bits.get(id(b))
            if bit is None:
                bit = bits[id(b)] = 1 << len(bits)
            mask |= bit
        elif iv is None:
            iv = [r]
        else:
            iv.append(r)
    return mask, iv


# what a pack reads and writes: (identities read as bits, buffer ranges read, identities written, ranges written)
Qual = tuple[int, list[Range] | None, int, list[Range] | None]
# a set of packs (the reorder's running set, the packs it skipped): identities read and written, ranges touched by
# buffer ({(p0, p1, written)})
State = list


def _iv_clear(iv: dict[object, set[tuple[int, int, bool]]], rs: list[Range] | None, dst: bool) -> bool:
    """ggml_mem_ranges_check for ranges in buffers: none overlaps one of the set's, `p0 < cmp.p1 && p1 >= cmp.p0`,
    unless both are read."""
    for pb, p0, p1 in rs or ():
        for c0, c1, cdst in iv.get(pb, ()):
            if (dst or cdst) and p0 < c1 and p1 >= c0:
                return False
    return True


def _iv_add(iv: dict[object, set[tuple[int, int, bool]]], rs: list[Range] | None, dst: bool) -> None:
    for pb, p0, p1 in rs or ():
        iv.setdefault(pb, set()).add((p0, p1, dst))


def _can_fuse(nodes: list[Tensor], i: int, f: int, uses: dict[int, int]) -> bool:  # ggml_can_fuse (ggml-impl.h)
    for k in range(f):
        node = nodes[i + k]
        if k < f - 1 and (uses.get(id(node), 0) != 1 or node.vs is not None or node.flags & FLAG_OUTPUT):
            return False  # ggml_node_has_n_uses(..., 1)
        if k > 0:
            prev = nodes[i + k - 1]
            src = node.src
            if not ((len(src) > 0 and src[0] is prev) or (len(src) > 1 and src[1] is prev)):
                return False
            if node.ne != prev.ne:
                return False
    return True


def _fuse_len(nodes: list[Tensor], i: int, uses: dict[int, int]) -> int:
    """0.3.35 ggml_graph_optimize: the longest run from i of ADD / MUL / NORM / RMS_NORM that ggml_can_fuse allows."""
    if nodes[i].op not in _FUSE_START:
        return 1
    n = len(nodes)
    f = i + 1
    while f < n and f < i + MAX_FUSE and nodes[f].op in _FUSE_NEXT:
        f += 1
    f -= i
    while f > 1 and not _can_fuse(nodes, i, f, uses):
        f -= 1
    return f


def pack_ends(pack: list[Tensor], table: bool) -> tuple[list[Tensor], list[Tensor]]:
    """ggml_graph_optimize's node_info of a pack: the tensors it reads and those it writes."""
    if table:  # 0.3.36: sources produced inside the pack are not sources; every node of it is a destination
        inside = {id(x) for x in pack}
        return [s for x in pack for s in x.src if s is not None and id(s) not in inside], pack
    # 0.3.35: every source of every node; the last node is the destination
    return [s for x in pack for s in x.src if s is not None], pack[-1:]


def reorder(nodes: list[Tensor], uses: dict[int, int], caches: dict[int, Range], build: LlamaBuild) -> list[Tensor]:
    """ggml_graph_optimize over one split's nodes: pack, reorder (ggml_metal_graph_optimize_reorder), unpack."""
    table = build.has("metal_fusion_table")
    if table:
        def span(i: int) -> int:
            return fusion_max(nodes, i, uses)
    else:
        def span(i: int) -> int:
            return _fuse_len(nodes, i, uses)

    # the packs (node_info), as parallel lists: nodes, op empty / movable, what each reads and writes
    packs: list[list[Tensor]] = []
    empty: list[bool] = []
    safe: list[bool] = []
    qual: list[Qual] = []
    bits: dict[int, int] = {}
    i = 0
    while i < len(nodes):
        pack = nodes[i:i + span(i)]
        srcs, dsts = pack_ends(pack, table)
        qual.append((*_ranges(srcs, caches, bits), *_ranges(dsts, caches, bits)))
        packs.append(pack)
        empty.append(pack[0].op in EMPTY_OPS)
        safe.append(pack[0].op in SAFE_OPS)
        i += len(pack)
    order: list[int] = []
    reorder_walk(range(len(packs)), len(packs), set(), [0, 0, {}], empty, safe, qual, lambda k: qual[k], order)
    return [t for k in order for t in packs[k]]


def _conflicts(s: int, d: int, iv: dict, q: Qual) -> int:
    """h_check's negation, as a truth value: the pack `q` reads what the set (identities read s, written d, ranges iv)
    writes, or writes what it touches."""
    si, siv, di, div = q
    return (d & (si | di)) or (s & di) or (bool(iv) and not (_iv_clear(iv, siv, False) and _iv_clear(iv, div, True)))


def reorder_walk(mains: Iterable[int], n: int, used: set[int], state: State, empty: list[bool], safe: list[bool],
                 qual: Sequence[Qual | None], fill: Callable[[int], Qual], emitted: list[int]) -> State:
    """ggml_metal_graph_optimize_reorder's walk over the packs `mains` (numbers below n; empty, safe and qual by number,
    fill(k) works out qual[k] where it is None), from `state`, the running concurrent set (mrs0): a pack that cannot
    join it (h_check) pulls into it the packs ahead of it (N_FORWARD - 1 of them) that read nothing the set or the
    skipped packs (mrs1) write and write nothing they touch, then starts a new set. Appends the packs in their new
    order to `emitted`, the pulled ones to `used`; returns the set it ends with."""
    s, d, iv = state
    for i0 in mains:
        if i0 in used:
            continue
        q0 = qual[i0] or fill(i0)
        if not empty[i0] and _conflicts(s, d, iv, q0):
            ks, kd = q0[0], q0[2]  # the packs skipped
            kiv: dict[object, set[tuple[int, int, bool]]] = {}
            _iv_add(kiv, q0[1], False)
            _iv_add(kiv, q0[3], True)
            for i1 in range(i0 + 1, min(i0 + N_FORWARD, n)):
                if i1 in used:
                    continue
                if not safe[i1]:
                    break
                q1 = qual[i1] or fill(i1)
                ti, tiv, ui, uiv = q1
                if (empty[i1] or not _conflicts(s, d, iv, q1)) and not _conflicts(ks, kd, kiv, q1):
                    s |= ti  # h_add to the set
                    d |= ui
                    _iv_add(iv, tiv, False)
                    _iv_add(iv, uiv, True)
                    emitted.append(i1)
                    used.add(i1)
                else:
                    ks |= ti  # and to the skipped
                    kd |= ui
                    _iv_add(kiv, tiv, False)
                    _iv_add(kiv, uiv, True)
            s, d, iv = 0, 0, {}
        s |= q0[0]  # h_add
        d |= q0[2]
        _iv_add(iv, q0[1], False)
        _iv_add(iv, q0[3], True)
        emitted.append(i0)
    return [s, d, iv]


def graph_optimize(nodes: list[Tensor], build: LlamaBuild, alloc_size: Callable[[Tensor], int], alignment: int,
                   gpu: int) -> list[Tensor]:
    """ggml_backend_metal_graph_optimize on every split of backend `gpu` in a placed and split graph (the scheduler's
    copies of a split's inputs stay at its start, as graph_copy puts them)."""
    deps: dict[int, list[Tensor]] = {}
    out = optimize_splits(nodes, graph_uses(nodes), cache_ranges(nodes, alloc_size, alignment), build, gpu, deps)
    return insert_alloc_deps(out, deps)  # graph_copy: after each `until` node, in the reordered order


def optimize_splits(nodes: list[Tensor], uses: dict[int, int], caches: dict[int, Range], build: LlamaBuild, gpu: int,
                    deps: dict[int, list[Tensor]]) -> list[Tensor]:
    """graph_optimize's walk over the splits of some nodes of the graph (uses and caches: the whole graph's): each
    split of backend `gpu` reordered, its alloc deps added to `deps`."""
    out: list[Tensor] = []
    i, n = 0, len(nodes)
    while i < n:
        j = i
        while j < n and nodes[j].sid < 0:  # the input copies pass 5 put before the split
            j += 1
        out += nodes[i:j]
        if j == n:
            break
        sid = nodes[j].sid
        k = j
        while k < n and nodes[k].sid == sid:
            k += 1
        split = nodes[j:k]
        be = next((t.be for t in split if t.op not in VIEW_OPS), split[0].be)
        if be == gpu:
            if build.has("metal_fusion_table"):  # ggml_metal_fusion_add_alloc_deps, on the split as it came
                for t, until in fusion_alloc_deps(split):
                    add_alloc_dep(deps, t, until)
            split = reorder(split, uses, caches, build)
        out += split
        i = k
    return out
