"""--rpc with rpc-servers serving a GPU (`ggml-rpc-server -d CUDA0`, RunConfig.rpc_backends CUDA), replayed.

benchmarks/gpu/rpc.sh cuda-server loaded the synthetic models with llama-server on RPC devices alone (-dev RPC0,RPC1
[,RPC2]) served by CUDA rpc-servers on an H200 (rpc-cuda-server-h200.json): the first load of each server group
allocated and printed its buffers before the remote aborted in its warm-up (-fa auto keeps flash attention on, as
RPC's supports_op says yes to every op, and CUDA has no kernel for the synthetic 32-wide heads); later rows found the
servers gone. rpc-cuda-server-fa-off-h200.json: the same 24 configs with -fa off, every load ok. Every RPC buffer is
exact from its server's GGML_RPC_DEBUG allocations: they follow the remote CUDA buffer type's alignment (128,
RPC_CMD_GET_ALIGNMENT), the host's are as printed (0.01 MiB).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.oracle.llama_log import PRINT_TOLERANCE_BYTES
from tests.fit.test_rpc_cuda_recorded import _measured
from tests.fit.test_rpc_recorded import _model

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FILES = [f for f in ("rpc-cuda-server-h200.json", "rpc-cuda-server-fa-off-h200.json") if (RESULTS / f).exists()]
ROWS = [(f, r) for f in FILES for r in json.loads((RESULTS / f).read_text())["rows"] if r["measured"]]


def _predict(r: dict, remote: str = "CUDA"):
    header, spec = _model(r["model"])
    cfg = dict(r["config"])
    eps = [d["endpoint"] for d in r["devices"] if d["name"].startswith("RPC")]
    if "tensor_split" not in cfg:  # llama_model::load_tensors: by each device's free memory
        cfg["tensor_split"] = [float(d["free_mib"]) for d in r["devices"] if d["name"].startswith("RPC")]
    cfg.update(tensor_split=tuple(cfg["tensor_split"]), rpc=",".join(eps), rpc_backends=(remote,) * len(eps))
    for flag, field in (("-fa", "flash_attn"),):  # rpc.sh's --main-args
        cmd = r["command"]
        if flag in cmd:
            cfg[field] = cmd[cmd.index(flag) + 1]
    return predict(header, spec, RunConfig(**cfg), Backend.RPC, Frontend.SERVER)


def _diffs(r: dict, remote: str = "CUDA") -> tuple[dict, dict]:
    ours: dict = {}
    for b in _predict(r, remote).buffers:
        ours[(b.device, b.kind)] = ours.get((b.device, b.kind), 0) + b.bytes
    measured = _measured(r)
    exact = {k: ours.get(k, 0) - m[0] for k, m in measured.items() if m[1]}
    printed = {k: ours.get(k, 0) - measured.get(k, [0, False, 1])[0] for k in ours.keys() | measured.keys()
               if k not in exact and abs(ours.get(k, 0) - measured.get(k, [0, False, 1])[0])
               > measured.get(k, [0, 0, 1])[2] * PRINT_TOLERANCE_BYTES}
    return {k: d for k, d in exact.items() if d}, printed


def test_the_recording_has_buffers_of_cuda_servers() -> None:
    assert len(ROWS) == 26 and {r["servers"] for _, r in ROWS} == {2, 3}
    assert all(r["status"] == "ok" and not r["problems"] for f, r in ROWS if "fa-off" in f)
    assert all(m["exact"] for _, r in ROWS for m in r["measured"] if "[" in m["buffer_type"] and m["bytes"])


@pytest.mark.parametrize("fr", ROWS, ids=lambda fr: f"{fr[0].split('-h200')[0]}-{fr[1]['model']}-{fr[1]['servers']}x-"
                         + "-".join(f"{k}={v}" for k, v in fr[1]["config"].items()))
def test_every_buffer_of_every_device_matches_llama_cpp(fr: tuple) -> None:
    assert _diffs(fr[1]) == ({}, {})


def test_a_cpu_servers_facts_miss_the_cuda_alignment() -> None:
    """With a CPU server's buffer type (alignment 32) every load comes out short: a compute buffer by 96 to 768
    bytes (qwen3: the last device's by 384), the hybrid's weights by up to 1.5 KiB."""
    (r,) = [r for f, r in ROWS if f == "rpc-cuda-server-h200.json" and r["servers"] == 2]
    assert _diffs(r, "CPU")[0] == {("RPC1", "compute"): -384}
    assert all(_diffs(r, "CPU")[0] for _, r in ROWS)
