"""Metal's fusion table: which node runs graph_optimize packs together, and what the fused kernels keep alive.

Mirrors ggml/src/ggml-metal/ggml-metal-fusion.cpp of the pinned llama.cpp 0c1e57098bba (llama-cpp-python
0.3.36): the pattern table ggml_metal_fusions and its check callbacks, ggml_metal_fusion_next in
GGML_METAL_FUSION_STRUCTURAL mode (the optimizer's: tensors are not allocated yet, so every FULL-only check
is skipped, as the source skips it), ggml_metal_fusion_max and ggml_metal_fusion_add_alloc_deps, with the
helpers they call from ggml/src/ggml-impl.h and ggml.c (ggml_op_is_empty, ggml_can_fuse_subgraph_ext,
ggml_node_get_use_count, ggml_are_same_layout, ggml_is_contiguous_rows).

`nodes` is one Metal split's node list (ggml_graph_view of the split: raw indices), `uses[id(t)]` ggml's
cgraph->use_counts of t over the WHOLE graph (the view shares them). Every graph node counts as
GGML_TENSOR_FLAG_COMPUTE (ggml_visit_parents sets it on every node ggml_build_forward_expand adds).

What ggfit's Tensor does not keep, so is not checked here (everything else of each check is):
- view_offs: GATED_DELTA_NET+CPY's "src->view_offs == tail_off" and the MoE reduce's
  "view->view_offs == (i-1)*mul->nb[1]" (ggfit's views carry no offset);
- SOFT_MAX's op params: the top-k MoE routing fusion's "scale == 1 && max_bias == 0" (ggfit's soft_max
  keeps no scale / ALiBi bias). The gating softmax of build_moe_ffn is a plain ggml_soft_max.
GATED_DELTA_NET's op param K (snapshot slots) is read back from its shape (ggml_gated_delta_net:
ne1 = n_tokens*n_seqs + K*S_v*n_seqs).
"""

from __future__ import annotations

from typing import Callable

from fitter.ggml.graph import can_fuse_subgraph
from fitter.ggml.tensor import FLAG_OUTPUT, Tensor, is_contiguous
from fitter.ggml.types import BLCK, F16, F32, GGML_TYPES, I32, TSIZE
from fitter.record import Record

FUSION_MAX = 16  # GGML_METAL_FUSION_MAX (ggml-metal-fusion.h)
_TOPK_MOE_MAX_EXPERTS = 1024  # GGML_METAL_TOPK_MOE_MAX_EXPERTS
_MOE_REDUCE_MAX_EXPERTS = 8  # GGML_METAL_MOE_REDUCE_MAX_EXPERTS
_EMPTY_OPS = frozenset(("NONE", "RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE"))  # ggml-impl.h ggml_op_is_empty
_BF16 = GGML_TYPES["bf16"]

# check(fusion, nodes of the pattern, split nodes, node_idxs, idx, uses): the pattern's extra constraints
_Check = Callable[["_Fusion", list[Tensor], list[Tensor], list[int], int, dict[int, int]], bool]


class _Fusion(Record, kw_only=False):
    """struct ggml_metal_fusion: ops is derived from ops_all (ggml_metal_fusion_filter_ops)."""

    id: str
    ops_all: tuple[str, ...]
    outs: tuple[int, ...]
    unsafe: bool
    check: _Check
    ops: tuple[str, ...] = ()  # (set from ops_all by __post_init__)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(op for op in self.ops_all if op not in _EMPTY_OPS))


# ---- helpers (ggml-impl.h / ggml.c) ----------------------------------------------------------------


def _src(t: Tensor, i: int) -> Tensor | None:
    """t->src[i] (ggml keeps GGML_MAX_SRC slots, NULL past the last source)."""
    return t.src[i] if i < len(t.src) else None


def _same_shape(a: Tensor, b: Tensor) -> bool:  # ggml_are_same_shape
    return a.ne[0] == b.ne[0] and a.ne[1] == b.ne[1] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3]


