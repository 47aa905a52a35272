"""--rpc against llama.cpp's real loads with CPU rpc-servers on this machine (issue 47), replayed.

benchmarks/rpc_here.py started two and three `ggml-rpc-server` processes of the pinned build on 127.0.0.1 (each
logging, with GGML_RPC_DEBUG=1, the exact size of every buffer llama.cpp allocated on it) and loaded a dense, a MoE,
a hybrid model and Gemma 3 270M with `llama-server --rpc ... -fit off --no-repack` at several -c, -ub, with and
without -ts, with every layer or some on the RPC devices (benchmarks/results/rpc-cpu-here.json). These tests predict
the same configs again: every buffer of every RPC device to the byte (weights, KV, recurrent state, compute), and the
main host's (token embedding, logits, host compute) to the 0.01 MiB llama.cpp prints them in.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.oracle.llama_log import PRINT_TOLERANCE_BYTES

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "rpc-cpu-here.json"
DATA = json.loads(RESULTS.read_text())
ROWS = [r for r in DATA["rows"] if r["status"] == "ok"]


@lru_cache(maxsize=None)
def _model(label: str):
    m = DATA["models"][label]
    if m["builder"] == "bundled":
        from fitter.bundled import resolve_model

        return load_model_spec(resolve_model(label))
    from tests.synth.common import build

    return load_model_spec(str(build(m["builder"], **m["overrides"])))


def _row_id(r: dict) -> str:
    return f"{r['model']}-{r['servers']}x-" + "-".join(f"{k}={v}" for k, v in r["config"].items()).replace(" ", "")


def _device(buffer_type: str, devices: list[dict]) -> str:
    """llama.cpp's buffer type RPC<i>[HOST:PORT] -> its device name (RPC<n>, n counted over every server)."""
    if "[" not in buffer_type:
        return buffer_type
    ep = buffer_type[buffer_type.index("[") + 1: -1]
    (name,) = [d["name"] for d in row_devices(devices) if d["endpoint"] == ep]
    return name


def row_devices(devices: list[dict]) -> list[dict]:
    return [d for d in devices if d["name"].startswith("RPC")]


def _predict(r: dict):
    header, spec = _model(r["model"])
    cfg = dict(r["config"])
    devs = row_devices(r["devices"])
    if "tensor_split" not in cfg:  # llama_model::load_tensors: by each device's free memory
        cfg["tensor_split"] = tuple(float(d["free_mib"]) for d in devs)
    else:
        cfg["tensor_split"] = tuple(cfg["tensor_split"])
    cfg["rpc"] = ",".join(d["endpoint"] for d in devs)
    return predict(header, spec, RunConfig(**cfg), Backend.RPC, Frontend.SERVER)


def _compare(r: dict) -> tuple[dict, dict]:
    """{(device, kind): predicted - measured} for the exact figures, and for the printed ones (0.01 MiB)."""
    pred = _predict(r)
    exact: dict = {}
    printed: dict = {}
    measured: dict = {}
    for m in r["measured"]:
        key = (_device(m["buffer_type"], r["devices"]), m["kind"])
        got = measured.setdefault(key, [0, True, 0])
        got[0] += m["bytes"]
        got[1] &= m["exact"]
        got[2] += 1
    ours: dict = {}
    for b in pred.buffers:
        if b.owner == "target":
            ours[(b.device, b.kind)] = ours.get((b.device, b.kind), 0) + b.bytes
    for key in measured.keys() | ours.keys():
        size, is_exact, n = measured.get(key, [0, True, 1])
        (exact if is_exact and key in measured else printed)[key] = (ours.get(key, 0) - size, n)
    return exact, printed


