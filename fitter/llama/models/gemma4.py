"""gemma4: src/models/gemma4.cpp."""

from __future__ import annotations

from fitter.errors import GGUFError
from fitter.ggml.tensor import (
    Tensor,
    add,
    cont,
    get_rows,
    inp,
    mm,
    mul,
    permute,
    reshape,
    rms_norm,
    rope,
    scale,
    unary,
    view,
    weight,
)
from fitter.ggml.types import F32, I32, row_size
from fitter.gguf.constants import Keys
from fitter.llama.graph import GraphContext, GraphGen
from fitter.llama.hparams import ArchRules, Meta, ModelSpec


def _gemma4_swa(m: Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_gemma4::load_arch_hparams: the pattern is a required bool array
    v = m.get(Keys.Attention.SLIDING_WINDOW_PATTERN, required=True)
    if not isinstance(v, list):
        raise GGUFError(0, f"'{m.key(Keys.Attention.SLIDING_WINDOW_PATTERN)}' must be an array for gemma4", m.src)
    return m.uint(Keys.Attention.SLIDING_WINDOW, required=True), [bool(x) for x in v] + [False] * (n_layer_all - len(v))


def _gemma4_kv_from_start(m: Meta, n_layer_all: int) -> int:
    # llama_model_gemma4::load_arch_hparams: the last shared_kv_layers layers reuse earlier KV
    return n_layer_all - m.uint(Keys.Attention.SHARED_KV_LAYERS, 0)


ARCHS = {"gemma4": ArchRules(swa=_gemma4_swa, kv_from_start=_gemma4_kv_from_start, output_before_tok_embd=True,
                             per_layer_globals_full_only=True)}



def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    kw: dict = {}
    if any(not l.has_kv for l in spec.layers):  # E2B / E4B: shared-KV layers and per-layer embeddings
        kw["n_embd_per_layer"] = 256
    kw["final_logit_softcapping"] = 30.0
    return {"attn_v": every, "layer_output_scale": every}, kw


def _build_inp_per_layer(c: GraphContext, inpL: Tensor) -> Tensor:
    """gemma4's per-layer embeddings (E2B / E4B): token rows plus a projection of the input, normed."""
    ctx0 = c.ctx0
    sp = c.spec
    n_tokens = c.n_tokens
    n_layer = sp.n_layer
    ple = c.d.n_embd_per_layer
    tokens = inp(ctx0, I32, (n_tokens,), "inp_tokens_ple")
    x = get_rows(ctx0, weight(ctx0, (ple * n_layer, sp.n_vocab), "per_layer_token_embd", host=True), tokens, "inp_per_layer")
    x = reshape(ctx0, x, (ple, n_layer, n_tokens))
    x = scale(ctx0, x, "inp_per_layer_scaled")
    c.g.expand(x)
    proj = mm(ctx0, ple * n_layer, inpL, "per_layer_proj")
    proj = scale(ctx0, proj)
    proj = reshape(ctx0, proj, (ple, n_layer, n_tokens))
    proj = c.build_norm(proj, name="per_layer_proj_norm")
    x = add(ctx0, proj, x)
    x = scale(ctx0, x)
    return cont(ctx0, permute(ctx0, x, 0, 2, 1, 3), "inp_per_layer")


def _build_ffn_dense_and_moe(c: GraphContext, attn_out: Tensor, il: int) -> Tensor:
    """A gemma4 MoE layer's FFN: the dense MLP plus the routed experts, each with its own norms."""
    ctx0 = c.ctx0
    sp = c.spec
    d = c.d
    l = sp.layers[il]
    mlp = c.build_norm(attn_out, name=f"ffn_norm-{il}")
    mlp = c.build_ffn(mlp, l.n_ff, act="gelu", il=il)
    mlp = c.build_norm(mlp, name=f"ffn_post_norm_1-{il}")
    moe = c.build_norm(attn_out, name=f"ffn_pre_norm_2-{il}")
    tmp = rms_norm(ctx0, attn_out)
    tmp = scale(ctx0, tmp)
    tmp = mul(ctx0, tmp, None)
    logits = mm(ctx0, sp.n_expert, tmp, f"ffn_moe_logits-{il}")
    moe = c.build_moe_ffn(moe, l, il, gating=1, norm_w=True, w_scale=1.0, act="gelu",
                          gate_up=d.has("ffn_gate_up_exps", il) and not d.has("ffn_up_exps", il), probs_in=logits)
    moe = c.build_norm(moe, name=f"ffn_post_norm_2-{il}")
    return add(ctx0, mlp, moe, f"ffn_out-{il}")


# long because llama_model_gemma4::graph::graph (src/models/gemma4.cpp), node for node
def build_graph(c: GraphContext) -> GraphGen:
    """gemma4: src/models/gemma4.cpp (per-layer heads, shared-KV layers, per-layer embeddings, MoE)."""
    ctx0 = c.ctx0
    sp = c.spec
    d = c.d
    n_tokens = c.n_tokens
    ple = d.n_embd_per_layer
    inpL = c.build_inp_embd()
    inpL = scale(ctx0, inpL, "inp_scaled")
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv_iswa()
    out_ids = c.build_inp_out_ids()
    inp_per_layer = _build_inp_per_layer(c, inpL) if ple else None
    # up to 0.3.25 the output rows are picked in the last layer: after attention, and in its per-layer input
    rows_in_layer = not c.build.has("gemma4_out_ids_after_norm")
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see fitter.llama.context
    while il is not None:
        last = rows_in_layer and il == sp.n_layer - 1
        l = sp.layers[il]
        hd, nh, nkv = l.n_embd_head_k, l.n_head, l.n_head_kv
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        fused = d.has("attn_qkv", il)
        if fused:
            qkv = mm(ctx0, hd * nh + 2 * hd * nkv, cur, f"wqkv-{il}")
            q = cont(ctx0, view(ctx0, qkv, (hd * nh, n_tokens), (qkv.nb[1],)))
        else:
            q = mm(ctx0, hd * nh, cur, f"Qcur-{il}")
        q = reshape(ctx0, q, (hd, nh, n_tokens))
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        q = rope(ctx0, q, inp_pos, None, f"Qcur-{il}")
        if l.has_kv:
            if fused:
                k = cont(ctx0, view(ctx0, qkv, (hd * nkv, n_tokens), (qkv.nb[1],)))
                v = cont(ctx0, view(ctx0, qkv, (hd * nkv, n_tokens), (qkv.nb[1],)))
            else:
                k = mm(ctx0, hd * nkv, cur, f"Kcur-{il}")
                v = mm(ctx0, hd * nkv, cur, f"Vcur-{il}") if d.has("attn_v", il) else k
            k = reshape(ctx0, k, (hd, nkv, n_tokens))
            v = reshape(ctx0, v, (hd, nkv, n_tokens))
            k = c.build_norm(k, name=f"Kcur_normed-{il}")
            v = rms_norm(ctx0, v, f"Vcur_normed-{il}")
            k = rope(ctx0, k, inp_pos, None, f"Kcur-{il}")
            cur = c.build_attn(ai, q, k, v, il)
        else:
            cur = c.build_attn(ai, q, None, None, il)
        if last:
            cur = get_rows(ctx0, cur, out_ids)
            inpL = get_rows(ctx0, inpL, out_ids)
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        attn_out = add(ctx0, cur, inpL, f"attn_out-{il}")
        if d.has("ffn_gate_inp", il):
            cur = _build_ffn_dense_and_moe(c, attn_out, il)
        else:
            cur = c.build_norm(attn_out, name=f"ffn_norm-{il}")
            cur = c.build_ffn(cur, l.n_ff, act="gelu", il=il)
        cur = c.build_norm(cur, name=f"ffn_post_norm-{il}")
        cur = add(ctx0, cur, attn_out, f"ffn_residual-{il}")
        if inp_per_layer is not None:
            pe_in = cur
            cur = mm(ctx0, ple, cur, f"per_layer_inp_gate-{il}")
            cur = unary(ctx0, cur)
            this = view(ctx0, inp_per_layer, (inp_per_layer.ne[0], inp_per_layer.ne[1]), (row_size(F32, inp_per_layer.ne[0]),), f"inp_per_layer-{il}")
            if last:
                this = get_rows(ctx0, this, out_ids)
            cur = mul(ctx0, cur, this)
            cur = mm(ctx0, c.n_embd, cur, f"per_layer_proj-{il}")
            cur = c.build_norm(cur, name=f"per_layer_post_norm-{il}")
            cur = add(ctx0, pe_in, cur, f"ple_out-{il}")
        if d.has("layer_output_scale", il):
            cur = mul(ctx0, cur, None, f"out_scaled-{il}")
        il, inpL = yield cur
    h = c.build_norm(inpL, name="result_norm")
    cur = h if rows_in_layer else get_rows(ctx0, h, out_ids)
    logits = mm(ctx0, sp.n_vocab, cur, "result_output")
    if d.final_logit_softcapping:
        logits = scale(ctx0, logits)
        logits = unary(ctx0, logits)
        logits = scale(ctx0, logits, "result_output")
    c.finish(*((h, logits) if rows_in_layer else (h, cur, logits)))
