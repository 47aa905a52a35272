"""`probe --soak N` with the server runner: the server's RSS after each soak request beside fitter.session's
prediction for the model and flags ggfit started llama-server with (search.soak). Replays a recording made here
(benchmarks/results/soak-server-cpu-here.json: the bundled Gemma, --cache-ram 64 / default / 0) and runs a tiny soak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.llama.cparams import RunConfig
from search.errors import ProbeError
from search.probe import run_probe
from search.soak import Soak, cache_flags, predict_soak
from search.workload import Workload

REC = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "soak-server-cpu-here.json"
MIB = 2**20


def _close(measured: int, predicted: int) -> bool:
    return abs(measured - predicted) <= max(0.05 * predicted, 8 * MIB)


@pytest.mark.skipif(not REC.exists(), reason="no soak recording")
def test_recorded_soaks_grow_as_predicted(gemma):
    doc = json.loads(REC.read_text())
    assert doc["build"]["ggml_commit"].startswith("0c1e570")
    for case in doc["cases"]:
        r = case["result"]
        w, soak = r["workload"], Soak(**r["soak"])
        flags = case["ggfit"][case["ggfit"].index("-t") + 2: -1]
        pred = predict_soak(gemma, RunConfig(**r["config"]), flags, w["prompt_tokens"], w["gen_tokens"],
                            w["warmup"] + w["repeats"], soak.requests)
        assert pred is not None and pred == {k: getattr(soak, k) for k in pred}, case["label"]
        assert _close(soak.growth_bytes, pred["predicted_growth_bytes"]), case["label"]
        assert pred["predicted_after_bytes"] <= pred["predicted_ceiling_bytes"]
    by = {c["label"]: Soak(**c["result"]["soak"]) for c in doc["cases"]}
    assert by["default"].verdict == "growing" and by["off"].verdict == "flat"


def test_cache_flags_read_as_llama_server_reads_them():
    f = cache_flags(["--cache-ram=64", "-ctxcp", "2", "--no-cache-idle-slots", "--port", "1"])
    assert (f.cache_ram_mib, f.ctx_checkpoints, f.cache_idle_slots) == (64, 2, False)
    assert cache_flags(["--cache-ram", "lots"]) is None  # llama-server refuses it itself


def test_soak_line_shows_both():
    s = Soak(requests=3, rss_after=[1, 2, 3], growth_bytes=40 * MIB, verdict="growing", predicted_after_bytes=60 * MIB,
             predicted_growth_bytes=38 * MIB, predicted_ceiling_bytes=70 * MIB)
    assert s.line() == ("soak 3 requests: growing (+40 MiB), predicted +38 MiB over the soak, 60 MiB held after it, "
                        "ceiling 70 MiB")


def test_python_runner_has_no_soak(gemma):
    with pytest.raises(ProbeError, match="--soak 2: N requests"):
        run_probe(gemma, RunConfig(n_ctx=512), Workload(prompt_tokens=8, gen_tokens=2, repeats=1), soak=2)


def test_a_tiny_server_soak(gemma, llama_server):
    r = run_probe(gemma, RunConfig(n_ctx=2048), Workload(prompt_tokens=300, gen_tokens=4, repeats=1), runner="server",
                  llama_server=llama_server, threads=2, extra_args=["--cache-ram", "64"], soak=4)
    assert r.ok and r.soak is not None and len(r.soak.rss_after) == 4
    assert r.soak.predicted_growth_bytes is not None and _close(r.soak.growth_bytes, r.soak.predicted_growth_bytes)
    assert "predicted" in r.summary() and "ceiling" in r.summary()
