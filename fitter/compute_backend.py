"""What each backend does to a buffer and to a tensor's allocation: the parts ggml-alloc cannot see.

ggml-alloc (`ggml_gallocr_*`, `ggml_backend_alloc_ctx_tensors_from_buft`) sizes every tensor with
`ggml_backend_buft_get_alloc_size` (ggml/src/ggml-backend.cpp), which calls the buffer type's
`get_alloc_size` when it has one and `ggml_nbytes` otherwise, then pads it to the buffer type's
`get_alignment` and packs the result into chunks of at most `get_max_size`. This module gives those
three rules for the default buffer type of each backend ("cpu", "cuda", "metal"), op by op, as pure
functions of the op's shapes and types, plus which ops a backend refuses (the scheduler then runs
them on the CPU and copies their inputs across). Mirrors the pinned llama.cpp 0c1e57098bba.

Buffer types
------------
=========  =========  ===========================  ====================  ==============================================
backend    alignment  max buffer size              get_alloc_size        source
=========  =========  ===========================  ====================  ==============================================
cpu        32         SIZE_MAX                     ggml_nbytes           ggml_backend_cpu_buffer_type_get_alignment
                                                                         (TENSOR_ALIGNMENT, ggml/src/ggml-impl.h)
cuda       128        SIZE_MAX                     FA extras, quantized  ggml_backend_cuda_buffer_type_get_alignment,
                                                   row padding           ..._get_alloc_size (ggml-cuda.cu)
CUDA_Host  32         SIZE_MAX                     ggml_nbytes           ggml_backend_cuda_host_buffer_type (CPU rules)
metal      32         device maxBufferLength       FA / MUL_MAT_ID /     ggml_backend_metal_buffer_type_shared_*
                      (run-time value)             ARGSORT / CUMSUM /    (ggml-metal.cpp); same for _private, _mapped
                                                   TOP_K extras
=========  =========  ===========================  ====================  ==============================================

A Metal buffer additionally occupies its size rounded up to the page size (16 KiB on Apple
Silicon): `ggml_metal_buffer_init` / `ggml_metal_buffer_map` (ggml-metal-device.m). llama.cpp logs
the unrounded size; the working set (`currentAllocatedSize`) holds the rounded one.

Per-tensor alloc-size terms (bytes added to ggml_nbytes of the op's output)
-------------------------------------------------------------------------
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
cuda quantized pad     + ggml_row_size(type, 512 - ne0 % 512) when ne0 % 512 != 0 ggml_backend_cuda_buffer_type_get_alloc_size
                       for any quantized tensor in a CUDA buffer: weights, a       (MATRIX_ROW_PADDING, ggml-cuda/common.cuh)
                       quantized K/V cache, weights copied into the compute
                       buffer by op offload; once per tensor, not per row
cuda FA f16 K          pad128(nbytes(out)) + 2*Dk*n_kv*n_head_kv*ns when the      ggml_cuda_flash_attn_ext_get_alloc_size
                       chosen kernel needs f16 K and K is not f16                 (fattn.cu) + ..._get_f16_extra_data
cuda FA f16 V          pad128(...) + 2*Dv*n_kv*n_head_kv*ns likewise for V, not   (fattn-common.cuh)
                       when V is a view of K
                       kernel: TILE / MMA_F16 need both; VEC needs them only for
                       f32 K/V or a K-V type pair without a compiled vec kernel
                       (default GGML_CUDA_FA_QUANTS: f16-f16, q4_0-q4_0,
                       q8_0-q8_0, bf16-bf16); ggml_cuda_get_best_fattn_kernel
=====================  =========================================================  ==========================================

What is not a get_alloc_size term but still moves the peak (for fitter/compute.py's walk):
  * Metal `graph_optimize` (ggml_backend_metal_graph_optimize, ggml-metal.cpp) first adds "alloc
    deps" for every raw op pattern of its fusion table (`ggml_metal_fusion_add_alloc_deps`,
    ggml-metal-fusion.cpp): every external input of a matched pattern stays live until the
    pattern's last node (`METAL_ALLOC_DEP_PATTERNS` below). It then reorders nodes for concurrency
    (`ggml_metal_graph_optimize_reorder`, ggml-metal-common.cpp; look-ahead 64 nodes, only across
    the "safe" ops listed there; off with GGML_METAL_GRAPH_OPTIMIZE_DISABLE).
  * CUDA `graph_optimize` (ggml_backend_cuda_graph_optimize, ggml-cuda.cu) adds alloc deps for the
    MoE weighted reduction (experts, weights, expert scale live until the reduction's output) and
    for the top-k MoE routing fusion (softmax/sigmoid ... argsort, get_rows, norm, scale).
  * CUDA scratch that is *not* in any ggml buffer: the per-device memory pool (`ggml_cuda_pool`,
    VMM or legacy) holds q8_1 copies of matmul activations, FA partial results (dst_tmp, KV_max),
    MoE id maps, cuBLAS workspaces; plus the CUDA context itself. Only measurement tells these.
  * CPU: the graph plan's work buffer (`ggml_graph_plan` -> cplan.work_size) is malloc'd by the CPU
    backend outside the compute buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from fitter.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from fitter.config import Backend, pad
from fitter.errors import GGFitError

SIZE_MAX = 2**64 - 1

# ggml/src/ggml-impl.h TENSOR_ALIGNMENT (ggml_backend_cpu_buffer_type_get_alignment)
CPU_ALIGNMENT = 32
# ggml-cuda.cu ggml_backend_cuda_buffer_type_get_alignment
CUDA_ALIGNMENT = 128
# ggml-metal.cpp ggml_backend_metal_buffer_type_{shared,private,mapped}_get_alignment
METAL_ALIGNMENT = 32
# sysconf(_SC_PAGESIZE) on arm64 macOS; ggml_metal_buffer_init rounds each buffer up to it
METAL_PAGE_SIZE = 16384

# ggml-cuda/common.cuh MATRIX_ROW_PADDING
CUDA_MATRIX_ROW_PADDING = 512
# ggml-cuda/fattn-common.cuh FATTN_KQ_STRIDE
CUDA_FATTN_KQ_STRIDE = 256
# ggml-metal/ggml-metal-impl.h
METAL_FA_NQPSG = 8  # OP_FLASH_ATTN_EXT_NQPSG
METAL_FA_NCPSG = 64  # OP_FLASH_ATTN_EXT_NCPSG
METAL_FA_VEC_NQPSG = 1  # OP_FLASH_ATTN_EXT_VEC_NQPSG
METAL_FA_VEC_NCPSG = 32  # OP_FLASH_ATTN_EXT_VEC_NCPSG
METAL_N_MM_NPART_AMAX = 256  # N_MM_NPART_AMAX

# ggml-cuda/common.cuh GGML_CUDA_CC_*
CUDA_CC_VOLTA = 700
CUDA_CC_TURING = 750
CUDA_CC_ADA_LOVELACE = 890
CUDA_CC_HOPPER = 900  # H100 / H200

# ggml/CMakeLists.txt GGML_CUDA_FA_QUANTS default; ggml/cmake/common.cmake always adds f16-f16
CUDA_FA_VEC_PAIRS_DEFAULT = frozenset({("f16", "f16"), ("q4_0", "q4_0"), ("q8_0", "q8_0"), ("bf16", "bf16")})
_CUDA_FA_VEC_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16", "f16")  # FA_TYPES in common.cmake
CUDA_FA_VEC_PAIRS_ALL = frozenset((k, v) for k in _CUDA_FA_VEC_TYPES for v in _CUDA_FA_VEC_TYPES)
_CUDA_FA_VEC_HEAD_SIZES = (64, 128, 256)  # FATTN_VEC_CASES_ALL_D (fattn.cu)

# ggml-metal-fusion.cpp ggml_metal_fusions: raw op sequences whose external inputs stay live until
# the last node of the match (ggml_metal_fusion_add_pattern_alloc_deps). Longest match wins.
_MOE_REDUCE = tuple(
    ("MUL",) + ("VIEW",) * n + ("ADD",) * (n - 1) for n in range(2, 9)
)  # ops_moe_reduce_2 .. _8
METAL_ALLOC_DEP_PATTERNS: tuple[tuple[str, ...], ...] = (
    ("NORM", "MUL"), ("NORM", "MUL", "ADD"), ("NORM", "SCALE"),
    ("RMS_NORM", "MUL"), ("RMS_NORM", "MUL", "ADD"), ("RMS_NORM", "SCALE"),
    *(("ADD",) * n for n in range(2, 8)),  # ops_add_2 .. ops_add_7
    ("MUL", "SIN", "SQR", "MUL", "ADD"),  # ops_snake
    ("GATED_DELTA_NET", "CPY"),  # ops_gdn_cache
    ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS"),  # ops_topk_moe
    ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS", "SCALE"),
    ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"),
    ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE", "SCALE"),
    *_MOE_REDUCE,
    ("SSM_CONV", "UNARY"),  # ops_ssm_conv_silu
)


class BackendError(GGFitError):
    """A backend name or a combination the chosen backend cannot run (the message says which)."""


# --- types -------------------------------------------------------------------------------------


def backend_of(backend: Backend | str) -> Backend:
    if isinstance(backend, Backend):
        return backend
    try:
        return Backend(str(backend).lower())
    except ValueError:
        raise BackendError(f"backend '{backend}': use cpu, cuda or metal") from None


def _qtype(t: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(t, GGMLQuantizationType):
        return t
    if isinstance(t, int):  # a ggml_type value (fitter.compute keeps types as ints)
        try:
            return GGMLQuantizationType(t)
        except ValueError:
            raise BackendError(f"unknown ggml type {t}") from None
    try:
        return GGMLQuantizationType[str(t).upper()]
    except KeyError:
        raise BackendError(f"unknown ggml type '{t}'") from None


def type_name(t: str | GGMLQuantizationType) -> str:
    return _qtype(t).name.lower()


def is_quantized(t: str | GGMLQuantizationType) -> bool:
    """ggml_is_quantized: a block type (block size > 1); f32/f16/bf16 and the integer types are not."""
    return GGML_QUANT_SIZES[_qtype(t)][0] > 1


def type_size(t: str | GGMLQuantizationType) -> int:
    """ggml_type_size: bytes of one block."""
    return GGML_QUANT_SIZES[_qtype(t)][1]


def block_size(t: str | GGMLQuantizationType) -> int:
    """ggml_blck_size."""
    return GGML_QUANT_SIZES[_qtype(t)][0]


def row_size(t: str | GGMLQuantizationType, ne: int) -> int:
    """ggml_row_size: bytes of ne elements (ne a multiple of the block size)."""
    blck, size = GGML_QUANT_SIZES[_qtype(t)]
    return size * ne // blck


def nbytes(t: str | GGMLQuantizationType, ne: Sequence[int]) -> int:
    """ggml_nbytes of a contiguous tensor with shape ne (ggml order, ne[0] innermost)."""
    n = row_size(t, ne[0])
    for d in ne[1:]:
        n *= d
    return n


# --- buffer types ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferRules:
    """The default buffer type's get_alignment / get_max_size, and how a buffer's size is rounded."""

    buffer_type: str  # llama.cpp's name for the device's default buffer type
    alignment: int
    max_size: int  # SIZE_MAX when the buffer type has no get_max_size
    page_size: int  # the allocation granularity of a whole buffer (1: none)
    is_host: bool


def buffer_rules(backend: Backend | str, *, metal_max_buffer_length: int | None = None,
                 metal_page_size: int = METAL_PAGE_SIZE) -> BufferRules:
    """Rules of a backend's default buffer type.

    Metal's max size is the device's `maxBufferLength` (ggml_metal_device_init:
    props.max_buffer_size), known only on the Mac; pass it when you have it, else SIZE_MAX is used
    (ggml-alloc then never splits a compute buffer into chunks).
    """
    be = backend_of(backend)
    if be == Backend.CPU:
        # ggml_backend_cpu_buffer_type: TENSOR_ALIGNMENT, get_max_size NULL -> SIZE_MAX
        return BufferRules("CPU", CPU_ALIGNMENT, SIZE_MAX, 1, True)
    if be == Backend.CUDA:
        # ggml_backend_cuda_buffer_type_interface: alignment 128, get_max_size NULL, is_host NULL
        return BufferRules("CUDA0", CUDA_ALIGNMENT, SIZE_MAX, 1, False)
    # ggml_backend_metal_buffer_type_shared_get_max_size -> props.max_buffer_size (maxBufferLength)
    # ggml_metal_buffer_init: size_aligned rounded up to sysconf(_SC_PAGESIZE)
    return BufferRules("MTL0", METAL_ALIGNMENT, metal_max_buffer_length or SIZE_MAX, metal_page_size, False)


def buffer_alignment(backend: Backend | str) -> int:
    """get_alignment of the backend's default buffer type."""
    return buffer_rules(backend).alignment


