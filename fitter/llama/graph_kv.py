"""The KV caches as llm_graph_context's builders see them: the attention inputs (build_attn_inp_kv, _k, _kv_iswa,
build_inp_mem_hybrid, build_rs) and the cache views of src/llama-kv-cache.cpp (cpy_k, cpy_v, get_k, get_v, the
Hadamard rotation inputs). `KVGraph` is a part of fitter.llama.graph.GraphContext, kept here by what it builds.
"""

from __future__ import annotations

from dataclasses import field

from fitter.ggml.graph import Graph
from fitter.ggml.symbolic import Sym
from fitter.ggml.tensor import (
    Context,
    Tensor,
    cache,
    cast,
    cont_nd,
    cpy,
    get_rows,
    inp,
    is_contiguous,
    mul_mat,
    nelements,
    pad,
    reshape,
    set_rows,
    transpose,
    view,
    view_tensor,
)
from fitter.ggml.types import BLCK, F16, F32, I32, I64, row_size, type_of
from fitter.llama.cparams import ContextParams
from fitter.llama.hparams import LayerKind, ModelSpec
from fitter.llama.kv_cache_iswa import swa_cache_types, swa_cells
from fitter.llama_builds import LlamaBuild
from fitter.record import Record


class KVCacheView(Record, frozen=False):
    """A llama_kv_cache as the reserve graph sees it (llama_kv_cache_context built by init_full)."""

    size: int  # cells per stream; n_kv = size in the reserve (llama_kv_cache_context: n_kv = get_size())
    n_stream: int
    type_k: int
    type_v: int
    v_trans: bool
    rot_k: int  # Hadamard rotation size of attn_inp_k_rot (0 = none; llama_kv_cache::build_input_k_rot)
    rot_v: int
    layers: list[int] = field(default_factory=list)  # the layers with their own K/V tensors
    share: dict[int, int] = field(default_factory=dict)  # layer -> the layer whose K/V it reuses
    tensors: dict[int, tuple[Tensor, Tensor | None]] = field(default_factory=dict)  # created on first use


