"""The peak working set of one prefill step (`--prefill-step-size` tokens), above weights and cache.

generate_step evaluates only the caches' state after each prefill chunk (no logits), so a chunk's
peak is the largest layer's working set:
- attention: mx.fast.scaled_dot_product_attention's unfused path (the CPU's, and Metal's for a long
  query chunk) holds the scores, n_heads x L x kL in the activations' dtype (`where` and the precise
  softmax write in place), plus the boolean causal mask, L x kL;
- a gated-delta-net layer on the CPU runs gated_delta_ops, a per-token loop whose L recurrent states
  (n_v_heads x Dv x Dk float32) are all alive before the outputs are gathered. Metal runs
  gated_delta_kernel instead, which holds one state: that term is a CPU-backend fact;
- a per-token rest, `TOKEN_FACTOR` x hidden_size x the activations' bytes: the projections, the
  float32 temporaries of the CPU's unfused rms_norm (3.5x its output) and rope (4x), the MLP.
  These factors were measured on the CPU backend (mlx 0.32.4, tests/mlxlm/test_prefill_peak.py);
  Metal fuses rms_norm and rope, so they are an upper bound there.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitter.mlx.cache import CacheSettings, caches_after, model_calls
from fitter.mlx.config import MlxSpec

# per-token working set of a layer beyond the attention scores / recurrent states, in hidden_size x
# activation bytes; measured on the CPU backend (see the module docstring)
TOKEN_FACTOR_DENSE = 30.0
TOKEN_FACTOR_DENSE_QUANTIZED = 33.0  # quantized_matmul's dequantized operand
TOKEN_FACTOR_MOE = 24.0
TOKEN_FACTOR_LINEAR = 11.5


@dataclass(frozen=True)
class PrefillPeak:
    bytes: int  # transient bytes above weights and the cache at the worst chunk
    cache_bytes: int  # every layer's cache at that chunk
    chunk: int  # tokens in that chunk
    keys: int  # keys it attends to (offset + chunk)


def _token_factor(spec: MlxSpec) -> float:
    if spec.num_experts:
        return TOKEN_FACTOR_MOE
    return TOKEN_FACTOR_DENSE_QUANTIZED if spec.quant_bits else TOKEN_FACTOR_DENSE


def chunk_bytes(spec: MlxSpec, chunk: int, keys: int, batch: int = 1) -> int:
    """The working set of the heaviest layer for one prefill chunk of `chunk` tokens over `keys` keys."""
    a = spec.act_bytes
    worst = 0
    if spec.n_attention:
        scores = spec.n_heads * chunk * keys * a + chunk * keys  # scores + bool causal mask
        worst = scores + int(chunk * _token_factor(spec) * spec.hidden_size * a)
    if spec.n_attention < len(spec.layers):
        state = spec.linear_num_v_heads * spec.linear_v_head_dim * spec.linear_k_head_dim * 4
        worst = max(worst, chunk * state + int(chunk * TOKEN_FACTOR_LINEAR * spec.hidden_size * a))
    return batch * worst


def prefill_peak(spec: MlxSpec, s: CacheSettings, n_prompt: int) -> PrefillPeak:
    """The worst prefill chunk of a prompt: its working set plus the cache it writes into."""
    calls = model_calls(n_prompt, 1, s.prefill_step_size)
    best = PrefillPeak(0, 0, 0, 0)
    offset = 0
    for i, n in enumerate(calls):
        keys = offset + n
        if s.max_kv_size is not None and not spec.has_make_cache:
            keys = min(keys, s.max_kv_size - 1 + n)  # RotatingKVCache keeps max_size - 1 + S for a chunk
        cache = sum(c.bytes for c in caches_after(spec, s, calls[: i + 1]))
        work = chunk_bytes(spec, n, keys, s.batch)
        if work + cache > best.bytes + best.cache_bytes:
            best = PrefillPeak(work, cache, n, keys)
        offset += n
    return best
