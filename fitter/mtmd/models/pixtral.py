"""tools/mtmd/models/pixtral.cpp clip_graph_pixtral::build: Pixtral and Mistral Small 3.x's vision tower
(PROJECTOR_TYPE_PIXTRAL): 2-D RoPE, the patch merger (an im2col unfold) when the file has one, the LLaVA projector,
and an [IMG_BREAK] embedding after each row."""

from __future__ import annotations

from fitter.ggml import tensor as T
from fitter.ggml.image_ops import im2col
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import I32
from fitter.mtmd.graph import ClipGraph
from fitter.mtmd.hparams import FFN_GELU


def build(c: ClipGraph) -> Tensor:
    ctx, hp = c.ctx, c.hp
    m = hp.n_merge
    pos_h = T.inp(ctx, I32, (c.n_patches,), "pos_h")
    pos_w = T.inp(ctx, I32, (c.n_patches,), "pos_w")

    def add_pos(cur: Tensor) -> Tensor:  # clip_graph::build_rope_2d: two ggml_rope_ext over the halves
        return T.rope(ctx, T.rope(ctx, cur, pos_h), pos_w)

    inp = c.build_inp()
    cur = c.build_vit(inp, c.n_patches, True, hp.ffn_op, None, add_pos)
    merger = c.w("mm.patch_merger.weight")
    if merger is not None:  # Mistral Small 3.1's patch merger
        cur = T.mul(ctx, T.rms_norm(ctx, cur), c.need("mm.input_norm.weight"))
        cur = T.reshape(ctx, cur, (hp.n_embd, c.n_patches_x, c.n_patches_y))
        cur = T.cont(ctx, T.permute(ctx, cur, 2, 0, 1, 3))
        kernel = T.view(ctx, cur, (m, m, cur.ne[2]), (0, 0))  # a dummy kernel: only its shape counts
        cur = im2col(ctx, kernel, cur, m, m, inp.type)
        cur = T.reshape(ctx, cur, (cur.ne[0], cur.ne[1] * cur.ne[2]))
        cur = c.mm(merger, cur)
    cur = c.build_ffn(cur, c.need("mm.1.weight"), c.w("mm.1.bias"), None, None, c.need("mm.2.weight"),
                      c.w("mm.2.bias"), FFN_GELU)
    brk = c.w("v.token_embd.img_break")
    if brk is not None:  # [IMG_BREAK] after every row but the last
        p_y, p_x = c.n_patches_y // m, c.n_patches_x // m
        e_text = cur.ne[0]
        tmp = T.reshape(ctx, cur, (e_text, p_x, p_y))
        tok = T.new_tensor(ctx, "NONE", tmp.type, (e_text, 1, p_y), (), "img_break")
        tok = T.add(ctx, T.scale(ctx, tok), brk)
        tmp = T.concat(ctx, tmp, tok, 1)
        cur = T.view(ctx, tmp, (e_text, p_x * p_y + p_y - 1), (tmp.nb[1],))
    return cur
