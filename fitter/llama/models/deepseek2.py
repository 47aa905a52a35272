"""deepseek2: src/models/deepseek2.cpp (graph and graph_mtp)."""

from __future__ import annotations

from typing import Iterator

from fitter.ggml.tensor import (
    Tensor,
    concat,
    cont,
    inp,
    mm,
    mul,
    permute,
    repeat_4d,
    reshape,
    rope,
    view,
)
from fitter.ggml.types import F32, row_size
from fitter.llama.graph import GraphContext
from fitter.llama.graph_blocks import build_moe_lead_dense_layers, build_mtp, build_mtp_moe_tail
from fitter.llama.hparams import ArchRules, ModelSpec

# LLAMA_EXPERT_GATING_FUNC_TYPE without the key: softmax (deepseek2.cpp load_arch_hparams, for V2 / V2.5
# files; its GLM 4.7 Lite exception, sigmoid for 47-48 layers and 154880 tokens, is not modelled)
_GATING = 1
ARCHS = {"deepseek2": ArchRules(mla=True)}



def _deepseek2_attn(c: GraphContext, cur: Tensor, inp_pos: Tensor, ai: dict, il: int, attn_scale: Tensor | None) -> Tensor:
    """The attention block of deepseek2's graph and graph_mtp (MLA with the absorbed K/V projections, or MHA)."""
    ctx0 = c.ctx0
    sp = c.spec
    d = c.d
    n_tokens = c.n_tokens
    l0 = sp.layers[0]
    n_head = l0.n_head
    kvr = sp.n_lora_kv
    if sp.is_mla:
        hk, hv = sp.n_embd_head_k_mla, sp.n_embd_head_v_mla
        n_rot = d.n_rot or (l0.n_embd_head_k - kvr)
    else:
        hk, hv = l0.n_embd_head_k, l0.n_embd_head_v
        n_rot = d.n_rot or 64
    nope = hk - n_rot
    if d.has("attn_q_a"):
        q = mm(ctx0, d.n_lora_q, cur, f"q_a-{il}")
        q = c.build_norm(q, name=f"q_a_norm-{il}")
        q = mm(ctx0, n_head * hk, q, f"q-{il}")
    else:  # V2-Lite: no q LoRA
        q = mm(ctx0, n_head * hk, cur, f"q-{il}")
    # 0.3.36 deepseek2.cpp reshapes q to {n_embd_head_k, n_head, n_tokens} first; 0.3.35's MLA path views the 2-d q
    if c.build.has("deepseek2_q_reshape") or not sp.is_mla:
        q = reshape(ctx0, q, (hk, n_head, n_tokens))
    q_nb = (row_size(q.type, hk), row_size(q.type, hk) * n_head)  # the views' strides (before: on the 2-d q)
    kv_pe = mm(ctx0, kvr + n_rot, cur, f"kv_cmpr_pe-{il}")
    rs = row_size(kv_pe.type, kvr + n_rot)
    kv_cmpr = view(ctx0, kv_pe, (kvr, n_tokens), (rs,), f"kv_cmpr-{il}")
    k_pe = view(ctx0, kv_pe, (n_rot, 1, n_tokens), (rs, rs), f"k_pe-{il}")
    k_pe = rope(ctx0, k_pe, inp_pos, None, f"k_pe-{il}")
    kv_cmpr = c.build_norm(kv_cmpr, name=f"kv_cmpr_norm-{il}")
    if sp.is_mla:
        q_nope = view(ctx0, q, (nope, n_head, n_tokens), q_nb, f"q_nope-{il}")
        q_pe = view(ctx0, q, (n_rot, n_head, n_tokens), q_nb, f"q_pe-{il}")
        q_pe = rope(ctx0, q_pe, inp_pos, None, f"q_pe-{il}")
        q_nope = permute(ctx0, q_nope, 0, 2, 1, 3)
        q_abs = mm(ctx0, kvr, q_nope, f"q_nope_absorbed-{il}", wne=(nope, kvr, n_head))
        q_abs = permute(ctx0, q_abs, 0, 2, 1, 3)
        Qcur = concat(ctx0, q_abs, q_pe, 0, f"Qcur-{il}")
        kv_cmpr = reshape(ctx0, kv_cmpr, (kvr, 1, n_tokens))
        Kcur = concat(ctx0, kv_cmpr, k_pe, 0, f"Kcur-{il}")
        Vcur = kv_cmpr
        if attn_scale is not None:
            Qcur = mul(ctx0, Qcur, attn_scale)
        return c.build_attn(ai, Qcur, Kcur, Vcur, il, v_mla=hv)
    kv = mm(ctx0, n_head * (nope + hv), kv_cmpr, f"kv-{il}")
    rsk = row_size(kv.type, nope + hv)
    k_nope = view(ctx0, kv, (nope, n_head, n_tokens), (rsk, rsk * n_head), f"k_nope-{il}")
    Vcur = view(ctx0, kv, (hv, n_head, n_tokens), (rsk, rsk * n_head), f"Vcur-{il}")
    Vcur = cont(ctx0, Vcur, f"Vcur-{il}")
    Qcur = rope(ctx0, q, inp_pos, None, f"Qcur-{il}")
    Kcur = concat(ctx0, k_nope, repeat_4d(ctx0, k_pe, (n_rot, n_head, n_tokens, 1)), 0, f"Kcur-{il}")
    if attn_scale is not None:
        Qcur = mul(ctx0, Qcur, attn_scale)
    return c.build_attn(ai, Qcur, Kcur, Vcur, il)


def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    kw: dict = dict(expert_gating_func=2, expert_weights_norm=True, expert_weights_scale=2.5,
                    n_expert_groups=8, n_group_used=4, n_lora_q=1536)
    if spec.is_mla:
        kw["n_rot"] = spec.layers[0].n_embd_head_k - spec.n_lora_kv
    return {"exp_probs_b.bias": moe_layers, "attn_q_a": every}, kw


def build_graph(c: GraphContext) -> Iterator:
    """deepseek2: src/models/deepseek2.cpp (MLA with the absorbed K/V projections, or legacy MHA)."""
    ctx0 = c.ctx0
    d = c.d
    inpL = c.build_inp_embd()
    attn_scale = inp(ctx0, F32, (1, 1, c.n_tokens), "inp_attn_scale") if d.attn_temperature_scale else None
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_k() if c.v_less else c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    yield from build_moe_lead_dense_layers(
        c, inpL, out_ids, lambda cur, il: _deepseek2_attn(c, cur, inp_pos, ai, il, attn_scale), "ffn_norm", _GATING)


def _mtp_layer(c: GraphContext, cur: Tensor, inpSA: Tensor, inp_pos: Tensor, ai: dict, out_ids: Tensor, il: int) -> Tensor:
    cur = _deepseek2_attn(c, cur, inp_pos, ai, il, None)
    return build_mtp_moe_tail(c, cur, inpSA, il, _GATING)


def build_graph_mtp(c: GraphContext) -> None:
    """graph_mtp of src/models/deepseek2.cpp (MLA: the K-only cache input)."""
    build_mtp(c, _mtp_layer, k_only=c.v_less)
