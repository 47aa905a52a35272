"""Full-size checkpoints predicted from their headers alone (tests/mlxlm/full_size.py), against the
published sizes: Qwen3.8-27B about 15.5 GB resident at 4-bit, 28 GB at 8-bit, a 253 MB MTP drafter.

The gaps (documented in the README) are what mlx-lm's classes alone cannot say: the 4-bit
checkpoint's per-layer overrides and the MTP head's own quantization are not in our fixture."""

from __future__ import annotations

import pytest

from fitter.mlx.cache import CacheSettings
from fitter.mlx.config import load_mlx_model
from fitter.mlx.memory import MlxRun, predict_mlx
from fitter.mlx.weights import weight_bytes


@pytest.fixture(scope="module")
def full(tmp_path_factory, mlx_model):
    from tests.mlxlm.full_size import write

    root = tmp_path_factory.mktemp("full")
    return lambda name, bits: load_mlx_model(str(write(name, bits, root)))


def test_qwen38_27b(full):
    q4, q8 = full("qwen3.8-27b", 4), full("qwen3.8-27b", 8)
    w4, w8 = weight_bytes(q4.spec, q4.tensors), weight_bytes(q8.spec, q8.tensors)
    assert w4.resident == 15_132_806_656  # mlx-lm's own arrays for the text model (4.5 bits a weight)
    assert abs(w4.resident - 15.5e9) / 15.5e9 < 0.03
    assert abs(w8.resident - 28e9) / 28e9 < 0.03
    assert abs(w4.mtp - 253e6) / 253e6 < 0.06
    assert q4.spec.layers.count("linear") == 48 and q4.spec.n_attention == 16
    # 16 attention layers x 4 KV heads x 256 x (K, V) x bf16 per token; 48 linear layers' fixed state
    p = predict_mlx(q4, MlxRun(n_ctx=32768, cache=CacheSettings()))
    assert p.by_kind("kv") == 16 * 4 * 256 * 2 * 2 * 32768
    assert p.by_kind("rs") == 48 * (3 * (2 * 16 * 128 + 48 * 128) * 2 + 48 * 128 * 128 * 4)
    p8 = predict_mlx(q4, MlxRun(n_ctx=32768, cache=CacheSettings(kv_bits=8, quantized_kv_start=0)))
    assert p8.by_kind("kv") == 16 * 4 * 32768 * (256 + 2 * 4 * 2) * 2  # 8-bit words + bf16 scale, bias / 64


def test_qwen36_35b_a3b(full):
    m = full("qwen3.6-35b-a3b", 4)
    w = weight_bytes(m.spec, m.tensors)
    assert m.spec.num_experts == 256 and m.spec.n_attention == 10
    assert 19e9 < w.resident < 20e9  # 35B parameters at ~4.5 bits
