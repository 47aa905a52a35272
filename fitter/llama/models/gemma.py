"""gemma2 and gemma3: src/models/gemma2.cpp, gemma3.cpp."""

from __future__ import annotations

from typing import Iterator

from fitter.ggml.tensor import Tensor, add, scale, unary
from fitter.gguf.constants import Keys
from fitter.llama.graph import GraphContext
from fitter.llama.hparams import ArchRules, Meta, ModelSpec, load_swa_pattern


def _gemma2_swa(m: Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_gemma2::load_arch_hparams: window defaults to 4096, pattern 2
    return m.uint(Keys.Attention.SLIDING_WINDOW, 4096), load_swa_pattern(m, 2, n_layer, n_layer_all)


def _gemma3_swa(m: Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_gemma3::load_arch_hparams: SWA only when the window key is present and > 0; pattern 6
    n_swa = m.uint(Keys.Attention.SLIDING_WINDOW, 0)
    if n_swa == 0:
        return 0, [False] * n_layer_all
    return n_swa, load_swa_pattern(m, 6, n_layer, n_layer_all)


ARCHS = {"gemma2": ArchRules(swa=_gemma2_swa), "gemma3": ArchRules(swa=_gemma3_swa)}



def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    if spec.architecture == "gemma3":
        return {"attn_q_norm": every, "attn_k_norm": every}, {}
    return {}, {"final_logit_softcapping": 30.0}


def build_graph(c: GraphContext) -> Iterator:
    """gemma2 and gemma3: src/models/gemma2.cpp, gemma3.cpp."""
    ctx0 = c.ctx0
    sp = c.spec
    gemma3 = c.arch == "gemma3"
    inpL = c.build_inp_embd()
    inpL = scale(ctx0, inpL, "inp_scaled")
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv_iswa() if sp.is_swa_any else c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    def layer(il: int, inpL: Tensor) -> Tensor:
        l = sp.layers[il]
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur)
        q, k = c.build_qk_rope(q, k, inp_pos, il, qk_norm=gemma3)
        q = scale(ctx0, q, f"Qcur_scaled-{il}")
        cur = c.build_attn(ai, q, k, v, il, softcap=not gemma3)
        cur, inpL = c.skip_unused_rows(il, out_ids, cur, inpL)
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        sa_out = add(ctx0, cur, inpL, f"sa_out-{il}")
        cur = c.build_norm(sa_out, name=f"ffn_norm-{il}")
        cur = c.build_ffn(cur, l.n_ff, act="gelu", il=il)
        cur = c.build_norm(cur, name=f"ffn_post_norm-{il}")
        return add(ctx0, cur, sa_out, f"l_out-{il}")

    inpL = yield from c.build_layers(inpL, layer)
    cur, logits = c.build_result(inpL)
    if not gemma3 or c.d.final_logit_softcapping:
        logits = scale(ctx0, logits)
        logits = unary(ctx0, logits)
        logits = scale(ctx0, logits, "result_output")
    c.finish(cur, logits)
