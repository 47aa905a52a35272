"""ggfit's placement model against llama.cpp's CUDA dry runs with placement flags, recorded on two H200s.

benchmarks/gpu/run.sh placement (benchmarks/gpu/measure.py phase_placement) ran llama.cpp's dry run (no_alloc,
exact bytes per buffer type from its memory breakdown) on the full-size Qwen3.6-35B-A3B, gpt-oss 20B and Llama 3.1
8B shapes (Q4_K_M mix) with -ngl 0 / half / all, --n-cpu-moe at several values, --cpu-moe, -ot patterns, -nkvo,
--no-op-offload; one GPU (CUDA_VISIBLE_DEVICES=0), then both GPUs with -sm layer / none, -mg and -ts. These tests
predict the same configs again, without a GPU.

Weights and KV / recurrent state are exact on every row, one GPU or two. Compute buffers are exact too, pipeline
parallelism over two GPUs, experts on the CPU and -nkvo included.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.fit.memory import predict
from fitter.fit.solver import solve_placement
from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from tests.synth.shapes import build_shape, q4_k_m_types

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ROWS = json.loads((RESULTS / "gpu-placement-h200.json").read_text())["rows"]
_BASE = ("n_ctx", "n_ubatch", "flash_attn", "no_mmap")

# (row id, buffer type) -> ggfit's compute bytes minus llama.cpp's, where not exact: none since 2026-11-30
RESIDUAL: dict[tuple[str, str], int] = {}


def _row_id(r: dict) -> str:
    return f"{r['shape']}-{r['gpus']}-" + "-".join(f"{k}{v}" for k, v in r["config"].items() if k not in _BASE)


@lru_cache(maxsize=None)
def _model(shape: str):
    return load_model_spec(str(build_shape(shape, tensor_types=q4_k_m_types(shape))))


def _predict(row: dict):
    header, spec = _model(row["shape"])
    return predict(header, spec, RunConfig(**row["config"]), Backend.CUDA, Frontend.SERVER, n_gpus=row["gpus"])


def _diffs(pred, row: dict, kinds: dict[str, tuple[str, ...]]) -> dict[tuple[str, str], int]:
    out = {}
    for m in row["measured"]:
        ours = [b for b in pred.buffers if b.owner == "target" and b.device == m["buffer_type"]]
        for field, ks in kinds.items():
            out[(m["buffer_type"], field)] = sum(b.bytes for b in ours if b.kind in ks) - m[field]
    # no buffer llama.cpp did not report (the output buffer is not in its breakdown)
    names = {m["buffer_type"] for m in row["measured"]}
    extra = [(b.device, b.kind) for b in pred.buffers if b.owner == "target" and b.kind in sum(kinds.values(), ())
             and b.bytes and b.device not in names]
    assert not extra, extra
    return out


_KINDS = {"model": ("model",), "context": ("kv", "rs"), "compute": ("compute",)}
LOADED = [r for r in ROWS if r["status"] == "ok"]


@pytest.mark.slow
@pytest.mark.parametrize("row", LOADED, ids=_row_id)
def test_every_buffer_of_every_device_matches_llama_cpp(row: dict) -> None:
    pred = _predict(row)
    diffs = _diffs(pred, row, _KINDS)
    rid = _row_id(row)
    for (buft, field), d in diffs.items():
        want = RESIDUAL.get((rid, buft), 0) if field == "compute" else 0
        assert d == want, (buft, field)
    # llama.cpp's device buffers count against the GPU, the host ones (CUDA_Host, CPU) do not
    host = {m["buffer_type"] for m in row["measured"] if m["is_host"]}
    assert all(b.counts == (b.device not in host) for b in pred.buffers if b.kind != "output" and b.owner == "target")


@pytest.mark.slow
def test_pipeline_parallelism_copies_every_input_four_times() -> None:
    """Two GPUs, every layer offloaded: llama.cpp's host compute buffer holds GGML_SCHED_MAX_COPIES copies of every
    graph input; with -nkvo (no pipeline parallelism) it is the one-GPU buffer again."""
    by = {_row_id(r): r for r in LOADED}
    host = {k: next(m["compute"] for m in by[k]["measured"] if m["buffer_type"] == "CUDA_Host")
            for k in ("llama-8b-1-", "llama-8b-2-", "llama-8b-2-split_modenone")}
    assert host["llama-8b-2-"] > 3 * host["llama-8b-1-"] and host["llama-8b-2-split_modenone"] == host["llama-8b-1-"]
    assert _buffer(_predict(by["llama-8b-2-"]), "CUDA_Host") == host["llama-8b-2-"]


def _buffer(pred, device: str) -> int:
    return sum(b.bytes for b in pred.buffers if b.kind == "compute" and b.device == device)


@pytest.mark.slow
def test_split_mode_row_is_refused_as_llama_cpp_fails_it() -> None:
    rows = [r for r in ROWS if r["config"].get("split_mode") == "row"]
    assert rows and all(r["status"] == "error" and "does not support split buffers" in r["message"] for r in rows)
    with pytest.raises(ConfigError, match="-sm row: llama.cpp fails the load"):
        _predict(rows[0])


EXPERTS = json.loads((RESULTS / "gpu-experts-h200.json").read_text())


@pytest.mark.slow
def test_recorded_expert_placement_loaded_and_one_predicted_over_ran_out_of_memory() -> None:
    """A 3090-sized GPU (22,000 MiB held free on an H200): `ggfit fit -c 262144` proposed --n-cpu-moe 11, which
    loaded, prefilled 4096 tokens and decoded; --n-cpu-moe 7, predicted 640 MiB over what was free, ran out of memory.
    Today's solver proposes the same placement with the same bytes."""
    header, spec = _model("qwen36-35b-a3b")
    free, fit = EXPERTS["free_bytes_held_to"], EXPERTS["fit"]
    available = fit["budget_bytes"] - fit["margin_bytes"]
    choice, _ = solve_placement(header, spec, RunConfig(n_ctx=262144), Backend.CUDA, Frontend.SERVER, available, None,
                                table=False)
    assert choice is not None and (choice.lever, choice.value) == ("n_cpu_moe", fit["placement"]["value"]) == ("n_cpu_moe", 11)
    rows = {r["case"].split(" (")[0]: r for r in EXPERTS["rows"]}
    ok, over = rows["placement from ggfit fit"], rows["512 MiB over"]
    # today's predictions against what llama.cpp did with them on the GPU
    pred_ok, pred_over = (predict(header, spec, RunConfig(**r["config"]), Backend.CUDA, Frontend.SERVER).total_device_bytes
                          for r in (ok, over))
    assert ok["status"] == "ok" and ok["decode_tps"] > 0 and pred_ok <= available
    assert over["status"] == "oom" and pred_over >= free + 512 * 2**20


