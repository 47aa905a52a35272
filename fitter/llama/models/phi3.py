"""phi3: src/models/phi3.cpp."""

from __future__ import annotations

from typing import Iterator

from fitter.ggml.tensor import Tensor, add, scale
from fitter.llama.graph import GraphContext
from fitter.llama.hparams import ArchRules

ARCHS = {"phi3": ArchRules()}  # llama_model_phi3: a sliding window in the file is ignored (SWA disabled)



def build_graph(c: GraphContext) -> Iterator:
    """phi3 (llama.cpp disables its sliding window): src/models/phi3.cpp."""
    ctx0 = c.ctx0
    sp = c.spec
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    def layer(il: int, inpL: Tensor) -> Tensor:
        l = sp.layers[il]
        residual = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur, fused=True)
        q, k = c.build_qk_rope(q, k, inp_pos, il)
        q = scale(ctx0, q, f"Qcur_scaled-{il}")
        cur = c.build_attn(ai, q, k, v, il)
        cur, residual = c.skip_unused_rows(il, out_ids, cur, residual)
        cur = add(ctx0, cur, residual, f"ffn_inp-{il}")
        residual = cur
        cur = c.build_norm(cur, name=f"ffn_norm-{il}")
        if sp.n_expert > 0 and l.n_ff_exp > 0:
            cur = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
        else:
            cur = c.build_ffn(cur, l.n_ff, gate=None, act="swiglu", up_rows=2 * l.n_ff, il=il)
        return add(ctx0, residual, cur, f"l_out-{il}")

    inpL = yield from c.build_layers(inpL, layer)
    cur, logits = c.build_result(inpL)
    c.finish(cur, logits)
