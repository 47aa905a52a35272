"""tools/mtmd/models/siglip.cpp clip_graph_siglip::build, the Gemma 3 projector (PROJECTOR_TYPE_GEMMA3)."""

from __future__ import annotations

from fitter.ggml import tensor as T
from fitter.ggml.image_ops import pool_2d
from fitter.ggml.tensor import Tensor
from fitter.mtmd.graph import ClipGraph


def build(c: ClipGraph) -> Tensor:
    ctx, hp = c.ctx, c.hp
    inp = c.build_inp()
    cur = c.build_vit(inp, c.n_patches, False, hp.ffn_op, c.w("v.position_embd.weight"))
    # gemma3: avg-pool the patches by n_merge a side, RMS norm, then the input projection
    per_side = c.n_patches_x
    k = hp.n_merge
    cur = T.transpose(ctx, cur)
    cur = T.cont_nd(ctx, cur, (per_side, per_side, hp.n_embd, 1))
    cur = pool_2d(ctx, cur, k, k)
    cur = T.reshape(ctx, cur, (cur.ne[0] * cur.ne[0], hp.n_embd, 1))
    cur = T.cont(ctx, T.transpose(ctx, cur))
    cur = T.rms_norm(ctx, cur)
    cur = T.mul(ctx, cur, c.need("mm.soft_emb_norm.weight"))
    proj = c.need("mm.input_projection.weight")
    return T.mul_mat(ctx, T.cont(ctx, T.transpose(ctx, proj)), cur)
