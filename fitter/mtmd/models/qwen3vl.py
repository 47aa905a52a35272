"""tools/mtmd/models/qwen3vl.cpp clip_graph_qwen3vl::build (Qwen3-VL: fused QKV, learned positions resized to the
image, M-RoPE, deepstack features concatenated to the merger's output)."""

from __future__ import annotations

from fitter.ggml import tensor as T
from fitter.ggml.image_ops import interpolate
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import I32
from fitter.mtmd.graph import ClipGraph
from fitter.mtmd.hparams import FFN_GELU
from fitter.mtmd.models.qwen2vl import build_inp_with_temporal_merge


def resize_position_embeddings(c: ClipGraph) -> Tensor:  # clip_graph::resize_position_embeddings
    ctx, e = c.ctx, c.hp.n_embd
    pos = c.need("v.position_embd.weight")
    h, w = c.ny // c.hp.patch_size, c.nx // c.hp.patch_size
    side = int(pos.ne[1] ** 0.5)
    if h == side and w == side:
        return pos
    pos = T.reshape(ctx, pos, (e, side, side))
    pos = T.permute(ctx, pos, 2, 0, 1, 3)
    pos = interpolate(ctx, pos, (w, h, e, 1))
    pos = T.permute(ctx, pos, 1, 2, 0, 3)
    return T.cont_nd(ctx, pos, (e, w * h))


def _merge_order(c: ClipGraph, t: Tensor) -> Tensor:
    """The 2x2 patch reordering both the patches and the learned positions go through."""
    ctx, e, npx, npy = c.ctx, c.hp.n_embd, c.n_patches_x, c.n_patches_y
    t = T.cont_nd(ctx, t, (e * 2, npx // 2, npy, 1))
    t = T.reshape(ctx, t, (e * 2, npx // 2, 2, npy // 2))
    t = T.permute(ctx, t, 0, 2, 1, 3)
    return T.cont_nd(ctx, t, (e, npx * npy, 1))


def build(c: ClipGraph) -> Tensor:
    ctx, hp = c.ctx, c.hp
    n_pos, e, d_head = c.n_patches, hp.n_embd, hp.d_head
    inp = build_inp_with_temporal_merge(c)
    inp = _merge_order(c, T.permute(ctx, inp, 1, 2, 0, 3))
    inp = T.add(ctx, inp, c.need("v.patch_embd.bias"))
    inp = T.add(ctx, inp, _merge_order(c, resize_position_embeddings(c)))
    inpl = inp
    positions = T.inp(ctx, I32, (n_pos * 4,), "positions")
    if c.w("v.pre_ln.weight") is not None:
        inpl = c.build_norm(inpl, c.w("v.pre_ln.weight"), c.w("v.pre_ln.bias"), False)
    deepstack: Tensor | None = None
    merge = hp.n_merge * hp.n_merge if hp.n_merge > 0 else 4
    for il in range(hp.n_layer):
        L = lambda n, il=il: c.layer(il, n)  # noqa: E731
        cur = c.build_norm(inpl, L("ln1.weight"), L("ln1.bias"), False)
        cur = T.add(ctx, c.mm(c.need(f"v.blk.{il}.attn_qkv.weight"), cur), L("attn_qkv.bias"))
        nb = (cur.nb[0] * d_head, cur.nb[1])
        q = T.view(ctx, cur, (d_head, hp.n_head, n_pos), nb)
        k = T.view(ctx, cur, (d_head, hp.n_head, n_pos), nb)
        v = T.view(ctx, cur, (d_head, hp.n_head, n_pos), nb)
        q = T.rope(ctx, q, positions)  # ggml_rope_multi
        k = T.rope(ctx, k, positions)
        cur = c.build_attn(L("attn_out.weight"), L("attn_out.bias"), q, k, v, None)
        cur = T.add(ctx, cur, inpl)
        inpl = cur
        cur = c.build_norm(cur, L("ln2.weight"), L("ln2.bias"), False)
        cur = c.build_ffn(cur, L("ffn_up.weight"), L("ffn_up.bias"), L("ffn_gate.weight"), L("ffn_gate.bias"),
                          L("ffn_down.weight"), L("ffn_down.bias"), hp.ffn_op)
        cur = T.add(ctx, inpl, cur)
        if il in hp.deepstack_layers:
            D = lambda n, il=il: c.w(f"v.deepstack.{il}.{n}")  # noqa: E731
            feat = T.reshape(ctx, cur, (e * merge, n_pos // merge, 1))
            feat = c.build_norm(feat, D("norm.weight"), D("norm.bias"), False)
            feat = c.build_ffn(feat, D("fc1.weight"), D("fc1.bias"), None, None, D("fc2.weight"), D("fc2.bias"),
                               FFN_GELU)
            deepstack = feat if deepstack is None else T.concat(ctx, deepstack, feat, 0)
        inpl = cur
    if c.w("v.post_ln.weight") is not None:
        inpl = c.build_norm(inpl, c.w("v.post_ln.weight"), c.w("v.post_ln.bias"), False)
    emb = T.reshape(ctx, inpl, (e * 4, n_pos // 4, 1))
    emb = c.build_ffn(emb, c.need("mm.0.weight"), c.w("mm.0.bias"), None, None, c.need("mm.2.weight"),
                      c.w("mm.2.bias"), FFN_GELU)
    if deepstack is not None:
        emb = T.concat(ctx, emb, deepstack, 0)
    return emb