HOSTRSS = json.loads((RESULTS / "gpu-hostrss-h200.json").read_text())


@pytest.mark.slow
def test_recorded_host_budget_held_by_the_process_resident_memory() -> None:
    """22,000 MiB held free on an H200, `ggfit fit -c 262144 --no-mmap --host-budget 8192MiB`: the placement it
    proposed (--n-cpu-moe 11, weights read into memory with -lm none) loaded and decoded with a peak RSS of 6,501 MiB,
    within the host budget; today's prediction of it fits the GPU's free memory, and the RSS is above its predicted
    host bytes by no more than the CUDA host margin. A host budget below the placement's needs makes the solver refuse it."""
    from fitter.fit.margin import default_host_margin

    header, spec = _model("qwen36-35b-a3b")
    row = HOSTRSS["rows"][0]
    cfg = RunConfig.from_server_args([a for f in row["flags"] for a in f]).config
    pred = predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER)
    fit = HOSTRSS["fit"]
    available = fit["budget_bytes"] - fit["margin_bytes"]
    assert row["status"] == "ok" and row["decode_tps"] > 0 and pred.total_device_bytes <= available
    assert row["peak_rss_bytes"] <= HOSTRSS["host_budget_bytes"]
    assert pred.host_bytes < row["peak_rss_bytes"] <= pred.host_bytes + default_host_margin("cuda")
    base = RunConfig(n_ctx=262144, no_mmap=True)
    choice, _ = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, available,
                                HOSTRSS["host_budget_bytes"] - default_host_margin("cuda"), table=False)
    assert choice is not None and (choice.lever, choice.value) == ("n_cpu_moe", 11)
    none, why = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, available,
                                pred.host_bytes - 1, table=False)
    assert none is None and "host budget" in why