def host_buffer_alignment(backend: Backend | str) -> int:
    """The host buffer type llama.cpp uses for inputs/outputs next to that device (CUDA_Host or CPU): 32."""
    backend_of(backend)
    return CPU_ALIGNMENT  # ggml_backend_cuda_host_buffer_type reuses the CPU get_alignment


def metal_buffer_resident_size(size: int, page_size: int = METAL_PAGE_SIZE) -> int:
    """What one Metal buffer of `size` bytes adds to the working set (ggml_metal_buffer_init rounds up)."""
    return pad(size, page_size) if size > 0 else 0


def aligned(size: int, backend: Backend | str) -> int:
    """GGML_PAD(size, alignment): one tensor's footprint in a buffer of the backend's default type."""
    return pad(size, buffer_alignment(backend))


# --- CUDA: quantized rows ----------------------------------------------------------------------


def cuda_quant_row_padding(t: str | GGMLQuantizationType, ne0: int) -> int:
    """Bytes ggml_backend_cuda_buffer_type_get_alloc_size adds to a quantized tensor ([TAG_ALLOC_SIZE_EXPAND]).

    MATRIX_ROW_PADDING = 512: the last row is padded to a multiple of 512 elements so that the mmq /
    mmvq kernels can read past it. Added once per tensor, whatever its number of rows.
    """
    if not is_quantized(t) or ne0 % CUDA_MATRIX_ROW_PADDING == 0:
        return 0
    return row_size(t, CUDA_MATRIX_ROW_PADDING - ne0 % CUDA_MATRIX_ROW_PADDING)