def _same_layout(a: Tensor | None, b: Tensor | None) -> bool:  # ggml-impl.h ggml_are_same_layout
    if a is None or b is None:
        return False  # a NULL addend: never built (ggml_add always has src[1])
    return a.type == b.type and list(a.ne) == list(b.ne) and list(a.nb) == list(b.nb)


def _contiguous_rows(t: Tensor) -> bool:  # ggml_is_contiguous_rows
    return t.ne[0] == BLCK[t.type] or t.nb[0] == TSIZE[t.type]


def _can_fuse_subgraph(nodes: list[Tensor], idxs: list[int], ops: tuple[str, ...], outputs: tuple[Tensor, ...],
                       uses: dict[int, int]) -> bool:  # ggml_can_fuse_subgraph_ext over the nodes at idxs
    return can_fuse_subgraph([nodes[k] for k in idxs], ops, outputs, uses)


# ---- pattern checks --------------------------------------------------------------------------------


def _check_norm(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int, uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_norm: NORM/RMS_NORM + MUL (+ ADD) by row-wide weights, or + SCALE."""
    if f.id == "NORM_SCALE":
        sc = p[1]
        return sc.op == "SCALE" and _src(sc, 0) is p[0] and _src(sc, 1) is None and sc.type == F32
    for j in range(1, len(f.ops)):
        if _src(p[j], 0) is not p[j - 1]:
            return False
        w = _src(p[j], 1)
        if w is None:  # the weight / bias: ggfit leaves it out of graphs built without Context.weights
            return False
        if w.ne[0] != p[0].ne[0] or not _contiguous_rows(w) or p[j].type != F32:
            return False
    return True


def _check_ssm_conv_silu(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int,
                         uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_ssm_conv_silu (GGML_UNARY_OP_SILU: Tensor.uop "silu")."""
    conv, un = p[0], p[1]
    if conv.op != "SSM_CONV" or un.op != "UNARY" or _src(un, 0) is not conv or _src(un, 1) is not None:
        return False
    if un.uop != "silu":
        return False
    return conv.type == F32 and un.type == F32 and _contiguous_rows(un)


def _check_add_chain(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int,
                     uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_add_chain: each ADD reads the previous one, the addends share a layout (the FULL-mode
    same-buffer check is skipped)."""
    for j in range(1, len(f.ops)):
        if _src(p[j], 0) is not p[j - 1]:
            return False
        if not _same_layout(_src(p[j], 1), _src(p[j - 1], 1)):
            return False
    return True


def _check_gdn_cache(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int,
                     uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_gdn_cache: the CPY writes this GATED_DELTA_NET's state snapshots into the cache.

    view_offs (src at the snapshot tail) is not kept by ggfit: not checked. K is ggml_gated_delta_net's op param 0,
    read back from the output's ne1 = n_tokens*n_seqs + K*S_v*n_seqs."""
    gdn, cp = p[0], p[1]
    if gdn.type != F32 or gdn.flags & FLAG_OUTPUT:
        return False
    if cp.op != "CPY" or cp.flags & FLAG_OUTPUT:
        return False
    v = _src(gdn, 2)
    if v is None:
        return False
    s_v, h, n_tokens, n_seqs = v.ne
    k = (gdn.ne[1] - n_tokens * n_seqs) // (s_v * n_seqs) if s_v * n_seqs else 1
    d = s_v * s_v * h
    n_written = min(n_tokens, k)
    src, dst = _src(cp, 0), _src(cp, 1)
    if src is None or dst is None:
        return False
    if src.op != "VIEW" or src.vs is not gdn or not is_contiguous(src):
        return False
    return (dst.type == F32 and list(dst.ne) == [d, n_seqs, n_written, 1] and dst.nb[0] == TSIZE[F32]
            and dst.nb[1] == TSIZE[F32] * d)


def _check_snake(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int, uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_snake: MUL + SIN + SQR + MUL + ADD (ggfit builds no SIN: kept for the table)."""
    mul0, sin_node, sqr, mul1, add = p
    m0s0, m0s1 = _src(mul0, 0), _src(mul0, 1)
    if m0s0 is None or m0s1 is None:
        return False
    x = m0s0 if _same_shape(mul0, m0s0) else m0s1
    a = m0s1 if x is m0s0 else m0s0
    inv_b = _src(mul1, 1) if _src(mul1, 0) is sqr else _src(mul1, 0)
    x_in_add = _src(add, 1) if _src(add, 0) is mul1 else _src(add, 0)
    if inv_b is None:
        return False
    types_ok = (x.type in (F32, F16, _BF16) and a.type == F32 and inv_b.type == F32 and mul0.type == x.type
                and sin_node.type == x.type and sqr.type == x.type and mul1.type == x.type and add.type == x.type)
    shape_ok = _same_shape(a, inv_b) and a.ne[0] == 1 and a.ne[1] == x.ne[1]
    dim_ok = all(t.ne[2] == 1 and t.ne[3] == 1 for t in (x, add, a, inv_b))
    contig_ok = all(is_contiguous(t) for t in (x, add, a, inv_b))
    return types_ok and shape_ok and dim_ok and contig_ok and x_in_add is x


def _check_topk_moe(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int,
                    uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_topk_moe: SOFT_MAX + ARGSORT + GET_ROWS (+ weight norm, + scale) of MoE routing.

    The softmax's scale / max_bias op params are not kept by ggfit: not checked."""
    n_ops = len(f.ops)
    with_norm = n_ops >= 6
    with_scale = n_ops in (4, 7)
    ops_all = f.ops_all
    raw_start = idxs[idx]
    raw_end = idxs[idx + n_ops - 1]
    # the norm variant ends with a RESHAPE the non-empty sequence filters out
    if with_norm and not with_scale:
        if raw_end + 1 >= len(nodes):
            return False
        trailing = nodes[raw_end + 1]
        if trailing.op != "RESHAPE" or _src(trailing, 0) is not nodes[raw_end]:
            return False
        raw_end += 1
    raw_count = raw_end - raw_start + 1
    if raw_count != len(ops_all):
        return False
    raw_idxs = list(range(raw_start, raw_start + raw_count))
    if any(nodes[k].op != ops_all[i] for i, k in enumerate(raw_idxs)):
        return False
    softmax, probs_reshaped, argsort, ids, get_rows = nodes[raw_start:raw_start + 5]
    out = nodes[raw_end]
    logits = _src(softmax, 0)
    if logits is None or _src(softmax, 1) is not None or _src(softmax, 2) is not None:
        return False
    if logits.type != F32 or softmax.type != F32 or out.type != F32 or ids.type != I32:
        return False
    n_expert, n_tokens, n_used = logits.ne[0], logits.ne[1], ids.ne[0]
    if (n_expert <= 0 or n_used <= 0 or n_used > n_expert or n_expert > _TOPK_MOE_MAX_EXPERTS
            or n_used > _TOPK_MOE_MAX_EXPERTS):
        return False
    if (logits.ne[2] != 1 or logits.ne[3] != 1 or ids.ne[1] != n_tokens or ids.ne[2] != 1 or ids.ne[3] != 1
            or out.ne[0] != 1 or out.ne[1] != n_used or out.ne[2] != n_tokens or out.ne[3] != 1):
        return False
    if (not is_contiguous(logits) or not is_contiguous(out) or ids.nb[0] != TSIZE[I32]
            or ids.nb[1] != TSIZE[I32] * n_expert):
        return False
    if (_src(probs_reshaped, 0) is not softmax or _src(argsort, 0) is not softmax or _src(ids, 0) is not argsort
            or _src(get_rows, 0) is not probs_reshaped or _src(get_rows, 1) is not ids):
        return False
    if with_norm:
        w_reshaped, sum_rows, clamp, div, out_reshaped = nodes[raw_start + 5:raw_start + 10]
        if (_src(w_reshaped, 0) is not get_rows or _src(sum_rows, 0) is not w_reshaped or _src(clamp, 0) is not sum_rows
                or _src(div, 0) is not w_reshaped or _src(div, 1) is not clamp or _src(out_reshaped, 0) is not div):
            return False
        if with_scale and _src(nodes[raw_start + 10], 0) is not out_reshaped:
            return False
    elif with_scale and _src(nodes[raw_start + 5], 0) is not get_rows:
        return False
    return _can_fuse_subgraph(nodes, raw_idxs, ops_all, (nodes[raw_start + 3], nodes[raw_end]), uses)


def _match_moe_reduce(nodes: list[Tensor], node_idx: int, ops_all: tuple[str, ...],
                      uses: dict[int, int]) -> tuple[Tensor, int] | None:
    """ggml_metal_fusion_match_moe_reduce: MUL, one VIEW per expert, one ADD per further expert; (experts, node
    count) or None. The views' view_offs (i-1)*mul->nb[1] are not kept by ggfit: not checked."""
    if node_idx < 0 or node_idx + len(ops_all) > len(nodes):
        return None
    mul = nodes[node_idx]
    if mul.op != "MUL" or mul.type != F32:
        return None
    raw_count = len(ops_all)
    n_used = raw_count // 2
    if n_used < 2 or n_used > _MOE_REDUCE_MAX_EXPERTS or raw_count != 2 * n_used:
        return None
    n_views = 0
    while node_idx + 1 + n_views < len(nodes) and nodes[node_idx + 1 + n_views].op == "VIEW":
        n_views += 1
    if n_views != n_used:
        return None
    if any(nodes[node_idx + i].op != "ADD" for i in range(n_used + 1, raw_count)):
        return None
    raw_idxs = list(range(node_idx, node_idx + raw_count))
    if any(nodes[k].op != ops_all[i] for i, k in enumerate(raw_idxs)):
        return None
    experts, weights = _src(mul, 0), _src(mul, 1)
    dst = nodes[node_idx + raw_count - 1]
    if experts is None or weights is None:
        return None
    if experts.type != F32 or weights.type != F32 or dst.type != F32:
        return None
    n_embd, n_tokens = experts.ne[0], experts.ne[2]
    if (n_embd <= 0 or experts.ne[1] != n_used or experts.ne[3] != 1 or weights.ne[0] != 1 or weights.ne[1] != n_used
            or weights.ne[2] != n_tokens or weights.ne[3] != 1 or dst.ne[0] != n_embd or dst.ne[1] != n_tokens
            or dst.ne[2] != 1 or dst.ne[3] != 1):
        return None
    if not is_contiguous(experts) or not is_contiguous(weights) or not is_contiguous(dst):
        return None
    for i in range(1, n_used + 1):
        v = nodes[node_idx + i]
        if (v.vs is not mul or _src(v, 0) is not mul or v.ne[0] != n_embd or v.ne[1] != n_tokens
                or v.nb[1] != mul.nb[2]):
            return None
    prev: Tensor | None = None
    for j in range(1, n_used):
        add = nodes[node_idx + n_used + j]
        rhs = nodes[node_idx + j + 1]
        lhs = nodes[node_idx + 1] if j == 1 else prev
        if _src(add, 0) is not lhs or _src(add, 1) is not rhs:
            return None
        prev = add
    if not _can_fuse_subgraph(nodes, raw_idxs, ops_all, (dst,), uses):
        return None
    return experts, raw_count


def _check_moe_reduce(f: _Fusion, p: list[Tensor], nodes: list[Tensor], idxs: list[int], idx: int,
                      uses: dict[int, int]) -> bool:
    """ggml_metal_fusion_check_moe_reduce."""
    m = _match_moe_reduce(nodes, idxs[idx], f.ops_all, uses)
    if m is None:
        return False
    experts, count = m
    if len(f.ops) != experts.ne[1]:
        return False
    return idxs[idx + len(f.ops) - 1] == idxs[idx] + count - 1


# ---- patterns (ggml_metal_fusions, in table order) -------------------------------------------------

_TOPK = ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS")
_TOPK_NORM = _TOPK + ("RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE")

FUSIONS: tuple[_Fusion, ...] = (
    _Fusion("NORM_MUL", ("NORM", "MUL"), (), False, _check_norm),
    _Fusion("NORM_MUL_ADD", ("NORM", "MUL", "ADD"), (), False, _check_norm),
    _Fusion("NORM_SCALE", ("NORM", "SCALE"), (), False, _check_norm),
    _Fusion("NORM_MUL", ("RMS_NORM", "MUL"), (), False, _check_norm),
    _Fusion("NORM_MUL_ADD", ("RMS_NORM", "MUL", "ADD"), (), False, _check_norm),
    _Fusion("NORM_SCALE", ("RMS_NORM", "SCALE"), (), False, _check_norm),
    *(_Fusion("ADD_CHAIN", ("ADD",) * n, (), False, _check_add_chain) for n in range(2, 8)),
    _Fusion("SNAKE", ("MUL", "SIN", "SQR", "MUL", "ADD"), (), False, _check_snake),
    _Fusion("GDN_CACHE", ("GATED_DELTA_NET", "CPY"), (), True, _check_gdn_cache),
    _Fusion("TOPK_MOE", _TOPK, (1,), True, _check_topk_moe),
    _Fusion("TOPK_MOE", _TOPK + ("SCALE",), (1,), True, _check_topk_moe),
    _Fusion("TOPK_MOE", _TOPK_NORM, (1,), True, _check_topk_moe),
    _Fusion("TOPK_MOE", _TOPK_NORM + ("SCALE",), (1,), True, _check_topk_moe),
    *(_Fusion("MOE_REDUCE", ("MUL",) + ("VIEW",) * n + ("ADD",) * (n - 1), (), True, _check_moe_reduce)
      for n in range(2, _MOE_REDUCE_MAX_EXPERTS + 1)),
    _Fusion("SSM_CONV_SILU", ("SSM_CONV", "UNARY"), (), False, _check_ssm_conv_silu),
)


# the table's patterns by their first op (non-empty ops, then raw ops), in table order: a node no pattern starts with
# is never looked at further
def _by_first(first: Callable[[_Fusion], str]) -> dict[str, tuple[_Fusion, ...]]:
    out: dict[str, tuple[_Fusion, ...]] = {}
    for f in FUSIONS:
        out[first(f)] = out.get(first(f), ()) + (f,)
    return out


_BY_OP = _by_first(lambda f: f.ops[0])
_BY_RAW_OP = _by_first(lambda f: f.ops_all[0])


# ---- queries ---------------------------------------------------------------------------------------


def _fusion_next(nodes: list[Tensor], idxs: list[int], idx: int, uses: dict[int, int],
                 ops: tuple[str, ...]) -> tuple[_Fusion | None, int]:
    """ggml_metal_fusion_next in GGML_METAL_FUSION_STRUCTURAL mode: the longest pattern matching at idxs[idx] (idx a
    position in idxs, the non-empty raw indices; `ops` their ops) and the count of idxs it takes (1: none)."""
    res: _Fusion | None = None
    best = 1
    for f in _BY_OP.get(ops[idx], ()):
        n_ops = len(f.ops)
        if n_ops <= best or idx + n_ops > len(idxs) or ops[idx:idx + n_ops] != f.ops:
            continue
        p = [nodes[idxs[idx + j]] for j in range(n_ops)]
        if not f.unsafe:
            # element-wise chain: each node reads the previous one, all of one shape
            if any((_src(p[j], 0) is not p[j - 1] and _src(p[j], 1) is not p[j - 1]) or not _same_shape(p[j], p[j - 1])
                   for j in range(1, n_ops)):
                continue
            outputs = (p[n_ops - 1],) + tuple(p[o] for o in f.outs)
            if not _can_fuse_subgraph(nodes, idxs[idx:idx + n_ops], f.ops, outputs, uses):
                continue
        if not f.check(f, p, nodes, idxs, idx, uses):
            continue
        # the FULL-mode memory-range check (ggml_metal_fusion_check_memory_ranges) needs allocated tensors: skipped
        best = n_ops
        res = f
    return res, best


def fusion_max(nodes: list[Tensor], idx: int, uses: dict[int, int]) -> int:
    """ggml_metal_fusion_max: how many raw nodes from `idx` on graph_optimize packs as one fused group (>= 1).

    Patterns are chained back to back over the non-empty nodes (views are skipped, and packed along when inside the
    span), at most GGML_METAL_FUSION_MAX (16) non-empty nodes; the span is capped at 16 raw nodes too. `nodes` is one
    split's node list, `uses[id(t)]` t's use count over the whole graph."""
    if nodes[idx].op in _EMPTY_OPS or nodes[idx].op not in _BY_OP:  # a view cannot start a pattern, nor an op none has
        return 1
    idxs: list[int] = []  # the non-empty nodes from idx on, at most 16
    for i in range(idx, len(nodes)):
        if len(idxs) == FUSION_MAX:
            break
        if nodes[i].op not in _EMPTY_OPS:
            idxs.append(i)
    if not idxs:
        return 1
    ops = tuple(nodes[i].op for i in idxs)
    total = 0
    i_f = 0
    while i_f < len(idxs) and total < FUSION_MAX:
        f, n = _fusion_next(nodes, idxs, i_f, uses, ops)
        if f is None or total + n > FUSION_MAX:
            break
        total += n
        i_f += n
    if i_f == 0:
        return 1
    return min(FUSION_MAX, idxs[i_f - 1] - idx + 1)


def fusion_alloc_deps(nodes: list[Tensor], end: int | None = None) -> list[tuple[Tensor, Tensor]]:
    """ggml_metal_fusion_add_alloc_deps: (tensor, until) pairs in the order add_alloc_dep is called.

    At each raw index the longest pattern whose raw op sequence (ops_all, views included) matches there, with no other
    check; each source of its nodes that is not one of its earlier nodes is kept alive until its last node. The scan
    resumes after the pattern. Runs on the split's nodes before the reorder (ggml_backend_metal_graph_optimize); the
    pairs are as called, the scheduler's add_alloc_dep drops a tensor already kept for the same `until`. `end`: scan
    only patterns that start before it (the nodes after it are the ones they may reach)."""
    deps: list[tuple[Tensor, Tensor]] = []
    n_nodes = len(nodes)
    ops = tuple(t.op for t in nodes)
    i = 0
    while i < (n_nodes if end is None else end):
        best: _Fusion | None = None
        best_raw = 0
        for f in _BY_RAW_OP.get(ops[i], ()):
            n = len(f.ops_all)
            if n <= best_raw or i + n > n_nodes:
                continue
            if ops[i:i + n] == f.ops_all:  # ggml_metal_fusion_match_raw_pattern
                best, best_raw = f, n
        if best is not None:
            last = nodes[i + best_raw - 1]
            seen: set[int] = set()  # ggml_metal_fusion_add_pattern_alloc_deps
            for node in nodes[i:i + best_raw]:
                for s in node.src:
                    if s is not None and id(s) not in seen:
                        seen.add(id(s))
                        deps.append((s, last))
                seen.add(id(node))
            i += best_raw - 1
        i += 1
    return deps
