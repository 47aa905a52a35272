"""Metal's fusion table (fitter.ggml.backends.metal.fusion): how many nodes graph_optimize packs as one fused group
(ggml_metal_fusion_max, STRUCTURAL mode) and what the fused kernels keep alive (ggml_metal_fusion_add_alloc_deps).
Metal cannot run here: every expected value is worked out from ggml/src/ggml-metal/ggml-metal-fusion.cpp and
ggml_can_fuse_subgraph_ext (ggml.c) of the pinned build, on graphs built with ggfit's own op constructors."""

from __future__ import annotations

from functools import lru_cache

import pytest

from fitter.ggml.backends.metal.fusion import FUSIONS, fusion_alloc_deps, fusion_max
from fitter.ggml.graph import Graph
from fitter.ggml.tensor import (
    FLAG_OUTPUT,
    Context,
    Tensor,
    add,
    inp,
    mm,
    mul,
    new_tensor,
    norm,
    rms_norm,
    scale,
    sqr,
    unary,
    view,
    weight,
)
from fitter.ggml.types import F32
from fitter.llama.context import model_of
from fitter.llama.cparams import Frontend, RunConfig, resolve_context
from fitter.llama.graph import GraphContext
from fitter.llama.model import load_model_spec
from fitter.llama.models import default_details
from tests.synth import build

E = 64  # row width
T = 8  # rows (tokens)


def _ctx() -> Context:
    ctx = Context()
    ctx.weights = True  # a GPU graph: ops that read a weight have it as a source (as the scheduler's graphs do)
    return ctx


def _nodes(*outs: Tensor) -> list[Tensor]:
    g = Graph()
    for o in outs:
        g.expand(o)
    return g.nodes


def _uses(nodes: list[Tensor]) -> dict[int, int]:
    """cgraph->use_counts: how many times each tensor is a source of a node of the graph."""
    u: dict[int, int] = {}
    for n in nodes:
        for s in n.src:
            if s is not None:
                u[id(s)] = u.get(id(s), 0) + 1
    return u


def _fmax(nodes: list[Tensor], idx: int = 0) -> int:
    return fusion_max(nodes, idx, _uses(nodes))


def _x(ctx: Context, name: str = "x", ne: tuple[int, ...] = (E, T)) -> Tensor:
    return inp(ctx, F32, ne, name)


def _ops(nodes: list[Tensor]) -> list[str]:
    return [n.op for n in nodes]


# --- the table ----------------------------------------------------------------------------------


def test_the_table_is_upstreams():
    # ggml_metal_fusions: 6 norm, 6 ADD chains (2..7), snake, gdn cache, 4 top-k MoE, 7 MoE reduce (2..8), ssm_conv
    assert len(FUSIONS) == 26
    assert [f.ops for f in FUSIONS if f.id == "ADD_CHAIN"] == [("ADD",) * n for n in range(2, 8)]
    # ops is ops_all less the empty ops (ggml_metal_fusion_filter_ops): the MoE reduce is MUL + (k-1) ADDs
    assert [len(f.ops) for f in FUSIONS if f.id == "MOE_REDUCE"] == list(range(2, 9))
    assert [len(f.ops_all) for f in FUSIONS if f.id == "MOE_REDUCE"] == list(range(4, 17, 2))
    assert [len(f.ops) for f in FUSIONS if f.id == "TOPK_MOE"] == [3, 4, 6, 7]
    assert [f.outs for f in FUSIONS if f.outs] == [(1,)] * 4  # the top-k's ids (ops[1], the ARGSORT) are an output


# --- norms --------------------------------------------------------------------------------------


def test_rms_norm_mul():
    ctx = _ctx()
    x = _x(ctx)
    n = rms_norm(ctx, x)
    m = mul(ctx, n)  # by the norm weight [E]
    out = mm(ctx, 32, m, "ffn_up")
    nodes = _nodes(out)
    assert _ops(nodes) == ["RMS_NORM", "MUL", "MUL_MAT"]
    assert _fmax(nodes, 0) == 2
    assert _fmax(nodes, 1) == 1  # MUL then MUL_MAT: no pattern
    assert _fmax(nodes, 2) == 1
    w = m.src[1]
    # every source of the pattern not produced inside it lives until its last node
    assert fusion_alloc_deps(nodes) == [(x, m), (w, m)]


def test_rms_norm_mul_add():
    ctx = _ctx()
    x = _x(ctx)
    n = rms_norm(ctx, x)
    m = mul(ctx, n)
    a = add(ctx, m)  # by a bias [E]
    nodes = _nodes(a)
    assert _fmax(nodes) == 3  # NORM_MUL_ADD is longer than NORM_MUL: the longest match wins
    assert fusion_alloc_deps(nodes) == [(x, a), (m.src[1], a), (a.src[1], a)]


