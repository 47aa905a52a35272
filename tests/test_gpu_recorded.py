"""ggfit's CUDA prediction against llama.cpp's CUDA dry runs recorded on an NVIDIA H200.

benchmarks/gpu/run.sh measured them (llama-cpp-python 0.3.36 built with CUDA for sm_90; exact bytes
from llama.cpp's memory breakdown per buffer type) on full-size Qwen3.6-35B-A3B and Llama 3.1 8B
shapes with a Q4_K_M type mix. The shapes are rebuilt here as sparse headers and predicted again, so
the test guards the model against regressions without a GPU.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.config import Backend, Frontend, RunConfig
from fitter.memory import predict
from fitter.model_spec import load_model_spec
from tests.synth.shapes import build_shape, q4_k_m_types

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-memory-h200.json"
ROWS = json.loads(RESULTS.read_text())["rows"]


@lru_cache(maxsize=None)
def _model(shape: str):
    return load_model_spec(str(build_shape(shape, tensor_types=q4_k_m_types(shape))))


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['shape']}-" + "-".join(f"{k}{v}" for k, v in r["config"].items()))
def test_cuda_prediction_matches_recorded_dry_run(row: dict) -> None:
    assert row["status"] == "ok"
    header, spec = _model(row["shape"])
    pred = predict(header, spec, RunConfig(**row["config"]), Backend.CUDA, Frontend.SERVER)
    measured = {m["buffer_type"]: m for m in row["measured"]}
    # every byte per llama.cpp buffer type: weights, KV + recurrent state ("context"), compute
    for buffer_type, m in measured.items():
        ours = [b for b in pred.buffers if b.owner == "target" and b.device == buffer_type]
        assert sum(b.bytes for b in ours if b.kind == "model") == m["model"], buffer_type
        assert sum(b.bytes for b in ours if b.kind in ("kv", "rs")) == m["context"], buffer_type
        assert sum(b.bytes for b in ours if b.kind == "compute") == m["compute"], buffer_type
        # the device's buffers count against the GPU's memory, the pinned host buffer does not
        assert all(b.counts == (not m["is_host"]) for b in ours if b.kind != "output")
