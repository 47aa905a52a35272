"""llama, mistral3, qwen2, qwen3, qwen3moe: src/models/{llama,mistral3,qwen2,qwen3,qwen3moe}.cpp."""

from __future__ import annotations

from typing import Iterator

from fitter.ggml.tensor import Tensor, add, inp, mul
from fitter.ggml.types import F32
from fitter.llama.graph import GraphContext
from fitter.llama.hparams import ArchRules, ModelSpec

ARCHS = {"llama": ArchRules(), "mistral3": ArchRules(), "qwen2": ArchRules(), "qwen3": ArchRules(), "qwen3moe": ArchRules()}



def default_details(spec: ModelSpec, every: frozenset[int], moe_layers: frozenset[int]) -> tuple[dict, dict]:
    """The GraphDetails of released models (layer tensors, keyword fields) without a header."""
    arch = spec.architecture
    lt: dict[str, frozenset[int]] = {}
    kw: dict = {}
    if arch == "qwen2":
        lt |= {"attn_q.bias": every, "attn_k.bias": every, "attn_v.bias": every}
    if arch in ("qwen3", "qwen3moe"):
        lt |= {"attn_q_norm": every, "attn_k_norm": every}
    if arch == "mistral3":
        kw["attn_temperature_scale"] = 0.1
    return lt, kw


def build_graph(c: GraphContext) -> Iterator:
    """llama, mistral3, qwen2, qwen3 (and their MoE FFN branch): src/models/{llama,mistral3,qwen2,qwen3}.cpp."""
    ctx0 = c.ctx0
    sp = c.spec
    arch = c.arch
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos()
    attn_scale = inp(ctx0, F32, (1, 1, c.n_tokens), "inp_attn_scale") if c.d.attn_temperature_scale else None
    ai = c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    qk_norm = arch in ("qwen3", "qwen3moe")
    bias = c.d.has("attn_q.bias")
    def layer(il: int, inpL: Tensor) -> Tensor:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur, bias=bias)
        q, k = c.build_qk_rope(q, k, inp_pos, il, qk_norm=qk_norm)
        if attn_scale is not None:
            q = mul(ctx0, q, attn_scale, f"Qcur_scaled-{il}")
        cur = c.build_attn(ai, q, k, v, il)
        cur, inpSA = c.skip_unused_rows(il, out_ids, cur, inpSA)
        ffn_inp = add(ctx0, cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"ffn_norm-{il}")
        if sp.n_expert > 0 and l.n_ff_exp > 0:
            cur = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
        else:
            cur = c.build_ffn(cur, l.n_ff, il=il)
        return add(ctx0, cur, ffn_inp, f"l_out-{il}")

    inpL = yield from c.build_layers(inpL, layer)
    cur, logits = c.build_result(inpL)
    c.finish(cur, logits)
