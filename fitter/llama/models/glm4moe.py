"""glm4moe: src/models/glm4-moe.cpp (graph and graph_mtp)."""

from __future__ import annotations

from typing import Iterator

from fitter.ggml.tensor import Tensor, rope
from fitter.llama.graph import GraphContext
from fitter.llama.graph_blocks import build_moe_lead_dense_layers, build_mtp, build_mtp_moe_tail
from fitter.llama.hparams import ArchRules, ModelSpec

# LLAMA_EXPERT_GATING_FUNC_TYPE without the key: sigmoid (glm4-moe.cpp load_arch_hparams)
_GATING = 2
ARCHS = {"glm4moe": ArchRules()}



def _glm4moe_attn(c: GraphContext, cur: Tensor, inp_pos: Tensor, ai: dict, il: int) -> Tensor:
    """The attention block of glm4-moe.cpp's graph and its MTP layer (optional Q/K norms, NeoX RoPE)."""
    ctx0 = c.ctx0
    d = c.d
    q, k, v = c.build_qkv(c.spec.layers[il], cur, bias=d.has("attn_q.bias", il))
    if d.has("attn_q_norm", il):
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
    if d.has("attn_k_norm", il):
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
    q = rope(ctx0, q, inp_pos, None, f"Qcur-{il}")
    k = rope(ctx0, k, inp_pos, None, f"Kcur-{il}")
    return c.build_attn(ai, q, k, v, il)


def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    lt = {"attn_q.bias": every, "attn_k.bias": every, "attn_v.bias": every, "exp_probs_b.bias": moe_layers}
    return lt, dict(expert_gating_func=2, expert_weights_norm=True, expert_weights_scale=2.5)


def build_graph(c: GraphContext) -> Iterator:
    """glm4moe: src/models/glm4-moe.cpp (leading dense layers, routed + shared experts)."""
    d = c.d
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos(4 if d.mrope else 1)
    ai = c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    yield from build_moe_lead_dense_layers(
        c, inpL, out_ids, lambda cur, il: _glm4moe_attn(c, cur, inp_pos, ai, il), "attn_post_norm", _GATING)


def _mtp_layer(c: GraphContext, cur: Tensor, inpSA: Tensor, inp_pos: Tensor, ai: dict, out_ids: Tensor, il: int) -> Tensor:
    cur = _glm4moe_attn(c, cur, inp_pos, ai, il)
    return build_mtp_moe_tail(c, cur, inpSA, il, _GATING)


def build_graph_mtp(c: GraphContext) -> None:
    """graph_mtp of src/models/glm4-moe.cpp."""
    build_mtp(c, _mtp_layer, n_pos_per_embd=4 if c.d.mrope else 1)
