"""probe and optimise with --rpc against a real CPU rpc-server of the pinned build on 127.0.0.1 (issue 47): the server
runner hands --rpc to llama-server, whose weights, KV and compute land on the server (GGML_RPC_DEBUG=1 logs each
buffer it allocates), and a study's trials do the same, each device against its own --budget, each trial with the -ts ggfit proposes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitter.ggml.backends.rpc.protocol import RPCError, query_server

ROOT = Path(__file__).resolve().parents[2]


def _bindir() -> Path:
    from search.build_server import server_dir

    return server_dir() / "bin"


pytestmark = pytest.mark.skipif(not (_bindir() / "ggml-rpc-server").exists(),
                                reason="the pinned llama-server / ggml-rpc-server are not built here")


@pytest.fixture
def rpc_servers(tmp_path):
    """start(i) -> (endpoint, log): CPU ggml-rpc-servers on free ports, each logging its allocations; stopped by
    their pids."""
    import socket

    procs = []

    def start(i: int = 0) -> tuple[str, Path]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path / f"rpc{i}.log"
        with log.open("wb") as f:
            procs.append(subprocess.Popen([str(_bindir() / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port),
                                           "-t", "1"], stdout=f, stderr=subprocess.STDOUT,
                                          env={**os.environ, "GGML_RPC_DEBUG": "1"}, start_new_session=True))
        ep = f"127.0.0.1:{port}"
        for _ in range(100):
            try:
                query_server(ep, timeout=1.0)
                break
            except RPCError:
                time.sleep(0.1)
        return ep, log

    try:
        yield start
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def rpc_server(rpc_servers):
    """One CPU ggml-rpc-server on a free port, logging its allocations."""
    return rpc_servers(0)


def _ggfit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, **(env or {})})


def _model() -> str:
    from tests.synth.common import build

    return str(build("qwen3", n_layer=6))


def test_probe_with_the_server_runner_loads_on_the_rpc_server(rpc_server) -> None:
    ep, log = rpc_server
    r = _ggfit("probe", _model(), "--runner", "server", "--llama-server", str(_bindir() / "llama-server"),
               "--rpc", ep, "-c", "1024", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["status"] == "ok" and "--rpc" in res["command"] and ep in res["command"]
    assert "[alloc_buffer]" in log.read_text(errors="replace")  # the weights, KV and compute went there


def test_optimise_trials_run_with_rpc(rpc_servers, tmp_path) -> None:
    """Two servers, a budget each as fit takes them: every trial runs with the -ts ggfit proposes at its own
    context (here, with room on both, llama.cpp's split by the budgets, 3:1 for 3 GiB against 1 GiB less the margins),
    not a fixed 1,1."""
    from fitter.fit.split import _proportional

    (ep0, log0), (ep1, log1) = rpc_servers(0), rpc_servers(1)
    r = _ggfit("optimise", _model(), "--rpc", f"{ep0},{ep1}", "--runner", "server", "--budget", "3GiB,1GiB",
               "--trials", "2", "--no-compare", "--llama-server", str(_bindir() / "llama-server"),
               "--storage", f"sqlite:///{tmp_path / 'study.db'}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    margin = 301 * 2**20  # a CPU rpc-server's (fitter.fit.margin)
    ts = ",".join(str(c) for c in _proportional(7, [3 * 2**30 - margin, 2**30 - margin]))
    assert f"--rpc {ep0},{ep1}" in r.stdout and f"-ts {ts}" in r.stdout and ts == "6,1"
    assert all("[alloc_buffer]" in log.read_text(errors="replace") for log in (log0, log1))
