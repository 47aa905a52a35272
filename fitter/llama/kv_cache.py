"""KV caches and recurrent state: which caches llama.cpp creates for a model and their exact bytes.

Mirrors `llama_model::create_memory` (src/llama-model.cpp), the constructors of `llama_kv_cache`
(src/llama-kv-cache.cpp), `llama_kv_cache_iswa` (src/llama-kv-cache-iswa.cpp),
`llama_memory_hybrid` (src/llama-memory-hybrid.cpp) and `llama_memory_recurrent`
(src/llama-memory-recurrent.cpp). Pure functions of a ModelSpec and ContextParams.
"""

from __future__ import annotations

from typing import Literal

from fitter.ggml import backends
from fitter.ggml.types import F32, pad, row_size, type_of
from fitter.llama.cparams import Backend, ContextParams
from fitter.llama.hparams import LayerKind, ModelSpec
from fitter.llama.kv_cache_iswa import swa_cache_types, swa_cells
from fitter.llama.models import rules_of
from fitter.record import Record

# TENSOR_ALIGNMENT of the CPU buffer type: what llama.cpp's KV / RS buffer sizes pad each tensor to here
BUFFER_ALIGNMENT = backends.get(Backend.CPU).alignment


class CacheBuffer(Record):
    """One memory module's tensors (one llama.cpp "KV buffer" / "RS buffer" line per device)."""

    kind: Literal["kv", "rs"]
    name: str  # "kv", "kv_swa" or "rs"
    cells: int  # KV cells (per stream) or recurrent rows
    n_stream: int
    layers: list[int]
    type_k: str  # for rs: type of R
    type_v: str | None  # for rs: type of S; None for MLA (no V cache)
    k_bytes: int  # ggml_nbytes summed over layers (the "K (type): X MiB" figure); R for rs
    v_bytes: int  # V (or S for rs)
    buffer_bytes: int  # the allocated buffer: every tensor padded to the buffer alignment

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes


def _kv_cache(
    name: str, spec: ModelSpec, cp: ContextParams, layers: list[int], kv_size: int,
    types: tuple[str, str] | None = None,
) -> CacheBuffer:
    # llama_kv_cache::llama_kv_cache
    n_stream = 1 if cp.kv_unified else cp.n_seq_max
    v_trans = not cp.flash_attn
    type_k, type_v = types or (cp.type_k, cp.type_v)
    tk, tv = type_of(type_k), type_of(type_v)
    # [TAG_V_CACHE_VARIABLE]: without FA the V cache is padded to the widest layer of the whole model
    v_max = max(layer.n_embd_v_gqa for layer in spec.layers) if v_trans else 0
    k_total = v_total = buf = 0
    # MLA: no V cache since #19067 (llama_kv_cache::llama_kv_cache); 0.3.16 cached V (kv_lora_rank wide) as well
    v_less = spec.is_mla and cp.build.has("mla_v_less_cache")
    for il in layers:
        layer = spec.layers[il]
        k = row_size(tk, layer.n_embd_k_gqa) * kv_size * n_stream
        k_total += k
        buf += pad(k, BUFFER_ALIGNMENT)
        if not v_less:
            v = row_size(tv, v_max if v_trans else layer.n_embd_v_gqa) * kv_size * n_stream
            v_total += v
            buf += pad(v, BUFFER_ALIGNMENT)
    return CacheBuffer(
        kind="kv",
        name=name,
        cells=kv_size,
        n_stream=n_stream,
        layers=layers,
        type_k=type_k,
        type_v=None if v_less else type_v,
        k_bytes=k_total,
        v_bytes=v_total,
        buffer_bytes=buf,
    )


def _recurrent(spec: ModelSpec, cp: ContextParams, layers: list[int]) -> CacheBuffer:
    # llama_memory_recurrent::llama_memory_recurrent: f32 r and s, mem_size * (1 + n_rs_seq) rows
    assert spec.ssm is not None
    mem_size = max(1, cp.n_seq_max)
    rows = mem_size * (1 + cp.n_rs_seq)
    r = row_size(F32, spec.ssm.n_embd_r) * rows
    s = row_size(F32, spec.ssm.n_embd_s) * rows
    return CacheBuffer(
        kind="rs",
        name="rs",
        cells=mem_size,
        n_stream=1,
        layers=layers,
        type_k="f32",
        type_v="f32",
        k_bytes=r * len(layers),
        v_bytes=s * len(layers),
        buffer_bytes=(pad(r, BUFFER_ALIGNMENT) + pad(s, BUFFER_ALIGNMENT)) * len(layers),
    )


def memory_caches(spec: ModelSpec, cp: ContextParams, *, mtp: bool = False) -> list[CacheBuffer]:
    """The caches of a context: the target's (mtp=False) or an MTP draft context's (mtp=True)."""
    n_layer = spec.n_layer
    all_layers = range(len(spec.layers))
    kv_size = cp.n_ctx_seq

    rules = rules_of(spec.architecture)
    if rules is not None and rules.hybrid_memory:
        if mtp:
            # mtp_on_hybrid_qwen: a plain KV cache over the NextN layers only
            return [_kv_cache("kv", spec, cp, [il for il in all_layers if il >= n_layer], kv_size)]
        attn = [il for il in all_layers if il < n_layer and spec.layers[il].kind != LayerKind.RECURRENT]
        recr = [il for il in all_layers if il < n_layer and spec.layers[il].kind == LayerKind.RECURRENT]
        return [_kv_cache("kv", spec, cp, attn, kv_size), _recurrent(spec, cp, recr)]

    def keep(il: int) -> bool:
        if not spec.layers[il].has_kv:  # llama_hparams::has_kv (gemma4's shared-KV layers reuse others)
            return False
        if spec.n_layer_nextn > 0:
            if cp.build.has("kv_nextn_layers_main_ctx"):
                return True  # 0.3.29 llama_kv_cache: every layer of n_layer_all, no NextN filter (fixed by #28630)
            return il >= n_layer if mtp else il < n_layer
        return True

    layers = [il for il in all_layers if keep(il)]
    if spec.is_swa_any:
        base = [il for il in layers if spec.layers[il].kind != LayerKind.SWA]
        swa = [il for il in layers if spec.layers[il].kind == LayerKind.SWA]
        return [_kv_cache("kv", spec, cp, base, kv_size), _kv_cache("kv_swa", spec, cp, swa, swa_cells(spec, cp),
                                                                    swa_cache_types(cp))]
    return [_kv_cache("kv", spec, cp, layers, kv_size)]
