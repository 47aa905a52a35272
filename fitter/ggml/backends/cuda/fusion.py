"""CUDA's graph_optimize: the tensors its fusions keep alive longer (ggml_backend_cuda_graph_optimize).

Mirrors ggml/src/ggml-cuda/ggml-cuda.cu: the MoE weighted reduction matcher
(ggml_cuda_match_moe_weighted_reduction), the top-k MoE routing fusion (ggml_cuda_topk_moe_fusion
and the op list of ggml_backend_cuda_graph_optimize, ggml_cuda_should_use_topk_moe) and
ggml_can_fuse_subgraph (ggml/src/ggml-impl.h). Each kept set becomes an "alloc_dep" node.
"""

from __future__ import annotations

from fitter.ggml.graph import Segment, can_fuse_subgraph
from fitter.ggml.sched import add_alloc_dep, insert_alloc_deps
from fitter.ggml.tensor import HOST, Tensor, is_contiguous
from fitter.ggml.types import F32


def cuda_alloc_deps(seq: list[Segment], own: frozenset[int] | None = None) -> None:
    """ggml_backend_cuda_graph_optimize: tensors kept alive for CUDA's fusions, split by split.

    Two matchers: the MoE weighted reduction (ggml_cuda_match_moe_weighted_reduction: experts and
    router weights live until the last ADD of the per-expert views) and the top-k MoE routing fusion
    (ggml_cuda_topk_moe_fusion: every node of the gating pattern and its sources live until the node
    after it). Each kept set becomes a GGML_OP_NONE node after its `until` node (graph_copy). `own`: the scheduler
    ids of CUDA's devices where others beside it are not the CPU (RPC devices: fitter.ggml.backends.rpc.local).
    """
    for seg in seq:
        nodes = [n for n in seg.nodes if not n.name.endswith(("#dep", "#copy"))]
        uses: dict[int, int] = {}
        for n in seg.nodes:
            for s_ in n.src:
                if s_ is not None:
                    uses[id(s_)] = uses.get(id(s_), 0) + 1
        deps: dict[int, list[Tensor]] = {}

        def dep(t: Tensor | None, until: Tensor) -> None:  # called in this loop turn only
            if t is not None:
                add_alloc_dep(deps, t, until)  # noqa: B023

        n_nodes = len(nodes)
        i = 0
        while i < n_nodes:
            node = nodes[i]
            if node.be == HOST or (own is not None and node.be not in own):  # CUDA sees its own splits only
                i += 1
                continue
            m = _match_moe_reduction(nodes, i, uses)
            if m is not None:
                experts, weights, scale, dst, count = m
                dep(experts, dst)
                dep(weights, dst)
                dep(scale, dst)
                i += count - 1
                node = nodes[i]
            if node.op in ("UNARY", "SOFT_MAX", "ARGSORT"):
                ops = _match_topk_moe(nodes, i, uses)
                if ops is not None and i + ops < n_nodes:
                    last = nodes[i + ops]
                    for k in range(i, i + ops):
                        dep(nodes[k], last)
                        for s_ in nodes[k].src:
                            dep(s_, last)
                    i += ops - 1
            i += 1
        seg.nodes = insert_alloc_deps(seg.nodes, deps)


def _same_split(nodes: list[Tensor], i: int, count: int) -> bool:
    sid = nodes[i].sid
    return i + count <= len(nodes) and all(nodes[k].sid == sid for k in range(i, i + count))


def _can_fuse(nodes: list[Tensor], i: int, ops: list[str], outputs: tuple[Tensor, ...], uses: dict[int, int]) -> bool:
    """ggml_can_fuse_subgraph over the nodes from i, within one split."""
    count = len(ops)
    return _same_split(nodes, i, count) and can_fuse_subgraph(nodes[i:i + count], ops, outputs, uses)


# long because ggml_cuda_match_moe_weighted_reduction (ggml-cuda.cu, 131 lines), step by step
def _match_moe_reduction(nodes: list[Tensor], i: int, uses: dict[int, int]):
    """ggml_cuda_match_moe_weighted_reduction."""
    first = nodes[i]
    if first.op != "MUL" or first.type != F32 or not is_contiguous(first):
        return None

    def split_mul(mul: Tensor):
        def is_weights(t):
            return (t is not None and t.type == F32 and is_contiguous(t) and t.ne[0] == 1 and t.ne[1] == mul.ne[1]
                    and t.ne[2] == mul.ne[2] and t.ne[3] == mul.ne[3])

        def is_experts(t):
            return t is not None and t.type == F32 and is_contiguous(t) and t.ne == mul.ne

        a = mul.src[0] if len(mul.src) > 0 else None
        b = mul.src[1] if len(mul.src) > 1 else None
        if is_experts(a) and is_weights(b):
            return a, b
        if is_experts(b) and is_weights(a):
            return b, a
        return None

    weighted, experts, scale, weights, mul_count = first, None, None, None, 1
    if i + 1 < len(nodes):
        second = nodes[i + 1]
        if second.op == "MUL" and second.type == F32 and is_contiguous(second):
            r2, r1 = split_mul(second), split_mul(first)
            if r2 is not None and r2[0] is first and r1 is not None:
                weighted, experts, scale, weights, mul_count = second, r1[0], r1[1], r2[1], 2
    if experts is None:
        r = split_mul(first)
        if r is None:
            return None
        experts, weights = r
    n_used = weighted.ne[1]
    n_tokens = weighted.ne[2] * weighted.ne[3]
    if n_used < 2 or n_used > 15 or n_tokens <= 0:
        return None
    count = 2 * n_used + mul_count - 1
    if i + count > len(nodes):
        return None
    ops = ["VIEW"] * count
    ops[0] = "MUL"
    if mul_count == 2:
        ops[1] = "MUL"
    views: list[Tensor] = []
    prev = None
    n_adds = 0
    for off in range(mul_count, count):
        cand = nodes[i + off]
        ops[off] = cand.op
        if cand.op == "VIEW":
            if (len(views) >= n_used or cand.src[0] is not weighted or cand.vs is not weighted or cand.type != F32
                    or cand.ne != [weighted.ne[0], n_tokens, 1, 1] or cand.nb[0] != weighted.nb[0]
                    or cand.nb[1] != weighted.nb[2]):
                return None
            views.append(cand)
            continue
        if cand.op != "ADD" or len(views) < 2 or n_adds + 1 >= len(views):
            return None
        lhs = views[0] if n_adds == 0 else prev
        if cand.src[0] is not lhs or cand.src[1] is not views[n_adds + 1] or cand.type != F32:
            return None
        prev = cand
        n_adds += 1
    if len(views) != n_used or n_adds != n_used - 1 or prev is None:
        return None
    if not is_contiguous(prev) or prev.ne != [weighted.ne[0], n_tokens, 1, 1]:
        return None
    dst = nodes[i + count - 1]
    if not _can_fuse(nodes, i, ops, (dst,), uses):
        return None
    return experts, weights, scale, dst, count


