"""The backends' buffer types, alloc sizes and op support (fitter.ggml.backends). Metal and CUDA cannot
run here, so their formulas are checked against values worked out by hand from the pinned ggml sources."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fitter.ggml import backends
from fitter.ggml.backends.base import SIZE_MAX, FlashAttnShape, flash_attn_shape_of
from fitter.ggml.backends.cuda import backend as cuda
from fitter.ggml.backends.metal import backend as metal
from fitter.ggml.types import nbytes, row_size
from fitter.llama.cparams import Backend, pad

MiB = 2**20
GiB = 2**30
CUDA = backends.get("cuda")
METAL = backends.get("metal")


# --- buffer types -----------------------------------------------------------------


def test_buffer_types():
    assert backends.get("cpu").alignment == 32
    assert backends.get("cuda").alignment == 128
    assert backends.get("metal").alignment == 32
    assert backends.get("cuda").host_alignment == 32
    assert [backends.get(b).name for b in ("cpu", "cuda", "metal")] == ["CPU", "CUDA0", "MTL0"]
    assert [backends.get(b).host_buffer_name for b in ("cpu", "cuda", "metal")] == ["CPU", "CUDA_Host", "CPU"]
    assert backends.get("cuda").max_size() == SIZE_MAX
    assert backends.get("metal").max_size(metal_max_buffer_length=17 * GiB) == 17 * GiB
    with pytest.raises(backends.BackendError, match="use cpu, cuda, metal, rpc or rpc-cuda"):
        backends.get("vulkan")


def test_cuda_quant_row_padding():
    # ggml_backend_cuda_buffer_type_get_alloc_size: + ggml_row_size(type, 512 - ne0 % 512)
    assert cuda.cuda_quant_row_padding("q8_0", 512) == 0
    assert cuda.cuda_quant_row_padding("q8_0", 256) == 256 // 32 * 34
    assert cuda.cuda_quant_row_padding("q4_k", 2816) == (512 - 2816 % 512) // 256 * 144
    assert cuda.cuda_quant_row_padding("f16", 100) == 0
    # a weight: once per tensor, then aligned to 128
    base = nbytes("q4_k", (2816, 2048))
    assert pad(CUDA.tensor_alloc_size("q4_k", (2816, 2048)), CUDA.alignment) == pad(base + 256 // 256 * 144, 128)
    assert METAL.tensor_alloc_size("q4_k", (2816, 2048)) == base
    # K cache q8_0 with 2 KV heads of 128 (n_embd_k_gqa 256): one padded row, aligned to 128
    k = row_size("q8_0", 256) * 4096
    assert pad(CUDA.tensor_alloc_size("q8_0", (256, 4096, 1)), 128) == pad(k + 272, 128)
    assert CUDA.tensor_alloc_size("q8_0", (512, 4096, 1)) == row_size("q8_0", 512) * 4096
    assert METAL.tensor_alloc_size("q8_0", (256, 4096, 1)) == k


# --- FLASH_ATTN_EXT ---------------------------------------------------------------

# Qwen3.6-35B-A3B full-attention layer: 16 heads, 2 KV heads of 256, ctx 262,144, ubatch 2048, q8_0
QWEN = dict(d_k=256, d_v=256, n_head=16, n_head_kv=2, n_kv=262144)


def test_metal_fa_qwen35moe_prefill():
    s = FlashAttnShape(n_q=2048, type_k="q8_0", type_v="q8_0", **QWEN)
    assert metal.metal_fa_use_kv_f16(s) and not metal.metal_fa_use_vec(s)
    e = metal.metal_fa_extras(s)
    assert e["pad"] == 64 * (2 * 256 * 2 + 2 * 256 * 2 + 2 * 2048)  # f16 strides after the dequant
    assert e["blk"] == (262144 // 64) * (2048 // 8)
    assert e["tmp"] == 4 * 32 * 16 * 32 * 258
    assert e["kv_f16"] == 2 * (2 * 256 * 262144 * 2)
    assert e["idx"] == 0
    assert s.out_nbytes == 32 * MiB
    assert metal.metal_fa_alloc_size(s) == 32 * MiB + 393216 + MiB + 16_908_288 + 512 * MiB
    assert s.mask_nbytes == 1024 * MiB


def test_metal_fa_kv_f16_always_reserved():
    f16 = FlashAttnShape(n_q=2048, **QWEN)
    assert not metal.metal_fa_use_kv_f16(f16)
    assert metal.metal_fa_extra_kv_f16(f16) == 512 * MiB
    assert metal.metal_fa_extra_pad(f16) == 64 * (1024 * 2 + 1024 * 2 + 2 * 2048)  # nb11 = 2*512 per cell
    tg = FlashAttnShape(n_q=1, type_k="q8_0", type_v="q8_0", **QWEN)
    assert not metal.metal_fa_use_kv_f16(tg) and metal.metal_fa_use_vec(tg)
    assert metal.metal_fa_extra_kv_f16(tg) == 512 * MiB
    assert metal.metal_fa_extra_pad(tg) == 64 * (544 * 2 + 544 * 2 + 2)  # q8_0 row of 512 = 544 B
    assert metal.metal_fa_extra_blk(tg) == pad(262144 // 32, 32)
    assert metal.metal_fa_extra_tmp(tg) == 4 * 1 * 16 * 32 * 258


def test_metal_fa_kv_f16_threshold():
    assert not metal.metal_fa_use_kv_f16(FlashAttnShape(n_q=31, type_k="q4_0", type_v="q4_0", **QWEN))
    assert metal.metal_fa_use_kv_f16(FlashAttnShape(n_q=32, type_k="q4_0", type_v="q4_0", **QWEN))
    assert not metal.metal_fa_use_kv_f16(FlashAttnShape(n_q=512, type_k="bf16", type_v="bf16", **QWEN))


def test_metal_fa_mla_v_view_of_k():
    s = FlashAttnShape(d_k=576, d_v=512, n_q=512, n_head=16, n_head_kv=1, n_kv=4096,
                          type_k="f16", type_v="f16", v_is_view_of_k=True)
    assert metal.metal_fa_extra_kv_f16(s) == 2 * 576 * 4096
    assert s.nb21 == s.nb11 == 2 * 576


def test_metal_fa_sparse_idx():
    s = FlashAttnShape(n_q=4, n_kv_max=2048, **QWEN)
    assert metal.metal_fa_extra_idx(s) == 4 * 2048 * 4
    assert metal.metal_fa_extra_idx(FlashAttnShape(n_q=4, n_kv_max=8192, **QWEN)) == 0


def test_cuda_fa_prefill_converts_quantized_kv():
    s = FlashAttnShape(n_q=2048, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cuda.cuda_fa_kernel(s, 900) == "mma_f16"
    e = cuda.cuda_fa_extras(s, 900)
    assert e == {"f16_k": 256 * MiB, "f16_v": 256 * MiB}
    assert cuda.cuda_fa_alloc_size(s) == 32 * MiB + 512 * MiB
    f16 = FlashAttnShape(n_q=2048, **QWEN)
    assert cuda.cuda_fa_extras(f16) == {"f16_k": 0, "f16_v": 0}


def test_cuda_fa_decode_kernels():
    tg = FlashAttnShape(n_q=1, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cuda.cuda_fa_kernel(tg, 900) == "vec"
    assert cuda.cuda_fa_extras(tg, 900) == {"f16_k": 0, "f16_v": 0}
    # a K-V pair without a compiled vec kernel (default GGML_CUDA_FA_QUANTS) converts both to f16
    mixed = FlashAttnShape(n_q=1, type_k="q8_0", type_v="q4_0", **QWEN)
    assert cuda.cuda_fa_kernel(mixed, 900) == "vec"
    assert cuda.cuda_fa_extras(mixed, 900) == {"f16_k": 256 * MiB, "f16_v": 256 * MiB}
    assert cuda.cuda_fa_extras(mixed, 900, cuda.CUDA_FA_VEC_PAIRS_ALL) == {"f16_k": 0, "f16_v": 0}
    # 4 slots in one stream (llama-server -np auto): 4 queries -> MMA on Ada/Hopper
    tg4 = FlashAttnShape(n_q=4, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cuda.cuda_fa_kernel(tg4, 900) == "mma_f16"
    # f16 decode with GQA 8 and head 256: not the vec kernel on Hopper
    assert cuda.cuda_fa_kernel(FlashAttnShape(n_q=1, **QWEN), 900) == "mma_f16"
    # Pascal: tile kernel for a batch
    assert cuda.cuda_fa_kernel(FlashAttnShape(n_q=512, **QWEN), 610) == "tile"


def test_cuda_fa_unsupported():
    assert cuda.cuda_fa_kernel(FlashAttnShape(n_q=8, type_k="iq4_nl", type_v="iq4_nl", **QWEN)) == "none"
    r = backends.get("cuda").flash_attn_unsupported_reason(FlashAttnShape(d_k=192, d_v=128, n_q=8, n_head=16, n_head_kv=4, n_kv=4096))
    assert r and "192" in r
    assert backends.get("cuda").flash_attn_unsupported_reason(FlashAttnShape(d_k=192, d_v=128, n_q=8, n_head=16, n_head_kv=2, n_kv=4096)) is None
    assert backends.get("cuda").flash_attn_unsupported_reason(FlashAttnShape(d_k=48, d_v=48, n_q=8, n_head=4, n_head_kv=4, n_kv=256))
    assert backends.get("cpu").flash_attn_unsupported_reason(FlashAttnShape(n_q=8, type_k="iq4_nl", type_v="iq4_nl", **QWEN)) is None


def test_metal_fa_support():
    assert metal.metal_fa_unsupported_reason(256, 256, "q8_0", "q8_0") is None
    assert "differ" in metal.metal_fa_unsupported_reason(256, 256, "q8_0", "f16")
    assert "iq4_nl" in metal.metal_fa_unsupported_reason(128, 128, "iq4_nl", "iq4_nl")
    assert metal.metal_fa_unsupported_reason(72, 64, "f16", "f16")
    assert metal.metal_fa_unsupported_reason(128, 256, "f16", "f16")
    assert metal.metal_fa_unsupported_reason(576, 512, "f16", "f16") is None
    assert metal.metal_fa_unsupported_reason(200, 200, "f16", "f16")
    assert metal.metal_fa_unsupported_reason(128, 128, "bf16", "bf16", has_bfloat=False)


def test_other_op_support():
    assert backends.get("metal").gated_delta_net_unsupported_reason(128) is None
    assert backends.get("metal").gated_delta_net_unsupported_reason(100)
    assert backends.get("cuda").gated_delta_net_unsupported_reason(100) is None
    assert backends.get("cuda").ssm_conv_unsupported_reason(4096 + 2 * 16 * 128) is None
    assert backends.get("cuda").ssm_conv_unsupported_reason(1000)
    assert backends.get("metal").ssm_conv_unsupported_reason(1000) is None
    assert backends.get("metal").mul_mat_unsupported_reason("nvfp4")
    assert backends.get("cuda").mul_mat_unsupported_reason("tq2_0")
    assert backends.get("cuda").mul_mat_unsupported_reason("q4_k") is None
    assert backends.get("cuda").mul_mat_unsupported_reason("q4_k", mul_mat_id=True, prec_f32_src1=True)


# --- MUL_MAT_ID, ARGSORT, TOP_K, and alloc_size --------------------------------


def test_metal_mul_mat_id():
    e = metal.metal_mul_mat_id_extras(256, 2048)
    assert e == {"tpe": 1024, "ids": 4 * 256 * 2048, "amax": 1032}
    assert metal.metal_mul_mat_id_alloc_size(512, 8, 2048, 256) == 4 * 512 * 8 * 2048 + sum(e.values())


def _t(op, type_, ne, src=(), **kw):
    return SimpleNamespace(op=op, type=type_, ne=ne, src=list(src), **kw)


def test_dispatcher_matches_functions():
    q = _t("PERMUTE", "f32", (256, 2048, 16, 1))
    k = _t("PERMUTE", "q8_0", (256, 262144, 2, 1))
    v = _t("PERMUTE", "q8_0", (256, 262144, 2, 1))
    mask = _t("NONE", "f16", (262144, 2048, 1, 1))
    fa = _t("GGML_OP_FLASH_ATTN_EXT", "f32", (256, 16, 2048, 1), (q, k, v, mask))
    s = FlashAttnShape(n_q=2048, type_k="q8_0", type_v="q8_0", **QWEN)
    assert backends.get("metal").alloc_size(fa) == metal.metal_fa_alloc_size(s)
    assert backends.get("cuda").alloc_size(fa) == cuda.cuda_fa_alloc_size(s)
    assert backends.get("cpu").alloc_size(fa) == s.out_nbytes

    w = _t("NONE", "q4_k", (2048, 512, 256))
    b = _t("VIEW", "f32", (2048, 8, 2048))
    ids = _t("VIEW", "i32", (8, 2048))
    mmid = _t("MUL_MAT_ID", "f32", (512, 8, 2048), (w, b, ids))
    assert backends.get("metal").alloc_size(mmid) == metal.metal_mul_mat_id_alloc_size(512, 8, 2048, 256)
    assert backends.get("cuda").alloc_size(mmid) == 4 * 512 * 8 * 2048

    logits = _t("SOFT_MAX", "f32", (256, 2048))
    srt = _t("ARGSORT", "i32", (256, 2048), (logits,))
    assert backends.get("metal").alloc_size(srt) == 2 * 4 * 256 * 2048
    topk = _t("TOP_K", "i32", (8, 2048), (logits,))
    assert backends.get("metal").alloc_size(topk) == 2 * 4 * 256 * 2048
    cs = _t("CUMSUM", "f32", (64, 100))
    assert backends.get("metal").alloc_size(cs) == 2 * 4 * 64 * 100
    assert backends.get("cuda").alloc_size(cs) == 4 * 64 * 100

    wq = _t("NONE", "q8_0", (256, 10))
    assert backends.get("cuda").alloc_size(wq) == row_size("q8_0", 256) * 10 + 272
    assert backends.get("metal").alloc_size(wq) == row_size("q8_0", 256) * 10


def test_tensor_info_hook_for_weights():
    from gguf import GGMLQuantizationType as T

    from fitter.gguf.reader import TensorInfo

    t = TensorInfo(name="blk.0.ffn_down.weight", shape=(2816, 2048), ggml_type=T.Q4_K, offset=0,
                   nbytes=nbytes("q4_k", (2816, 2048)))
    assert backends.tensor_info_alloc_size(t, "cuda") == t.nbytes + 144
    assert backends.tensor_info_alloc_size(t, "metal") == t.nbytes
    assert backends.tensor_info_alloc_size(t, Backend.CPU) == t.nbytes


def test_dispatcher_on_compute_tensors():
    """fitter.ggml.tensor.Tensor: int types, nbytes() a method, view source in .vs, MUL_MAT_ID src (b, ids)."""
    from gguf import GGMLQuantizationType as T

    class _T(SimpleNamespace):
        def nbytes(self):
            return nbytes(self.type, self.ne)

    kcache = _T(op="NONE", type=T.F16.value, ne=(576, 4096, 1, 1), src=(), vs=None)
    q = _T(op="PERMUTE", type=T.F32.value, ne=(576, 512, 16, 1), src=(), vs=None)
    k = _T(op="PERMUTE", type=T.F16.value, ne=(576, 4096, 1, 1), src=(), vs=kcache)
    v = _T(op="PERMUTE", type=T.F16.value, ne=(512, 4096, 1, 1), src=(), vs=kcache)
    mask = _T(op="NONE", type=T.F16.value, ne=(4096, 512, 1, 1), src=(), vs=None)
    fa = _T(op="FLASH_ATTN_EXT", type=T.F32.value, ne=(512, 16, 512, 1), src=(q, k, v, mask), vs=None)
    s = FlashAttnShape(d_k=576, d_v=512, n_q=512, n_head=16, n_head_kv=1, n_kv=4096, v_is_view_of_k=True)
    assert flash_attn_shape_of(fa).v_is_view_of_k
    assert backends.get("metal").alloc_size(fa) == metal.metal_fa_alloc_size(s)

    b = _T(op="VIEW", type=T.F32.value, ne=(2048, 1, 2048, 1), src=(), vs=None)
    ids = _T(op="VIEW", type=T.I32.value, ne=(8, 2048, 1, 1), src=(), vs=None)
    mmid = _T(op="MUL_MAT_ID", type=T.F32.value, ne=(512, 8, 2048, 1), src=(b, ids), vs=None, n_expert=256)
    assert backends.get("metal").alloc_size(mmid) == metal.metal_mul_mat_id_alloc_size(512, 8, 2048, 256)
    del mmid.n_expert
    with pytest.raises(ValueError):
        backends.get("metal").alloc_size(mmid)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
def test_compute_size_is_alloc_size_on_every_compute_tensor(backend: str) -> None:
    """BackendImpl.compute_size (the allocator's, ggml_nbytes outside `sized_ops`) equals alloc_size on every tensor
    the allocator placed in graphs of several architectures, f16 and quantized caches, FA on and off."""
    from fitter.cache import CACHES
    from fitter.llama import context as C
    from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
    from fitter.llama.graph_details import graph_details
    from fitter.llama.model import load_model_spec
    from fitter.llama.traced_graph import _TRACED
    from tests.synth import build

    impl = backends.get(backend)
    checked = sized = 0
    for arch in ("llama", "gemma3", "qwen3moe", "qwen35moe", "gpt-oss", "deepseek2"):
        header, spec = load_model_spec(str(build(arch)))
        d = graph_details(header)
        for kw in (dict(), dict(type_k="q8_0", type_v="q8_0", flash_attn="on"), dict(flash_attn="off")):
            CACHES.clear("compute", "traced")
            try:
                cp = resolve_context(spec, RunConfig(n_ctx=4096, n_ubatch=512, **kw), Frontend.SERVER)
            except ConfigError:
                continue
            C.compute_buffers(spec, cp, backend, details=d)
            for traced in _TRACED.values():
                for t in traced.ts:
                    if t.op != "NONE":
                        assert impl.compute_size(t) == impl.alloc_size(t), (arch, kw, t.name, t.op)
                        checked += 1
                        sized += t.op in impl.sized_ops
    assert checked > 1000 and (sized or backend == "cpu")


def test_backend_facts_live_on_the_backend_objects() -> None:
    """What code outside the backends asks of them instead of their names (ggml-cpu, ggml-cuda, ggml-metal)."""
    from fitter.llama_builds import PINNED, resolve_build

    cpu_, cuda_, metal_ = (backends.get(b) for b in ("cpu", "cuda", "metal"))
    assert [b.is_gpu for b in (cpu_, cuda_, metal_)] == [False, True, True]
    assert [b.label for b in (cpu_, cuda_, metal_)] == ["CPU", "CUDA", "Metal"]
    assert [b.single_device for b in (cpu_, cuda_, metal_)] == [False, False, True]  # MTL0 only
    assert [b.unified_memory for b in (cpu_, cuda_, metal_)] == [False, False, True]  # Apple Silicon
    assert cuda_.has_host_buffer_type and not metal_.has_host_buffer_type  # CUDA_Host; Metal's is NULL
    # -fa auto: Metal's supports_op (K head size below V's), the CPU runs every FA node
    assert metal_.fa_auto_unsupported_reason([(128, 128), (64, 128)], "f16", "f16") == "K head size 64 < V head size 128"
    assert cpu_.fa_auto_unsupported_reason([(64, 128)], "f16", "f16") is None
    assert metal_.fa_auto_unsupported_reason([(128, 128)], "f16", "f16") is None
    # ggml_metal_op_flash_attn_ext_use_kv_f16: 32 queries per stream and more, since #27390
    assert not metal_.fa_alloc_reads_kv_type(PINNED, 32) and metal_.fa_alloc_reads_kv_type(PINNED, 31)
    assert metal_.fa_alloc_reads_kv_type(resolve_build("0.3.35"), 512)
    assert cuda_.fa_alloc_reads_kv_type(PINNED, 512) and not cpu_.fa_alloc_reads_kv_type(PINNED, 512)
    # how free memory is read (--budget auto), each backend its own way
    from fitter.ggml.backends.probes import DeviceProbes

    probes = DeviceProbes(run=lambda cmd: " 80000\n" if cmd[0] == "nvidia-smi" else None, system="Linux", given=True,
                          metal_probe=lambda: 25559 * 2**20, device=0)
    assert cuda_.free_memory(probes).source == "nvidia-smi memory.free (GPU 0)"
    assert metal_.free_memory(probes).bytes == 25559 * 2**20
