"""gpt-oss: src/models/openai-moe.cpp."""

from __future__ import annotations

from typing import Iterator

from fitter.ggml.tensor import Tensor, add, get_rows, mm
from fitter.gguf.constants import Keys
from fitter.llama.graph import GraphContext
from fitter.llama.hparams import ArchRules, Meta, ModelSpec, load_swa_pattern


def _gpt_oss_swa(m: Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_openai_moe::load_arch_hparams: required window, pattern 2
    return m.uint(Keys.Attention.SLIDING_WINDOW, required=True), load_swa_pattern(m, 2, n_layer, n_layer_all)


# load_tensors never duplicates token_embd as the output
ARCHS = {"gpt-oss": ArchRules(swa=_gpt_oss_swa, tied_output=False)}



def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    lt = {"attn_q.bias": every, "attn_k.bias": every, "attn_v.bias": every, "attn_output.bias": every,
          "ffn_gate_inp.bias": every, "ffn_up_exps.bias": every, "ffn_gate_exps.bias": every, "ffn_down_exps.bias": every}
    return lt, {"expert_gating_func": 3}


def build_graph(c: GraphContext) -> Iterator:
    """gpt-oss: src/models/openai-moe.cpp (iSWA, attention sinks, biased experts)."""
    ctx0 = c.ctx0
    sp = c.spec
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv_iswa() if sp.is_swa_any else c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    # up to 0.3.34 the output rows are picked in the last layer, before its residual add (openai-moe.cpp)
    rows_in_layer = not c.build.has("out_ids_after_norm")

    def layer(il: int, inpL: Tensor) -> Tensor:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur, bias=c.d.has("attn_q.bias", il))
        q, k = c.build_qk_rope(q, k, inp_pos, il)
        cur = c.build_attn(ai, q, k, v, il, wo_b=c.d.has("attn_output.bias", il), sinks=True)
        if rows_in_layer and il == sp.n_layer - 1:
            cur = get_rows(ctx0, cur, out_ids)
            inpSA = get_rows(ctx0, inpSA, out_ids)
        ffn_inp = add(ctx0, cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"attn_post_norm-{il}")
        cur = c.build_moe_ffn(cur, l, il, gating=3, norm_w=False, w_scale=c.d.expert_weights_scale, gate_inp_b=True,
                              exps_b=True, act="swiglu_oai")
        return add(ctx0, cur, ffn_inp, f"l_out-{il}")

    inpL = yield from c.build_layers(inpL, layer)
    if rows_in_layer:  # t_embd and t_logits are the outputs
        cur = c.build_norm(inpL, name="result_norm")
        c.finish(cur, mm(ctx0, sp.n_vocab, cur, "result_output"))
        return
    h_nextn = inpL
    cur = get_rows(ctx0, inpL, out_ids)
    cur = c.build_norm(cur, name="result_norm")
    logits = mm(ctx0, sp.n_vocab, cur, "result_output")
    c.finish(h_nextn, cur, logits)