def test_the_recording_covers_the_issue() -> None:
    """A dense, a MoE, a hybrid model and Gemma 3; two and three servers; with and without -ts; several -c and -ub;
    every run loaded and each RPC device's buffers paired with its server's allocations."""
    assert ROWS and len(ROWS) == len(DATA["rows"])
    assert {r["model"] for r in ROWS} >= {"gemma3-270m", "qwen3-6l", "qwen3moe-6l", "qwen35-8l"}
    assert {r["servers"] for r in ROWS} == {2, 3}
    assert any("tensor_split" in r["config"] for r in ROWS) and any("tensor_split" not in r["config"] for r in ROWS)
    assert len({(r["config"]["n_ctx"], r["config"]["n_ubatch"]) for r in ROWS}) >= 4
    assert all(not r["problems"] for r in ROWS)
    assert all(m["exact"] for r in ROWS for m in r["measured"] if "[" in m["buffer_type"] and m["bytes"])


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_every_buffer_of_every_device_matches_llama_cpp(row: dict) -> None:
    exact, printed = _compare(row)
    assert {k: d for k, (d, _) in exact.items() if d} == {}
    assert {k: d for k, (d, n) in printed.items() if abs(d) > n * PRINT_TOLERANCE_BYTES} == {}


def test_the_protocol_client_read_every_server() -> None:
    """fitter.ggml.backends.rpc.protocol asked each server before the runs: one CPU device each, its memory what
    llama.cpp then read (`using device RPC0 (...) - N MiB free`)."""
    for p in DATA["protocol"]:
        assert len(p["answers"]) == p["servers"]
        for a in p["answers"]:
            (dev,) = a["devices"]
            assert dev["device"] == 0 and dev["free"] > 0 and dev["total"] >= dev["free"]
    for r in ROWS:
        (answers,) = [p["answers"] for p in DATA["protocol"] if p["servers"] == r["servers"]]
        for d, a in zip(row_devices(r["devices"]), answers):
            assert d["endpoint"] == a["devices"][0]["endpoint"]
            assert d["free_mib"] == a["devices"][0]["free"] // 2**20


DRY = [x for x in DATA["dry_runs"] if DATA["models"][x["model"]]["builder"] != "bundled"]


@pytest.mark.parametrize("dry", DRY, ids=lambda x: f"{x['model']}-{x['servers']}x")
def test_llama_cpps_dry_run_drops_the_layer_pins(dry: dict, monkeypatch) -> None:
    """llama-fit-params --rpc (a no_alloc dry run, whole MiB per device): its ggml_backend_sched_reserve_size resets
    llama_context's graph-callback assignments, so its figures are ggfit's with the layer norms left unpinned
    (BackendImpl.keeps_layer_pins off), and a real load's (the tests above) differ from them. (Gemma 3 is left out:
    llama-fit-params' SWA defaults are not the library front end's.)"""
    from fitter.cache import CACHES
    from fitter.ggml import backends
    from fitter.oracle.fit_params import FIT_PARAMS_FRONTEND, parse_fit_print, predicted_mib

    got = parse_fit_print("\n".join(dry["lines"]))
    cmd = dry["command"]
    cfg = RunConfig(n_ctx=int(cmd[cmd.index("-c") + 1]), n_ubatch=int(cmd[cmd.index("-ub") + 1]),
                    rpc=cmd[cmd.index("--rpc") + 1])
    header, spec = _model(dry["model"])
    monkeypatch.setattr(backends.get(Backend.RPC), "keeps_layer_pins", False)
    CACHES.clear()
    want = predicted_mib(predict(header, spec, cfg, Backend.RPC, FIT_PARAMS_FRONTEND))
    assert {dev: want[dev] for dev in got} == got and {d for d in got if d.startswith("RPC")} == {
        d for d in want if d.startswith("RPC")}


def test_the_rpc_margins_cover_what_the_processes_held() -> None:
    """fitter.fit.margin's RPC figures: no rpc-server held more than 45 MiB beyond its buffers after a load and
    warm-up, nor the main llama-server more than 51 MiB beyond its host buffers (VmRSS), and one of each came close."""
    from fitter.ggml import backends

    rpc = backends.get(Backend.RPC)

    server, main = [], []
    for r in ROWS:
        for d, rss in zip(row_devices(r["devices"]), r["rss"]["servers"]):
            server.append(rss - sum(m["bytes"] for m in r["measured"] if m["buffer_type"].endswith(f"[{d['endpoint']}]")))
        main.append(r["rss"]["main"] - sum(m["bytes"] for m in r["measured"] if "[" not in m["buffer_type"]))
    assert rpc.overhead is not None and rpc.host_overhead is not None  # the margins' facts, on the backend
    assert rpc.overhead.bytes - 2**20 < max(server) <= rpc.overhead.bytes
    assert rpc.host_overhead.bytes - 2**20 < max(main) <= rpc.host_overhead.bytes
