"""llama_kv_cache_iswa (src/llama-kv-cache-iswa.cpp): the cell count of the sliding-window cache."""

from __future__ import annotations

from fitter.ggml.types import pad
from fitter.llama.cparams import ContextParams
from fitter.llama.hparams import ModelSpec


def swa_cells(spec: ModelSpec, cp: ContextParams) -> int:
    """llama_kv_cache_iswa: the SWA cache's cell count (always padded to 256)."""
    if cp.swa_full:
        return cp.n_ctx_seq
    return pad(min(cp.n_ctx_seq, spec.n_swa * (cp.n_seq_max if cp.kv_unified else 1) + cp.n_ubatch), 256)
