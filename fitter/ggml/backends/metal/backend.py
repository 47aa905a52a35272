"""The Metal backend: ggml-metal's buffer types, alloc sizes and op support (Apple Silicon).

Mirrors ggml/src/ggml-metal/ggml-metal.cpp and ggml-metal-device.m of the pinned llama.cpp
0c1e57098bba: ggml_backend_metal_buffer_type_{shared,private,mapped} (alignment 32, max size the
device's maxBufferLength, get_alloc_size below), ggml_metal_device_supports_op and the device's
offload_op (matmuls only). The host buffer next to it is the CPU's. Metal's graph_optimize (the
concurrency reorder of ggml-metal-common.cpp, whose packs come from ggml-metal-fusion.cpp since 0.3.36) is
fitter.ggml.backends.metal.common.

Other llama.cpp builds (`backends.get("metal").for_build(build)`): 0.3.16's ggml-metal.m had no get_alloc_size
(ggml_nbytes for every op); 0.3.17-0.3.35 (ggml-metal.cpp) add the FA pad (with K's and V's own strides), blk and
tmp, MUL_MAT_ID tpe and ids, the CUMSUM/ARGSORT/TOP_K sizes; kv_f16 (and the f16 pad strides) since #27390, amax
and idx since 0.3.36 (fitter.llama_builds.changes: metal_alloc_size_extras, metal_fa_kv_f16_extra, metal_mul_mat_id_amax,
metal_fa_sparse_idx).

get_alloc_size terms (bytes added to ggml_nbytes of the op's output)
-------------------------------------------------------------------
Notation: FLASH_ATTN_EXT has Q = src0 [Dk, n_q, n_head, n_stream] f32, K = src1 [Dk, n_kv, n_head_kv,
n_stream], V = src2 [Dv, n_kv, n_head_kv, n_stream], mask = src3 [n_kv, n_q, 1, n_stream] f16;
output [Dv, n_head, n_q, n_stream] f32. nb11 / nb21 are K's / V's stride between KV cells
(for a KV-cache view: ggml_row_size(type, n_embd_k_gqa) / (type, n_embd_v_gqa)).

=====================  =========================================================  ==========================================
term                   formula                                                    source (ggml/src/...)
=====================  =========================================================  ==========================================
metal FA pad           64 * (nb11p*n_head_kv*ns + nb21p*n_head_kv*ns + 2*n_q*ns)  ggml-metal/ggml-metal-ops.cpp
                       nb11p = 2*Dk, nb21p = 2*Dv (2*Dk if V is a view of K)      ggml_metal_op_flash_attn_ext_extra_pad
                       when use_kv_f16, else nb11 / nb21; always reserved         (OP_FLASH_ATTN_EXT_NCPSG = 64)
metal FA use_kv_f16    n_q >= 32 and K type in {q4_0,q4_1,q5_0,q5_1,q8_0}         ggml_metal_op_flash_attn_ext_use_kv_f16
metal FA blk           pad32(ceil(n_kv/C) * ceil(n_q/Q) * 1 * ns) with a mask;     ggml_metal_op_flash_attn_ext_extra_blk
                       vec (n_q < 20 and Dk % 32 == 0): Q=1, C=32; else Q=8, C=64
metal FA tmp           4 * min(n_q, 32) * n_head * ns * 32 * (Dv + 2), always      ggml_metal_op_flash_attn_ext_extra_tmp
metal FA kv_f16        pad16(2*Dk*n_kv*n_head_kv*ns) + pad16(2*Dv*n_kv*n_head_kv*ns) ggml_metal_op_flash_attn_ext_extra_kv_f16
                       (V term omitted when V is a view of K, MLA); ALWAYS        (+ _kv_f16_k_size; PR #27390)
                       reserved, whatever the K/V type and n_q
metal FA idx           pad16(4 * pad(n_kv_max, 32) * n_q * 1 * ns) only with a     ggml_metal_op_flash_attn_ext_extra_idx
                       sparse n_kv_max hint (op_params[4], DSA top-k paths) <=     (..._n_kv_max_sparse)
                       4096, supported (Dk,Dv) pair and K type; else 0
metal MUL_MAT_ID tpe   4 * n_expert                                               ggml_metal_op_mul_mat_id_extra_tpe
metal MUL_MAT_ID ids   4 * n_expert * n_tokens (ids->ne[1])                       ggml_metal_op_mul_mat_id_extra_ids
metal MUL_MAT_ID amax  8 + 4 * N_MM_NPART_AMAX = 1032                             ggml_metal_op_mul_mat_id_extra_amax
metal ARGSORT, CUMSUM  2 * ggml_nbytes (replaces, not adds)                       ggml_backend_metal_buffer_type_get_alloc_size
metal TOP_K            2 * 4 * ggml_nelements(src0) (replaces ggml_nbytes)        ggml_backend_metal_buffer_type_get_alloc_size
=====================  =========================================================  ==========================================

A Metal buffer occupies its size rounded up to the page size (16 KiB on Apple Silicon:
ggml_metal_buffer_init / ggml_metal_buffer_map); llama.cpp logs the unrounded size, which is what is
predicted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from fitter.ggml.backends.base import (
    SIZE_MAX,
    Backend,
    BackendImpl,
    FlashAttnShape,
    _nbytes_of,
    _ne4,
    _op,
    flash_attn_shape_of,
)
from fitter.ggml.backends.metal.common import graph_optimize as metal_graph_optimize
from fitter.ggml.backends.metal.evidence import metal_margin
from fitter.ggml.graph import Segment
from fitter.ggml.replay import ChunkPlan
from fitter.ggml.tensor import Tensor
from fitter.ggml.types import pad, type_name
from fitter.llama_builds import PINNED, LlamaBuild

if TYPE_CHECKING:
    from fitter.ggml.backends.probes import DeviceProbes, FreeMemory

# ggml-metal.cpp ggml_backend_metal_buffer_type_{shared,private,mapped}_get_alignment
METAL_ALIGNMENT = 32
# ggml-metal/ggml-metal-impl.h
METAL_FA_NQPSG = 8  # OP_FLASH_ATTN_EXT_NQPSG
METAL_FA_NCPSG = 64  # OP_FLASH_ATTN_EXT_NCPSG
METAL_FA_VEC_NQPSG = 1  # OP_FLASH_ATTN_EXT_VEC_NQPSG
METAL_FA_VEC_NCPSG = 32  # OP_FLASH_ATTN_EXT_VEC_NCPSG
METAL_N_MM_NPART_AMAX = 256  # N_MM_NPART_AMAX


def metal_fa_use_vec(s: FlashAttnShape) -> bool:
    """ggml_metal_op_flash_attn_ext_use_vec: small batch and a head size multiple of 32."""
    return s.n_q < 20 and s.d_k % 32 == 0


# ggml_metal_op_flash_attn_ext_use_kv_f16's types: the quantized K types it dequantizes to f16 first
METAL_FA_KV_F16_TYPES = frozenset({"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"})


def metal_fa_use_kv_f16(s: FlashAttnShape) -> bool:
    """ggml_metal_op_flash_attn_ext_use_kv_f16: dequantize a quantized K/V to f16 first (>= 32 queries)."""
    if s.n_q < 32:
        return False
    return type_name(s.type_k) in METAL_FA_KV_F16_TYPES


def metal_fa_n_kv_max_sparse(s: FlashAttnShape) -> int:
    """ggml_metal_op_flash_attn_ext_n_kv_max_sparse: the sparse-index hint, or 0 when not usable."""
    if s.n_kv_max <= 0 or not s.has_mask or s.n_kv_max > 4096:
        return 0
    pairs = {(32, 32), (64, 64), (96, 96), (96, 64), (128, 128), (192, 128), (192, 192), (256, 256),
             (320, 256), (512, 512), (576, 512)}
    if (s.d_k, s.d_v) not in pairs:
        return 0
    if type_name(s.type_k) not in ("f16", "bf16", "f32", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        return 0
    return s.n_kv_max


def metal_fa_extra_pad(s: FlashAttnShape, build: LlamaBuild = PINNED) -> int:
    """ggml_metal_op_flash_attn_ext_extra_pad: a 64-cell tail of K, V and mask (always reserved)."""
    # the tail is copied from the f16 scratch since #27390; before (0.3.35 ggml-metal-ops.cpp), K's and V's own strides
    use_kv_f16 = metal_fa_use_kv_f16(s) and build.has("metal_fa_kv_f16_extra")
    nb11, nb21 = s.nb11, s.nb21
    if use_kv_f16:
        nb11 = 2 * s.d_k  # sizeof(ggml_fp16_t)*ne10
        nb21 = 2 * (s.d_k if s.v_is_view_of_k else s.d_v)
    mask = 2 * s.n_q * 1 * s.n_stream if s.has_mask else 0  # ggml_type_size(F16)*ne31*ne32*ne33
    # the non-vec kernel's OP_FLASH_ATTN_EXT_NCPSG (64) is always reserved
    return METAL_FA_NCPSG * (nb11 * s.n_head_kv * s.n_stream + nb21 * s.n_head_kv * s.n_stream + mask)


def metal_fa_extra_blk(s: FlashAttnShape) -> int:
    """ggml_metal_op_flash_attn_ext_extra_blk: one i8 per (query block, KV block) of the mask."""
    if not s.has_mask:
        return 0
    vec = metal_fa_use_vec(s)
    nqptg = METAL_FA_VEC_NQPSG if vec else METAL_FA_NQPSG
    ncpsg = METAL_FA_VEC_NCPSG if vec else METAL_FA_NCPSG
    ne1 = (s.n_q + nqptg - 1) // nqptg
    ne0 = (s.n_kv + ncpsg - 1) // ncpsg
    return pad(ne0 * ne1 * 1 * s.n_stream, 32)


def metal_fa_extra_tmp(s: FlashAttnShape) -> int:
    """ggml_metal_op_flash_attn_ext_extra_tmp: f32 partials of 32 workgroups, <= 32 query rows (always)."""
    nwg = 32
    return 4 * (min(s.n_q, 32) * s.n_head * s.n_stream * nwg * (s.d_v + 2))


def metal_fa_extra_kv_f16(s: FlashAttnShape) -> int:
    """ggml_metal_op_flash_attn_ext_extra_kv_f16: f16 copies of K and V, always reserved (PR #27390).

    Reserved for every K/V type and batch size "to avoid graph reallocations", although the dequant
    pass only runs when metal_fa_use_kv_f16 is true (and not on the sparse path).
    """
    k = pad(2 * s.d_k * s.n_kv * s.n_head_kv * s.n_stream, 16)  # ggml_metal_op_flash_attn_ext_kv_f16_k_size
    if s.v_is_view_of_k:
        return k
    return k + pad(2 * s.d_v * s.n_kv * s.n_head_kv * s.n_stream, 16)


def metal_fa_extra_idx(s: FlashAttnShape) -> int:
    """ggml_metal_op_flash_attn_ext_extra_idx: sparse KV index lists (0 unless an n_kv_max hint is usable)."""
    n_kv_max = metal_fa_n_kv_max_sparse(s)
    if n_kv_max <= 0:
        return 0
    return pad(4 * pad(n_kv_max, METAL_FA_VEC_NCPSG) * s.n_q * 1 * s.n_stream, 16)


def metal_fa_extras(s: FlashAttnShape, build: LlamaBuild = PINNED) -> dict[str, int]:
    """Each term ggml_backend_metal_buffer_type_get_alloc_size adds to a FLASH_ATTN_EXT output, in `build`'s ggml."""
    if not build.has("metal_alloc_size_extras"):
        return {}  # 0.3.16 ggml-metal.m: no get_alloc_size (ggml_nbytes)
    out = {"pad": metal_fa_extra_pad(s, build), "blk": metal_fa_extra_blk(s), "tmp": metal_fa_extra_tmp(s)}
    if build.has("metal_fa_kv_f16_extra"):  # #27390 (0.3.36 ggml-metal.cpp); 0.3.17-0.3.35: pad, blk, tmp only
        out["kv_f16"] = metal_fa_extra_kv_f16(s)
    if build.has("metal_fa_sparse_idx"):
        out["idx"] = metal_fa_extra_idx(s)
    return out


def metal_fa_alloc_size(s: FlashAttnShape, build: LlamaBuild = PINNED) -> int:
    """ggml_backend_metal_buffer_type_get_alloc_size of a FLASH_ATTN_EXT node."""
    return s.out_nbytes + sum(metal_fa_extras(s, build).values())


def metal_mul_mat_id_extras(n_expert: int, n_tokens: int, build: LlamaBuild = PINNED) -> dict[str, int]:
    """ggml_metal_op_mul_mat_id_extra_{tpe,ids,amax}: routing scratch after every MUL_MAT_ID output.

    n_expert = src0->ne[2] (experts in the weight), n_tokens = src2->ne[1] (ids [n_expert_used, n_tokens]).
    Always added by ggml_backend_metal_buffer_type_get_alloc_size, whichever kernel runs.
    """
    if not build.has("metal_alloc_size_extras"):
        return {}  # 0.3.16 ggml-metal.m: no get_alloc_size
    out = {"tpe": 4 * n_expert, "ids": 4 * n_expert * n_tokens}
    if build.has("metal_mul_mat_id_amax"):  # 0.3.36 ggml-metal.cpp; 0.3.17-0.3.35: tpe and ids only
        out["amax"] = 8 + METAL_N_MM_NPART_AMAX * 4
    return out


def mul_mat_id_nbytes(n_out: int, n_expert_used: int, n_tokens: int) -> int:
    """ggml_mul_mat_id output: f32 [as->ne[1], ids->ne[0], b->ne[2]]."""
    return 4 * n_out * n_expert_used * n_tokens


def metal_mul_mat_id_alloc_size(n_out: int, n_expert_used: int, n_tokens: int, n_expert: int,
                                build: LlamaBuild = PINNED) -> int:
    return mul_mat_id_nbytes(n_out, n_expert_used, n_tokens) + sum(
        metal_mul_mat_id_extras(n_expert, n_tokens, build).values())


def metal_top_k_alloc_size(src_nelements: int) -> int:
    """TOP_K: 2*sizeof(int32_t)*ggml_nelements(src0), instead of ggml_nbytes of the [k, ...] output."""
    return 2 * 4 * src_nelements


METAL_FA_HEAD_SIZES = (32, 40, 48, 64, 72, 80, 96, 112, 128, 192, 256, 320, 512, 576)


def metal_fa_unsupported_reason(d_k: int, d_v: int, type_k: str, type_v: str, *,
                                has_bfloat: bool = True, has_simdgroup_mm: bool = True) -> str | None:
    """ggml_metal_device_supports_op, case GGML_OP_FLASH_ATTN_EXT (ggml-metal-device.m).

    Apple7+ GPUs (M1 and later) have simdgroup mm; bfloat needs MTLGPUFamilyMetal3 (has_bfloat).
    """
    if d_k not in METAL_FA_HEAD_SIZES:
        return f"no Metal flash-attention kernel for head size {d_k}"
    if d_k == 72 and d_v != 72:
        return "head size 72 needs V head size 72"
    if d_k < d_v:
        return f"K head size {d_k} < V head size {d_v}"
    tk, tv = type_name(type_k), type_name(type_v)
    if tk != tv:
        return f"K ({tk}) and V ({tv}) cache types differ; Metal flash attention needs one type"
    if tk not in ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "bf16"):
        return f"{tk} K/V has no Metal flash-attention kernel"
    if tk == "bf16" and not has_bfloat:
        return "bf16 K/V needs a GPU with bfloat (MTLGPUFamilyMetal3)"
    if not has_simdgroup_mm:
        return "flash attention needs simdgroup matrix multiply (Apple7 / M1 or later)"
    return None


