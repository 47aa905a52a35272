"""llama_kv_cache_iswa (src/llama-kv-cache-iswa.cpp): the cell count and cache types of the sliding-window cache."""

from __future__ import annotations

from fitter.ggml.types import pad
from fitter.llama.cparams import ContextParams
from fitter.llama.hparams import ModelSpec


def swa_cells(spec: ModelSpec, cp: ContextParams) -> int:
    """llama_kv_cache_iswa: the SWA cache's cell count (always padded to 256)."""
    if cp.swa_full:
        return cp.n_ctx_seq
    if not cp.build.has("kv_size_pad_backend"):
        # 0.3.16 llama_kv_cache_unified_iswa: min(size_base, GGML_PAD(n_swa*(unified ? n_seq_max : 1) + n_ubatch, n_pad)),
        # n_pad = llama_kv_cache_unified::get_padding (256 with flash attention, 32 without)
        n_pad = 256 if cp.flash_attn else 32
        return min(cp.n_ctx_seq, pad(spec.n_swa * (cp.n_seq_max if cp.kv_unified else 1) + cp.n_ubatch, n_pad))
    return pad(min(cp.n_ctx_seq, spec.n_swa * (cp.n_seq_max if cp.kv_unified else 1) + cp.n_ubatch), 256)


def swa_cache_types(cp: ContextParams) -> tuple[str, str]:
    """The SWA cache's K and V types: -ctk / -ctv, except in builds between #21277 and its revert #21332 (0.3.20
    llama_kv_cache_iswa::llama_kv_cache_iswa: "the SWA cache is never quantized", GGML_TYPE_F16 for both)."""
    if cp.build.has("swa_cache_f16_only"):
        return "f16", "f16"
    return cp.type_k, cp.type_v
