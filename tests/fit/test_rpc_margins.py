"""--rpc: each device's default margin is its own backend's (fitter.fit.margin.device_margins): a CPU rpc-server keeps
RPC's measured 45 MiB (plus the safety share) beside a local CUDA GPU's 772 MiB; a CUDA server's device CUDA's, a
Mac's Metal one Metal's. --margin given is one for every device."""

from __future__ import annotations

import json

from fitter.fit.margin import default_margin, device_margins
from fitter.fit.request import Budgets
from fitter.fit.sizes import Budget
from fitter.llama.cparams import Backend
from tests.fit.test_rpc import _ggfit

MiB = 2**20


def test_a_cpu_server_keeps_rpcs_margin_beside_a_local_cuda_gpu() -> None:
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:1,127.0.0.1:2", "--backend", "cuda",
               "--budget", "600MiB,600MiB,1500MiB", "-c", "8192", "--json", "--no-speed")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    m = {k: v["bytes"] for k, v in out["device_margins"].items()}
    assert m == {"RPC0": default_margin("rpc"), "RPC1": default_margin("rpc"), "CUDA0": default_margin("cuda")}
    assert m["RPC0"] == 301 * MiB and m["CUDA0"] == 1028 * MiB
    assert "rpc-server" in out["device_margins"]["RPC0"]["source"]


def test_margin_given_is_every_devices() -> None:
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:1", "--backend", "cuda", "--budget", "600MiB,1500MiB",
               "--margin", "100MiB", "-c", "8192", "--json", "--no-speed")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["device_margins"] is None


def test_each_servers_backend_gives_its_devices_margin() -> None:
    m = device_margins("rpc", 3, ("MTL", "CPU", "CUDA"))
    assert m == {"RPC0": default_margin("metal"), "RPC1": default_margin("rpc"), "RPC2": default_margin("cuda")}
    assert device_margins("rpc", 2) is None  # every device a CPU server's: the backend's one margin
    devices = [Budget(bytes=25559 * MiB, source="mac"), Budget(bytes=8 * 2**30, source="box")]
    b = Budgets.parse("25559MiB,8GiB", None, Backend.RPC, devices=devices, remote=("MTL", "CPU"))
    assert b.avail == {"RPC0": 25559 * MiB - default_margin("metal"), "RPC1": 8 * 2**30 - default_margin("rpc")}
