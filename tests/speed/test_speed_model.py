"""The speed model against llama-bench's recorded rates on the H200 (benchmarks/results/speed-h200.json, llama.cpp
0c1e570): the orders that the measurements show, which a user's choice rests on. Error figures live in
benchmarks/speed_model.py, not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.fit.fastest import fastest_placements
from fitter.fit.solver import solve_placement
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.speed.hardware import get_profile
from fitter.speed.predict import predict_speed
from tests.synth.shapes import build_shape, quant_types

ROWS = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/speed-h200.json").read_text())["rows"]
MiB = 2**20


def _model(shape: str, ftype: str):
    return load_model_spec(str(build_shape(shape, tensor_types=quant_types(shape, ftype))))


@pytest.fixture(scope="module")
def h200():
    return get_profile("nvidia-h200").model_copy(update={"host_bandwidth_gbs": 90.0})


def _measured(shape: str, ftype: str, **match) -> float:
    rows = [r for r in ROWS if r["shape"] == shape and r["ftype"] == ftype
            and all(r[k] == v for k, v in match.items())]
    assert rows, (shape, ftype, match)
    return rows[0]["avg_ts"]


def test_quants_decode_in_the_measured_order(h200):
    """8B on the GPU: llama-bench's tg128 falls from Q4_0 to Q4_K_M, Q8_0 and F16 as measured
    (Q6_K, measured below Q8_0 at fewer bytes, the model puts above it: its K-quant dequantization is one class)."""
    ftypes = ["Q4_0", "Q4_K_M", "Q8_0", "F16"]
    measured = [_measured("llama-8b", f, n_gen=128, n_depth=0, n_gpu_layers=99) for f in ftypes]
    assert measured == sorted(measured, reverse=True)
    predicted = [predict_speed(*_model("llama-8b", f), RunConfig(), Backend.CUDA, h200).decode_tps for f in ftypes]
    assert predicted == sorted(predicted, reverse=True)


def test_experts_on_the_cpu_slow_decode_as_measured(h200):
    header, spec = _model("qwen36-35b-a3b", "Q4_K_M")
    rates = [predict_speed(header, spec, RunConfig(n_cpu_moe=k), Backend.CUDA, h200, threads=16).decode_tps
             for k in (0, 5, 8, 20)]
    assert rates == sorted(rates, reverse=True)
    m0 = _measured("qwen36-35b-a3b", "Q4_K_M", n_gen=128, n_depth=0, n_cpu_moe=0, n_ubatch=512)
    m20 = _measured("qwen36-35b-a3b", "Q4_K_M", n_gen=128, n_depth=0, n_cpu_moe=20, n_ubatch=512)
    assert 1.5 < m0 / m20 and 1.5 < rates[0] / rates[3]


def test_speed_names_its_bound_and_range(h200):
    sp = predict_speed(*_model("llama-8b", "Q4_K_M"), RunConfig(n_gpu_layers=8), Backend.CUDA, h200, threads=16)
    assert sp.low.decode_tps < sp.decode_tps < sp.high.decode_tps
    assert sp.bound["decode"] in ("host memory (CPU)", "CPU compute")


def test_fastest_placement_under_22000_mib_decodes_fastest_as_measured(h200):
    """Qwen3.6-35B-A3B Q4_K_M at -c 131072 on a 22,000 MiB budget: of the --n-cpu-moe/-ub that fit (5-8), the
    measured tg128 is highest at the fewest experts on the CPU, which fit-for-speed picks for a pp512 request."""
    header, spec = _model("qwen36-35b-a3b", "Q4_K_M")
    base = RunConfig(n_ctx=131072)
    avail = (22000 - 1028) * MiB
    choice, _ = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, avail, None, table=False)
    assert choice is not None and choice.flags == ["--n-cpu-moe", "5"]
    opts = fastest_placements(header, spec, base, Backend.CUDA, Frontend.SERVER, avail, None, choice, h200,
                              prompt=512, threads=16)
    assert opts[0].update["n_cpu_moe"] == 5
    budget = [r for r in ROWS if r.get("group") == "budget" and r["ftype"] == "Q4_K_M" and r["n_gen"]]
    best = max(budget, key=lambda r: r["avg_ts"] if (r["n_cpu_moe"], r["n_ubatch"]) != (5, 1024) else 0)
    assert best["n_cpu_moe"] == 5  # (5, -ub 1024) does not fit the budget (ggfit's prediction)


def test_a_small_ubatch_copies_only_the_experts_it_routes_to(h200):
    """ggml_backend_sched_compute_splits copies a MUL_MAT_ID's used experts alone: with even routing a 512-token
    ubatch of 8-of-256 uses every expert, a 32-token one about 64% of them (1 - (1 - 8/256)^32)."""
    from fitter.speed.model import ubatch_terms
    from fitter.speed.work import experts_used, work_of

    assert experts_used(256, 8, 512) == pytest.approx(1.0, abs=1e-6)
    assert experts_used(256, 8, 32) == pytest.approx(1 - (31 / 32) ** 32)
    header, spec = _model("qwen36-35b-a3b", "Q4_K_M")
    work = work_of(header, spec, RunConfig(n_cpu_moe=10), Backend.CUDA)
    cpu = work.devices[min(work.devices)]
    dense = cpu.bytes_matmul - cpu.expert_bytes
    copy = {u: ubatch_terms(work, h200, Backend.CUDA, u, 0, 16, op_offload=True)["copy"] for u in (32, 512)}
    rate = cpu.bytes_matmul / copy[512]  # bytes per second of the copy term
    assert copy[512] * rate == pytest.approx(cpu.bytes_matmul, rel=1e-6)
    assert copy[32] * rate == pytest.approx(dense + cpu.expert_bytes * experts_used(256, 8, 32), rel=1e-6)


def test_without_flash_attention_the_scores_go_through_memory(h200):
    """build_attn_mha without flash attention writes KQ (F32, n_head per query and position) to memory: a 'kq' term
    that grows with the positions attended, absent with flash attention."""
    from fitter.speed.model import ubatch_terms
    from fitter.speed.work import work_of

    work = work_of(*_model("llama-8b", "Q4_K_M"), RunConfig(), Backend.CUDA)
    near = ubatch_terms(work, h200, Backend.CUDA, 512, 256, 16, op_offload=True, flash_attn=False)["kq"]
    far = ubatch_terms(work, h200, Backend.CUDA, 512, 4096 + 256, 16, op_offload=True, flash_attn=False)["kq"]
    assert far / near == pytest.approx((4096 + 257) / 257)
    assert "kq" not in ubatch_terms(work, h200, Backend.CUDA, 512, 256, 16, op_offload=True, flash_attn=True)


def test_a_profile_with_published_rows_carries_their_scale(h200):
    """fit's rates on a named profile are the fitted coefficients' times that profile's scale from the published
    tables (factors.PROFILE_SCALE), what benchmarks/speed_model.py reports; a calibration's scale replaces it, and
    another backend on the profile (the CPU of an RPC host) takes none."""
    from fitter.speed import factors
    from fitter.speed.calibration import UNSCALED

    header, spec = _model("llama-8b", "Q4_K_M")
    shipped = factors.PROFILE_SCALE["nvidia-h200"]
    got = predict_speed(header, spec, RunConfig(), Backend.CUDA, h200)
    bare = predict_speed(header, spec, RunConfig(), Backend.CUDA, h200, scale=UNSCALED)
    assert got.decode_tps == pytest.approx(bare.decode_tps / shipped["decode"], rel=1e-9)
    assert got.prefill_tps == pytest.approx(bare.prefill_tps / shipped["prefill"], rel=1e-9)
    mine = predict_speed(header, spec, RunConfig(), Backend.CUDA, h200, scale={"decode": 2.0, "prefill": 1.0})
    assert mine.decode_tps == pytest.approx(bare.decode_tps / 2.0, rel=1e-9)
    cpu = predict_speed(header, spec, RunConfig(), Backend.CPU, h200, threads=16)
    assert cpu.decode_tps == predict_speed(header, spec, RunConfig(), Backend.CPU, h200, threads=16,
                                           scale=UNSCALED).decode_tps
    assert "cpu" not in factors.PROFILE_SCALE  # the CPU profile is whatever CPU runs ggfit
