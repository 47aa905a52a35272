"""Bytes of one sequence's saved state: what `llama_state_seq_get_size_ext` returns in the pinned build.

llama-server copies this state into host memory for its prompt cache (flags NONE: the whole sequence) and for
context checkpoints (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: only the part that cannot be rolled back, the SWA cache
or the recurrent state). Mirrors llama_context::state_seq_write_data -> memory->state_write:
llama_kv_cache::state_write / state_write_meta / state_write_data (src/llama-kv-cache.cpp),
llama_kv_cache_iswa::state_write, llama_memory_hybrid::state_write and llama_memory_recurrent::state_write
(src/llama-memory-recurrent.cpp). The caches' layers and types come from fitter.llama.kv_cache.memory_caches.
"""

from __future__ import annotations

from fitter.ggml.types import F32, row_size, type_size
from fitter.llama.cparams import ContextParams
from fitter.llama.hparams import ModelSpec
from fitter.llama.kv_cache import CacheBuffer, memory_caches

# llama_model_rope_type: the architectures whose rope type is MROPE / IMROPE (n_pos_per_embd() > 1), whose KV
# cells carry a llama_kv_cell_ext (llama_kv_cache::has_cell_ext); glm4 only with rope.dimension_sections
_MROPE_ARCHS = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp",
                          "qwen3tts"})
CELL_EXT_BYTES = 12  # sizeof(llama_kv_cell_ext): x, y, tok


def has_cell_ext(spec: ModelSpec, mrope: bool = False) -> bool:
    """llama_kv_cache::has_cell_ext: M-RoPE (2D positions) or the PLE n-gram hash (not modelled here)."""
    return spec.architecture in _MROPE_ARCHS or (mrope and spec.architecture in {"glm4", "glm4moe"})


def kv_state_bytes(cache: CacheBuffer, spec: ModelSpec, cp: ContextParams, n_cells: int, *, cell_ext: bool) -> int:
    """llama_kv_cache::state_write for one sequence holding `n_cells` (unmasked) cells in its stream."""
    out = 4 + 4 * cache.n_stream  # n_stream, then each stream's cell_count (0 for the streams of other sequences)
    if n_cells == 0:
        return out
    # state_write_meta: pos, n_seq_id (1: only the asked seq_id), [ext], the seq_id
    out += n_cells * (4 + 4 + (CELL_EXT_BYTES if cell_ext else 0) + 4)
    out += 8  # state_write_data: v_trans, n_layer
    v_trans = not cp.flash_attn
    for il in cache.layers:
        out += 4 + 8 + n_cells * row_size(cache.type_k, spec.layers[il].n_embd_k_gqa)  # type, row size, rows
    if cache.type_v is None:  # MLA: no V tensors
        return out
    for il in cache.layers:
        n_v = spec.layers[il].n_embd_v_gqa
        if v_trans:  # type, element size, n_embd_v_gqa, then each row's elements of the cells
            out += 4 + 4 + 4 + n_cells * n_v * type_size(cache.type_v)
        else:
            out += 4 + 8 + n_cells * row_size(cache.type_v, n_v)
    return out


def recurrent_state_bytes(cache: CacheBuffer, spec: ModelSpec) -> int:
    """llama_memory_recurrent::state_write for one sequence (one cell: its conv and ssm rows)."""
    assert spec.ssm is not None
    out = 4 + 1 * (4 + 4)  # cell_count; meta: pos, n_seq_id = 0 (one seq_id asked)
    out += 8  # s_trans, n_layer
    out += len(cache.layers) * (4 + 8 + row_size(F32, spec.ssm.n_embd_r))  # R: type, row size, one row
    out += len(cache.layers) * (4 + 8 + row_size(F32, spec.ssm.n_embd_s))  # S
    return out


def swa_cells(spec: ModelSpec, cp: ContextParams, n_tokens: int) -> int:
    """Cells of the SWA cache written for a sequence of n_tokens positions 0..n-1: those not SWA-masked against
    its largest position (llama_hparams::is_masked_swa, LLAMA_SWA_TYPE_STANDARD: p1 - p0 >= n_swa is masked)."""
    if cp.swa_full or spec.n_swa <= 0:
        return n_tokens
    return min(n_tokens, spec.n_swa)


def seq_state_bytes(spec: ModelSpec, cp: ContextParams, n_tokens: int, *, partial: bool = False,
                    mrope: bool = False, mtp: bool = False) -> int:
    """llama_state_seq_get_size_ext(ctx, seq, flags) for a sequence of `n_tokens` in memory. `partial`:
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (a context checkpoint): only the SWA cache or the recurrent state. `mtp`: an
    MTP draft context's memory (its NextN layers)."""
    ext = has_cell_ext(spec, mrope)
    # a plain llama_kv_cache or llama_memory_recurrent ignores the flag (GGML_UNUSED(flags)): whole state
    partial = partial and (spec.is_swa_any or spec.is_hybrid)
    out = 4 + 4  # llama_context::state_seq_get_size: io_magic, seq_id
    for cache in memory_caches(spec, cp, mtp=mtp):
        if cache.kind == "rs":
            out += recurrent_state_bytes(cache, spec)
        elif cache.name == "kv_swa":
            out += kv_state_bytes(cache, spec, cp, swa_cells(spec, cp, n_tokens), cell_ext=ext)
        elif not partial:
            out += kv_state_bytes(cache, spec, cp, n_tokens if n_tokens > 0 else 0, cell_ext=ext)
    return out


def checkpoints_apply(spec: ModelSpec, cp: ContextParams) -> bool:
    """server_context::update_slots do_checkpoint: the target cannot remove a partial sequence (recurrent,
    COMMON_CONTEXT_SEQ_RM_TYPE_FULL / _RS) or uses SWA without --swa-full (n_swa > 0)."""
    return spec.ssm is not None or (spec.is_swa_any and not cp.swa_full)
