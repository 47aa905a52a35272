"""qwen35, qwen35moe, qwen3next: src/models/{qwen35,qwen35moe,qwen3next}.cpp and delta-net-base.cpp."""

from __future__ import annotations

from typing import Iterator

from fitter.errors import GGUFError
from fitter.ggml.tensor import (
    Tensor,
    add,
    cache,
    concat,
    cont,
    cont_nd,
    cpy,
    get_rows,
    l2_norm,
    mm,
    mul,
    new_tensor,
    op_weight,
    repeat_4d,
    reshape,
    rms_norm,
    rope,
    scale,
    srcs,
    transpose,
    unary,
    view,
)
from fitter.ggml.types import F32, TSIZE, row_size
from fitter.gguf.constants import Keys
from fitter.llama.graph import GraphContext
from fitter.llama.graph_blocks import build_mtp
from fitter.llama.hparams import RECURRENT_LAYERS_KEY, ArchRules, LayerKind, Meta, ModelSpec


def _gdn_recurrent(m: Meta, n_layer: int, n_layer_all: int) -> list[bool]:
    # llama_model_qwen35::load_arch_hparams (same in qwen35moe, qwen3next): recurrent_layers array,
    # else every layer but each full_attention_interval-th; NextN layers are never recurrent
    if m.has(RECURRENT_LAYERS_KEY):
        return [bool(x) for x in m.per_layer(RECURRENT_LAYERS_KEY, n_layer_all, 0)]
    interval = m.uint(Keys.LLM.FULL_ATTENTION_INTERVAL, 4)
    if interval == 0:
        raise GGUFError(0, f"'{m.key(Keys.LLM.FULL_ATTENTION_INTERVAL)}' is 0", m.src)
    return [i < n_layer and (i + 1) % interval != 0 for i in range(n_layer_all)]


_RULES = ArchRules(recurrent=_gdn_recurrent, ssm=True, hybrid_memory=True)
# llm_arch_supports_rs_rollback (src/llama-arch.cpp): qwen35 and qwen35moe, not qwen3next
_ROLLBACK = _RULES.model_copy(update={"rs_rollback": True})
ARCHS = {"qwen35": _ROLLBACK, "qwen35moe": _ROLLBACK, "qwen3next": _RULES}