def test_norm_scale():
    ctx = _ctx()
    x = _x(ctx)
    s = scale(ctx, norm(ctx, x))
    nodes = _nodes(s)
    assert _ops(nodes) == ["NORM", "SCALE"]
    assert _fmax(nodes) == 2
    assert fusion_alloc_deps(nodes) == [(x, s)]


def test_a_weight_narrower_than_the_row_breaks_the_norm():
    # ggml_metal_fusion_check_norm: the weight must have the norm input's row width (a [1] scalar broadcast does not)
    ctx = _ctx()
    n = rms_norm(ctx, _x(ctx))
    m = mul(ctx, n, weight(ctx, (1,), "s"))
    nodes = _nodes(m)
    assert _fmax(nodes) == 1
    assert len(fusion_alloc_deps(nodes)) == 2  # the raw op sequence still matches: the alloc deps run no checks


def test_a_second_use_of_the_intermediate_breaks_the_pattern():
    ctx = _ctx()
    x = _x(ctx)
    n = rms_norm(ctx, x)
    m = mul(ctx, n)
    other = scale(ctx, n)  # n is used twice: ggml_can_fuse_subgraph_ext sees 1 use inside, 2 in the graph
    nodes = _nodes(m, other)
    assert _ops(nodes) == ["RMS_NORM", "MUL", "SCALE"]
    assert _fmax(nodes) == 1
    # the raw sequence RMS_NORM, MUL still matches ops_rms_norm_mul: its sources live until the MUL
    assert fusion_alloc_deps(nodes) == [(x, m), (m.src[1], m)]


def test_a_second_use_inside_the_pattern_is_elided():
    # n read by the MUL and by the ADD: both uses are inside RMS_NORM, MUL, ADD, so NORM_MUL_ADD fuses
    # (ggml_can_fuse_subgraph_ext counts the uses within the subgraph; check_norm takes n as the ADD's row-wide addend)
    ctx = _ctx()
    n = rms_norm(ctx, _x(ctx))
    nodes = _nodes(add(ctx, mul(ctx, n), n))
    assert _fmax(nodes) == 3


def test_an_output_intermediate_breaks_the_pattern():
    ctx = _ctx()
    n = rms_norm(ctx, _x(ctx))
    n.flags |= FLAG_OUTPUT
    nodes = _nodes(mul(ctx, n))
    assert _fmax(nodes) == 1
    n.flags = 0
    assert _fmax(nodes) == 2


# --- ADD chains ---------------------------------------------------------------------------------


def _add_chain(ctx: Context, n: int, ne: tuple[int, ...] = (E, T)) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """x + a1 + ... + an: (x, the addends, the ADDs)."""
    x = _x(ctx, "x", ne)
    cur, addends, adds = x, [], []
    for i in range(n):
        a = _x(ctx, f"a{i}", ne)
        cur = add(ctx, cur, a)
        addends.append(a)
        adds.append(cur)
    return x, addends, adds


@pytest.mark.parametrize("n", [2, 7])
def test_add_chain(n: int):
    ctx = _ctx()
    x, addends, adds = _add_chain(ctx, n)
    nodes = _nodes(adds[-1])
    assert _fmax(nodes) == n
    assert fusion_alloc_deps(nodes) == [(x, adds[-1])] + [(a, adds[-1]) for a in addends]


def test_an_eighth_add_does_not_join():
    ctx = _ctx()
    x, addends, adds = _add_chain(ctx, 8)
    nodes = _nodes(adds[-1])
    assert _fmax(nodes, 0) == 7  # ops_add_7 is the longest chain; the 8th ADD alone starts no pattern
    assert _fmax(nodes, 7) == 1
    # the alloc deps take the first 7 and resume at the 8th, which matches nothing alone
    assert fusion_alloc_deps(nodes) == [(x, adds[6])] + [(a, adds[6]) for a in addends[:7]]


def test_nine_adds_chain_two_patterns():
    # ggml_metal_fusion_max chains patterns back to back: ADD x7 then ADD x2
    ctx = _ctx()
    x, addends, adds = _add_chain(ctx, 9)
    nodes = _nodes(adds[-1])
    assert _fmax(nodes) == 9
    assert fusion_alloc_deps(nodes) == ([(x, adds[6])] + [(a, adds[6]) for a in addends[:7]]
                                        + [(adds[6], adds[8]), (addends[7], adds[8]), (addends[8], adds[8])])


