"""The prompt cache mlx-lm builds for one request, byte for byte (mlx_lm/models/cache.py).

`generate_step` prefills in chunks of `prefill_step_size` (leaving the last prompt token), then
runs the rest and one token per decode step; after every model call `maybe_quantize_kv_cache`
turns a KVCache whose offset reached `quantized_kv_start` into a QuantizedKVCache. Each class
grows its buffers its own way; this module replays those updates on shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitter.errors import GGFitError
from fitter.mlx.config import MlxSpec

STEP = 256  # KVCache.step, QuantizedKVCache.step, RotatingKVCache.step
ROTATING_KEEP = 4  # make_prompt_cache: RotatingKVCache(max_size=max_kv_size, keep=4)
DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate.DEFAULT_QUANTIZED_KV_START
DEFAULT_PREFILL_STEP = 2048  # generate_step / mlx_lm.server --prefill-step-size
DEFAULT_KV_GROUP_SIZE = 64


@dataclass(frozen=True)
class CacheSettings:
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    batch: int = 1


@dataclass(frozen=True)
class LayerCache:
    cls: str  # KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache
    capacity: int  # token slots allocated (0 for ArraysCache)
    bytes_per_layer: int
    n_layers: int

    @property
    def bytes(self) -> int:
        return self.bytes_per_layer * self.n_layers


def model_calls(n_prompt: int, n_generated: int, prefill_step_size: int) -> list[int]:
    """The token count of each model call of generate_step: prefill chunks, the prompt's rest, then decode."""
    if n_prompt < 1:
        raise GGFitError("the prompt needs at least 1 token")
    if prefill_step_size < 1:
        raise GGFitError(f"--prefill-step-size {prefill_step_size}: must be at least 1")
    calls = []
    done = 0
    while n_prompt - done > 1:  # generate_step: `while total_prompt_tokens - prompt_processed_tokens > 1`
        n = min(prefill_step_size, n_prompt - done - 1)
        calls.append(n)
        done += n
    calls.append(n_prompt - done)
    # the decode loop calls _step(y) once per generated token after the first (the prompt's call made it)
    calls += [1] * max(0, n_generated - 1)
    return calls


def _kv_grow(cap: int, offset: int, n: int) -> int:
    """KVCache.update_and_fetch (and QuantizedKVCache's): a new buffer of whole steps for n tokens,
    appended after the used part when the old one is full."""
    if cap == 0 or offset + n > cap:
        new = (STEP + n - 1) // STEP * STEP
        if cap and offset % STEP != 0:
            cap = offset  # keys[..., :prev, :] before the concatenation
        cap = (cap if cap else 0) + new
    return cap


def _rotating(calls: list[int], max_size: int) -> int:
    """RotatingKVCache: token slots held after these calls (_update_concat for S > 1, _update_in_place for 1)."""
    size = idx = offset = 0
    started = False
    for s in calls:
        if s > 1:
            if not started:
                size, started = s, True
            else:
                if idx != size and idx >= offset:
                    size = idx  # _temporal_order slices off the unused end
                idx = size
                trim = idx - max_size + 1
                size = size - max(trim, 0) + s
            offset += s
            idx = size
        else:
            if not started or (offset >= size and size < max_size):
                size += min(STEP, max_size - offset)
                idx = offset
                started = True
            if size > max_size:
                size = idx = max_size
            if idx == max_size:
                idx = ROTATING_KEEP
            offset += 1
            idx += 1
    return size


def _kv_bytes(spec: MlxSpec, slots: int, batch: int) -> int:
    return batch * spec.n_kv_heads * slots * spec.head_dim * 2 * spec.act_bytes


def _quant_bytes(spec: MlxSpec, slots: int, bits: int, group: int, batch: int) -> int:
    """mx.quantize of K and V: packed uint32 words plus scales and biases (the activations' dtype) per group."""
    d = spec.head_dim
    per = d * bits // 32 * 4 + 2 * (d // group) * spec.act_bytes
    return batch * spec.n_kv_heads * slots * per * 2


