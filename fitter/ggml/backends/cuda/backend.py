"""The CUDA backend: ggml-cuda's buffer types, alloc sizes, op support and graph_optimize.

Mirrors ggml/src/ggml-cuda/ggml-cuda.cu of the pinned llama.cpp 0c1e57098bba:
ggml_backend_cuda_buffer_type (alignment 128, no max size, get_alloc_size below), the pinned host
buffer type CUDA_Host (the CPU's rules), ggml_backend_cuda_device_supports_op / offload_op, and
ggml_backend_cuda_graph_optimize (fitter.ggml.backends.cuda.fusion).

get_alloc_size terms (bytes added to ggml_nbytes of the op's output)
-------------------------------------------------------------------
=====================  =========================================================  ==========================================
term                   formula                                                    source (ggml/src/...)
=====================  =========================================================  ==========================================
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

Other llama.cpp builds (`backends.get("cuda").for_build(build)`): no FA f16 copies before #23907 (they came from the
pool); the vec kernel's f16 fallback for a type pair without a vec kernel only since 0.3.36 (fitter.llama_builds.changes:
cuda_fa_f16_kv_reserve, cuda_fa_vec_f16_fallback). The kernel choice is the pinned build's for every build.

Not in any ggml buffer, so not predicted here: the per-device memory pool (`ggml_cuda_pool`, VMM or
legacy: q8_1 copies of matmul activations, FA partial results, MoE id maps, cuBLAS workspaces) and
the CUDA context itself. Only measurement tells these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from fitter.ggml.backends.base import (
    Backend,
    BackendImpl,
    FlashAttnShape,
    Overhead,
    _nbytes_of,
    _ne4,
    _op,
    flash_attn_shape_of,
)
from fitter.ggml.backends.cuda.fusion import cuda_alloc_deps
from fitter.ggml.tensor import Tensor, nbytes_strided
from fitter.ggml.types import BLCK, is_quantized, nbytes, pad, row_size, type_name, type_size
from fitter.gguf.constants import GGMLQuantizationType
from fitter.llama_builds import PINNED, LlamaBuild

if TYPE_CHECKING:
    from fitter.ggml.backends.probes import DeviceProbes, FreeMemory

# ggml-cuda.cu ggml_backend_cuda_buffer_type_get_alignment
CUDA_ALIGNMENT = 128
# ggml-cuda/common.cuh MATRIX_ROW_PADDING
CUDA_MATRIX_ROW_PADDING = 512
# ggml-cuda/fattn-common.cuh FATTN_KQ_STRIDE
CUDA_FATTN_KQ_STRIDE = 256
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
_CUDA_MATMUL_TYPES = frozenset({
    "f32", "f16", "bf16", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "nvfp4", "q2_k", "q3_k",
    "q4_k", "q5_k", "q6_k", "q8_k", "iq1_m", "iq1_s", "iq2_s", "iq2_xs", "iq2_xxs", "iq3_s", "iq3_xxs", "iq4_nl",
    "iq4_xs",
})  # the weight types of ggml_backend_cuda_device_supports_op, case MUL_MAT / MUL_MAT_ID


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
                   vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT,
                   build: LlamaBuild = PINNED) -> dict[str, int]:
    """The f16 K/V conversion buffers ggml_cuda_flash_attn_ext_get_alloc_size appends to the output.

    ggml_cuda_flash_attn_ext_get_f16_extra_data (fattn-common.cuh): each copy starts at a 128-byte
    boundary after the previous end; the result is end - dst->data (dst->data is aligned, so the
    padding is computed from offset 0). Builds before #23907 reserve none (0.3.25 ggml-cuda.cu
    get_alloc_size: ggml_nbytes of the FA output; the copies came from the CUDA pool). The kernel choice
    is the pinned build's ggml_cuda_get_best_fattn_kernel for every build.
    """
    if not build.has("cuda_fa_f16_kv_reserve"):
        return {"f16_k": 0, "f16_v": 0}
    kernel = cuda_fa_kernel(s, cc)
    need_k = need_v = False
    if kernel in ("tile", "mma_f16"):
        need_k = need_v = True
    elif kernel == "vec":
        # 0.3.29-0.3.35 fattn.cu: the vec kernel needs f16 only for f32 K/V
        fallback = (build.has("cuda_fa_vec_f16_fallback")
                    and not cuda_fa_vec_case_exists(s.d_k, s.type_k, s.type_v, vec_pairs))
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
                       vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT,
                       build: LlamaBuild = PINNED) -> int:
    """ggml_backend_cuda_buffer_type_get_alloc_size of a FLASH_ATTN_EXT node (f32 output: no row padding)."""
    return s.out_nbytes + sum(cuda_fa_extras(s, cc, vec_pairs, build).values())


class CUDABackend(BackendImpl):
    """The first CUDA device (ggml_backend_cuda_buffer_type(0)) and CUDA_Host next to it."""

    kind = Backend.CUDA
    name = "CUDA0"
    host_buffer_name = "CUDA_Host"
    registry = "CUDA"  # ggml_backend_reg_name
    alignment = CUDA_ALIGNMENT
    maps_host_memory = False  # caps.buffer_from_host_ptr is false: weights are copied (no _Mapped buffer)
    is_gpu = True
    label = "CUDA"
    log_names = ("CUDA",)
    has_host_buffer_type = True  # ggml_backend_cuda_host_buffer_type (CUDA_Host)
    # H200, driver 580.159, CUDA 13: cudaMemGetInfo around 15 real loads and decodes, and the host's peak RSS
    # (benchmarks/results/gpu-load-h200.json, gpu-hostrss-h200.json; the table in fitter.fit.margin)
    overhead = Overhead(772 << 20, "CUDA context 527 MiB + CUDA pool and cuBLAS workspace 245 MiB (measured on an H200)")
    host_overhead = Overhead(747 << 20, "llama-server's resident memory beyond its host buffers (CUDA runtime, heap; "
                                        "measured on the H200 host)")

    # fa_auto_unsupported_reason: CUDA's rules are not mirrored (-fa auto stays as asked)

    def machine_kind(self) -> str | None:
        """The first GPU's name and memory (nvidia-smi), or 'unknown'."""
        import subprocess

        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        return out.splitlines()[0] if out else "unknown"

    def free_memory(self, probes: DeviceProbes) -> FreeMemory:
        """Free VRAM of the device: nvidia-smi, else NVML (cuda/memory.py)."""
        from fitter.ggml.backends.cuda import memory  # (its probes import ctypes: only for `auto`)

        return memory.free_memory(probes)

    def fa_alloc_reads_kv_type(self, build: LlamaBuild, queries_per_stream: int) -> bool:
        """CUDA's flash attention keeps f16 copies of a quantized K/V (its scratch depends on the type)."""
        return True

    def alloc_size(self, t: Any, *, cc: int = CUDA_CC_HOPPER,
                   vec_pairs: frozenset[tuple[str, str]] = CUDA_FA_VEC_PAIRS_DEFAULT) -> int:
        """ggml_backend_cuda_buffer_type_get_alloc_size: FA's f16 K/V copies, quantized row padding."""
        size = _nbytes_of(t)
        if _op(t) == "FLASH_ATTN_EXT":
            size = cuda_fa_alloc_size(flash_attn_shape_of(t), cc, vec_pairs, self.build)
        return size + cuda_quant_row_padding(t.type, _ne4(t)[0])

    sized_ops = frozenset({"FLASH_ATTN_EXT"})

    def compute_size(self, t: Tensor) -> int:
        # alloc_size's cases: FLASH_ATTN_EXT, and any quantized tensor (its last row padded; BLCK > 1 is is_quantized
        # without its conversion of the type to the enum, a call each tensor the allocator sizes)
        return self.alloc_size(t) if t.op in self.sized_ops or BLCK[t.type] > 1 else t.nbytes()

    def tensor_alloc_size(self, t: Any, ne: tuple[int, ...], size: int | None = None) -> int:
        return cuda_tensor_alloc_size(t, ne, size)

    def copy_size(self, t: Tensor) -> int:
        # a split input copy (ggml_dup_tensor_layout): strides kept, quantized rows padded
        return nbytes_strided(t) + cuda_quant_row_padding(t.type, t.ne[0])

    def flash_attn_unsupported_reason(self, s: FlashAttnShape, *, has_bfloat: bool = True) -> str | None:
        return cuda_fa_unsupported_reason(s)

    def ssm_conv_unsupported_reason(self, conv_channels: int) -> str | None:
        # ggml_backend_cuda_device_supports_op: src[0]->ne[1] % 128 == 0
        if conv_channels % 128:
            return f"CUDA ssm_conv needs conv channels % 128 == 0, got {conv_channels}"
        return None

    def mul_mat_unsupported_reason(self, weight_type: str, *, mul_mat_id: bool = False,
                                   prec_f32_src1: bool = False) -> str | None:
        # the weight-type list of ggml_backend_cuda_device_supports_op (no TQ1_0 / TQ2_0 / I-types);
        # MUL_MAT_ID with GGML_PREC_F32 on src1 (mistral4's ffn_moe_down) is refused
        wt = str(weight_type).lower()
        if wt not in _CUDA_MATMUL_TYPES:
            return f"CUDA has no matmul kernel for {wt} weights"
        if mul_mat_id and prec_f32_src1:
            return "CUDA refuses MUL_MAT_ID with GGML_PREC_F32 on src1"
        return None

    def op_batch_size(self, t: Tensor) -> int:  # get_op_batch_size (ggml-cuda.cu)
        op = t.op
        if op == "GET_ROWS":
            return 0
        if op == "ROPE":
            return t.ne[2]
        return super().op_batch_size(t)

    def graph_optimize(self, segments: list) -> None:
        # alloc deps exist since 0.3.36 (ggml_backend_graph_optimize_params.add_alloc_dep); before, CUDA's
        # graph_optimize only reordered for stream concurrency, off by default (0.3.35 ggml-cuda.cu, GGML_CUDA_GRAPH_OPT)
        if self.build.has("cuda_fusion_alloc_deps"):
            cuda_alloc_deps(segments)