class KVGraph:
    """GraphContext's KV-cache inputs and views (the attributes below are GraphContext's, set in its __init__)."""

    spec: ModelSpec
    cp: ContextParams
    ctx0: Context
    g: Graph
    build: LlamaBuild
    fa: bool
    v_trans: bool  # the V cache transposed (GraphContext: not fa unless the context says)
    v_less: bool
    symbolic: bool
    n_tokens: int
    n_seqs: int
    n_stream: int
    v_gqa_max: int

    def cells(self, swa: bool = False) -> int:
        """The cells of the full KV cache (n_ctx_seq) or of the sliding-window one (llama_kv_cache_iswa)."""
        n = swa_cells(self.spec, self.cp) if swa else self.cp.n_ctx_seq
        return Sym.var(int(swa), n) if self.symbolic else n

    def _kv(self, layers: list[int], size: int, types: tuple[str, str] | None = None) -> KVCacheView:
        cp = self.cp
        tk, tv = type_of((types or (cp.type_k, cp.type_v))[0]), type_of((types or (cp.type_k, cp.type_v))[1])
        # llama_kv_cache::llama_kv_cache: attn_rot_k / attn_rot_v (Hadamard rotation for quantized caches)
        hk = {self.spec.layers[il].n_embd_head_k for il in layers}
        hv = {self.spec.layers[il].n_embd_head_v for il in layers}
        head_k_all = hk.pop() if len(hk) == 1 else (-1 if hk else 0)
        head_v_all = hv.pop() if len(hv) == 1 else (-1 if hv else 0)
        if self.v_less:
            head_v_all = 0  # MLA caches have no V
        # hparams.n_embd_head_k() / n_embd_head_v(): the default argument is layer 0
        full_k = self.spec.layers[0].n_embd_head_k
        full_v = self.spec.layers[0].n_embd_head_v
        rot_k = rot_v = 0
        if not self.build.has("attn_rot_quantized_kv"):  # before #21038 (0.3.17 llama_kv_cache): no rotation
            head_k_all = head_v_all = 0
        if head_k_all > 0 and BLCK[tk] > 1 and full_k % 64 == 0:
            n = 64
            while head_k_all % n == 0:
                n *= 2
            rot_k = n // 2
        if head_v_all > 0 and BLCK[tv] > 1 and full_v % 64 == 0 and not self.v_less:
            rot_v = 64
        return KVCacheView(size=size, n_stream=self.n_stream, type_k=tk, type_v=tv, v_trans=self.v_trans, rot_k=rot_k,
                           rot_v=rot_v, layers=list(layers))

    def kv_tensors(self, kv: KVCacheView, il: int) -> tuple[Tensor, Tensor | None]:
        """The layer's K and V cache tensors (llama_kv_cache::layers[map_layer_ids[il]])."""
        ctx0 = self.ctx0
        il = kv.share.get(il, il)
        t = kv.tensors.get(il)
        if t is None:
            l = self.spec.layers[il]
            buf = ("kv", kv.layers[0] if kv.layers else il)
            k = cache(ctx0, kv.type_k, (l.n_embd_k_gqa, kv.size, kv.n_stream), f"cache_k_l{il}", buf)
            v = None
            if not self.v_less:
                v = cache(ctx0, kv.type_v, ((self.v_gqa_max if kv.v_trans else l.n_embd_v_gqa), kv.size, kv.n_stream),
                          f"cache_v_l{il}", buf)
            t = kv.tensors[il] = (k, v)
        return t

    def _kq_mask(self, kv: KVCacheView) -> Tensor:  # build_attn_inp_kq_mask
        ctx0 = self.ctx0
        rows = self.n_tokens // self.n_stream
        if not self.build.has("kq_mask_batch_pad_64"):
            rows = -(-rows // 64) * 64  # GGML_PAD(n_tokens/n_stream, GGML_KQ_MASK_PAD) (0.3.16 build_attn_inp_kv_unified)
        if self.build.has("kq_mask_f16_fa"):
            return inp(ctx0, F16 if self.fa else F32, (kv.size, rows, 1, self.n_stream), "attn_inp_kq_mask")
        # before #23764 (0.3.23 build_attn_inp_kq_mask): an f32 input, cast to f16 for flash attention
        mask = inp(ctx0, F32, (kv.size, rows, 1, self.n_stream), "attn_inp_kq_mask")
        return cast(ctx0, mask, F16) if self.fa else mask

    def _attn_inputs(self, kv: KVCacheView, with_v: bool = True) -> dict:
        ctx0 = self.ctx0
        # before #14959 the KV update is a view + ggml_cpy: the row indices are not in the graph (cpy_k / cpy_v)
        set_rows = self.build.has("kv_set_rows_default")
        d = {"kv": kv, "k_idxs": inp(ctx0, I64, (self.n_tokens,), "attn_inp_k_idxs") if set_rows else None}
        if with_v:
            n = self.n_tokens * self.v_gqa_max if kv.v_trans else self.n_tokens
            d["v_idxs"] = inp(ctx0, I64, (n,), "attn_inp_v_idxs") if set_rows else None
        d["mask"] = self._kq_mask(kv)
        d["k_rot"] = inp(ctx0, F32, (kv.rot_k, kv.rot_k), "attn_inp_k_rot") if kv.rot_k else None
        d["v_rot"] = inp(ctx0, F32, (kv.rot_v, kv.rot_v), "attn_inp_v_rot") if (kv.rot_v and with_v) else None
        return d

    def build_attn_inp_kv(self, layers: list[int] | None = None) -> dict:  # build_attn_inp_kv
        if layers is None:
            layers = [l.index for l in self.spec.layers[: self.spec.n_layer] if l.has_kv]
        return self._attn_inputs(self._kv(layers, self.cells()))

    def build_inp_mem_hybrid(self) -> tuple[dict, dict]:  # build_inp_mem_hybrid: (recurrent, attention)
        ctx0 = self.ctx0
        sp = self.spec
        n_rs = max(1, self.cp.n_seq_max)  # llama_memory_recurrent_context (full): n_rs = mem size
        s_copy = inp(ctx0, I32, (n_rs,), "rs_s_copy")
        rs = {
            "s_copy_main": view(ctx0, s_copy, (self.n_seqs,), (), "s_copy_main"),
            "s_copy_extra": view(ctx0, s_copy, (n_rs - self.n_seqs,), (), "s_copy_extra"),
            "n_rs": n_rs,
            "rows": n_rs * (1 + self.cp.n_rs_seq),
        }
        attn_layers = [l.index for l in sp.layers[: sp.n_layer] if l.kind != LayerKind.RECURRENT]
        return rs, self.build_attn_inp_kv(attn_layers)

    def build_rs(self, rs: dict, s: Tensor, state_size: int) -> Tensor:  # llm_graph_context::build_rs
        ctx0 = self.ctx0
        g = self.g
        states = reshape(ctx0, s, (state_size, s.ne[1]))
        state_zero = view(ctx0, states, (state_size,), (), "state_zero")
        g.expand(view_tensor(ctx0, state_zero, "SCALE", (state_zero,), "state_zero (scaled)"))  # ggml_scale_inplace
        out = get_rows(ctx0, states, rs["s_copy_main"], "rs_states")
        g.expand(out)
        extra = get_rows(ctx0, states, rs["s_copy_extra"], "rs_states_extra")
        dst = view(ctx0, s, (state_size, rs["n_rs"] - self.n_seqs), (s.nb[1],), "rs_extra_dst")
        g.expand(cpy(ctx0, extra, dst))
        return out

    def build_attn_inp_k(self) -> dict:  # build_attn_inp_k (MLA: K cache only, no rotation inputs)
        return self._attn_k_inputs([l.index for l in self.spec.layers[: self.spec.n_layer] if l.has_kv])

    def _attn_k_inputs(self, layers: list[int]) -> dict:
        ctx0 = self.ctx0
        kv = self._kv(layers, self.cells())
        return {"kv": kv, "k_idxs": inp(ctx0, I64, (self.n_tokens,), "attn_inp_k_idxs"), "mask": self._kq_mask(kv), "k_only": True}

    def build_attn_inp_kv_iswa(self) -> dict:  # build_attn_inp_kv_iswa
        sp = self.spec
        trunk = [l for l in sp.layers[: sp.n_layer] if l.has_kv]
        base = self._kv([l.index for l in trunk if l.kind != LayerKind.SWA], self.cells())
        swa = self._kv([l.index for l in trunk if l.kind == LayerKind.SWA], self.cells(swa=True), swa_cache_types(self.cp))
        # llama_model::create_memory (gemma3n / gemma4): layers past n_layer_kv_from_start reuse the KV
        # of the last layer of their kind that has one
        for l in sp.layers[: sp.n_layer]:
            if not l.has_kv:
                kv = swa if l.kind == LayerKind.SWA else base
                srcs = [il for il in kv.layers if il < l.index]
                if srcs:
                    kv.share[l.index] = max(srcs)
        b = self._attn_inputs(base)
        s = self._attn_inputs(swa)
        # creation order: k_idxs, v_idxs, mask (base) then (swa), then the rotations
        return {"iswa": True, "base": b, "swa": s}

    # ---- shared layer builders ---------------------------------------------------------------

    def cpy_k(self, kv: KVCacheView, k_cur: Tensor, k_idxs: Tensor | None, il: int) -> Tensor:  # llama_kv_cache::cpy_k
        ctx0 = self.ctx0
        k = self.kv_tensors(kv, il)[0]
        n_embd_gqa = k_cur.ne[0] * k_cur.ne[1]
        n_tokens = k_cur.ne[2]
        if k_idxs is None:  # before #14959 (0.3.15 llama_kv_cache_unified::cpy_k, LLAMA_SET_ROWS=0): view + ggml_cpy
            k_cur = reshape(ctx0, k_cur, (n_embd_gqa, n_tokens))
            return cpy(ctx0, k_cur, view(ctx0, k, (n_tokens * n_embd_gqa,), (), "k_view"), f"cache_k_l{il} (view)")
        k_cur = view(ctx0, k_cur, (n_embd_gqa, n_tokens), (k_cur.nb[2],), "k_cur")
        if k.ne[2] > 1:
            k = reshape(ctx0, k, (n_embd_gqa, kv.size * k.ne[2]))
        return set_rows(ctx0, k, k_cur, k_idxs, f"cache_k_l{il} (view)")

    def cpy_v(self, kv: KVCacheView, v_cur: Tensor, v_idxs: Tensor | None, il: int) -> Tensor:  # llama_kv_cache::cpy_v
        ctx0 = self.ctx0
        v = self.kv_tensors(kv, il)[1]
        assert v is not None  # MLA caches (no V) take build_attn's k_only path
        n_embd_gqa = v_cur.ne[0] * v_cur.ne[1]
        n_tokens = v_cur.ne[2]
        if v_idxs is None:  # before #14959 (0.3.15 llama_kv_cache_unified::cpy_v, LLAMA_SET_ROWS=0): view + ggml_cpy
            v_cur = reshape(ctx0, v_cur, (n_embd_gqa, n_tokens))
            if not kv.v_trans:
                return cpy(ctx0, v_cur, view(ctx0, v, (n_tokens * n_embd_gqa,), (), "v_view"), f"cache_v_l{il} (view)")
            v_view = view(ctx0, v, (n_tokens, n_embd_gqa), (row_size(v.type, v.ne[1]),), "v_view")
            return cpy(ctx0, transpose(ctx0, v_cur), v_view, f"cache_v_l{il} (view)")
        if not kv.v_trans:
            v_cur = view(ctx0, v_cur, (n_embd_gqa, n_tokens), (v_cur.nb[2],), "v_cur")
            if v.ne[2] > 1:
                v = reshape(ctx0, v, (n_embd_gqa, kv.size * v.ne[2]))
            return set_rows(ctx0, v, v_cur, v_idxs, f"cache_v_l{il} (view)")
        if row_size(v_cur.type, n_embd_gqa) == v_cur.nb[2]:
            v_cur = reshape(ctx0, v_cur, (n_embd_gqa, n_tokens))
        else:
            v_cur = cont_nd(ctx0, v_cur, (n_embd_gqa, n_tokens))
        if n_embd_gqa < v.ne[0]:  # [TAG_V_CACHE_VARIABLE]
            v_cur = pad(ctx0, v_cur, v.ne[0] - n_embd_gqa)
        v_view = reshape(ctx0, v, (1, nelements(v)))
        v_cur = reshape(ctx0, v_cur, (1, nelements(v_cur)))
        return set_rows(ctx0, v_view, v_cur, v_idxs, f"cache_v_l{il} (view)")

    def get_k(self, kv: KVCacheView, il: int) -> Tensor:  # llama_kv_cache::get_k
        ctx0 = self.ctx0
        k = self.kv_tensors(kv, il)[0]
        l = self.spec.layers[il]
        rs = lambda n: row_size(k.type, n)
        return view(ctx0, k, (l.n_embd_head_k, l.n_head_kv, kv.size, kv.n_stream),
                    (rs(l.n_embd_head_k), rs(k.ne[0]), rs(k.ne[0] * kv.size)), "k")

    def get_v(self, kv: KVCacheView, il: int) -> Tensor:  # llama_kv_cache::get_v
        ctx0 = self.ctx0
        v = self.kv_tensors(kv, il)[1]
        assert v is not None  # MLA caches (no V) take build_attn's k_only path
        l = self.spec.layers[il]
        rs = lambda n: row_size(v.type, n)
        if not kv.v_trans:
            return view(ctx0, v, (l.n_embd_head_v, l.n_head_kv, kv.size, kv.n_stream),
                        (rs(l.n_embd_head_v), rs(v.ne[0]), rs(v.ne[0] * kv.size)), "v")
        return view(ctx0, v, (kv.size, l.n_head_kv, l.n_embd_head_v, kv.n_stream),
                    (rs(kv.size * l.n_embd_head_v), rs(kv.size), rs(kv.size * v.ne[0])), "v")

    def hadamard(self, cur: Tensor, rot: Tensor) -> Tensor:  # llama_mul_mat_hadamard
        ctx0 = self.ctx0
        n = rot.ne[0]
        if not is_contiguous(cur):
            res = cont_nd(ctx0, cur, (n, nelements(cur) // n))
        else:
            res = reshape(ctx0, cur, (n, nelements(cur) // n))
        res = mul_mat(ctx0, rot, res)
        return reshape(ctx0, res, cur.ne)
