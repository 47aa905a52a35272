"""Each era's Metal and CUDA get_alloc_size, bound to a llama.cpp build (BackendImpl.for_build).

The figures are each era's source formula worked by hand for one Qwen3.6-35B-A3B full-attention layer
(16 heads, 2 KV heads of 256, n_kv 262,144, n_ubatch 2048, q8_0 K/V):
- 0.3.16 ggml-metal.m: no get_alloc_size, every tensor is ggml_nbytes;
- 0.3.17-0.3.35 ggml-metal.cpp / ggml-metal-ops.cpp: FLASH_ATTN_EXT + pad (K's and V's own strides) + blk + tmp,
  MUL_MAT_ID + tpe + ids;
- 0.3.36 (#27390): the pad from the f16 scratch, + kv_f16 (f16 K and V, always), + idx; MUL_MAT_ID + amax;
- CUDA: nothing before #23907 (0.3.25 ggml-cuda.cu: ggml_nbytes); f16 copies of a quantized K/V for the tile / MMA
  kernels since (0.3.29 fattn.cu ggml_cuda_flash_attn_ext_get_alloc_size); the vec kernel's f16 fallback for a type
  pair without a vec kernel only in 0.3.36.
"""

from __future__ import annotations

from types import SimpleNamespace

from fitter.ggml import backends
from fitter.ggml.backends.base import FlashAttnShape
from fitter.ggml.backends.cuda import backend as cuda
from fitter.ggml.backends.metal import backend as metal
from fitter.llama_builds import PINNED, resolve_build

MiB = 2**20
QWEN_FA = FlashAttnShape(d_k=256, d_v=256, n_head=16, n_head_kv=2, n_kv=262144, n_q=2048, type_k="q8_0",
                         type_v="q8_0")
