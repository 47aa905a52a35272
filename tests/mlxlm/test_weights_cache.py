"""Weights and every cache class, byte-exact against mlx-lm's own loaded arrays and cache objects
after a real prefill and decode (mlx CPU backend)."""

from __future__ import annotations

import pytest

from fitter.mlx.cache import CacheSettings, layer_caches
from fitter.mlx.config import load_mlx_model
from fitter.mlx.weights import weight_bytes

NAMES = ("qwen3", "qwen3_5", "qwen3_moe")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", NAMES)
def test_weights_exact(mlx_model, name, bits):
    from mlx.utils import tree_flatten
    from mlx_lm import load

    d = mlx_model(name, bits)
    model, _ = load(str(d))
    real = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    m = load_mlx_model(str(d))
    assert weight_bytes(m.spec, m.tensors).resident == real
    assert m.spec.quant_bits == bits and m.spec.quant_group_size == 64


# (prompt, generated, prefill step, max_kv_size, kv_bits, quantized_kv_start)
RUNS = [
    (100, 1, 2048, None, None, 5000),  # KVCache, one chunk
    (300, 5, 128, None, None, 5000),  # chunks across the 256 steps
    (513, 40, 200, None, None, 5000),  # decode past a step boundary
    (400, 3, 256, None, 8, 0),  # QuantizedKVCache from the start, 8-bit
    (400, 3, 256, None, 4, 300),  # converted mid-prefill, 4-bit
    (500, 20, 100, None, 4, 499),  # converted at the last prompt token, then grown
    (400, 30, 128, 300, None, 5000),  # RotatingKVCache (flat models) / KVCache (make_cache models)
    (300, 100, 64, 256, None, 5000),  # rotating in place
    (500, 3, 500, 300, None, 5000),  # one chunk larger than max_kv_size
]


@pytest.mark.parametrize("name", NAMES)
def test_caches_exact(mlx_model, name):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    d = mlx_model(name, 4)
    model, _ = load(str(d))
    spec = load_mlx_model(str(d)).spec
    seen = set()
    for n, gen, step, mk, bits, qs in RUNS:
        cache = make_prompt_cache(model, max_kv_size=mk)
        prompt = mx.array([(i * 7) % 1000 + 3 for i in range(n)])
        for _ in generate_step(prompt, model, max_tokens=gen, prefill_step_size=step, prompt_cache=cache,
                               max_kv_size=mk, kv_bits=bits, quantized_kv_start=qs):
            pass
        real: dict[str, int] = {}
        for c in cache:
            real[type(c).__name__] = real.get(type(c).__name__, 0) + c.nbytes
        s = CacheSettings(max_kv_size=mk, kv_bits=bits, quantized_kv_start=qs, prefill_step_size=step)
        pred = {c.cls: c.bytes for c in layer_caches(spec, s, n, gen)}
        assert pred == real, (n, gen, step, mk, bits, qs)
        seen |= set(real)
    want = {"KVCache", "QuantizedKVCache"} | ({"ArraysCache"} if name == "qwen3_5" else {"RotatingKVCache"})
    assert seen == want


def test_rotating_with_kv_bits_is_mlx_lms_error(mlx_model):
    from fitter.errors import GGFitError

    spec = load_mlx_model(str(mlx_model("qwen3", 4))).spec
    with pytest.raises(GGFitError, match="RotatingKVCache Quantization NYI"):
        layer_caches(spec, CacheSettings(max_kv_size=512, kv_bits=8, quantized_kv_start=0), 100, 1)
