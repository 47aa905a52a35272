"""An mmproj's buffers on CUDA against the pinned libmtmd built with CUDA, recorded on an H200.

benchmarks/gpu/mmproj.sh (one device call, 351 s with the build, 2026-12-04) built the pinned llama.cpp's libmtmd for
sm_90, loaded each synthetic projector with tests/mtmd/mtmd_mem.cpp (every ggml_backend_buft_alloc_buffer: the weight
buffer, then the warmup's compute buffers, then those of an encode of the largest image where one is asked) with
use_gpu on (clip's scheduler over CUDA0 and the CPU) and off, -fa auto and off. These tests predict the same files
again, without a GPU: the weight buffer (CUDA0, quantized rows padded), CUDA0's and the CPU's compute buffers and what
the largest image grows them to, exact on all 33 rows (Gemma 3, Gemma 4, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Pixtral
projectors, small ones whose 16-wide heads CUDA's flash attention lacks, so -fa auto reserves twice; Gemma 3 27B's
SigLIP, Qwen2.5-VL-7B and Qwen3-VL-8B at full size).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.ggml.backends.base import Backend
from fitter.gguf.reader import read_header
from fitter.mtmd.memory import mmproj_buffers
from tests.synth.mmproj import build_mmproj

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ROWS = json.loads((RESULTS / "gpu-mmproj-h200.json").read_text())["rows"]


def _id(r: dict) -> str:
    over = ",".join(f"{k}={v}" for k, v in r["overrides"].items() if k != "sparse") or "small"
    return f"{r['kind']}[{over}]-fa_{r['flash_attn']}-{'gpu' if r['use_gpu'] else 'cpu'}"


def _final(allocs: list[list]) -> dict[str, int]:
    """Each buffer type's last allocation after the weights (ggml_gallocr_reserve_n reallocates only to grow)."""
    out: dict[str, int] = {}
    for name, size in allocs[1:]:
        out[name] = size
    return out


@pytest.mark.parametrize("row", ROWS, ids=[_id(r) for r in ROWS])
def test_recorded_row(row: dict) -> None:
    assert row["rc"] == 0
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in row["overrides"].items()}
    path = str(build_mmproj(row["kind"], **over))
    rows = mmproj_buffers(read_header(path), path, Backend.CUDA, offload=row["use_gpu"], flash_attn=row["flash_attn"])
    weights = [(r.device, r.bytes) for r in rows if r.kind == "model"]
    assert weights == [tuple(row["allocs"][0])]
    assert {r.device: r.bytes for r in rows if r.kind == "compute"} == _final(row["allocs"])
    assert any(("flash attention on" in r.detail) == row["fa_enabled"] for r in rows if r.kind == "compute")
    if row.get("encode"):  # an image of the largest size encoded after the warmup: the device's buffer grew to
        grown = [size for name, size in row["grown"] if name == rows[0].device]
        assert [r.grows_to for r in rows if r.kind == "compute" and r.on_device] == grown[-1:]
