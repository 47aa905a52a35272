"""The prefill peak (weights + cache + the worst chunk's working set) within 5% of
mx.get_peak_memory() at three --prefill-step-size values, on the CPU backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fitter.mlx.activations import prefill_peak
from fitter.mlx.cache import CacheSettings
from fitter.mlx.config import load_mlx_model
from fitter.mlx.weights import weight_bytes

N_PROMPT = 1100


@pytest.mark.slow
@pytest.mark.parametrize("step", [256, 512, 1024])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_moe"])
def test_prefill_peak_within_5_percent(mlx_model, name, step):
    d = mlx_model(name, 4)
    out = subprocess.run([sys.executable, "-m", "tests.mlxlm._peak_child", str(d), str(N_PROMPT), str(step)],
                         capture_output=True, text=True, timeout=600, check=True)
    real = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    m = load_mlx_model(str(d))
    pk = prefill_peak(m.spec, CacheSettings(prefill_step_size=step), N_PROMPT)
    pred = weight_bytes(m.spec, m.tensors).resident + pk.cache_bytes + pk.bytes
    assert abs(pred - real) <= 0.05 * real, f"predicted {pred}, mx.get_peak_memory() {real}"