def optimize_segments(*args: Any) -> tuple[ChunkPlan, list[Segment]] | None:
    """fitter.ggml.backends.metal.segments.optimize_segments, imported on the first Metal graph that needs it (a CPU or
    CUDA prediction loads none of the reorder's modules)."""
    from fitter.ggml.backends.metal import segments

    return segments.optimize_segments(*args)


class MetalBackend(BackendImpl):
    """The Metal device (MTL0); its host buffers are the CPU's."""

    kind = Backend.METAL
    name = "MTL0"
    host_buffer_name = "CPU"
    registry = "MTL"  # ggml_backend_reg_name (ggml-metal.cpp GGML_METAL_NAME)
    alignment = METAL_ALIGNMENT
    maps_host_memory = True  # unified memory: mmapped weights are wrapped (MTL0_Mapped)
    is_gpu = True
    label = "Metal"
    log_names = ("MTL", "Metal")
    single_device = True  # the default Metal device, MTL0
    unified_memory = True  # Apple Silicon: MTL0 is the host's RAM (recommendedMaxWorkingSetSize of it)
    has_host_buffer_type = False  # ggml-metal.cpp get_host_buffer_type: NULL
    # the evidence (metal/evidence.py) bounds the whole margin: a safety share on top would reject what ran
    overhead = metal_margin()
    margin_safety = False

    def fa_auto_unsupported_reason(self, heads: Iterable[tuple[int, int]], type_k: str, type_v: str) -> str | None:
        """ggml_metal_device_supports_op's FLASH_ATTN_EXT rules (metal_fa_unsupported_reason): the first layer's
        heads it refuses."""
        for d_k, d_v in dict.fromkeys(heads):  # each pair once, in layer order
            why = metal_fa_unsupported_reason(d_k, d_v, type_k, type_v)
            if why:
                return why
        return None

    def free_memory(self, probes: DeviceProbes) -> FreeMemory:
        """The default device's recommendedMaxWorkingSetSize, else the wired limit, else a table (metal/memory.py)."""
        from fitter.ggml.backends.metal import memory  # (its probes import ctypes: only for `auto`)

        return memory.free_memory(probes)

    def fa_alloc_reads_kv_type(self, build: LlamaBuild, queries_per_stream: int) -> bool:
        """FLASH_ATTN_EXT's alloc size reads the views' strides only where ggml_metal_op_flash_attn_ext_use_kv_f16 is
        false: under 32 queries per stream, and in builds before #27390 (metal_fa_kv_f16_extra)."""
        return not build.has("metal_fa_kv_f16_extra") or queries_per_stream < 32

    def max_size(self, *, metal_max_buffer_length: int | None = None) -> int:
        """get_max_size is the device's maxBufferLength (ggml_metal_device_init: props.max_buffer_size),
        known only on the Mac; without it SIZE_MAX (ggml-alloc then never splits a buffer into chunks)."""
        return metal_max_buffer_length or SIZE_MAX

    sized_ops = frozenset({"MUL_MAT_ID", "FLASH_ATTN_EXT", "CUMSUM", "ARGSORT", "TOP_K"})  # alloc_size's cases

    def alloc_size(self, t: Any) -> int:
        """ggml_backend_metal_buffer_type_get_alloc_size."""
        op = _op(t)
        size = _nbytes_of(t)
        if op == "MUL_MAT_ID":
            n_expert = getattr(t, "n_expert", None)
            if n_expert is None:
                if len(t.src) < 3:
                    raise ValueError("MUL_MAT_ID without its weight in src needs .n_expert")
                n_expert = _ne4(t.src[0])[2]
            n_tokens = _ne4(t.src[-1])[1]  # ids [n_expert_used, n_tokens] is the last source
            return size + sum(metal_mul_mat_id_extras(n_expert, n_tokens, self.build).values())
        if op == "FLASH_ATTN_EXT":
            s = flash_attn_shape_of(t)
            return size + sum(metal_fa_extras(s, self.build).values())
        if op not in ("CUMSUM", "ARGSORT", "TOP_K") or not self.build.has("metal_alloc_size_extras"):
            return size  # (0.3.16 ggml-metal.m: get_alloc_size NULL, ggml_nbytes for every op)
        if op == "TOP_K":
            sne = _ne4(t.src[0])
            return metal_top_k_alloc_size(sne[0] * sne[1] * sne[2] * sne[3])
        return 2 * size  # CUMSUM, ARGSORT

    def flash_attn_unsupported_reason(self, s: FlashAttnShape, *, has_bfloat: bool = True) -> str | None:
        return metal_fa_unsupported_reason(s.d_k, s.d_v, s.type_k, s.type_v, has_bfloat=has_bfloat)

    def gated_delta_net_unsupported_reason(self, head_v_dim: int) -> str | None:
        # ggml_metal_device_supports_op: has_simdgroup_reduction && src[2]->ne[0] (V head size) % 32 == 0
        if head_v_dim % 32:
            return f"Metal gated delta net needs a V head size multiple of 32, got {head_v_dim}"
        return None

    def mul_mat_unsupported_reason(self, weight_type: str, *, mul_mat_id: bool = False,
                                   prec_f32_src1: bool = False) -> str | None:
        # ggml_metal_supports_mul_mat_op refuses NVFP4 and TQ1_0 weights
        wt = str(weight_type).lower()
        if wt in ("nvfp4", "tq1_0"):
            return f"Metal has no matmul kernel for {wt} weights"
        return None

    @property
    def reorders_graph(self) -> bool:
        """ggml_backend_metal_graph_optimize reorders a split's nodes (since #15929), across layers: the graph is then
        allocated as chunks of the reordered layers (optimize_segments) or whole, not replayed layer by layer."""
        return self.build.has("metal_graph_optimize")

    def graph_optimize(self, segments: list) -> None:
        """ggml_backend_metal_graph_optimize: each segment is a whole placed and split graph (fitter.ggml.backends
        .metal.common)."""
        if not self.reorders_graph:
            return
        for seg in segments:
            seg.nodes = metal_graph_optimize(seg.nodes, self.build, self.alloc_size, self.alignment, 0)

    def optimize_segments(self, n: int, pro: Segment, seg0: Segment, templates: dict[tuple, Segment],
                          keys: list[tuple], epi: Segment) -> tuple[ChunkPlan, list[Segment]] | None:
        """graph_optimize over a graph built one segment per distinct layer (fitter.ggml.backends.metal.segments): its
        chunks to allocate; None: build it whole."""
        return optimize_segments(n, pro, seg0, templates, keys, epi, self.build, self.alloc_size, self.alignment, 0)

    def offload_op(self, t: Tensor) -> bool:  # ggml_backend_metal_device_offload_op: matmuls only
        if t.op not in ("MUL_MAT", "MUL_MAT_ID"):
            return False
        return super().offload_op(t)
