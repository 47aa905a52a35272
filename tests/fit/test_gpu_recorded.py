"""ggfit's CUDA prediction against what llama.cpp did on an NVIDIA H200, recorded by benchmarks/gpu/.

benchmarks/gpu/run.sh measured them (llama-cpp-python 0.3.36 built with CUDA for sm_90; exact bytes from
llama.cpp's memory breakdown per buffer type) on full-size shapes with a Q4_K_M type mix: Qwen3.6-35B-A3B,
its Qwen3.5 0.8B drafter, Llama 3.1 8B, gpt-oss 20B and Gemma 3 27B. Dry runs (no_alloc) over a grid of
n_ctx, n_ubatch, K/V type and flash attention; real loads of the same shapes filled with random valid
blocks; and probes on a GPU held down to 25,559 MiB free. The shapes are rebuilt here as sparse headers
and predicted again, so these tests guard the model against regressions without a GPU.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.fit.budget import DEFAULT_MARGIN_BYTES
from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from tests.synth.shapes import build_shape, q4_k_m_types

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
DRY = json.loads((RESULTS / "gpu-memory-h200.json").read_text())["rows"]
LOAD = json.loads((RESULTS / "gpu-load-h200.json").read_text())["rows"]
BUDGET = json.loads((RESULTS / "gpu-budget-h200.json").read_text())


@lru_cache(maxsize=None)
def _model(shape: str):
    return load_model_spec(str(build_shape(shape, tensor_types=q4_k_m_types(shape))))


def _predict(shape: str, config: dict):
    header, spec = _model(shape)
    draft = _model("qwen35-0.8b") if config.get("draft_model") else None
    return predict(header, spec, RunConfig(**config), Backend.CUDA, Frontend.SERVER, draft)


def _row_id(r: dict) -> str:
    return f"{r['shape']}-" + "-".join(f"{k}{v}" for k, v in r["config"].items())


def _assert_every_byte(row: dict) -> None:
    pred = _predict(row["shape"], row["config"])
    # every byte per llama.cpp buffer type: weights, KV + recurrent state ("context"), compute
    for m in row["measured"]:
        ours = [b for b in pred.buffers if b.owner == "target" and b.device == m["buffer_type"]]
        assert sum(b.bytes for b in ours if b.kind == "model") == m["model"], m["buffer_type"]
        assert sum(b.bytes for b in ours if b.kind in ("kv", "rs")) == m["context"], m["buffer_type"]
        assert sum(b.bytes for b in ours if b.kind == "compute") == m["compute"], m["buffer_type"]
        # the device's buffers count against the GPU's memory, the pinned host buffer does not
        assert all(b.counts == (not m["is_host"]) for b in ours if b.kind != "output")


@pytest.mark.slow
@pytest.mark.parametrize("row", DRY, ids=_row_id)
def test_cuda_prediction_matches_recorded_dry_run(row: dict) -> None:
    assert row["status"] == "ok"
    _assert_every_byte(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", LOAD, ids=_row_id)
def test_cuda_prediction_matches_recorded_real_load(row: dict) -> None:
    assert row["status"] == "ok"
    _assert_every_byte(row)
    # cudaMemGetInfo saw the predicted buffers plus allocation rounding (a few MiB) after the load; after
    # a decode the CUDA pool had grown too. With the CUDA context, all of it fits the default margin.
    assert 0 <= row["unbuffered_after_load_bytes"] <= 16 * 2**20
    assert row["cuda_context_bytes"] + row["unbuffered_after_decode_bytes"] < DEFAULT_MARGIN_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("row", BUDGET["rows"], ids=lambda r: r["case"])
def test_recorded_budget_cases_behaved_as_predicted(row: dict) -> None:
    budget, free = BUDGET["fit"]["budget_bytes"], BUDGET["free_bytes_held_to"]
    assert abs(budget - free) <= 2 * 2**20  # ggfit --budget auto read what the holder left free
    pred = _predict("qwen36-35b-a3b", row["config"])
    assert pred.total_device_bytes == row["predicted_device_bytes"]
    if pred.total_device_bytes <= budget - BUDGET["fit"]["margin_bytes"]:
        assert row["status"] == "ok", row["message"]
    else:
        assert pred.total_device_bytes >= budget + 2**30 and row["status"] == "oom"