# long because ggml_cuda_topk_moe_fusion (ggml-cuda.cu, 153 lines): its pattern walk step by step
def _match_topk_moe(nodes: list[Tensor], i: int, uses: dict[int, int]) -> int | None:
    """ggml_cuda_topk_moe_fusion + the pattern check of ggml_backend_cuda_graph_optimize: its length, or None."""
    n = len(nodes)
    node = nodes[i]
    sigmoid = softplus = False
    idx = i
    if node.op == "SOFT_MAX":
        pass  # softmax gating: nothing more to match before the top-k
    elif node.op == "UNARY":
        if node.uop == "sigmoid":
            sigmoid = True
        elif node.uop == "softplus" and idx + 1 < n and nodes[idx + 1].op == "SQRT" and nodes[idx + 1].src[0] is node:
            softplus = True
            idx += 1
        else:
            return None
    else:
        return None  # ARGSORT first: the delayed-softmax form adds no dependency
    idx += 1

    def at(k: int, op: str) -> Tensor | None:
        return nodes[k] if k < n and nodes[k].op == op else None

    r = at(idx, "RESHAPE")
    if r is None or r.src[0] is not nodes[idx - 1]:
        return None
    probs_reshaped = r
    idx += 1
    if idx >= n:
        return None
    prob_bias = nodes[idx].op == "ADD" and nodes[idx].src[0] is nodes[idx - 2]
    if prob_bias:
        idx += 1
    a = at(idx, "ARGSORT")
    if a is None or a.src[0] is not (nodes[idx - 1] if prob_bias else nodes[idx - 2]):
        return None
    idx += 1
    v = at(idx, "VIEW")
    if v is None or v.src[0] is not nodes[idx - 1]:
        return None
    idx += 1
    g = at(idx, "GET_ROWS")
    if g is None or g.src[0] is not probs_reshaped or g.src[1] is not nodes[idx - 1]:
        return None
    idx += 1
    norm = scale = False
    if idx < n:
        norm = True
        k = idx
        for op in ("RESHAPE", "SUM_ROWS", "CLAMP"):
            if k < n and nodes[k].op == op and nodes[k].src[0] is nodes[k - 1]:
                k += 1
            else:
                norm = False
                break
        if norm:
            if not (k < n and nodes[k].op == "DIV" and nodes[k].src[1] is nodes[k - 1] and nodes[k].src[0] is nodes[k - 3]):
                norm = False
            else:
                k += 1
                if not (k < n and nodes[k].op == "RESHAPE" and nodes[k].src[0] is nodes[k - 1]):
                    norm = False
                else:
                    idx = k + 1
        if norm or nodes[idx].op != "RESHAPE":
            if idx < n and nodes[idx].op == "SCALE" and nodes[idx].src[0] is nodes[idx - 1]:
                scale = True
    # the op list of ggml_backend_cuda_graph_optimize
    ops = ["UNARY"] if sigmoid else (["UNARY", "SQRT"] if softplus else ["SOFT_MAX"])
    i_probs = i + len(ops) - 1
    ops += ["RESHAPE", "ADD", "ARGSORT", "VIEW", "GET_ROWS"] if prob_bias else ["RESHAPE", "ARGSORT", "VIEW", "GET_ROWS"]
    ids = nodes[i_probs + (4 if prob_bias else 3)]
    if norm:
        ops += ["RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"]
    if scale:
        ops += ["SCALE"]
    if i + len(ops) > n:
        return None
    weights = nodes[i + len(ops) - 1]
    if not _can_fuse(nodes, i, ops, (ids, weights), uses):
        return None
    # ggml_cuda_should_use_topk_moe
    n_expert = ids.nb[1] // ids.nb[0]
    if ((n_expert & (n_expert - 1)) != 0 or n_expert > 512) and n_expert not in (288, 576):
        return None
    logits = node.src[0]
    if not is_contiguous(weights) or not is_contiguous(logits):
        return None
    if node.op == "SOFT_MAX" and (not is_contiguous(node.src[0]) or len([x for x in node.src if x is not None]) > 1):
        return None
    return len(ops)