def test_addends_of_another_layout_break_the_chain():
    # ggml_metal_fusion_check_add_chain: every addend has the previous one's layout (type, ne, nb)
    ctx = _ctx()
    x = _x(ctx)
    a1 = add(ctx, x, _x(ctx, "a1"))
    a2 = add(ctx, a1, _x(ctx, "a2", (E, 1)))  # a broadcast row
    assert _fmax(_nodes(a2)) == 1


def test_a_shape_mismatch_breaks_the_chain():
    # the second ADD reads the first as its broadcast src1: ggml_are_same_shape(nodes[1], nodes[0]) fails
    ctx = _ctx()
    a1 = add(ctx, _x(ctx), _x(ctx, "a1"))
    a2 = add(ctx, _x(ctx, "big", (E, T, 2)), a1)
    nodes = _nodes(a2)
    assert _ops(nodes) == ["ADD", "ADD"]
    assert _fmax(nodes) == 1


# --- chained patterns, views inside a span, the cap of 16 ------------------------------------------


def test_rms_norm_mul_then_an_add_chain():
    # addends one column wide fail check_norm's width rule, so NORM_MUL (2) is followed by ADD x3
    ctx = _ctx()
    m = mul(ctx, rms_norm(ctx, _x(ctx)))
    cur = m
    for i in range(3):
        cur = add(ctx, cur, _x(ctx, f"b{i}", (1, T)))
    nodes = _nodes(cur)
    assert _ops(nodes) == ["RMS_NORM", "MUL", "ADD", "ADD", "ADD"]
    assert _fmax(nodes) == 5
    assert _fmax(nodes, 1) == 1  # MUL, ADD...: no pattern starts with MUL ADD but the MoE reduce (not this)
    assert _fmax(nodes, 2) == 3


def test_views_inside_a_span_are_packed_along():
    # the addends are views of an input: graph nodes of their own, between the ADDs
    ctx = _ctx()
    big = _x(ctx, "big", (4, T))
    m = mul(ctx, rms_norm(ctx, _x(ctx)))
    a1 = add(ctx, m, view(ctx, big, (1, T), (big.nb[1],)))
    a2 = add(ctx, a1, view(ctx, big, (1, T), (big.nb[1],)))
    nodes = _nodes(a2)
    assert _ops(nodes) == ["RMS_NORM", "MUL", "VIEW", "ADD", "VIEW", "ADD"]
    # matching runs on RMS_NORM, MUL, ADD, ADD (NORM_MUL, then ADD x2); the span runs to the last ADD: 6 raw nodes
    assert _fmax(nodes, 0) == 6
    assert _fmax(nodes, 2) == 1  # a view starts no pattern
    # the alloc deps match raw sequences: RMS_NORM, MUL only (a VIEW sits between the ADDs)
    assert fusion_alloc_deps(nodes) == [(m.src[0].src[0], m), (m.src[1], m)]


def test_the_span_is_capped_at_16():
    # NORM_MUL_ADD (3) + ADD x7 (10) + ADD x6 (16: only 16 non-empty nodes are looked at)
    ctx = _ctx()
    cur = add(ctx, mul(ctx, rms_norm(ctx, _x(ctx))))
    for i in range(20):
        cur = add(ctx, cur, _x(ctx, f"b{i}"))
    nodes = _nodes(cur)
    assert _fmax(nodes) == 16
    assert _fmax(nodes, 16) == 7  # the last 7 ADDs


# --- snake (ggfit builds no SIN: the table's check on hand-made nodes) ------------------------------------


@pytest.mark.parametrize(("a_ne", "n"), [((1, 4), 5), ((16, 4), 1)])
def test_snake(a_ne: tuple[int, ...], n: int):
    # x + inv_b * sin(a * x)^2 with a, inv_b one value per channel (ne1); a full-size `a` is not the kernel's
    ctx = _ctx()
    x, a, inv_b = _x(ctx, "x", (16, 4)), _x(ctx, "a", a_ne), _x(ctx, "inv_b", a_ne)
    mul1 = mul(ctx, sqr(ctx, new_tensor(ctx, "SIN", F32, (16, 4), (mul(ctx, x, a),))), inv_b)
    out = add(ctx, mul1, x)
    nodes = _nodes(out)
    assert _ops(nodes) == ["MUL", "SIN", "SQR", "MUL", "ADD"]
    assert _fmax(nodes) == n
    assert fusion_alloc_deps(nodes) == [(x, out), (a, out), (inv_b, out)]


# --- SSM_CONV + silu, GATED_DELTA_NET + CPY (qwen35's graph) ----------------------------------------


