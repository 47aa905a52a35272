"""tools/mtmd/models/gemma4v.cpp clip_graph_gemma4v::build: Gemma 4's vision tower (PROJECTOR_TYPE_GEMMA4V).

2-D positions from two lookup tables, 2-D NeoX RoPE over the two halves of each head, V RMS-normed, every weight
matmul clamped (clip_graph_gemma4v::build_mm, ClipGraph.clamp_mm), then the pooler (avg-pool by n_merge, scaled by
sqrt(n_embd)), the optional standardisation and the RMS-normed input projection.
"""

from __future__ import annotations

from fitter.ggml import tensor as T
from fitter.ggml.image_ops import pool_2d
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import I32
from fitter.mtmd.graph import ClipGraph


def build(c: ClipGraph) -> Tensor:
    ctx, hp = c.ctx, c.hp
    inp_raw = T.scale(ctx, c.build_inp_raw())  # ggml_scale_bias: patches * 2 - 1
    inp = c.conv_2d(c.need("v.patch_embd.weight"), inp_raw, hp.patch_size)
    inp = T.reshape(ctx, inp, (c.n_patches, hp.n_embd, c.n_batch))
    inp = T.cont(ctx, T.transpose(ctx, inp))  # no patch bias
    pos_x = T.inp(ctx, I32, (c.n_patches,), "pos_x")
    pos_y = T.inp(ctx, I32, (c.n_patches,), "pos_y")
    pe = c.need("v.position_embd.weight")
    nb1 = pe.nb[1]
    tbl_x = T.view(ctx, pe, (hp.n_embd, pe.ne[1]), (nb1,))
    tbl_y = T.view(ctx, pe, (hp.n_embd, pe.ne[1]), (nb1,))
    inp = T.add(ctx, inp, T.get_rows(ctx, tbl_x, pos_x))
    inp = T.add(ctx, inp, T.get_rows(ctx, tbl_y, pos_y))

    def add_pos(cur: Tensor) -> Tensor:  # two ggml_rope_ext, the second on the upper half (ggml_rope_set_offset)
        return T.rope(ctx, T.rope(ctx, cur, pos_x), pos_y)

    cur = c.build_vit(inp, c.n_patches, True, hp.ffn_op, None, add_pos)
    k = hp.n_merge  # Gemma4VisionPooler
    cur = T.cont_nd(ctx, T.transpose(ctx, cur), (c.n_patches_x, c.n_patches_y, hp.n_embd, c.n_batch))
    cur = pool_2d(ctx, cur, k, k)
    cur = T.reshape(ctx, cur, ((c.n_patches_x // k) * (c.n_patches_y // k), hp.n_embd, c.n_batch))
    cur = T.cont(ctx, T.transpose(ctx, cur))
    cur = T.scale(ctx, cur)
    std_bias, std_scale = c.w("v.std_bias"), c.w("v.std_scale")
    if std_bias is not None and std_scale is not None:
        cur = T.mul(ctx, T.sub(ctx, cur, std_bias), std_scale)
    cur = T.rms_norm(ctx, cur)  # Gemma4MultimodalEmbedder: embedding_pre_projection_norm
    return c.mm(c.need("mm.input_projection.weight"), cur)
