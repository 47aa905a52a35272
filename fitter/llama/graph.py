"""llm_graph_context: the shared graph builders of src/llama-graph.cpp and the KV-cache views they use.

Mirrors src/llama-graph.cpp (build_inp_*, build_norm, build_ffn, build_moe_ffn, build_attn, build_attn_mha); the
KV caches' inputs and views (build_attn_inp_*, build_rs, cpy_k, cpy_v, get_k, get_v, the Hadamard rotation) are
fitter.llama.graph_kv's KVGraph, a part of GraphContext, and the blocks several architectures share are
fitter.llama.graph_blocks. Each architecture's graph is a function of a
GraphContext in fitter.llama.models; the context owns the ggml_context (`ctx0`) and the graph (`g`).
"""

from __future__ import annotations

from typing import Callable, Generator

from fitter.ggml.graph import Graph
from fitter.ggml.symbolic import Sym
from fitter.ggml.tensor import (
    FLAG_OUTPUT,
    HOST,
    IS_ADAPTER,
    LAYER_PIN,
    ON_HOST,
    Context,
    Tensor,
    add,
    argsort_top_k,
    cast,
    clamp,
    cont,
    cont_nd,
    div,
    dup,
    fill,
    flash_attn_ext,
    get_rows,
    glu,
    glu_split,
    inp,
    mm,
    mul,
    mul_mat,
    mul_mat_id,
    norm,
    op_weight,
    permute,
    reshape,
    rms_norm,
    rope,
    scale,
    set_rows,
    soft_max,
    sqr,
    sqrt,
    srcs,
    sum_rows,
    transpose,
    unary,
    view,
    weight,
)
from fitter.ggml.types import F16, F32, I32, row_size
from fitter.llama.cparams import ContextParams, reserve_ubatch
from fitter.llama.graph_details import GraphDetails
from fitter.llama.graph_kv import KVCacheView, KVGraph
from fitter.llama.hparams import LayerKind, LayerSpec, ModelSpec

# what the graph builders call a matmul's output -> the weight's GGUF suffix (for its type)
WEIGHT_OF = {
    "Qcur": "attn_q", "Kcur": "attn_k", "Vcur": "attn_v", "wqkv": "attn_qkv", "attn_out": "attn_output",
    "ffn_up": "ffn_up", "ffn_gate": "ffn_gate", "ffn_out": "ffn_down", "ffn_moe_logits": "ffn_gate_inp",
    "ffn_moe_up": "ffn_up_exps", "ffn_moe_gate": "ffn_gate_exps", "ffn_moe_down": "ffn_down_exps",
    "ffn_moe_gate_up": "ffn_gate_up_exps", "result_output": "output", "q_a": "attn_q_a", "q": "attn_q_b",
    "kv_cmpr_pe": "attn_kv_a_mqa", "q_nope_absorbed": "attn_k_b", "kv": "attn_kv_b", "fattn_mla": "attn_v_b",
    "kqv_mla": "attn_v_b", "qkv_mixed": "attn_qkv", "z": "attn_gate", "beta": "ssm_beta", "alpha": "ssm_alpha",
    "mixed_ba": "ssm_ba", "mixed_qkvz": "ssm_in", "ssm_out": "ssm_out", "Qcur_full": "attn_q",
    "shared_gate": "ffn_gate_inp_shexp", "per_layer_inp_gate": "inp_gate", "per_layer_proj": "proj",
    # the experts' biases (ADD_ID): the overrides of their experts' tensor names match them too
    "ffn_moe_gate_up_b": "ffn_gate_up_exps", "ffn_moe_up_b": "ffn_up_exps", "ffn_moe_gate_b": "ffn_gate_exps",
    "ffn_moe_down_b": "ffn_down_exps",
}


# matmuls llama.cpp builds with a plain ggml_mul_mat, not build_lora_mm (src/models/<arch>.cpp, build_attn_mha's
# v_mla): an adapter's pair on their weights is loaded but changes no graph
_PLAIN_MUL_MAT = {
    "deepseek2": frozenset(("attn_q_a", "attn_q_b", "attn_q", "attn_kv_a_mqa", "attn_k_b", "attn_kv_b", "output")),
}
_PLAIN_ANY = frozenset(("attn_v_b",))