def test_ssm_conv_silu():
    ctx = _ctx()
    conv = new_tensor(ctx, "SSM_CONV", F32, (E, T, 1), (_x(ctx, "c", (T + 3, E, 1)),))
    nodes = _nodes(unary(ctx, conv, "", "silu"))
    assert _fmax(nodes) == 2
    ctx = _ctx()
    conv = new_tensor(ctx, "SSM_CONV", F32, (E, T, 1), (_x(ctx, "c", (T + 3, E, 1)),))
    nodes = _nodes(unary(ctx, conv, "", "sigmoid"))
    assert _fmax(nodes) == 1  # GGML_UNARY_OP_SILU only


@lru_cache(maxsize=None)
def _model_graph(arch: str, mtp: bool = False) -> tuple[list[Tensor], dict[int, int]]:
    """The whole graph of a synthetic model as a GPU backend sees it (weights as sources), one split. mtp: with an MTP
    head and -draft-mtp (3 drafts): the recurrent layers keep 4 state snapshots (n_rs_seq)."""
    spec = load_model_spec(str(build(arch, **({"n_nextn": 1} if mtp else {}))))[1]
    extra = dict(spec_type="draft-mtp", draft_n_max=3) if mtp else {}
    cp = resolve_context(spec, RunConfig(n_ctx=4096, n_ubatch=64, **extra), Frontend.LIBRARY)
    assert cp.n_rs_seq == (3 if mtp else 0)
    c = GraphContext(spec, cp, default_details(spec))
    c.ctx0.weights = True
    m = model_of(spec.architecture)
    assert m is not None
    gen = m.build_graph(c)
    x = next(gen)
    for il in range(spec.n_layer):
        c.ctx0.layer = il
        x = gen.send((il, x))
    c.ctx0.layer = None
    with pytest.raises(StopIteration):
        gen.send((None, x))
    return c.g.nodes, _uses(c.g.nodes)


def _first(nodes: list[Tensor], op: str) -> int:
    return next(i for i, n in enumerate(nodes) if n.op == op)


def test_qwen35_ssm_conv_silu_then_the_l2_norms():
    nodes, uses = _model_graph("qwen35")
    i = _first(nodes, "SSM_CONV")
    assert nodes[i + 1].uop == "silu"  # qwen35's builder names the activation
    # SSM_CONV_SILU (2), then RMS_NORM + SCALE of q, then of k, each behind its VIEW of the conv output
    assert _ops(nodes[i:i + 8]) == ["SSM_CONV", "UNARY", "VIEW", "RMS_NORM", "SCALE", "VIEW", "RMS_NORM", "SCALE"]
    assert fusion_max(nodes, i, uses) == 8
    assert fusion_max(nodes, i + 1, uses) == 1  # the UNARY alone starts nothing


@pytest.mark.parametrize("mtp", [False, True])
def test_qwen35_gated_delta_net_cache_copy(mtp: bool):
    nodes, uses = _model_graph("qwen35", mtp)
    i = _first(nodes, "GATED_DELTA_NET")
    # the cache view the CPY writes: [S_v*S_v*H, n_seqs, min(n_tokens, K), 1], K = n_rs_seq + 1 snapshots
    assert nodes[i + 3].src[1].ne == [1024, 1, 4 if mtp else 1, 1]
    # GDN_CACHE: the CPY of the state snapshot (a view of the GDN) into the recurrent cache, two views between;
    # then the output view's RMS_NORM + MUL (ssm_norm)
    assert _ops(nodes[i:i + 7]) == ["GATED_DELTA_NET", "VIEW", "VIEW", "CPY", "VIEW", "RMS_NORM", "MUL"]
    assert fusion_max(nodes, i, uses) == 7
    gdn, cp = nodes[i], nodes[i + 3]
    if mtp:  # K is read back from the GDN's shape: with 2 snapshots the 4-row cache view is not min(n_tokens, K)
        ne1 = gdn.ne[1]
        gdn.ne[1] = ne1 - 2 * 16  # S_v = 16, one sequence
        try:
            assert fusion_max(nodes, i, uses) == 1
        finally:
            gdn.ne[1] = ne1
    # an output GDN may not fuse (the kernel skips the snapshot tail); the RMS_NORM + MUL after it still packs alone
    gdn.flags |= FLAG_OUTPUT
    try:
        assert fusion_max(nodes, i, uses) == 1
    finally:
        gdn.flags = 0
    # the alloc deps: GATED_DELTA_NET, CPY is no raw sequence (views between), nothing from here to the norm
    deps = fusion_alloc_deps(nodes[i:i + 7])
    assert deps == [(nodes[i + 5].src[0], nodes[i + 6]), (nodes[i + 6].src[1], nodes[i + 6])]
    assert cp.src[0].vs is gdn