def arrays_cache_bytes(spec: MlxSpec, batch: int = 1) -> int:
    """GatedDeltaNet's ArraysCache(size=2): the conv state (B, kernel-1, conv_dim) in the activations'
    dtype and the recurrent state (B, Hv, Dv, Dk) in float32 (gated_delta_update's initial state)."""
    conv_dim = 2 * spec.linear_num_k_heads * spec.linear_k_head_dim + spec.linear_num_v_heads * spec.linear_v_head_dim
    conv = batch * (spec.linear_conv_kernel - 1) * conv_dim * spec.act_bytes
    state = batch * spec.linear_num_v_heads * spec.linear_v_head_dim * spec.linear_k_head_dim * 4
    return conv + state


def check_settings(spec: MlxSpec, s: CacheSettings) -> None:
    if s.kv_bits is not None and s.kv_bits not in (2, 3, 4, 5, 6, 8):
        raise GGFitError(f"--kv-bits {s.kv_bits}: mlx quantizes to 2, 3, 4, 5, 6 or 8 bits")
    if s.kv_bits is not None and s.kv_group_size not in (32, 64, 128):
        raise GGFitError(f"--kv-group-size {s.kv_group_size}: mlx quantizes in groups of 32, 64 or 128")
    if s.kv_bits is not None and spec.head_dim % s.kv_group_size:
        raise GGFitError(f"--kv-group-size {s.kv_group_size}: does not divide the head size {spec.head_dim}")
    if s.max_kv_size is not None and s.max_kv_size < 1:
        raise GGFitError(f"--max-kv-size {s.max_kv_size}: must be at least 1")


def layer_caches(spec: MlxSpec, s: CacheSettings, n_prompt: int, n_generated: int) -> list[LayerCache]:
    """Every layer's cache after a request of n_prompt tokens that generated n_generated."""
    return caches_after(spec, s, model_calls(n_prompt, n_generated, s.prefill_step_size))


def caches_after(spec: MlxSpec, s: CacheSettings, calls: list[int]) -> list[LayerCache]:
    """Every layer's cache after model calls of these token counts (see `model_calls`)."""
    check_settings(spec, s)
    total = sum(calls)
    out: list[LayerCache] = []
    n_lin = len(spec.layers) - spec.n_attention
    if n_lin:
        out.append(LayerCache("ArraysCache", 0, arrays_cache_bytes(spec, s.batch), n_lin))
    rotating = s.max_kv_size is not None and not spec.has_make_cache  # make_prompt_cache
    if rotating:
        assert s.max_kv_size is not None
        if s.kv_bits is not None and total >= s.quantized_kv_start:
            # maybe_quantize_kv_cache calls RotatingKVCache.to_quantized
            raise GGFitError("--kv-bits with --max-kv-size: mlx-lm raises 'RotatingKVCache Quantization NYI' "
                             f"once a cache reaches --quantized-kv-start ({s.quantized_kv_start})")
        slots = _rotating(calls, s.max_kv_size)
        out.append(LayerCache("RotatingKVCache", slots, _kv_bytes(spec, slots, s.batch), spec.n_attention))
        return out
    cap = offset = 0
    quantized = False
    for n in calls:
        cap = _kv_grow(cap, offset, n)
        offset += n
        if s.kv_bits is not None and offset >= s.quantized_kv_start:
            quantized = True  # to_quantized keeps the capacity; QuantizedKVCache then grows like KVCache
    if quantized:
        assert s.kv_bits is not None
        b = _quant_bytes(spec, cap, s.kv_bits, s.kv_group_size, s.batch)
        out.append(LayerCache("QuantizedKVCache", cap, b, spec.n_attention))
    else:
        out.append(LayerCache("KVCache", cap, _kv_bytes(spec, cap, s.batch), spec.n_attention))
    return out


def kv_capacity(spec: MlxSpec, s: CacheSettings, n_prompt: int) -> int:
    """Token slots of an attention layer's cache while the prompt's last prefill chunk runs."""
    return next((c.capacity for c in layer_caches(spec, s, n_prompt, 1) if c.cls != "ArraysCache"), 0)
MlxCacheSettings = CacheSettings  # the name fitter exports
