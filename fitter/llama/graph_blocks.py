"""Blocks several architectures share, over GraphContext's builders: routed experts beside shared ones, dense lead
layers before the MoE ones (deepseek2, glm4moe), the MTP (NextN) head's graph (deepseek2, glm4moe, qwen35)."""

from __future__ import annotations

from typing import Callable

from fitter.ggml.tensor import (
    Tensor,
    add,
    concat,
    get_rows,
    inp,
    mm,
    unary,
    weight,
)
from fitter.ggml.types import F32, I32
from fitter.llama.graph import GraphContext, GraphGen


def build_shared_expert(c: GraphContext, cur: Tensor, il: int) -> Tensor:
    """build_ffn over the shared expert (glm4moe, deepseek2: n_ff_exp * n_expert_shared wide)."""
    ctx0 = c.ctx0
    sp = c.spec
    n_ff = sp.layers[il].n_ff_exp * sp.n_expert_shared
    if n_ff == 0:  # build_ffn with no weights: silu(cur)
        return unary(ctx0, cur, f"ffn_silu-{il}")
    return c.build_ffn(cur, n_ff, il=il)


def build_routed_and_shared(c: GraphContext, cur: Tensor, il: int, default_gating: int) -> Tensor:
    """The MoE FFN of glm4moe and deepseek2 (graph and MTP): routed experts plus the shared expert."""
    ctx0 = c.ctx0
    routed = c.build_moe_ffn(cur, c.spec.layers[il], il, **c.moe_args_selected(il, default_gating))
    return add(ctx0, routed, build_shared_expert(c, cur, il), f"ffn_out-{il}")


def build_moe_lead_dense_layers(c: GraphContext, inpL: Tensor, out_ids: Tensor, attn: Callable[[Tensor, int], Tensor],
                                ffn_norm: str, default_gating: int) -> GraphGen:
    """The layer loop and output of glm4moe and deepseek2 (a generator the family's build_graph delegates to): the
    attention `attn(cur, il)`, then a dense FFN on the leading dense layers, routed + shared experts after."""
    ctx0 = c.ctx0
    sp = c.spec
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see fitter.llama.context
    while il is not None:
        l = sp.layers[il]
        inpSA = inpL
        cur = attn(c.build_norm(inpL, name=f"attn_norm-{il}"), il)
        cur, inpSA = c.skip_unused_rows(il, out_ids, cur, inpSA)
        ffn_inp = add(ctx0, cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"{ffn_norm}-{il}")
        if il < sp.n_layer_dense_lead:
            cur = c.build_ffn(cur, l.n_ff, il=il)
        else:
            cur = build_routed_and_shared(c, cur, il, default_gating)
        il, inpL = yield add(ctx0, cur, ffn_inp, f"l_out-{il}")
    cur, logits = c.build_result(inpL)
    c.finish(cur, logits)


def build_mtp(c: GraphContext, layer: Callable[..., Tensor], *, n_pos_per_embd: int = 1, k_only: bool = False,
              gather_out: bool = True) -> None:
    """The draft graph of an MTP context (LLM_GRAPH_TYPE_DECODER_MTP): one NextN block after the trunk.

    The part graph_mtp of src/models/{qwen35,qwen35moe,qwen3next,glm4-moe,deepseek2}.cpp share: the
    token embedding and the trunk's hidden state, normed, concatenated and projected (eh_proj), then
    `layer(c, cur, inpSA, inp_pos, ai, out_ids, il)` (the family's NextN layer), the output norm and
    the logits. Not a generator: the whole graph is one segment.
    """
    ctx0 = c.ctx0
    sp = c.spec
    n_tokens = c.n_tokens
    il = sp.n_layer
    tokens = inp(ctx0, I32, (n_tokens,), "inp_tokens")
    tok = get_rows(ctx0, weight(ctx0, (c.n_embd, sp.n_vocab), "token_embd", host=True), tokens, "mtp_tok_embd")
    h = inp(ctx0, F32, (c.n_embd, n_tokens), "mtp_h_input")
    inp_pos = c.build_inp_pos(n_pos_per_embd)
    out_ids = c.build_inp_out_ids()
    layers = [x.index for x in sp.layers if x.index >= sp.n_layer]
    if k_only:
        ai = c._attn_k_inputs(layers)
    else:
        ai = c.build_attn_inp_kv(layers)
    h_norm = c.build_norm(h, name=f"mtp_hnorm-{il}")
    e_norm = c.build_norm(tok, name=f"mtp_enorm-{il}")
    cur = concat(ctx0, e_norm, h_norm, 0, f"mtp_concat-{il}")
    cur = mm(ctx0, c.n_embd, cur, f"mtp_eh_proj-{il}")
    inpSA = cur
    cur = c.build_norm(cur, name=f"mtp_attn_norm-{il}")
    cur = layer(c, cur, inpSA, inp_pos, ai, out_ids, il)
    h_out = c.build_norm(cur, name="result_norm")
    cur = get_rows(ctx0, h_out, out_ids) if gather_out else h_out
    logits = mm(ctx0, sp.n_vocab, cur, "result_output")
    c.finish(h_out, logits)


def build_mtp_moe_tail(c: GraphContext, cur: Tensor, inpSA: Tensor, il: int, default_gating: int) -> Tensor:
    """The NextN layer of glm4moe and deepseek2 after its attention: residual, norm, routed + shared experts."""
    ctx0 = c.ctx0
    ffn_inp = add(ctx0, cur, inpSA, f"ffn_inp-{il}")
    cur = c.build_norm(ffn_inp, name=f"ffn_norm-{il}")
    cur = build_routed_and_shared(c, cur, il, default_gating)
    return add(ctx0, cur, ffn_inp, f"l_out-{il}")