def test_gated_delta_net_cache_copy_back_to_back():
    # GATED_DELTA_NET then directly its CPY (the raw pattern): the alloc deps keep its sources until the CPY
    nodes, _ = _model_graph("qwen35")
    i = _first(nodes, "GATED_DELTA_NET")
    gdn, cp = nodes[i], nodes[i + 3]
    seq = [gdn, cp]
    assert fusion_max(seq, 0, _uses(nodes)) == 2
    assert fusion_alloc_deps(seq) == [(s, cp) for s in gdn.src] + [(cp.src[0], cp), (cp.src[1], cp)]


# --- MoE: top-k routing, the weighted reduce (build_moe_ffn) ---------------------------------------------


@lru_cache(maxsize=None)
def _moe(n_used: int, w_scale: float = 0.0, norm_w: bool = True) -> tuple[list[Tensor], Tensor, Tensor]:
    """A qwen3moe MoE FFN (8 experts, n_used of them) from ggfit's build_moe_ffn: (nodes, input, output)."""
    spec = load_model_spec(str(build("qwen3moe")))[1]
    cp = resolve_context(spec, RunConfig(n_ctx=4096, n_ubatch=T), Frontend.LIBRARY)
    c = GraphContext(spec, cp, default_details(spec))
    c.ctx0.weights = True
    x = inp(c.ctx0, F32, (spec.n_embd, c.n_tokens), "x")
    layer = spec.layers[0].model_copy(update={"n_expert_used": n_used})
    out = c.build_moe_ffn(x, layer, 0, gating=1, norm_w=norm_w, w_scale=w_scale)
    c.g.expand(out)
    return c.g.nodes, x, out


TOPK_NORM = ["SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"]


def test_topk_moe_with_weight_norm():
    nodes, _, _ = _moe(4)
    i = _first(nodes, "SOFT_MAX")
    assert _ops(nodes[i:i + 10]) == TOPK_NORM
    # ops_topk_moe_norm: 6 non-empty nodes; the span ends at the DIV (its trailing RESHAPE is checked, not packed)
    assert fusion_max(nodes, i, _uses(nodes)) == 9


def test_topk_moe_with_weight_norm_and_scale():
    nodes, _, _ = _moe(4, w_scale=2.5)
    i = _first(nodes, "SOFT_MAX")
    assert _ops(nodes[i:i + 11]) == TOPK_NORM + ["SCALE"]
    assert fusion_max(nodes, i, _uses(nodes)) == 11


@pytest.mark.parametrize(("w_scale", "n"), [(0.0, 5), (2.5, 6)])
def test_topk_moe_without_norm(w_scale: float, n: int):
    nodes, _, _ = _moe(4, w_scale=w_scale, norm_w=False)
    i = _first(nodes, "SOFT_MAX")
    assert fusion_max(nodes, i, _uses(nodes)) == n  # ops_topk_moe (5 raw) / ops_topk_moe_scale (6 raw)


def test_topk_moe_alloc_deps():
    nodes, _, _ = _moe(4)
    i = _first(nodes, "SOFT_MAX")
    logits = nodes[i].src[0]
    deps = fusion_alloc_deps(nodes[i:i + 10])
    # only the logits come from outside; everything lives until the trailing RESHAPE (the raw pattern's last node)
    assert deps == [(logits, nodes[i + 9])]


@pytest.mark.parametrize("n_used", range(2, 9))
def test_moe_reduce(n_used: int):
    nodes, _, out = _moe(n_used)
    uses = _uses(nodes)
    i = _first(nodes, "MUL")  # ffn_moe_weighted: the experts' outputs times their router weights
    assert nodes[-1] is out
    assert _ops(nodes[i:]) == ["MUL"] + ["VIEW"] * n_used + ["ADD"] * (n_used - 1)
    assert fusion_max(nodes, i, uses) == 2 * n_used  # ops_moe_reduce_<n_used>: the whole tail
    mul_ = nodes[i]
    experts, weights = mul_.src[0], mul_.src[1]
    assert experts.op == "MUL_MAT_ID"
    # the experts and the router weights live until the last ADD; the views and ADDs read only pattern nodes
    assert fusion_alloc_deps(nodes[i:]) == [(experts, out), (weights, out)]


def test_moe_reduce_broken_by_a_second_use_of_a_view():
    nodes, _, out = _moe(3)
    uses = _uses(nodes)
    i = _first(nodes, "MUL")
    uses[id(nodes[i + 2])] += 1  # a node outside the split reads the second expert's view
    assert fusion_max(nodes, i, uses) == 1
