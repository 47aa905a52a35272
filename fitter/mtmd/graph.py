"""clip_graph (tools/mtmd/clip.cpp, clip-graph.h): the shared builders of the vision graphs, over fitter.ggml.

A ClipGraph is built for one image (the warmup image: clip_model_loader::get_dummy_batch, n_batch 1). Weights
are the header's tensors (external: they live in the weight buffer); ops that read them take them as a source,
as ggml does, so the GPU scheduler sees where they are.
"""

from __future__ import annotations

from typing import Callable

from fitter.ggml import tensor as T
from fitter.ggml.graph import Graph
from fitter.ggml.image_ops import im2col
from fitter.ggml.tensor import Context, Tensor
from fitter.ggml.types import F16, F32, GGML_TYPES
from fitter.mtmd.hparams import (
    FFN_GELU,
    FFN_GELU_QUICK,
    FFN_SILU,
    GEMMA3,
    GEMMA4V,
    QWEN2VL,
    QWEN25VL,
    ClipHparams,
    MmprojError,
)

_FFN_SWAP_TYPES = (GEMMA3, QWEN2VL, QWEN25VL)  # load_tensors' is_ffn_swapped, of the types mirrored here

BF16 = GGML_TYPES["bf16"]


class ClipGraph:
    """clip_graph's members and helpers for one image of nx x ny pixels."""

    def __init__(self, hp: ClipHparams, nx: int, ny: int, flash_attn: bool) -> None:
        self.hp = hp
        self.ctx = Context()
        self.g = Graph()
        self.nx, self.ny = nx, ny
        self.n_patches_x, self.n_patches_y = nx // hp.patch_size, ny // hp.patch_size
        self.n_patches = self.n_patches_x * self.n_patches_y
        self.n_batch = 1
        self.flash_attn = flash_attn
        self.clamp_mm = hp.proj_type == GEMMA4V
        self._w: dict[str, Tensor] = {}

    def w(self, name: str) -> Tensor | None:
        """The model tensor `name` (clip_model_loader::load_tensors' get_tensor), None when the file lacks it."""
        t = self._w.get(name)
        if t is None:
            info = self.hp.tensors.get(name)
            if info is None:
                return None
            t = T.weight(self.ctx, info.shape, name, type_=int(info.ggml_type))
            self._w[name] = t
        return t

    def need(self, name: str) -> Tensor:
        t = self.w(name)
        if t is None:  # clip_model_loader::load_tensors' get_tensor(name, required)
            raise MmprojError(f"--mmproj {self.hp.path}: unable to find tensor {name}")
        return t

    # --- clip_graph helpers (clip.cpp) ---------------------------------------------------------------

    def build_inp_raw(self, channels: int = 3) -> Tensor:  # clip_graph::build_inp_raw
        return T.inp(self.ctx, F32, (self.nx, self.ny, channels, self.n_batch), "inp_raw")

    def conv_2d(self, a: Tensor, b: Tensor, s: int) -> Tensor:  # ggml_conv_2d (no padding, no dilation)
        ctx = self.ctx
        col = im2col(ctx, a, b, s, s, F32 if a.type == BF16 else F16)
        res = T.mul_mat(ctx, T.reshape(ctx, col, (col.ne[0], col.ne[3] * col.ne[2] * col.ne[1])),
                        T.reshape(ctx, a, (a.ne[0] * a.ne[1] * a.ne[2], a.ne[3])))
        res = T.reshape(ctx, res, (col.ne[1], col.ne[2], col.ne[3], a.ne[3]))
        return T.cont(ctx, T.permute(ctx, res, 0, 1, 3, 2))

    def build_inp(self) -> Tensor:  # clip_graph::build_inp
        ctx, hp = self.ctx, self.hp
        inp = self.conv_2d(self.need("v.patch_embd.weight"), self.build_inp_raw(), hp.patch_size)
        inp = T.reshape(ctx, inp, (self.n_patches, hp.n_embd, self.n_batch))
        inp = T.cont(ctx, T.transpose(ctx, inp))
        bias = self.w("v.patch_embd.bias")
        if bias is not None:
            inp = T.add(ctx, inp, bias)
        return inp

    def mm(self, w: Tensor, x: Tensor) -> Tensor:  # clip_graph::build_mm
        if self.clamp_mm:  # clip_graph_gemma4v::build_mm (Gemma4ClippableLinear): every weight has its clamp info
            return T.clamp(self.ctx, T.mul_mat(self.ctx, w, T.clamp(self.ctx, x)))
        return T.mul_mat(self.ctx, w, x)

    def build_norm(self, cur: Tensor, mw: Tensor | None, mb: Tensor | None, rms: bool) -> Tensor:  # build_norm
        ctx = self.ctx
        cur = T.rms_norm(ctx, cur) if rms else T.norm(ctx, cur)
        if mw is not None:
            cur = T.mul(ctx, cur, mw)
        if mb is not None:
            cur = T.add(ctx, cur, mb)
        return cur

    def build_ffn(self, cur: Tensor, up: Tensor | None, up_b: Tensor | None, gate: Tensor | None,
                  gate_b: Tensor | None, down: Tensor | None, down_b: Tensor | None, op: str) -> Tensor:
        """clip_graph::build_ffn (parallel gate only)."""
        ctx = self.ctx
        tmp = self.mm(up, cur) if up is not None else cur
        if up_b is not None:
            tmp = T.add(ctx, tmp, up_b)
        if gate is not None:
            cur = self.mm(gate, cur)
            if gate_b is not None:
                cur = T.add(ctx, cur, gate_b)
            cur = T.glu_split(ctx, cur, tmp)  # ggml_swiglu_split / geglu_split / geglu_quick_split
        else:
            assert op in (FFN_GELU, FFN_SILU, FFN_GELU_QUICK)
            cur = T.unary(ctx, tmp)  # ggml_gelu / silu / gelu_quick
        if down is not None:
            cur = self.mm(down, cur)
        if down_b is not None:
            cur = T.add(ctx, cur, down_b)
        return cur

    def build_attn(self, wo: Tensor | None, wo_b: Tensor | None, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor,
                   kq_mask: Tensor | None) -> Tensor:
        """clip_graph::build_attn: Q, K, V enter the graph first (ggml_build_forward_order), then the attention."""
        ctx, g = self.ctx, self.g
        for t in (q_cur, k_cur, v_cur):
            g.expand(t)
        q = T.permute(ctx, q_cur, 0, 2, 1, 3)
        k = T.permute(ctx, k_cur, 0, 2, 1, 3)
        if self.flash_attn:
            v = T.permute(ctx, v_cur, 0, 2, 1, 3)
            k = T.cast(ctx, k, F16)
            v = T.cast(ctx, v, F16)
            if kq_mask is not None:
                kq_mask = T.cast(ctx, kq_mask, F16)
            cur = T.flash_attn_ext(ctx, q, k, v, kq_mask)
            cur = T.reshape(ctx, cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
        else:
            v = T.cont(ctx, T.permute(ctx, v_cur, 1, 2, 0, 3))
            kq = T.mul_mat(ctx, k, q)
            kq = T.soft_max(ctx, kq, kq_mask)
            kqv = T.mul_mat(ctx, v, kq)
            cur = T.permute(ctx, kqv, 0, 2, 1, 3)
            cur = T.cont_nd(ctx, cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
        if wo is not None:
            cur = self.mm(wo, cur)
        if wo_b is not None:
            cur = T.add(ctx, cur, wo_b)
        return cur

    def layer(self, il: int, name: str) -> Tensor | None:
        return self.w(f"v.blk.{il}.{name}")

    # long because clip_graph::build_vit (tools/mtmd/clip.cpp, 232 lines), node for node
    def build_vit(self, inp: Tensor, n_pos: int, rms: bool, ffn_op: str, learned_pos_embd: Tensor | None,
                  add_pos: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """clip_graph::build_vit: pre-norm transformer layers, separate or fused QKV (no MoE FFN, no masks)."""
        ctx, hp = self.ctx, self.hp
        b = inp.ne[2]
        if learned_pos_embd is not None:
            inp = T.add(ctx, inp, learned_pos_embd)
        inp = T.reshape(ctx, inp, (hp.n_embd, n_pos * b))
        inpl = inp
        if self.w("v.pre_ln.weight") is not None:
            inpl = self.build_norm(inpl, self.w("v.pre_ln.weight"), self.w("v.pre_ln.bias"), rms)
        d_head, n_head, n_head_kv = hp.d_head, hp.n_head, hp.n_head_kv
        for il in range(hp.n_layer):
            L = lambda n, il=il: self.layer(il, n)  # noqa: E731
            cur = self.build_norm(inpl, L("ln1.weight"), L("ln1.bias"), rms)
            qkv_w = L("attn_qkv.weight")
            if qkv_w is not None:
                cur = self.mm(qkv_w, cur)
                if L("attn_qkv.bias") is not None:
                    cur = T.add(ctx, cur, L("attn_qkv.bias"))
                rs = cur.nb[0] * d_head
                nb = (rs, cur.nb[1], cur.nb[1] * n_pos)
                q = T.view(ctx, cur, (d_head, n_head, n_pos, b), nb)
                k = T.view(ctx, cur, (d_head, n_head, n_pos, b), nb)
                v = T.view(ctx, cur, (d_head, n_head, n_pos, b), nb)
                if L("attn_q_norm.weight") is not None:
                    q = self.build_norm(q, L("attn_q_norm.weight"), None, rms)
                if L("attn_k_norm.weight") is not None:
                    k = self.build_norm(k, L("attn_k_norm.weight"), None, rms)
            else:
                q = self.mm(self.need(f"v.blk.{il}.attn_q.weight"), cur)
                if L("attn_q.bias") is not None:
                    q = T.add(ctx, q, L("attn_q.bias"))
                k = self.mm(self.need(f"v.blk.{il}.attn_k.weight"), cur)
                if L("attn_k.bias") is not None:
                    k = T.add(ctx, k, L("attn_k.bias"))
                v = self.mm(self.need(f"v.blk.{il}.attn_v.weight"), cur)
                if L("attn_v.bias") is not None:
                    v = T.add(ctx, v, L("attn_v.bias"))
                qn, kn = L("attn_q_norm.weight"), L("attn_k_norm.weight")
                per_head = qn is not None and qn.ne[0] == d_head
                if not per_head:
                    if qn is not None:
                        q = self.build_norm(q, qn, None, rms)
                    if kn is not None:
                        k = self.build_norm(k, kn, None, rms)
                q = T.reshape(ctx, q, (d_head, n_head, n_pos, b))
                k = T.reshape(ctx, k, (d_head, n_head_kv, n_pos, b))
                v = T.reshape(ctx, v, (d_head, n_head_kv, n_pos, b))
                if per_head:
                    q = self.build_norm(q, qn, None, rms)
                    if kn is not None:
                        k = self.build_norm(k, kn, None, rms)
            if add_pos is not None:
                q = add_pos(q)
                k = add_pos(k)
            if hp.proj_type == GEMMA4V:
                v = T.rms_norm(ctx, v)
            cur = self.build_attn(L("attn_out.weight"), L("attn_out.bias"), q, k, v, None)
            if L("ls1.weight") is not None:
                cur = T.mul(ctx, cur, L("ls1.weight"))
            if L("attn_post_norm.weight") is not None:
                cur = self.build_norm(cur, L("attn_post_norm.weight"), None, rms)
            cur = T.add(ctx, cur, inpl)
            inpl = cur
            cur = self.build_norm(cur, L("ln2.weight"), L("ln2.bias"), rms)
            up, down = self._ffn_up_down(il)
            cur = self.build_ffn(cur, up[0], up[1], L("ffn_gate.weight"), L("ffn_gate.bias"), down[0], down[1], ffn_op)
            if L("ffn_post_norm.weight") is not None:
                cur = self.build_norm(cur, L("ffn_post_norm.weight"), None, rms)
            if L("ls2.weight") is not None:
                cur = T.mul(ctx, cur, L("ls2.weight"))
            cur = T.add(ctx, inpl, cur)
            if L("out_scale.weight") is not None:
                cur = T.mul(ctx, cur, L("out_scale.weight"))
            inpl = cur
        if self.w("v.post_ln.weight") is not None:
            inpl = self.build_norm(inpl, self.w("v.post_ln.weight"), self.w("v.post_ln.bias"), rms)
        return T.reshape(ctx, inpl, (hp.n_embd, inpl.ne[1] // b, b))

    def _ffn_up_down(self, il: int) -> tuple[tuple[Tensor | None, Tensor | None], tuple[Tensor | None, Tensor | None]]:
        """load_tensors' is_ffn_swapped: legacy files whose ffn_down has ne0 = n_embd swap up and down (and biases)."""
        up = (self.layer(il, "ffn_up.weight"), self.layer(il, "ffn_up.bias"))
        down = (self.layer(il, "ffn_down.weight"), self.layer(il, "ffn_down.bias"))
        if (self.hp.proj_type in _FFN_SWAP_TYPES and up[0] is not None and down[0] is not None
                and down[0].ne[0] == self.hp.n_embd):
            return down, up
        return up, down