# a family's build_graph: yields the embeddings, then each layer's output; the driver sends (layer, input)
# pairs and (None, last output) for the epilogue (see fitter.llama.context)
GraphGen = Generator[Tensor, tuple[int | None, Tensor], None]

class GraphContext(KVGraph):
    """llm_graph_context: shared builders; each architecture's graph is a function in fitter.llama.models."""

    def __init__(self, spec: ModelSpec, cp: ContextParams, details: GraphDetails):
        self.spec = spec
        self.cp = cp
        self.d = details
        self.arch = spec.architecture
        self.fa = cp.flash_attn
        # the V cache transposed without flash attention (llama_model::create_memory: attn_v_trans)
        self.v_trans = not cp.flash_attn if cp.v_trans is None else cp.v_trans
        self.build = cp.build
        # MLA caches only the latent K (V is a view of it) since #19067; before, V had a cache of its own (0.3.16)
        self.v_less = spec.is_mla and self.build.has("mla_v_less_cache")
        n_tokens, self.n_outputs, n_seqs, rounded = reserve_ubatch(cp)
        self.n_tokens = n_tokens
        # the unit n_tokens is traced in (trace_tokens): its largest power-of-two divisor up to 256, so that GGML_PAD
        # and the chunkings of 64 stay exact forms; 0 (n_tokens kept in the trace's key) where it was rounded up
        self.tokens_unit = 0 if rounded else min(n_tokens & -n_tokens, 256)
        self.n_seqs = n_seqs
        self.n_stream = 1 if cp.kv_unified else n_seqs
        self.g = Graph()
        self.v_gqa_max = max((l.n_embd_v_gqa for l in spec.layers), default=0)
        self.n_embd = spec.n_embd
        self.mtp = False  # the MTP draft context's graph (graph_mtp)
        self.ctx0 = Context()  # ggml_context of the graph being built (and the simulator's state)
        self.symbolic = False  # cache sizes as fitter.ggml.symbolic.Sym (a graph traced to serve every n_ctx; trace_tokens)
        if details.lora_graph:
            self.ctx0.lora = self.lora_pairs

    def lora_pairs(self, op: str) -> tuple[tuple[int, int, int], ...]:
        """The LoRA pairs (rank, lora_a type, lora_b type) on the weight of the matmul named `op` in the layer being
        built (llama_adapter_lora::get_weight by the weight's name), unless llama.cpp multiplies it plainly."""
        suffix = WEIGHT_OF.get(op)
        if suffix is None or suffix in _PLAIN_ANY or suffix in _PLAIN_MUL_MAT.get(self.arch, ()):
            return ()
        il = self.ctx0.layer
        return self.d.lora_graph.get(f"blk.{il}.{suffix}.weight" if il is not None else f"{suffix}.weight", ())

    def _lora_embd(self, cur: Tensor, tokens: Tensor) -> Tensor:
        """build_inp_embd's adapters on token_embd: cur + scale(lora_b x get_rows(lora_a, tokens)) (lora_b is not
        transposed there)."""
        ctx0 = self.ctx0
        for rank, ta, tb in self.d.lora_graph.get("token_embd.weight", ()):
            a = weight(ctx0, (rank, self.spec.n_vocab), "token_embd", host=True, type_=ta)
            rows = get_rows(ctx0, a, tokens, "embd_lora_a")
            b = weight(ctx0, (rank, cur.ne[0]), "token_embd", host=True, type_=tb)
            a.w = b.w = IS_ADAPTER
            d = mul_mat(ctx0, b, rows, "embd_lora_b")
            cur = add(ctx0, cur, scale(ctx0, d, "embd_lora_scaled"), "embd")
        return cur

    def trace_tokens(self) -> None:
        """n_tokens (and n_outputs with it) as a Sym, so that the graph being traced serves every ubatch of its unit."""
        if self.tokens_unit:
            t = Sym.var(2, self.n_tokens, self.tokens_unit)
            self.n_outputs = min(t, self.cp.n_outputs_max) if self.build.has("logits_whole_ubatch") else t
            self.n_tokens = t

    # ---- inputs ------------------------------------------------------------------------------

    def build_inp_embd(self, n_embd_inp: int | None = None) -> Tensor:  # llm_graph_context::build_inp_embd
        ctx0 = self.ctx0
        n_embd_inp = n_embd_inp or self.n_embd
        tokens = inp(ctx0, I32, (self.n_tokens,), "inp_tokens")
        if not self.build.has("embd_input_always"):
            # before #18898 (0.3.16 build_inp_embd): a token batch has only the tokens input
            cur = get_rows(ctx0, weight(ctx0, (n_embd_inp, self.spec.n_vocab), "token_embd", host=True), tokens, "embd")
            if self.d.lora_graph:
                cur = self._lora_embd(cur, tokens)
            self.g.expand(cur)
            return cur
        embd = inp(ctx0, F32, (n_embd_inp, self.n_tokens), "inp_embd")
        cur = get_rows(ctx0, weight(ctx0, (n_embd_inp, self.spec.n_vocab), "token_embd", host=True), tokens, "embd")
        if self.d.lora_graph:
            cur = self._lora_embd(cur, tokens)
        # ggml_build_forward_select: both alternatives enter the graph, the unused one as a leaf
        self.g.expand(cur)
        self.g.expand(embd)
        return cur

    def build_inp_pos(self, n_pos_per_embd: int = 1) -> Tensor:
        ctx0 = self.ctx0
        return inp(ctx0, I32, (self.n_tokens * n_pos_per_embd,), "inp_pos")

    def build_inp_out_ids(self) -> Tensor:
        ctx0 = self.ctx0
        return inp(ctx0, I32, (self.n_outputs,), "out_ids")

    def build_norm(self, cur: Tensor, with_weight: bool = True, bias: bool = False, kind: str = "rms", name: str = "norm") -> Tensor:
        ctx0 = self.ctx0
        cur = rms_norm(ctx0, cur, name) if kind == "rms" else norm(ctx0, cur, name)
        if (with_weight or bias) and ctx0.layer is not None:  # cb(cur, "norm", il)
            cur.flags |= LAYER_PIN
        if with_weight:
            cur = mul(ctx0, cur, None, name + "op_weight")
        if bias:
            cur = add(ctx0, cur, None, name + "_b")
        return cur

    def build_qkv(self, layer: LayerSpec, cur: Tensor, bias: bool = False, fused: bool = False,
                  head_q: int | None = None, n_head_q: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        ctx0 = self.ctx0
        hq = head_q or layer.n_embd_head_k
        nq = n_head_q or layer.n_head
        hk, nk = layer.n_embd_head_k, layer.n_head_kv
        hv = layer.n_embd_head_v
        n_tokens = cur.ne[1]
        if fused:  # layer.wqkv
            qkv = mm(ctx0, hq * nq + hk * nk + hv * nk, cur, "wqkv")
            if bias:
                qkv = add(ctx0, qkv, None, "wqkv_b")
            rs = lambda n: row_size(qkv.type, n)
            q = view(ctx0, qkv, (hq, nq, n_tokens), (rs(hq), qkv.nb[1]), "Qcur")
            k = view(ctx0, qkv, (hk, nk, n_tokens), (rs(hk), qkv.nb[1]), "Kcur")
            v = view(ctx0, qkv, (hv, nk, n_tokens), (rs(hv), qkv.nb[1]), "Vcur")
            return q, k, v
        q = mm(ctx0, hq * nq, cur, "Qcur")
        if bias:
            q = add(ctx0, q, None, "Qcur")
        k = mm(ctx0, hk * nk, cur, "Kcur")
        if bias:
            k = add(ctx0, k, None, "Kcur")
        v = mm(ctx0, hv * nk, cur, "Vcur")
        if bias:
            v = add(ctx0, v, None, "Vcur")
        q = reshape(ctx0, q, (hq, nq, n_tokens), "Qcur")
        k = reshape(ctx0, k, (hk, nk, n_tokens), "Kcur")
        v = reshape(ctx0, v, (hv, nk, n_tokens), "Vcur")
        return q, k, v

    def build_ffn(self, cur: Tensor, n_ff: int, *, up: bool = True, gate: str | None = "par", act: str = "silu",
                  up_rows: int | None = None, down: int | None = None, il: int = -1) -> Tensor:
        """llm_graph_context::build_ffn. gate: 'par', 'seq' or None; act: silu, gelu, relu, relu_sqr, swiglu, geglu."""
        ctx0 = self.ctx0
        tmp = mm(ctx0, up_rows or n_ff, cur, "ffn_up") if up else cur
        if gate == "seq":
            cur = mm(ctx0, n_ff, tmp, "ffn_gate")
        elif gate == "par":
            cur = mm(ctx0, n_ff, cur, "ffn_gate")
        else:
            cur = tmp
        par = gate == "par"
        if act in ("silu", "gelu", "relu"):
            if par:
                cur = glu_split(ctx0, cur, tmp, f"ffn_{act}glu")
                par = False
            else:
                cur = unary(ctx0, cur, f"ffn_{act}")
        elif act == "relu_sqr":
            cur = sqr(ctx0, unary(ctx0, cur, "ffn_relu"), "ffn_sqr")
        elif act in ("swiglu", "geglu", "reglu"):
            cur = glu(ctx0, cur, "ffn_" + act)
        elif act == "swiglu_oai":
            cur = glu_split(ctx0, cur, tmp, "ffn_swiglu_oai")
            par = False
        if par:
            cur = mul(ctx0, cur, tmp, "ffn_gate_par")
        return mm(ctx0, down or self.n_embd, cur, "ffn_out")

    # long because llm_graph_context::build_moe_ffn (llama-graph.cpp), node for node
    def build_moe_ffn(self, cur: Tensor, l: LayerSpec, il: int, *, gating: int = 1, probs_b: bool = False,
                      norm_w: bool = True, w_scale: float = 0.0, gate_inp_b: bool = False, exps_b: bool = False,
                      act: str = "silu", gate_up: bool = False, has_gate: bool = True, probs_in: Tensor | None = None) -> Tensor:
        """llm_graph_context::build_moe_ffn. gating: 1 softmax, 2 sigmoid, 3 softmax_weight, 4 sqrt_softplus.

        It follows upstream's function node for node (the node order is what the allocator sees), so it is kept
        whole to be read side by side with llama-graph.cpp.
        """
        ctx0 = self.ctx0
        g = self.g
        n_embd, n_tokens = cur.ne[0], cur.ne[1]
        n_expert = self.spec.n_expert
        n_used = l.n_expert_used or self.spec.n_expert_used
        n_ff = l.n_ff_exp
        logits = mm(ctx0, n_expert, cur, f"ffn_moe_logits-{il}") if probs_in is None else probs_in
        if gate_inp_b:
            logits = add(ctx0, logits, None, f"ffn_moe_logits_biased-{il}")
        if gating == 2:
            probs = unary(ctx0, logits, f"ffn_moe_probs-{il}", "sigmoid")
        elif gating == 3:
            probs = logits
        elif gating == 4:
            probs = sqrt(ctx0, unary(ctx0, logits, "", "softplus"), f"ffn_moe_probs-{il}")
        else:
            probs = soft_max(ctx0, logits, None, None, f"ffn_moe_probs-{il}")
        selection = probs
        if probs_b:
            selection = add(ctx0, probs, None, f"ffn_moe_probs_biased-{il}")
        n_groups = self.d.n_expert_groups
        if n_groups > 1 and n_tokens > 0:
            per = n_expert // n_groups
            groups = reshape(ctx0, selection, (per, n_groups, n_tokens))
            scores = argsort_top_k(ctx0, groups, 2, f"group_scores-{il}")
            scores = get_rows(ctx0, reshape(ctx0, groups, (1, groups.ne[0], groups.ne[1], groups.ne[2])), scores)
            scores = sum_rows(ctx0, reshape(ctx0, scores, (scores.ne[1], scores.ne[2], scores.ne[3])))
            scores = reshape(ctx0, scores, (scores.ne[1], scores.ne[2]))
            expert_groups = argsort_top_k(ctx0, scores, self.d.n_group_used, f"ffn_moe_group_topk-{il}")
            selection = get_rows(ctx0, groups, expert_groups)
            selection = set_rows(ctx0, fill(ctx0, groups), selection, expert_groups)
            selection = reshape(ctx0, selection, (n_expert, n_tokens))
        selected = argsort_top_k(ctx0, selection, n_used, f"ffn_moe_topk-{il}")
        probs = reshape(ctx0, probs, (1, n_expert, n_tokens))
        weights = get_rows(ctx0, probs, selected, f"ffn_moe_weights-{il}")
        if gating == 3:
            weights = reshape(ctx0, weights, (n_used, n_tokens))
            weights = soft_max(ctx0, weights, None, None, f"ffn_moe_weights_softmax-{il}")
            weights = reshape(ctx0, weights, (1, n_used, n_tokens))
        if norm_w:
            weights = reshape(ctx0, weights, (n_used, n_tokens))
            wsum = sum_rows(ctx0, weights, f"ffn_moe_weights_sum-{il}")
            wsum = clamp(ctx0, wsum)
            if not self.build.has("gallocr_clamp_inplace"):
                wsum.inpl = False  # ggml_op_can_inplace has no GGML_OP_CLAMP before 0.3.36 (0.3.35 ggml-alloc.c)
            weights = div(ctx0, weights, wsum, f"ffn_moe_weights_norm-{il}")
            weights = reshape(ctx0, weights, (1, n_used, n_tokens))
        if w_scale != 0.0 and w_scale != 1.0:
            weights = scale(ctx0, weights, f"ffn_moe_weights_scaled-{il}")
        g.expand(weights)
        cur = reshape(ctx0, cur, (n_embd, 1, n_tokens))
        if gate_up:
            gu = mul_mat_id(ctx0, 2 * n_ff, cur, selected, f"ffn_moe_gate_up-{il}", n_expert)
            if exps_b:
                gu = dup(ctx0, "ADD_ID", gu, srcs(gu, op_weight(ctx0, (gu.ne[0], n_expert), "ffn_moe_gate_up_b", True), selected))
            cur = view(ctx0, gu, (n_ff, gu.ne[1], gu.ne[2]), (gu.nb[1], gu.nb[2]), f"ffn_moe_gate-{il}")
            up = view(ctx0, gu, (n_ff, gu.ne[1], gu.ne[2]), (gu.nb[1], gu.nb[2]), f"ffn_moe_up-{il}")
        else:
            up = mul_mat_id(ctx0, n_ff, cur, selected, f"ffn_moe_up-{il}", n_expert)
            if exps_b:
                up = dup(ctx0, "ADD_ID", up, srcs(up, op_weight(ctx0, (up.ne[0], n_expert), "ffn_moe_up_b", True), selected), f"ffn_moe_up_biased-{il}")
            if has_gate:
                cur = mul_mat_id(ctx0, n_ff, cur, selected, f"ffn_moe_gate-{il}", n_expert)
            else:
                cur = up
            if exps_b:
                cur = dup(ctx0, "ADD_ID", cur, srcs(cur, op_weight(ctx0, (cur.ne[0], n_expert), "ffn_moe_gate_b", True), selected), f"ffn_moe_gate_biased-{il}")
        if act == "swiglu_oai" or has_gate or gate_up:
            cur = glu_split(ctx0, cur, up, f"ffn_moe_{act}-{il}")
        else:
            cur = unary(ctx0, cur, f"ffn_moe_{act}-{il}")
        experts = mul_mat_id(ctx0, n_embd, cur, selected, f"ffn_moe_down-{il}", n_expert)
        if exps_b:
            experts = dup(ctx0, "ADD_ID", experts, srcs(experts, op_weight(ctx0, (experts.ne[0], n_expert), "ffn_moe_down_b", True), selected), f"ffn_moe_down_biased-{il}")
        experts = mul(ctx0, experts, weights, f"ffn_moe_weighted-{il}")
        g.expand(experts)
        views = []
        for _ in range(n_used):
            v = view(ctx0, experts, (n_embd, n_tokens), (experts.nb[2],), f"ffn_moe_view-{il}")
            g.expand(v)
            views.append(v)
        moe_out = views[0]
        for i in range(1, n_used):
            moe_out = add(ctx0, moe_out, views[i], f"ffn_moe_out-{il}")
            g.expand(moe_out)
        if n_used == 1:
            moe_out = cont(ctx0, moe_out, f"ffn_moe_out-{il}")
        return moe_out

    def moe_args(self, il: int) -> dict:
        """The build_moe_ffn arguments most architectures pass (softmax gating, normalized weights)."""
        d = self.d
        return dict(gating=1, norm_w=True, w_scale=d.expert_weights_scale,
                    gate_up=d.has("ffn_gate_up_exps", il) and not d.has("ffn_up_exps", il))

    def moe_args_selected(self, il: int, default_gating: int) -> dict:
        """build_moe_ffn arguments from the header's gating function, selection bias and weight norm
        (glm4moe, deepseek2); default_gating stands in when the header has no expert_gating_func."""
        d = self.d
        gating = d.expert_gating_func or default_gating
        return dict(gating=gating, probs_b=d.has("exp_probs_b.bias", il), norm_w=d.expert_weights_norm,
                    w_scale=d.expert_weights_scale, gate_up=d.has("ffn_gate_up_exps", il) and not d.has("ffn_up_exps", il))

    def build_attn_mha(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, kq_b: Tensor | None = None, sinks: bool = False,
                       v_mla: int = 0, softcap: bool = False, il: int = -1) -> Tensor:  # build_attn_mha
        ctx0 = self.ctx0
        v_trans = v.nb[1] > v.nb[2]
        n_stream = k.ne[3]
        q = view(ctx0, q, (q.ne[0], q.ne[1], q.ne[2] // n_stream, n_stream), (q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // n_stream)), "q")
        q = permute(ctx0, q, 0, 2, 1, 3)
        k = permute(ctx0, k, 0, 2, 1, 3)
        v = permute(ctx0, v, 0, 2, 1, 3)
        if self.fa and kq_b is None:
            if v_trans:
                v = transpose(ctx0, v)
            if k.type == F32:
                k = cast(ctx0, k, F16)
            if v.type == F32:
                v = cast(ctx0, v, F16)
            cur = flash_attn_ext(ctx0, q, k, v, mask, op_weight(ctx0, (q.ne[2],), "attn_sinks", True) if sinks else None, f"fattn-{il}")
            if v_mla:
                cur = permute(ctx0, cur, 0, 2, 1, 3)
                cur = mm(ctx0, v_mla, cur, f"fattn_mla-{il}")
                cur = permute(ctx0, cur, 0, 2, 1, 3)
                cur = cont(ctx0, cur)
            cur = reshape(ctx0, cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
        else:
            kq = mul_mat(ctx0, k, q, f"kq-{il}")
            if softcap:
                kq = scale(ctx0, kq, f"kq_scaled_1-{il}")
                kq = unary(ctx0, kq, f"kq_tanh-{il}")
                kq = scale(ctx0, kq, f"kq_scaled_2-{il}")
            if kq_b is not None:
                kq = add(ctx0, kq, kq_b, f"kq_plus_kq_b-{il}")
            kq = soft_max(ctx0, kq, mask, op_weight(ctx0, (kq.ne[2],), "attn_sinks", True) if sinks else None, f"kq_soft_max-{il}")
            if not v_trans:
                v = cont(ctx0, transpose(ctx0, v), f"v_cont-{il}")
            kqv = mul_mat(ctx0, v, kq, f"kqv-{il}")
            if v_mla:
                kqv = mm(ctx0, v_mla, kqv, f"kqv_mla-{il}")
            cur = permute(ctx0, kqv, 0, 2, 1, 3)
            cur = cont_nd(ctx0, cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), f"kqv_out-{il}")
            if ctx0.kv_dev == HOST:  # !offload_kqv: "all nodes between the KV store and the attention output" on the CPU
                cur.flags |= ON_HOST
        self.g.expand(cur)
        return cur

    def build_attn(self, ai: dict, q: Tensor, k: Tensor | None, v: Tensor | None, il: int, *, wo: int | None = None,
                   wo_b: bool = False, sinks: bool = False, softcap: bool = False, v_mla: int = 0) -> Tensor:
        """llm_graph_context::build_attn for llm_graph_input_attn_kv / _kv_iswa (K+V caches)."""
        ctx0 = self.ctx0
        g = self.g
        kv: KVCacheView
        if ai.get("k_only"):  # build_attn(llm_graph_input_attn_k *): the cached K doubles as V
            assert k is not None and v is not None  # only gemma4's shared-KV layers pass None, and they are iswa
            kv = ai["kv"]
            g.expand(q)
            g.expand(v)
            g.expand(k)
            g.expand(self.cpy_k(kv, k, ai["k_idxs"], il))
            kk = self.get_k(kv, il)
            vv = view(ctx0, kk, (v.ne[0], kk.ne[1], kk.ne[2], kk.ne[3]), (kk.nb[1], kk.nb[2], kk.nb[3]), "v")
            cur = self.build_attn_mha(q, kk, vv, ai["mask"], v_mla=v_mla, il=il)
            return mm(ctx0, wo if wo is not None else self.n_embd, cur, f"attn_out-{il}")
        iswa = ai.get("iswa", False)
        if iswa:
            ai = ai["swa"] if self.spec.layers[il].kind == LayerKind.SWA else ai["base"]
        kv = ai["kv"]
        k_rot, v_rot = ai["k_rot"], ai["v_rot"]
        if k_rot is not None:
            q = self.hadamard(q, k_rot)
            if k is not None:
                k = self.hadamard(k, k_rot)
        if v_rot is not None and v is not None:
            v = self.hadamard(v, v_rot)
        if iswa:
            g.expand(q)
            if k is not None:
                g.expand(k)
            if v is not None:
                g.expand(v)
        else:
            assert k is not None and v is not None  # only gemma4's shared-KV layers pass None, and they are iswa
            g.expand(q)
            g.expand(v)
            g.expand(k)
        if k is not None:
            g.expand(self.cpy_k(kv, k, ai["k_idxs"], il))
        if v is not None:
            g.expand(self.cpy_v(kv, v, ai["v_idxs"], il))
        kk = self.get_k(kv, il)
        vv = self.get_v(kv, il)
        cur = self.build_attn_mha(q, kk, vv, ai["mask"], sinks=sinks, softcap=softcap, v_mla=v_mla, il=il)
        if v_rot is not None:
            cur = self.hadamard(cur, v_rot)
        if wo == 0:  # no output projection inside build_attn (the caller applies it)
            return cur
        cur = mm(ctx0, wo if wo is not None else self.n_embd, cur, f"attn_out-{il}")
        if wo_b:
            cur = add(ctx0, cur, None, f"attn_out_b-{il}")
        return cur

    def build_qk_rope(self, q: Tensor, k: Tensor, inp_pos: Tensor, il: int, *, qk_norm: bool = False) -> tuple[Tensor, Tensor]:
        """RoPE on Q and K (each RMS-normed first with qk_norm), in the order the family builders write them."""
        if qk_norm:
            q = self.build_norm(q, name=f"Qcur_normed-{il}")
        q = rope(self.ctx0, q, inp_pos, None, f"Qcur-{il}")
        if qk_norm:
            k = self.build_norm(k, name=f"Kcur_normed-{il}")
        k = rope(self.ctx0, k, inp_pos, None, f"Kcur-{il}")
        return q, k

    def skip_unused_rows(self, il: int, out_ids: Tensor, *ts: Tensor) -> tuple[Tensor, ...]:
        """The last layer keeps only the rows of the outputs: `if (il == n_layer - 1 && inp_out_ids)` get_rows each."""
        if il != self.spec.n_layer - 1:
            return ts
        return tuple(get_rows(self.ctx0, t, out_ids) for t in ts)

    def build_result(self, inpL: Tensor) -> tuple[Tensor, Tensor]:
        """result_norm and result_output (the logits) over the last layer's output."""
        cur = self.build_norm(inpL, name="result_norm")
        return cur, mm(self.ctx0, self.spec.n_vocab, cur, "result_output")

    def build_layers(self, inpL: Tensor, layer: Callable[[int, Tensor], Tensor]) -> Generator[Tensor, tuple, Tensor]:
        """The layer loop of a family's build_graph (delegate to it with `yield from`): the driver sends (layer,
        input) pairs (see fitter.llama.context) and receives each layer's output; returns the last input."""
        il, inpL = yield inpL
        while il is not None:
            il, inpL = yield layer(il, inpL)
        return inpL

    def finish(self, *outputs: Tensor) -> None:
        for t in outputs:
            if t is not None:
                t.flags |= FLAG_OUTPUT
        self.g.expand(outputs[-1])
