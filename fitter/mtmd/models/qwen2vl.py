"""tools/mtmd/models/qwen2vl.cpp clip_graph_qwen2vl::build: Qwen2-VL and Qwen2.5-VL (window attention, M-RoPE)."""

from __future__ import annotations

from fitter.ggml import tensor as T
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import F16, F32, I32
from fitter.mtmd.graph import ClipGraph
from fitter.mtmd.hparams import FFN_GELU, QWEN25VL


def build_inp_with_temporal_merge(c: ClipGraph) -> Tensor:  # clip_graph_qwen2vl::build_inp_with_temporal_merge
    inp_raw = c.build_inp_raw()
    ps = c.hp.patch_size
    return T.add(c.ctx, c.conv_2d(c.need("v.patch_embd.weight"), inp_raw, ps),
                 c.conv_2d(c.need("v.patch_embd.weight.1"), inp_raw, ps))


def build(c: ClipGraph) -> Tensor:
    ctx, hp = c.ctx, c.hp
    use_window_attn = hp.n_wa_pattern > 0
    n_pos = c.n_patches
    rms = hp.proj_type == QWEN25VL
    e, npx, npy = hp.n_embd, c.n_patches_x, c.n_patches_y

    inp = build_inp_with_temporal_merge(c)
    inp = T.permute(ctx, inp, 1, 2, 0, 3)
    inp = T.cont_nd(ctx, inp, (e * 2, npx // 2, npy, 1))
    inp = T.reshape(ctx, inp, (e * 2, npx // 2, 2, npy // 2))
    inp = T.permute(ctx, inp, 0, 2, 1, 3)
    inp = T.cont_nd(ctx, inp, (e, npx * npy, 1))

    inpl = inp
    window_mask = None
    positions = T.inp(ctx, I32, (n_pos * 4,), "positions")
    if c.w("v.pre_ln.weight") is not None:
        inpl = c.build_norm(inpl, c.w("v.pre_ln.weight"), c.w("v.pre_ln.bias"), rms)
    if use_window_attn:
        inv_window_idx = T.inp(ctx, I32, (n_pos // 4,), "inv_window_idx")
        window_mask = T.inp(ctx, F32, (n_pos, n_pos), "window_mask")
        if c.flash_attn:
            window_mask = T.cast(ctx, window_mask, F16)
        inpl = T.reshape(ctx, inpl, (e * 4, npx * npy // 4))
        inpl = T.get_rows(ctx, inpl, inv_window_idx)
        inpl = T.reshape(ctx, inpl, (e, npx * npy, 1))

    for il in range(hp.n_layer):
        L = lambda n, il=il: c.layer(il, n)  # noqa: E731
        full_attn = (il + 1) % hp.n_wa_pattern == 0 if use_window_attn else True
        cur = c.build_norm(inpl, L("ln1.weight"), L("ln1.bias"), rms)
        q = T.add(ctx, c.mm(c.need(f"v.blk.{il}.attn_q.weight"), cur), L("attn_q.bias"))
        k = T.add(ctx, c.mm(c.need(f"v.blk.{il}.attn_k.weight"), cur), L("attn_k.bias"))
        v = T.add(ctx, c.mm(c.need(f"v.blk.{il}.attn_v.weight"), cur), L("attn_v.bias"))
        q = T.reshape(ctx, q, (hp.d_head, hp.n_head, n_pos))
        k = T.reshape(ctx, k, (hp.d_head, hp.n_head, n_pos))
        v = T.reshape(ctx, v, (hp.d_head, hp.n_head, n_pos))
        q = T.rope(ctx, q, positions)  # ggml_rope_multi
        k = T.rope(ctx, k, positions)
        cur = c.build_attn(L("attn_out.weight"), L("attn_out.bias"), q, k, v, None if full_attn else window_mask)
        cur = T.add(ctx, cur, inpl)
        inpl = cur
        cur = c.build_norm(cur, L("ln2.weight"), L("ln2.bias"), rms)
        up, down = c._ffn_up_down(il)
        cur = c.build_ffn(cur, up[0], up[1], L("ffn_gate.weight"), L("ffn_gate.bias"), down[0], down[1], hp.ffn_op)
        cur = T.add(ctx, inpl, cur)
        inpl = cur

    if c.w("v.post_ln.weight") is not None:
        inpl = c.build_norm(inpl, c.w("v.post_ln.weight"), c.w("v.post_ln.bias"), rms)
    emb = T.reshape(ctx, inpl, (e * 4, n_pos // 4, 1))
    emb = c.build_ffn(emb, c.need("mm.0.weight"), c.w("mm.0.bias"), None, None, c.need("mm.2.weight"),
                      c.w("mm.2.bias"), FFN_GELU)
    if use_window_attn:
        window_idx = T.inp(ctx, I32, (n_pos // 4,), "window_idx")
        emb = T.reshape(ctx, emb, (hp.projection_dim, npx * npy // 4))
        emb = T.get_rows(ctx, emb, window_idx)
        emb = T.reshape(ctx, emb, (hp.projection_dim, npx * npy // 4, 1))
    return emb