OUT = 4 * 256 * 16 * 2048  # f32 [d_v, n_head, n_q]: 32 MiB
ROW_Q8 = 34 * 512 // 32  # ggml_row_size(q8_0, 256 x 2 KV heads): a K (or V) cache row, 544 B
BLK = (262144 // 64) * (2048 // 8)  # one i8 per (8-query, 64-cell) block: 1 MiB
TMP = 4 * 32 * 16 * 32 * (256 + 2)  # f32 partials of 32 workgroups, 32 query rows: 16,908,288 B


def _fa_tensor():
    def t(op, type_, ne, src=()):
        return SimpleNamespace(op=op, type=type_, ne=ne, src=list(src))
    q = t("PERMUTE", "f32", (256, 2048, 16, 1))
    k = t("PERMUTE", "q8_0", (256, 262144, 2, 1))
    v = t("PERMUTE", "q8_0", (256, 262144, 2, 1))
    mask = t("NONE", "f16", (262144, 2048, 1, 1))
    return t("FLASH_ATTN_EXT", "f32", (256, 16, 2048, 1), (q, k, v, mask))


def test_metal_fa_per_era():
    # 0.3.16: ggml_nbytes
    assert metal.metal_fa_alloc_size(QWEN_FA, resolve_build("0.3.16")) == OUT == 32 * MiB
    # 0.3.17 .. 0.3.35: a 64-cell tail with the q8_0 cache's own row stride, blk, tmp
    pad_q8 = 64 * (ROW_Q8 * 2 + ROW_Q8 * 2 + 2 * 2048)
    for release in ("0.3.17", "0.3.23", "0.3.35"):
        b = resolve_build(release)
        assert metal.metal_fa_extras(QWEN_FA, b) == {"pad": pad_q8, "blk": BLK, "tmp": TMP}
        assert metal.metal_fa_alloc_size(QWEN_FA, b) == OUT + 401_408 + MiB + 16_908_288
    # 0.3.36: the tail from the f16 scratch, + f16 K and V of the whole cache (512 MiB)
    pad_f16 = 64 * (2 * 256 * 2 + 2 * 256 * 2 + 2 * 2048)
    e = metal.metal_fa_extras(QWEN_FA, PINNED)
    assert e == {"pad": pad_f16, "blk": BLK, "tmp": TMP, "kv_f16": 512 * MiB, "idx": 0}
    grew = metal.metal_fa_alloc_size(QWEN_FA, PINNED) - metal.metal_fa_alloc_size(QWEN_FA, resolve_build("0.3.35"))
    assert grew == 512 * MiB + pad_f16 - pad_q8


def test_metal_fa_kv_f16_follows_the_merge_of_27390():
    # merged about 2026-08-20: a build of 2026-08-19 has no f16 copy, one of 2026-08-21 does
    assert "kv_f16" not in metal.metal_fa_extras(QWEN_FA, resolve_build("2026-08-19"))
    assert metal.metal_fa_extras(QWEN_FA, resolve_build("2026-08-21"))["kv_f16"] == 512 * MiB


def test_metal_mul_mat_id_per_era():
    assert metal.metal_mul_mat_id_extras(256, 2048, resolve_build("0.3.16")) == {}
    assert metal.metal_mul_mat_id_extras(256, 2048, resolve_build("0.3.35")) == {"tpe": 1024, "ids": 4 * 256 * 2048}
    assert metal.metal_mul_mat_id_extras(256, 2048, PINNED) == {"tpe": 1024, "ids": 4 * 256 * 2048, "amax": 1032}


def test_cuda_fa_f16_copies_per_era():
    # the prefill of 2048 queries runs the MMA kernel on an H200, which needs f16 K and V
    assert cuda.cuda_fa_kernel(QWEN_FA) == "mma_f16"
    f16_k = 2 * 256 * 262144 * 2  # ggml_nelements(K) * sizeof(half): 256 MiB
    assert cuda.cuda_fa_alloc_size(QWEN_FA, build=resolve_build("0.3.25")) == OUT
    for b in (resolve_build("0.3.29"), resolve_build("0.3.35"), PINNED):
        assert cuda.cuda_fa_extras(QWEN_FA, build=b) == {"f16_k": f16_k, "f16_v": f16_k}  # 128-aligned already
    # #23907: merged between 2026-06-01 (0.3.25 lacks it) and 2026-06-05; placed on 2026-06-02
    assert cuda.cuda_fa_alloc_size(QWEN_FA, build=resolve_build("2026-06-01")) == OUT
    assert cuda.cuda_fa_alloc_size(QWEN_FA, build=resolve_build("2026-06-05")) == OUT + 2 * f16_k


def test_cuda_vec_fallback_only_in_0_3_36():
    # one decode token, q8_0 K with f16 V: no compiled vec kernel for the pair (GGML_CUDA_FA_QUANTS default)
    s = FlashAttnShape(d_k=128, d_v=128, n_head=32, n_head_kv=8, n_kv=4096, n_q=1, type_k="q8_0", type_v="f16")
    assert cuda.cuda_fa_kernel(s) == "vec"
    # the output (4 x 128 x 32 B = 16 KiB) ends on a 128-byte boundary, so the f16 K copy follows it directly
    assert cuda.cuda_fa_extras(s, build=PINNED) == {"f16_k": 2 * 128 * 4096 * 8, "f16_v": 0}
    assert cuda.cuda_fa_extras(s, build=resolve_build("0.3.35")) == {"f16_k": 0, "f16_v": 0}


def test_backends_bound_to_a_build():
    fa = _fa_tensor()
    old = resolve_build("0.3.23")
    m = backends.get("metal")
    assert m.for_build(PINNED) is m  # the pinned build's rules are the module's own
    assert m.for_build(old).alloc_size(fa) == OUT + 401_408 + MiB + 16_908_288
    assert m.alloc_size(fa) == metal.metal_fa_alloc_size(QWEN_FA)
    assert backends.get("cuda").for_build(old).alloc_size(fa) == OUT
    assert backends.get("metal").build is PINNED  # binding copies; the registry's backend is unchanged