def cuda_tensor_alloc_size(t: str | GGMLQuantizationType, ne: Sequence[int], size: int | None = None) -> int:
    """ggml_backend_cuda_buffer_type_get_alloc_size for any op but FLASH_ATTN_EXT: nbytes + row padding."""
    base = nbytes(t, ne) if size is None else size
    return base + cuda_quant_row_padding(t, ne[0])


def weight_alloc_size(backend: Backend | str, t: str | GGMLQuantizationType, ne: Sequence[int]) -> int:
    """One weight tensor's footprint in a backend buffer: GGML_PAD(get_alloc_size, alignment).

    ggml_backend_alloc_ctx_tensors_from_buft (ggml-alloc.c). CUDA pads quantized weights by
    MATRIX_ROW_PADDING (ggml_backend_cuda_buffer_type_get_alloc_size) and aligns to 128. CPU and
    Metal copies (--no-mmap) use ggml_nbytes aligned to 32; mmapped CPU/Metal weights are not
    allocated per tensor at all (the file range is wrapped: llama_model_loader::get_mapping_range).
    """
    be = backend_of(backend)
    size = cuda_tensor_alloc_size(t, ne) if be == Backend.CUDA else nbytes(t, ne)
    return aligned(size, be)


def tensor_info_alloc_size(t: Any, backend: Backend | str) -> int:
    """The `alloc_size(tensor, backend)` hook of fitter.llama.weights.weight_buffers for a gguf TensorInfo.

    Unaligned (the caller pads to the alignment): ggml_nbytes, plus MATRIX_ROW_PADDING on CUDA.
    """
    if backend_of(backend) == Backend.CUDA:
        return cuda_tensor_alloc_size(t.ggml_type, t.shape, t.nbytes)
    return int(t.nbytes)


