"""Ops whose inputs live in host memory, against llama.cpp's CUDA runs recorded on an H200 (issue 49, items 1, 2, 5).

benchmarks/gpu/run.sh hostops (benchmarks/gpu/hostops.py) ran the pinned llama.cpp with CUDA on one H200:
- dry runs (no_alloc) of five full-size shapes (Llama 3.1 8B, Gemma 3 27B, Qwen3.6-35B-A3B, gpt-oss 20B, Qwen3.5
  0.8B; Q4_K_M mix, mmap on) with -ngl 0 and -ngl 1 (op offload: a batch's matmuls run on the GPU, their host
  weights copied there), -nkvo with flash attention on and off, for llama-server's and the library's defaults;
- real loads of seven of those configs, each with a decode of one full ubatch;
- real loads of the CPU LoRA tests' adapters (tests/llama/test_lora.py CASES) with every, no and one layer on the GPU.
These tests predict the same configs again, without a GPU: every KV, recurrent-state and compute buffer of every
device to the byte, and the weights of the real loads.

llama.cpp's dry run is not the truth for one case: with -nkvo and flash attention off, llama-graph.cpp assigns the
attention output to the CPU (ggml_backend_sched_set_tensor_backend), and a real load runs the whole attention there;
the dry run sizes its buffers with ggml_backend_sched_reserve_size, whose ggml_backend_sched_reset drops that
assignment first. Its rows are checked to differ from the real load's placement, not to match.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from tests.synth.shapes import SHAPES, build_shape, q4_k_m_types

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ROWS = json.loads((RESULTS / "gpu-hostops-h200.json").read_text())["rows"]
_KINDS = {"context": ("kv", "rs"), "compute": ("compute",)}


def _row_id(r: dict) -> str:
    return f"{r['mode']}-{r['shape']}-{r['frontend']}-{r['case']}".replace(" ", "-")


def _dry_drops_user_assignment(r: dict) -> bool:
    return r["mode"] == "dry" and r["config"].get("no_kv_offload") and r["config"]["flash_attn"] == "off"


@lru_cache(maxsize=None)
def _model(shape: str):
    return load_model_spec(str(build_shape(shape, tensor_types=q4_k_m_types(shape))))


@lru_cache(maxsize=None)
def _lora_case(i: int):
    """The i-th CPU LoRA case's base and adapters, built here (the recorded paths are the device's cache)."""
    from tests.llama.test_lora import CASES, _base
    from tests.synth.lora import build_lora

    arch, adapters, _cfg, _moves = CASES[i]
    base = _base(arch)
    return load_model_spec(str(base)), tuple((str(build_lora(base, t, **o)), s) for t, o, s in adapters)


def _predict(r: dict):
    cfg = dict(r["config"])
    if r["shape"] in SHAPES:
        header, spec = _model(r["shape"])
    else:  # "<arch>-<i>": the i-th LoRA case
        (header, spec), cfg["lora"] = _lora_case(int(r["shape"].rsplit("-", 1)[1]))
    return predict(header, spec, RunConfig(**cfg), Backend.CUDA, Frontend(r["frontend"]))


def _diffs(pred, r: dict) -> dict[tuple[str, str], int]:
    kinds = {**_KINDS, "model": ("model",)} if r["mode"] == "load" else _KINDS  # a dry run maps no file
    out = {}
    for m in r["measured"]:
        ours = [b for b in pred.buffers if b.owner == "target" and b.device == m["buffer_type"]]
        for field, ks in kinds.items():
            out[(m["buffer_type"], field)] = sum(b.bytes for b in ours if b.kind in ks) - m[field]
    return out


CHECKED = [r for r in ROWS if r["status"] == "ok" and not _dry_drops_user_assignment(r)]


def test_the_recording_covers_the_issue() -> None:
    """Four architectures and more, both frontends, -ngl 0 / 1, -nkvo with flash attention on and off (real loads
    of both), LoRA with every / no / one layer on the GPU; every run loaded."""
    assert all(r["status"] == "ok" for r in ROWS)
    assert len({r["shape"] for r in ROWS if r["shape"] in SHAPES}) == 5
    cases = {(r["mode"], r["case"].split()[0], r["config"]["flash_attn"]) for r in ROWS}
    for want in (("dry", "ngl0", "on"), ("dry", "ngl0", "off"), ("dry", "ngl1", "on"), ("dry", "nkvo", "on"),
                 ("load", "ngl0", "on"), ("load", "ngl0", "off"), ("load", "nkvo", "off"), ("load", "nkvo", "on")):
        assert want in cases
    assert {r["config"]["n_gpu_layers"] for r in ROWS if r["case"].startswith("lora")} == {0, 1, 99}


@pytest.mark.slow
@pytest.mark.parametrize("row", CHECKED, ids=_row_id)
def test_every_buffer_matches_llama_cpp(row: dict) -> None:
    diffs = _diffs(_predict(row), row)
    assert {k: d for k, d in diffs.items() if d} == {}


@pytest.mark.slow
def test_nkvo_without_flash_attention_runs_the_attention_on_the_host() -> None:
    """-nkvo -fa off, 8B, -c 32768 -ub 512, llama-server's defaults: a real load puts 2,136.01 MiB of compute in
    CUDA_Host (the KQ matrix of a whole ubatch) and 108.00 MiB on CUDA0; ggfit predicts that, not the dry run's
    2,272.00 MiB on CUDA0."""
    (load,) = [r for r in ROWS if r["mode"] == "load" and r["case"] == "nkvo fa=off c=32768 ub=512"
               and r["shape"] == "llama-8b"]
    dry = [r for r in ROWS if r["mode"] == "dry" and r["case"] == load["case"] and r["shape"] == "llama-8b"
           and r["frontend"] == load["frontend"]][0]
    pred = _predict(load)
    got = {b.device: b.bytes for b in pred.buffers if b.kind == "compute"}
    measured = {m["buffer_type"]: m["compute"] for m in load["measured"] if m["compute"]}
    assert got == measured
    assert round(measured["CUDA_Host"] / 2**20, 2) == 2136.01 and round(measured["CUDA0"] / 2**20, 2) == 108.0
    assert {m["buffer_type"]: m["compute"] for m in dry["measured"] if m["compute"]} != measured