def _build_qkvz(c: GraphContext, cur: Tensor, il: int) -> tuple[Tensor, Tensor]:
    """build_qkvz: the conv input (q, k, v mixed) and the output gate z."""
    ctx0 = c.ctx0
    ssm = c.spec.ssm
    assert ssm is not None  # ARCHS read the ssm.* keys
    n_seqs = c.n_seqs
    nst = c.n_tokens // n_seqs
    d_inner, hk, nkh, nvh = ssm.d_inner, ssm.d_state, ssm.n_group, ssm.dt_rank
    hv = d_inner // nvh
    conv_channels = d_inner + 2 * nkh * hk
    if c.arch == "qwen3next" and c.d.has("ssm_in", il):
        qkvz_dim = 2 * hk + 2 * hv * (nvh // nkh)
        mixed = mm(ctx0, nkh * qkvz_dim, cur, f"mixed_qkvz-{il}")
        mixed = reshape(ctx0, mixed, (qkvz_dim, nkh, nst, n_seqs))
        sizes = (hk, hk, hv * nvh // nkh, hv * nvh // nkh)
        nb = (mixed.nb[1], mixed.nb[2], mixed.nb[3])
        query = view(ctx0, mixed, (sizes[0], nkh, nst, n_seqs), nb)
        key = view(ctx0, mixed, (sizes[1], nkh, nst, n_seqs), nb)
        value = view(ctx0, mixed, (sizes[2], nkh, nst, n_seqs), nb)
        z = view(ctx0, mixed, (sizes[3], nkh, nst, n_seqs), nb)
        z = cont(ctx0, z, f"z-{il}")
        qf = cont_nd(ctx0, query, (hk * nkh, nst, n_seqs))
        kf = cont_nd(ctx0, key, (hk * nkh, nst, n_seqs))
        vf = cont_nd(ctx0, value, (hv * nvh, nst, n_seqs))
        qkv_mixed = concat(ctx0, concat(ctx0, qf, kf, 0), vf, 0, f"qkv_mixed-{il}")
    else:
        qkv_mixed = mm(ctx0, conv_channels, cur, f"qkv_mixed-{il}")
        qkv_mixed = reshape(ctx0, qkv_mixed, (qkv_mixed.ne[0], nst, n_seqs))
        z = mm(ctx0, d_inner, cur, f"z-{il}")
    return qkv_mixed, z


def _build_beta_gate(c: GraphContext, cur: Tensor, il: int) -> tuple[Tensor, Tensor]:
    """beta (sigmoid) and the decay gate (softplus(alpha + dt_bias) * a) of the delta net."""
    ctx0 = c.ctx0
    ssm = c.spec.ssm
    assert ssm is not None  # ARCHS read the ssm.* keys
    n_seqs = c.n_seqs
    nst = c.n_tokens // n_seqs
    nkh, nvh = ssm.n_group, ssm.dt_rank
    if c.arch == "qwen3next":
        ba = mm(ctx0, 2 * nvh, cur, f"mixed_ba-{il}")
        ba = reshape(ctx0, ba, (2 * nvh // nkh, nkh, nst, n_seqs))
        nb = (ba.nb[1], ba.nb[2], ba.nb[3])
        b = view(ctx0, ba, (nvh // nkh, nkh, nst, n_seqs), nb)
        a = view(ctx0, ba, (nvh // nkh, nkh, nst, n_seqs), nb)
        b = cont(ctx0, b)
        beta = unary(ctx0, b, f"beta-{il}")
        alpha = cont_nd(ctx0, a, (nvh, nst, n_seqs))
        alpha = unary(ctx0, add(ctx0, alpha, None), f"alpha_softplus-{il}")
        gate = mul(ctx0, alpha, None, f"gate-{il}")
        beta = reshape(ctx0, beta, (1, nvh, nst, n_seqs))
        gate = reshape(ctx0, gate, (1, nvh, nst, n_seqs))
    else:
        beta = mm(ctx0, nvh, cur, f"beta-{il}")
        beta = reshape(ctx0, beta, (1, nvh, nst, n_seqs))
        beta = unary(ctx0, beta, f"beta-{il}")
        alpha = mm(ctx0, nvh, cur, f"alpha-{il}")
        alpha = reshape(ctx0, alpha, (nvh, nst, n_seqs))
        alpha = unary(ctx0, add(ctx0, alpha, None), f"alpha_softplus-{il}")
        gate = mul(ctx0, alpha, None, f"gate-{il}")
        gate = reshape(ctx0, gate, (1, nvh, nst, n_seqs))
    return beta, gate


# long because build_layer_attn_linear (src/models/qwen35.cpp, 134 lines), node for node
def _gdn_layer(c: GraphContext, rs: dict, cur: Tensor, il: int) -> Tensor:
    """build_layer_attn_linear of qwen35 / qwen35moe / qwen3next (gated delta net, fused op)."""
    ctx0 = c.ctx0
    sp = c.spec
    ssm = sp.ssm
    assert ssm is not None  # ARCHS read the ssm.* keys
    g = c.g
    arch = c.arch
    n_seqs = c.n_seqs
    nst = c.n_tokens // n_seqs
    d_inner, hk, nkh, nvh = ssm.d_inner, ssm.d_state, ssm.n_group, ssm.dt_rank
    hv = d_inner // nvh
    conv_channels = d_inner + 2 * nkh * hk
    qkv_mixed, z = _build_qkvz(c, cur, il)
    beta, gate = _build_beta_gate(c, cur, il)
    conv_all = cache(ctx0, F32, (ssm.n_embd_r, rs["rows"]), f"cache_r_l{il}", ("rs", il, 0))
    ssm_all = cache(ctx0, F32, (ssm.n_embd_s, rs["rows"]), f"cache_s_l{il}", ("rs", il, 1))
    # build_conv_state
    conv_states = c.build_rs(rs, conv_all, ssm.n_embd_r)
    conv_states = reshape(ctx0, conv_states, (ssm.d_conv - 1, conv_channels, n_seqs))
    qkv_t = transpose(ctx0, qkv_mixed)
    conv_input = concat(ctx0, conv_states, qkv_t, 0, f"conv_input-{il}")
    K = c.cp.n_rs_seq + 1
    for _ in range(1, K + 1) if c.cp.n_rs_seq else (None,):
        last = view(ctx0, conv_input, (ssm.d_conv - 1, conv_channels, n_seqs), (conv_input.nb[1], conv_input.nb[2]), "conv_state_last")
        upd = view(ctx0, conv_all, (ssm.n_embd_r, n_seqs), (conv_all.nb[1],), "conv_state_update")
        g.expand(cpy(ctx0, last, upd))
    state = c.build_rs(rs, ssm_all, ssm.n_embd_s)
    state = reshape(ctx0, state, (hv, hv, nvh, n_seqs))
    conv_out = new_tensor(ctx0, "SSM_CONV", F32, (conv_channels, conv_input.ne[0] - ssm.d_conv + 1, conv_input.ne[2]),
                    srcs(conv_input, op_weight(ctx0, (ssm.d_conv, conv_channels), "ssm_conv1d", True)), f"conv_out-{il}")
    conv_out = unary(ctx0, conv_out, f"conv_out_silu-{il}", "silu")
    qkv_dim = hk * nkh * 2 + hv * nvh
    nb1 = row_size(F32, qkv_dim)
    q_conv = view(ctx0, conv_out, (hk, nkh, nst, n_seqs), (row_size(F32, hk), nb1, nb1 * nst), "q_conv")
    k_conv = view(ctx0, conv_out, (hk, nkh, nst, n_seqs), (row_size(F32, hk), nb1, nb1 * nst), "k_conv")
    v_conv = view(ctx0, conv_out, (hv, nvh, nst, n_seqs), (row_size(F32, hv), nb1, nb1 * nst), "v_conv")
    if c.build.has("gdn_l2_norm_rms_scale"):  # build_gdn_l2_norm (#28068)
        q_conv = scale(ctx0, rms_norm(ctx0, q_conv), f"q_conv-{il}")
        k_conv = scale(ctx0, rms_norm(ctx0, k_conv), f"k_conv-{il}")
    else:  # 0.3.35 qwen35.cpp: ggml_l2_norm
        q_conv = l2_norm(ctx0, q_conv, f"q_conv-{il}")
        k_conv = l2_norm(ctx0, k_conv, f"k_conv-{il}")
    if nkh != nvh:
        rf = nvh // nkh
        if arch == "qwen3next":
            qr = reshape(ctx0, q_conv, (hk, 1, nkh, nst * n_seqs))
            kr = reshape(ctx0, k_conv, (hk, 1, nkh, nst * n_seqs))
            q_conv = reshape(ctx0, repeat_4d(ctx0, qr, (hk, rf, nkh, nst * n_seqs)), (hk, nkh * rf, nst, n_seqs))
            k_conv = reshape(ctx0, repeat_4d(ctx0, kr, (hk, rf, nkh, nst * n_seqs)), (hk, nkh * rf, nst, n_seqs))
        # qwen35 / qwen35moe repeat only without the fused GDN ops (always fused: cparams.fused_gdn_*)
    # build_recurrent_attn -> build_delta_net_fused
    S_v, H_v = v_conv.ne[0], v_conv.ne[1]
    Kk = c.cp.n_rs_seq + 1 if c.cp.n_rs_seq else 1
    res = new_tensor(ctx0, "GATED_DELTA_NET", F32, (S_v * H_v, nst * n_seqs + Kk * S_v * n_seqs), (q_conv, k_conv, v_conv, gate, beta, state), f"gdn-{il}")
    rsz = lambda n: row_size(F32, n)
    output = view(ctx0, res, (S_v, H_v, nst, n_seqs), (rsz(S_v), rsz(S_v * H_v), rsz(S_v * H_v * nst)), "gdn_out")
    if not c.cp.n_rs_seq:
        new_state = view(ctx0, res, (S_v, S_v, H_v, n_seqs), (rsz(S_v), rsz(S_v * S_v), rsz(S_v * S_v * H_v)), "gdn_state")
        g.expand(cpy(ctx0, new_state, view(ctx0, ssm_all, (ssm.n_embd_s, n_seqs), (ssm_all.nb[1],), "ssm_dst")))
    else:
        D = S_v * S_v * H_v
        n_written = min(nst, Kk)
        src = view(ctx0, res, (D, n_seqs, n_written), (rsz(D), rsz(D * n_seqs)), "gdn_states")
        dst = view(ctx0, ssm_all, (D, n_seqs, n_written), (ssm_all.nb[1], ssm_all.nb[1] * rs["n_rs"]), "ssm_dst")
        g.expand(cpy(ctx0, src, dst))
    z_2d = reshape(ctx0, z, (hv, nvh, nst, n_seqs))
    normalized = c.build_norm(output, name=f"ssm_norm-{il}")
    gated = unary(ctx0, z_2d, f"z_silu-{il}")
    out = mul(ctx0, normalized, gated, f"attn_out_norm-{il}")
    out = reshape(ctx0, out, (hv * nvh, nst, n_seqs))
    cur = mm(ctx0, c.n_embd, out, f"ssm_out-{il}")
    return reshape(ctx0, cur, (c.n_embd, nst * n_seqs))


def _gated_attn_layer(c: GraphContext, ai: dict, cur: Tensor, inp_pos: Tensor, il: int) -> Tensor:
    """build_layer_attn of qwen35 / qwen35moe / qwen3next (Q with an output gate)."""
    ctx0 = c.ctx0
    l = c.spec.layers[il]
    hd, nh, nkv = l.n_embd_head_k, l.n_head, l.n_head_kv
    n_tokens = c.n_tokens
    q_full = mm(ctx0, hd * 2 * nh, cur, f"Qcur_full-{il}")
    k = mm(ctx0, hd * nkv, cur, f"Kcur-{il}")
    v = mm(ctx0, hd * nkv, cur, f"Vcur-{il}")
    es = TSIZE[F32]
    if c.arch == "qwen3next":
        q_full = reshape(ctx0, q_full, (hd * 2, nh, n_tokens, 1))
        nb = (q_full.nb[1], q_full.nb[2], q_full.nb[3])
        q = view(ctx0, q_full, (hd, nh, n_tokens, 1), nb, "Qcur")
        gate = view(ctx0, q_full, (hd, nh, n_tokens, 1), nb, "gate")
        k = reshape(ctx0, k, (hd, nkv, n_tokens))
        v = reshape(ctx0, v, (hd, nkv, n_tokens))
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
        q = rope(ctx0, q, inp_pos, None, f"Qcur-{il}")
        k = rope(ctx0, k, inp_pos, None, f"Kcur-{il}")
        cur = c.build_attn(ai, q, k, v, il, wo=0)
        gate = cont_nd(ctx0, gate, (hd * nh, n_tokens))
        gate = unary(ctx0, gate, f"gate_sigmoid-{il}")
        if not c.build.has("qwen3next_gate_no_reshape"):  # 0.3.34 qwen3next.cpp: ggml_reshape_2d of the gate
            gate = reshape(ctx0, gate, (hd * nh, n_tokens))
        cur = mul(ctx0, cur, gate)
    else:
        q = view(ctx0, q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "Qcur")
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        k = reshape(ctx0, k, (hd, nkv, n_tokens))
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
        gate = view(ctx0, q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "gate")
        gate = cont_nd(ctx0, gate, (hd * nh, n_tokens))
        v = reshape(ctx0, v, (hd, nkv, n_tokens))
        q = rope(ctx0, q, inp_pos, None, f"Qcur-{il}")
        k = rope(ctx0, k, inp_pos, None, f"Kcur-{il}")
        cur = c.build_attn(ai, q, k, v, il, wo=0)
        gate = unary(ctx0, gate, f"gate_sigmoid-{il}")
        cur = mul(ctx0, cur, gate)
    return mm(ctx0, c.n_embd, cur, f"attn_out-{il}")


def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    if spec.architecture in ("qwen35moe", "qwen3next"):
        return {"ffn_gate_inp_shexp": moe_layers}, {}
    return {}, {}


def build_graph(c: GraphContext) -> Iterator:
    """qwen35, qwen35moe, qwen3next: src/models/{qwen35,qwen35moe,qwen3next}.cpp + delta-net-base.cpp."""
    ctx0 = c.ctx0
    sp = c.spec
    inpL = c.build_inp_embd()
    rs, ai = c.build_inp_mem_hybrid()
    inp_pos = c.build_inp_pos(1 if c.arch == "qwen3next" else 4)
    out_ids = c.build_inp_out_ids()
    # the output rows are picked in the last layer, before its residual add, up to 0.3.23 (qwen35, qwen35moe) and
    # 0.3.34 (qwen3next); after the output norm since (0.3.25 / 0.3.35 src/models/*.cpp: !embeddings_*_masked)
    rows_in_layer = not c.build.has("out_ids_after_norm" if c.arch == "qwen3next" else "qwen35_out_ids_after_norm")

    def layer(il: int, inpL: Tensor) -> Tensor:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        c.g.expand(cur)
        if l.kind == LayerKind.RECURRENT:
            cur = _gdn_layer(c, rs, cur, il)
        else:
            cur = _gated_attn_layer(c, ai, cur, inp_pos, il)
        if rows_in_layer and il == sp.n_layer - 1:
            cur = get_rows(ctx0, cur, out_ids)
            inpSA = get_rows(ctx0, inpSA, out_ids)
        cur = add(ctx0, cur, inpSA, f"attn_residual-{il}")
        ffn_residual = cur
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        if sp.n_expert and l.n_ff_exp:
            moe_out = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
            if sp.n_ff_shexp:
                shexp = c.build_ffn(cur, sp.n_ff_shexp, il=il)
                sgate = unary(ctx0, mm(ctx0, 1, cur, f"shared_gate-{il}"))
                shexp = mul(ctx0, shexp, sgate)
                cur = add(ctx0, moe_out, shexp, f"ffn_out-{il}")
            else:
                cur = moe_out
        else:
            cur = c.build_ffn(cur, l.n_ff, il=il)
        return add(ctx0, cur, ffn_residual, f"l_out-{il}")

    inpL = yield from c.build_layers(inpL, layer)
    h = c.build_norm(inpL, name="result_norm")
    if rows_in_layer:  # no t_h_nextn: t_embd and t_logits are the outputs
        c.finish(h, mm(ctx0, sp.n_vocab, h, "result_output"))
        return
    cur = get_rows(ctx0, h, out_ids)
    logits = mm(ctx0, sp.n_vocab, cur, "result_output")
    c.finish(h, cur, logits)


def _mtp_layer(c: GraphContext, cur: Tensor, inpSA: Tensor, inp_pos: Tensor, ai: dict, out_ids: Tensor, il: int) -> Tensor:
    """The NextN layer of graph_mtp: gated attention and the dense or MoE FFN."""
    ctx0 = c.ctx0
    sp = c.spec
    arch = c.arch
    n_tokens = c.n_tokens
    l = sp.layers[il]
    hd, nh, nkv = l.n_embd_head_k, l.n_head, l.n_head_kv
    q_full = mm(ctx0, hd * 2 * nh, cur, f"Qcur_full-{il}")
    k = mm(ctx0, hd * nkv, cur, f"Kcur-{il}")
    v = mm(ctx0, hd * nkv, cur, f"Vcur-{il}")
    es = TSIZE[F32]
    q = view(ctx0, q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "Qcur")
    q = c.build_norm(q, name=f"Qcur_normed-{il}")
    if arch != "qwen3next":
        gate = view(ctx0, q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "gate")
        gate = cont_nd(ctx0, gate, (hd * nh, n_tokens), f"gate-{il}")
    k = reshape(ctx0, k, (hd, nkv, n_tokens))
    k = c.build_norm(k, name=f"Kcur_normed-{il}")
    v = reshape(ctx0, v, (hd, nkv, n_tokens))
    q = rope(ctx0, q, inp_pos, None, f"Qcur-{il}")
    k = rope(ctx0, k, inp_pos, None, f"Kcur-{il}")
    cur = c.build_attn(ai, q, k, v, il, wo=0)
    if arch == "qwen3next":
        gate = view(ctx0, q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "gate")
        gate = cont_nd(ctx0, gate, (hd * nh, n_tokens), f"gate-{il}")
    cur = mul(ctx0, cur, unary(ctx0, gate, f"gate_sigmoid-{il}"))
    cur = mm(ctx0, c.n_embd, cur, f"attn_out-{il}")
    if arch == "qwen3next":
        cur = get_rows(ctx0, cur, out_ids)
        inpSA = get_rows(ctx0, inpSA, out_ids)
    cur = add(ctx0, cur, inpSA, f"attn_residual-{il}")
    ffn_residual = cur
    cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
    if arch == "qwen35":
        cur = c.build_ffn(cur, l.n_ff, il=il)
    else:
        moe_out = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
        if sp.n_ff_shexp:
            shexp = c.build_ffn(cur, sp.n_ff_shexp, il=il)
            shexp = mul(ctx0, shexp, unary(ctx0, mm(ctx0, 1, cur, f"shared_gate-{il}")))
            cur = add(ctx0, moe_out, shexp, f"ffn_out-{il}")
        else:
            cur = moe_out
    return add(ctx0, cur, ffn_residual, f"l_out-{il}")


def build_graph_mtp(c: GraphContext) -> None:
    """graph_mtp of src/models/{qwen35,qwen35moe,qwen3next}.cpp."""
    arch = c.arch
    build_mtp(c, _mtp_layer, n_pos_per_embd=4 if arch in ("qwen35", "qwen35moe") else 1, gather_out=arch != "qwen3next")