def cuda_weight_alloc_size(t: str | GGMLQuantizationType, ne: Sequence[int]) -> int:
    """weight_alloc_size on CUDA: GGML_PAD(nbytes + quantized row padding, 128)."""
    return weight_alloc_size(Backend.CUDA, t, ne)


def kv_tensor_alloc_size(backend: Backend | str, t: str | GGMLQuantizationType,
                         n_embd_gqa: int, kv_size: int, n_stream: int) -> int:
    """One K or V cache tensor, [n_embd_gqa, kv_size, n_stream] (llama_kv_cache::llama_kv_cache), in its buffer.

    On CUDA a quantized cache (-ctk/-ctv q8_0, q4_0, ...) whose row width n_embd_k_gqa / n_embd_v_gqa
    is not a multiple of 512 gets one padded row (ggml_backend_cuda_buffer_type_get_alloc_size).
    The V cache without flash attention is the same tensor (its transposition is a view).
    """
    return weight_alloc_size(backend, t, (n_embd_gqa, kv_size, n_stream))


# --- FLASH_ATTN_EXT ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashAttnShape:
    """The shapes of one GGML_OP_FLASH_ATTN_EXT node as llm_graph_context::build_attn_mha builds it.

    Q [d_k, n_q, n_head, n_stream] f32 (n_q: tokens per stream), K [d_k, n_kv, n_head_kv, n_stream]
    and V [d_v, n_kv, n_head_kv, n_stream] views of the KV cache (llama_kv_cache::get_k / get_v,
    permuted), mask [n_kv, n_q, 1, n_stream] f16 (build_attn_inp_kq_mask). k_row_bytes /
    v_row_bytes are K's / V's stride between KV cells (nb[1] after the permute); None means a
    KV-cache view: ggml_row_size(type, d * n_head_kv).
    """

    d_k: int
    d_v: int
    n_q: int
    n_head: int
    n_head_kv: int
    n_kv: int
    type_k: str = "f16"
    type_v: str = "f16"
    n_stream: int = 1
    has_mask: bool = True
    v_is_view_of_k: bool = False  # MLA: V is the first d_v elements of each K row
    n_kv_max: int = 0  # ggml_flash_attn_ext_set_n_kv_max (op_params[4]); 0 except DSA top-k attention
    max_bias: float = 0.0  # ALiBi
    logit_softcap: float = 0.0
    k_row_bytes: int | None = None
    v_row_bytes: int | None = None

    @property
    def nb11(self) -> int:
        return self.k_row_bytes if self.k_row_bytes is not None else row_size(self.type_k, self.d_k * self.n_head_kv)

    @property
    def nb21(self) -> int:
        if self.v_row_bytes is not None:
            return self.v_row_bytes
        if self.v_is_view_of_k:
            return self.nb11
        return row_size(self.type_v, self.d_v * self.n_head_kv)

    @property
    def gqa_ratio(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def out_nbytes(self) -> int:
        """ggml_nbytes of the output: f32 [d_v, n_head, n_q, n_stream] (ggml_flash_attn_ext)."""
        return 4 * self.d_v * self.n_head * self.n_q * self.n_stream

    @property
    def mask_nbytes(self) -> int:
        """The f16 mask input [n_kv, n_q, 1, n_stream]: built on the CPU, copied to the device."""
        return 2 * self.n_kv * self.n_q * self.n_stream if self.has_mask else 0


# Metal -----------------------------------------------------------------------------------------


def metal_fa_use_vec(s: FlashAttnShape) -> bool:
    """ggml_metal_op_flash_attn_ext_use_vec: small batch and a head size multiple of 32."""
    return s.n_q < 20 and s.d_k % 32 == 0


def metal_fa_use_kv_f16(s: FlashAttnShape) -> bool:
    """ggml_metal_op_flash_attn_ext_use_kv_f16: dequantize a quantized K/V to f16 first (>= 32 queries)."""
    if s.n_q < 32:
        return False
    return type_name(s.type_k) in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


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


def metal_fa_extra_pad(s: FlashAttnShape) -> int:
    """ggml_metal_op_flash_attn_ext_extra_pad: a 64-cell tail of K, V and mask (always reserved)."""
    use_kv_f16 = metal_fa_use_kv_f16(s)
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


def metal_fa_extras(s: FlashAttnShape) -> dict[str, int]:
    """Each term ggml_backend_metal_buffer_type_get_alloc_size adds to a FLASH_ATTN_EXT output."""
    return {
        "pad": metal_fa_extra_pad(s),
        "blk": metal_fa_extra_blk(s),
        "tmp": metal_fa_extra_tmp(s),
        "kv_f16": metal_fa_extra_kv_f16(s),
        "idx": metal_fa_extra_idx(s),
    }


def metal_fa_alloc_size(s: FlashAttnShape) -> int:
    """ggml_backend_metal_buffer_type_get_alloc_size of a FLASH_ATTN_EXT node."""
    return s.out_nbytes + sum(metal_fa_extras(s).values())


# CUDA ------------------------------------------------------------------------------------------

CudaFAKernel = Literal["none", "vec", "tile", "mma_f16"]


def _cuda_fa_gqa_opt_applies(s: FlashAttnShape) -> bool:
    # ggml_cuda_get_best_fattn_kernel: gqa_ratio >= 2, a mask, no ALiBi, n_kv a multiple of 256, and
    # every non-quantized src with nb[1..3] % 16 == 0 (Q f32: 4*d_k; K/V f16/bf16: 2*d; f32: 4*d;
    # mask f16: 2*n_kv)
    ok = s.gqa_ratio >= 2 and s.has_mask and s.max_bias == 0.0 and s.n_kv % CUDA_FATTN_KQ_STRIDE == 0
    strides = [4 * s.d_k, 4 * s.d_k * s.n_head]
    for t, d, nb1 in ((s.type_k, s.d_k, s.nb11), (s.type_v, s.d_v, s.nb21)):
        if not is_quantized(t):
            strides += [type_size(t) * d, nb1]
    if s.has_mask:
        strides.append(2 * s.n_kv)
    return ok and all(x % 16 == 0 for x in strides)


def cuda_fa_vec_case_exists(d_k: int, type_k: str, type_v: str,
                            vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT) -> bool:
    """ggml_cuda_get_fattn_vec_case != nullptr: a compiled vec kernel for (head size, K type, V type).

    f32 K/V use the f16 instance (FATTN_VEC_CASE). Compiled pairs come from GGML_CUDA_FA_QUANTS.
    """
    tk, tv = type_name(type_k), type_name(type_v)
    tk = "f16" if tk == "f32" else tk
    tv = "f16" if tv == "f32" else tv
    return d_k in _CUDA_FA_VEC_HEAD_SIZES and (tk, tv) in vec_pairs


def cuda_fa_unsupported_reason(s: FlashAttnShape) -> str | None:
    """Why ggml_cuda_get_best_fattn_kernel returns BEST_FATTN_KERNEL_NONE, or None when CUDA can run it."""
    gqa_opt = _cuda_fa_gqa_opt_applies(s)
    dk, dv = s.d_k, s.d_v
    if s.n_head % s.n_head_kv:
        return f"n_head {s.n_head} is not a multiple of n_head_kv {s.n_head_kv}"
    if dk in (40, 64, 72, 80, 96, 112, 128, 256):
        if dv != dk:
            return f"head sizes K {dk} / V {dv} differ"
    elif dk == 192:
        if dv != 128 or not gqa_opt or s.gqa_ratio % 8:
            return "head size 192 needs V 128, the GQA optimisation and a GQA ratio multiple of 8"
    elif dk == 320:
        if dv != 256 or not gqa_opt or s.gqa_ratio % 32:
            return "head size 320 needs V 256, the GQA optimisation and a GQA ratio multiple of 32"
    elif dk == 512:
        if dv != dk or not gqa_opt:
            return "head size 512 needs V 512 and the GQA optimisation (GQA >= 2, mask, n_kv % 256 == 0)"
    elif dk == 576:
        if dv != 512 or not gqa_opt:
            return "head size 576 needs V 512 and the GQA optimisation"
    else:
        return f"no CUDA flash-attention kernel for head size {dk}"
    ok_types = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # ggml_cuda_fattn_kv_type_supported
    for name, t in (("K", s.type_k), ("V", s.type_v)):
        if type_name(t) not in ok_types:
            return f"{name} type {type_name(t)} has no CUDA flash-attention kernel"
    return None


def cuda_fa_kernel(s: FlashAttnShape, cc: int = CUDA_CC_HOPPER) -> CudaFAKernel:
    """ggml_cuda_get_best_fattn_kernel (fattn.cu) for an NVIDIA device of compute capability cc (e.g. 900).

    Assumes the binary was compiled for the device's architecture (ggml_cuda_highest_compiled_arch
    == the device's family). AMD/MUSA branches are not modelled.
    """
    if cuda_fa_unsupported_reason(s) is not None:
        return "none"
    gqa_opt = _cuda_fa_gqa_opt_applies(s)
    quant = is_quantized(s.type_k) or is_quantized(s.type_v)
    can_vec = s.d_k <= 256 and s.d_k % 64 == 0 and s.d_k != 192 and s.n_kv % CUDA_FATTN_KQ_STRIDE == 0
    if cc >= CUDA_CC_TURING and s.d_k not in (40, 72):  # turing_mma_available
        if can_vec:
            if not quant:
                # sparse decode needs an n_kv_max hint (ggml_cuda_flash_attn_ext_mma_f16_shall_use_sparse)
                sparse = (gqa_opt and s.gqa_ratio > 4 and s.n_kv_max > 0 and s.max_bias == 0.0
                          and s.logit_softcap == 0.0 and (s.d_k, s.d_v) in ((512, 512), (256, 256))
                          and s.n_kv >= max(4096, 2 * min(s.n_q, 64 // 8) * s.n_kv_max))
                if (not sparse and cc >= CUDA_CC_ADA_LOVELACE and s.n_q == 1 and s.n_stream == 1
                        and not (s.gqa_ratio > 4 and (s.d_k >= 256 or s.n_kv >= 8192))):
                    return "vec"
            elif cc >= CUDA_CC_ADA_LOVELACE:
                if s.n_q <= 2:
                    return "vec"
            elif s.n_q == 1:
                return "vec"
            if not gqa_opt and s.n_q == 1:
                return "vec"
        return "mma_f16"
    ncols2_max = 32 if s.d_k == 320 else (16 if s.d_k in (576, 192) else 8)
    eff = 1
    while s.gqa_ratio % (2 * eff) == 0 and eff < ncols2_max:
        eff *= 2
    if CUDA_CC_VOLTA <= cc < CUDA_CC_TURING and s.d_k not in (40, 72):  # volta_mma_available
        if can_vec and s.n_q * eff <= 2:
            return "vec"
        if s.n_q * eff <= 16:
            return "tile"
        return "mma_f16"
    if can_vec:
        if not quant:
            if s.n_q == 1 and not gqa_opt:
                return "vec"
        elif s.n_q <= 2:
            return "vec"
    return "tile"


def cuda_fa_extras(s: FlashAttnShape, cc: int = CUDA_CC_HOPPER,
                   vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT) -> dict[str, int]:
    """The f16 K/V conversion buffers ggml_cuda_flash_attn_ext_get_alloc_size appends to the output.

    ggml_cuda_flash_attn_ext_get_f16_extra_data (fattn-common.cuh): each copy starts at a 128-byte
    boundary after the previous end; the result is end - dst->data (dst->data is aligned, so the
    padding is computed from offset 0).
    """
    kernel = cuda_fa_kernel(s, cc)
    need_k = need_v = False
    if kernel in ("tile", "mma_f16"):
        need_k = need_v = True
    elif kernel == "vec":
        fallback = not cuda_fa_vec_case_exists(s.d_k, s.type_k, s.type_v, vec_pairs)
        need_k = type_name(s.type_k) == "f32" or fallback
        need_v = type_name(s.type_v) == "f32" or fallback
    end = s.out_nbytes
    out = {"f16_k": 0, "f16_v": 0}
    if need_k and type_name(s.type_k) != "f16":
        start = pad(end, 128)
        end = start + 2 * s.d_k * s.n_kv * s.n_head_kv * s.n_stream  # ggml_nelements(K)*sizeof(half)
        out["f16_k"] = end - s.out_nbytes
    if need_v and type_name(s.type_v) != "f16" and not s.v_is_view_of_k:
        before = end
        start = pad(end, 128)
        end = start + 2 * s.d_v * s.n_kv * s.n_head_kv * s.n_stream
        out["f16_v"] = end - before
    return out


def cuda_fa_alloc_size(s: FlashAttnShape, cc: int = CUDA_CC_HOPPER,
                       vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT) -> int:
    """ggml_backend_cuda_buffer_type_get_alloc_size of a FLASH_ATTN_EXT node (f32 output: no row padding)."""
    return s.out_nbytes + sum(cuda_fa_extras(s, cc, vec_pairs).values())


# --- MUL_MAT_ID, ARGSORT, CUMSUM, TOP_K ----------------------------------------------------------


def metal_mul_mat_id_extras(n_expert: int, n_tokens: int) -> dict[str, int]:
    """ggml_metal_op_mul_mat_id_extra_{tpe,ids,amax}: routing scratch after every MUL_MAT_ID output.

    n_expert = src0->ne[2] (experts in the weight), n_tokens = src2->ne[1] (ids [n_expert_used, n_tokens]).
    Always added by ggml_backend_metal_buffer_type_get_alloc_size, whichever kernel runs.
    """
    return {
        "tpe": 4 * n_expert,
        "ids": 4 * n_expert * n_tokens,
        "amax": 8 + METAL_N_MM_NPART_AMAX * 4,
    }


def mul_mat_id_nbytes(n_out: int, n_expert_used: int, n_tokens: int) -> int:
    """ggml_mul_mat_id output: f32 [as->ne[1], ids->ne[0], b->ne[2]]."""
    return 4 * n_out * n_expert_used * n_tokens


def metal_mul_mat_id_alloc_size(n_out: int, n_expert_used: int, n_tokens: int, n_expert: int) -> int:
    return mul_mat_id_nbytes(n_out, n_expert_used, n_tokens) + sum(metal_mul_mat_id_extras(n_expert, n_tokens).values())


def metal_argsort_alloc_size(size: int) -> int:
    """ARGSORT (MoE routing: ggml_argsort_top_k over [n_expert, n_tokens] i32): 2 * ggml_nbytes."""
    return 2 * size


def metal_cumsum_alloc_size(size: int) -> int:
    """CUMSUM (the unfused gated-delta-net chunking path, samplers): 2 * ggml_nbytes."""
    return 2 * size


def metal_top_k_alloc_size(src_nelements: int) -> int:
    """TOP_K: 2*sizeof(int32_t)*ggml_nelements(src0), instead of ggml_nbytes of the [k, ...] output."""
    return 2 * 4 * src_nelements


# --- generic dispatcher --------------------------------------------------------------------------


def _ne4(t: Any) -> tuple[int, int, int, int]:
    ne = tuple(int(x) for x in t.ne)
    return (ne + (1, 1, 1, 1))[:4]  # type: ignore[return-value]


def _op(t: Any) -> str:
    op = str(getattr(t, "op", "NONE") or "NONE").upper()
    return op.removeprefix("GGML_OP_")


def _view_src(t: Any) -> Any:
    return getattr(t, "view_src", None) or getattr(t, "vs", None)  # fitter.compute's _T calls it vs


def _nbytes_of(t: Any) -> int:
    n = getattr(t, "nbytes", None)
    if callable(n):
        n = n()
    return int(n) if n else nbytes(t.type, _ne4(t))


def flash_attn_shape_of(t: Any) -> FlashAttnShape:
    """Build a FlashAttnShape from a FLASH_ATTN_EXT tensor-like (`.src` = [Q, K, V, mask, sinks])."""
    q, k, v = t.src[0], t.src[1], t.src[2]
    mask = t.src[3] if len(t.src) > 3 else None
    qne, kne, vne = _ne4(q), _ne4(k), _ne4(v)
    knb = getattr(k, "nb", None)
    vnb = getattr(v, "nb", None)
    v_src, k_src = _view_src(v), _view_src(k)
    v_is_view_of_k = bool(getattr(t, "v_is_view_of_k", False)) or (
        v_src is not None and (v_src is k or (v_src is k_src
                                              and getattr(v, "view_offs", 0) == getattr(k, "view_offs", 0))))
    params = list(getattr(t, "op_params", ()) or ())
    return FlashAttnShape(
        d_k=qne[0], d_v=vne[0], n_q=qne[1], n_head=qne[2], n_head_kv=kne[2], n_kv=kne[1],
        type_k=type_name(k.type), type_v=type_name(v.type), n_stream=qne[3], has_mask=mask is not None,
        v_is_view_of_k=v_is_view_of_k, n_kv_max=int(params[4]) if len(params) > 4 else 0,
        k_row_bytes=int(knb[1]) if knb else None, v_row_bytes=int(vnb[1]) if vnb else None,
    )


def alloc_size(backend: Backend | str, t: Any, *, cuda_cc: int = CUDA_CC_HOPPER,
               cuda_vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT) -> int:
    """ggml_backend_buft_get_alloc_size for a tensor-like in the backend's default buffer type.

    `t` needs `.op` (ggml op name, "FLASH_ATTN_EXT" or "GGML_OP_FLASH_ATTN_EXT"), `.type` (ggml type
    name, enum or int value), `.ne`, and `.src` for the ops that look at their sources (ggml's own
    order: FLASH_ATTN_EXT [q, k, v, mask, sinks], MUL_MAT_ID [as, b, ids], TOP_K [a]); optional
    `.nbytes` (attribute or method; else computed for a contiguous tensor), `.nb`, `.op_params`,
    `.view_src` / `.vs`. A MUL_MAT_ID whose weight is not in `.src` (fitter.compute passes
    (b, ids)) must carry `.n_expert`. Not aligned: ggml-alloc pads the result to
    buffer_alignment(backend).
    """
    be = backend_of(backend)
    op = _op(t)
    ne = _ne4(t)
    size = _nbytes_of(t)
    if be == Backend.CPU:
        return size  # ggml_backend_cpu_buffer_type: get_alloc_size NULL -> ggml_nbytes
    if be == Backend.CUDA:
        if op == "FLASH_ATTN_EXT":
            size = cuda_fa_alloc_size(flash_attn_shape_of(t), cuda_cc, cuda_vec_pairs)
        return size + cuda_quant_row_padding(t.type, ne[0])
    # Metal: ggml_backend_metal_buffer_type_get_alloc_size
    if op == "MUL_MAT_ID":
        n_expert = getattr(t, "n_expert", None)
        if n_expert is None:
            if len(t.src) < 3:
                raise ValueError("MUL_MAT_ID without its weight in src needs .n_expert")
            n_expert = _ne4(t.src[0])[2]
        n_tokens = _ne4(t.src[-1])[1]  # ids [n_expert_used, n_tokens] is the last source
        return size + sum(metal_mul_mat_id_extras(n_expert, n_tokens).values())
    if op == "FLASH_ATTN_EXT":
        s = flash_attn_shape_of(t)
        return size + sum(metal_fa_extras(s).values())
    if op in ("CUMSUM", "ARGSORT"):
        return 2 * size
    if op == "TOP_K":
        sne = _ne4(t.src[0])
        return metal_top_k_alloc_size(sne[0] * sne[1] * sne[2] * sne[3])
    return size


# --- op support (what the scheduler must run on the CPU instead) ---------------------------------

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


def flash_attn_unsupported_reason(backend: Backend | str, s: FlashAttnShape, *, cuda_cc: int = CUDA_CC_HOPPER,
                                  has_bfloat: bool = True) -> str | None:
    """Why the backend cannot run this FLASH_ATTN_EXT node (None: it can).

    What llama.cpp then does (src/llama-context.cpp): with -fa auto the probe in
    llama_context::resolve_fused_ops sees the FA node on another device than its layer and turns
    flash attention off (the non-FA graph, with its n_kv x n_q x n_head score matrix, is built);
    with -fa on, or a quantized V cache (llama_init_from_model forces FA on), the node runs on the
    CPU and the scheduler copies Q, K, V and the mask views into the CPU compute buffer.
    """
    be = backend_of(backend)
    if be == Backend.CPU:
        return None
    if be == Backend.METAL:
        return metal_fa_unsupported_reason(s.d_k, s.d_v, s.type_k, s.type_v, has_bfloat=has_bfloat)
    return cuda_fa_unsupported_reason(s)


def gated_delta_net_unsupported_reason(backend: Backend | str, head_v_dim: int) -> str | None:
    """GGML_OP_GATED_DELTA_NET (qwen35, qwen35moe, qwen3next fused path).

    Metal: has_simdgroup_reduction && src[2]->ne[0] (V head size) % 32 == 0
    (ggml_metal_device_supports_op). CUDA: always (ggml_backend_cuda_device_supports_op).
    llama.cpp builds the fused op unconditionally (cparams.fused_gdn_ar/ch = true, auto_fgdn = false).
    """
    if backend_of(backend) == Backend.METAL and head_v_dim % 32:
        return f"Metal gated delta net needs a V head size multiple of 32, got {head_v_dim}"
    return None


def ssm_conv_unsupported_reason(backend: Backend | str, conv_channels: int) -> str | None:
    """GGML_OP_SSM_CONV: CUDA needs src[0]->ne[1] % 128 == 0; Metal needs simdgroup reduction (M1+).

    conv_channels is the conv input's width: d_inner + 2*n_group*d_state for gated delta net and Mamba2.
    """
    if backend_of(backend) == Backend.CUDA and conv_channels % 128:
        return f"CUDA ssm_conv needs conv channels % 128 == 0, got {conv_channels}"
    return None


def mul_mat_unsupported_reason(backend: Backend | str, weight_type: str, *, mul_mat_id: bool = False,
                               prec_f32_src1: bool = False) -> str | None:
    """GGML_OP_MUL_MAT / MUL_MAT_ID with f32 activations, by weight type.

    Metal: ggml_metal_supports_mul_mat_op refuses NVFP4 and TQ1_0 weights. CUDA: the weight-type
    list in ggml_backend_cuda_device_supports_op (no TQ1_0 / TQ2_0 / I-types); MUL_MAT_ID with
    GGML_PREC_F32 on src1 (mistral4's ffn_moe_down) is refused.
    """
    be = backend_of(backend)
    wt = str(weight_type).lower()
    if be == Backend.METAL and wt in ("nvfp4", "tq1_0"):
        return f"Metal has no matmul kernel for {wt} weights"
    if be == Backend.CUDA:
        ok = {"f32", "f16", "bf16", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "nvfp4",
              "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k", "iq1_m", "iq1_s", "iq2_s", "iq2_xs", "iq2_xxs",
              "iq3_s", "iq3_xxs", "iq4_nl", "iq4_xs"}
        if wt not in ok:
            return f"CUDA has no matmul kernel for {wt} weights"
        if mul_mat_id and prec_f32_src1:
            return "CUDA refuses MUL_MAT_ID with GGML_PREC_F32 on src1"
    return None
