"""--rpc beside a local CUDA GPU (backend rpc-cuda) against llama.cpp's real loads on the device, replayed.

benchmarks/gpu/rpc.sh loaded the synthetic dense, MoE and hybrid models with llama-server on CUDA0 and two or three
CPU rpc-servers (`-d CPU`), devices RPC0, RPC1[, RPC2], CUDA0 in llama.cpp's order: rpc-cuda-local-h200.json with -ts
giving CUDA0 layers (18 loads, an H200), rpc-cuda-main-h100.json with llama.cpp's default split by free memory and
some -ts (24 loads, an H100; CUDA0's free memory, not in 'devices', is nvidia-smi's 81,079 MiB of the run's note).
Every RPC buffer is exact from its server's GGML_RPC_DEBUG allocations, CUDA0's and the host's as printed (0.01 MiB).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.oracle.llama_log import PRINT_TOLERANCE_BYTES
from tests.fit.test_rpc_recorded import _model

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
CUDA0_FREE_MIB = 81079  # rpc-cuda-main-h100.json's note: nvidia-smi before the run
ROWS = [(f, r) for f in ("rpc-cuda-local-h200.json", "rpc-cuda-main-h100.json")
        for r in json.loads((RESULTS / f).read_text())["rows"]]


def _id(fr: tuple) -> str:
    f, r = fr
    return f"{f.split('-')[2]}-{r['model']}-{r['servers']}x-" + "-".join(
        f"{k}={v}" for k, v in r["config"].items()).replace(" ", "")


def _endpoints(r: dict) -> list[str]:
    return [d["endpoint"] for d in r["devices"] if d["name"].startswith("RPC")]


def _predict(r: dict, **over):
    header, spec = _model(r["model"])
    cfg = dict(r["config"])
    if "tensor_split" not in cfg:  # llama_model::load_tensors: by each device's free memory, CUDA0 last
        cfg["tensor_split"] = [float(d["free_mib"]) for d in r["devices"] if d["name"].startswith("RPC")]
        cfg["tensor_split"].append(float(CUDA0_FREE_MIB))
    cfg["tensor_split"] = tuple(cfg["tensor_split"])
    cfg["rpc"] = ",".join(_endpoints(r))
    return predict(header, spec, RunConfig(**{**cfg, **over}), Backend.RPC_CUDA, Frontend.SERVER)


def _measured(r: dict) -> dict:
    """{(device, kind): [bytes, exact, lines]}, RPC<i>[HOST:PORT] named by its device (RPC<n> in --rpc order)."""
    eps = _endpoints(r)
    out: dict = {}
    for m in r["measured"]:
        bt = m["buffer_type"]
        if "[" in bt:
            bt = f"RPC{eps.index(bt[bt.index('[') + 1: -1])}"
        got = out.setdefault((bt, m["kind"]), [0, True, 0])
        got[0] += m["bytes"]
        got[1] &= m["exact"]
        got[2] += 1
    return out


def test_the_recordings_cover_a_local_gpu_beside_rpc_devices() -> None:
    assert len(ROWS) == 42 and all(r["status"] == "ok" and not r["problems"] for _, r in ROWS)
    local = [r for f, r in ROWS if "local" in f]
    assert all(any(m["buffer_type"] == "CUDA0" and m["kind"] == "kv" for m in r["measured"])
               or r["config"].get("n_gpu_layers") or r["config"]["tensor_split"][-1] <= 1 for r in local)
    assert {r["servers"] for _, r in ROWS} == {2, 3}


@pytest.mark.parametrize("fr", ROWS, ids=_id)
def test_every_buffer_of_every_device_matches_llama_cpp(fr: tuple) -> None:
    """RPC buffers to the byte; CUDA0's (weights, KV, recurrent state, compute) and the host's (CPU_Mapped,
    CUDA_Host output, CPU compute) to the printed 0.01 MiB."""
    _, r = fr
    ours: dict = {}
    for b in _predict(r).buffers:
        ours[(b.device, b.kind)] = ours.get((b.device, b.kind), 0) + b.bytes
    measured = _measured(r)
    exact = {k: ours.get(k, 0) - m[0] for k, m in measured.items() if m[1]}
    printed = {k: ours.get(k, 0) - measured.get(k, [0, False, 1])[0] for k in ours.keys() | measured.keys()
               if k not in exact}
    assert {k: d for k, d in exact.items() if d} == {}
    assert {k: d for k, d in printed.items() if abs(d) > measured.get(k, [0, 0, 1])[2] * PRINT_TOLERANCE_BYTES} == {}


def test_fa_auto_turns_off_where_cuda0_holds_a_tiny_head_layer() -> None:
    """-fa auto: the synthetic models' 32-wide heads have no CUDA flash-attention kernel, so an attention layer on
    CUDA0 turns FA off (llama_context::resolve_fused_ops); the V cache stays as made with FA on (not transposed)."""
    (r,) = [r for f, r in ROWS if "local" in f and r["model"] == "qwen3-6l" and r["config"]["n_ubatch"] == 256]
    cp = _predict(r).context
    assert not cp.flash_attn and cp.v_trans is False and "CUDA0" in cp.defaults_applied["flash_attn"]
    from fitter.llama.cparams import served_config

    assert served_config(cp, RunConfig(), None).flash_attn == "auto"  # what fit prints: -fa off would transpose V
    (r,) = [r for f, r in ROWS if "local" in f and r["model"] == "qwen3-6l" and r["config"]["n_ubatch"] == 1024]
    assert _predict(r).context.flash_attn  # CUDA0 holds the output layer alone


def test_the_layer_pins_hold_on_cuda0_too() -> None:
    """A real load keeps each layer's norm on its layer's device on every device, CUDA0 included
    (keeps_layer_pins): without the pins the RPC and CUDA0 compute buffers differ from what the loads printed."""
    from fitter.cache import CACHES
    from fitter.ggml import backends

    (r,) = [r for f, r in ROWS if "local" in f and r["model"] == "qwen3-6l" and r["config"]["n_ubatch"] == 512
            and r["servers"] == 2 and "n_gpu_layers" not in r["config"]]
    impl = backends.get(Backend.RPC_CUDA)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(impl, "keeps_layer_pins", False)
        CACHES.clear()
        unpinned = _predict(r).device_totals()
    CACHES.clear()
    pinned = _predict(r).device_totals()
    assert unpinned != pinned
