"""--rpc (issue 47): the RPC protocol client against a stand-in rpc-server, the device names and order, and the CLI's
one-line errors. The buffers against llama.cpp's own runs: tests/fit/test_rpc_recorded.py."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fitter.ggml.backends.rpc.protocol import RPCError, parse_endpoints, query_devices, query_server

ROOT = Path(__file__).resolve().parents[2]


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError
        buf += chunk
    return buf


def _serve(conn: socket.socket, mem: list[tuple[int, int]], major: int, align: int = 32,
           max_size: int = 2**64 - 1) -> None:
    """rpc_serve_client's answers to HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY (ggml-rpc.cpp), as a CPU server sends
    them: every answer is a u64 size and its payload."""
    with conn:
        while True:
            try:
                cmd, size = struct.unpack("<BQ", _recv(conn, 9))
                payload = _recv(conn, size)
            except ConnectionError:
                return
            if cmd == 14:
                assert size == 24
                out = bytes([major, 0, 0, 0]) + bytes(24)
            elif cmd == 15:
                out = struct.pack("<I", len(mem))
            elif cmd == 11:
                out = struct.pack("<QQ", *mem[struct.unpack("<I", payload)[0]])
            elif cmd in (1, 2):  # GET_ALIGNMENT, GET_MAX_SIZE of the server's buffer type (the CPU's by default)
                out = struct.pack("<Q", align if cmd == 1 else max_size)
            else:
                return
            conn.sendall(struct.pack("<Q", len(out)) + out)


@pytest.fixture
def fake_server():
    """Start stand-in servers: fake_server(mem, major=7) -> "127.0.0.1:PORT"."""
    socks = []

    def start(mem: list[tuple[int, int]], major: int = 7, answer: bool = True, align: int = 32,
              max_size: int = 2**64 - 1) -> str:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        socks.append(s)

        def loop() -> None:
            while True:
                try:
                    conn, _ = s.accept()
                except OSError:
                    return
                if answer:
                    _serve(conn, mem, major, align, max_size)
                else:
                    socks.append(conn)  # accepted, never answered

        threading.Thread(target=loop, daemon=True).start()
        return f"127.0.0.1:{s.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()


def test_the_protocol_reads_each_servers_devices_in_order(fake_server) -> None:
    a = fake_server([(5 * 2**30, 8 * 2**30)])
    b = fake_server([(1 * 2**30, 2 * 2**30), (3 * 2**30, 4 * 2**30)])
    devs = query_devices([a, b])
    assert [(d.endpoint, d.device, d.free, d.total) for d in devs] == [
        (a, 0, 5 * 2**30, 8 * 2**30), (b, 0, 2**30, 2 * 2**30), (b, 1, 3 * 2**30, 4 * 2**30)]


def test_a_server_that_does_not_answer_is_one_clear_error(fake_server) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    with pytest.raises(RPCError, match=f"127.0.0.1:{port}: the rpc-server does not answer"):
        query_server(f"127.0.0.1:{port}", timeout=1.0)
    silent = fake_server([], answer=False)
    with pytest.raises(RPCError, match="does not answer .no answer."):
        query_server(silent, timeout=0.5)


def test_another_protocol_version_is_refused(fake_server) -> None:
    with pytest.raises(RPCError, match="protocol 6.0.0"):
        query_server(fake_server([(1, 1)], major=6))


@pytest.mark.parametrize("text", ["127.0.0.1", "host:port", ":50052", "a:1,", "h:70000"])
def test_malformed_endpoints(text: str) -> None:
    with pytest.raises(RPCError, match="HOST:PORT"):
        parse_endpoints(text)


def test_device_names_and_buffers_follow_llama_cpp() -> None:
    """RPC devices are GPUs to llama.cpp with the CPU's buffer facts: RPC0, RPC1 in --rpc order; weights, KV and
    compute on them, the token embedding, logits and host compute on the main host's CPU."""
    from fitter.bundled import resolve_model
    from fitter.fit.memory import predict
    from fitter.llama.cparams import Backend, Frontend, RunConfig
    from fitter.llama.model import load_model_spec

    header, spec = load_model_spec(resolve_model("gemma3-270m"))
    cfg = RunConfig(n_ctx=4096, rpc="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    pred = predict(header, spec, cfg, Backend.RPC, Frontend.SERVER)
    where = {(b.device, b.kind) for b in pred.buffers}
    assert {("RPC0", "model"), ("RPC1", "kv"), ("RPC2", "compute"), ("CPU_Mapped", "model"), ("CPU", "output"),
            ("CPU", "compute")} <= where
    assert {b.device for b in pred.buffers if b.counts} == {"RPC0", "RPC1", "RPC2"}
    assert ["--rpc", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"] in cfg.to_server_args()


def _ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_budget_auto_with_a_silent_host_exits_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _ggfit("fit", "gemma3-270m", "--rpc", f"127.0.0.1:{port}", "--budget", "auto", "-c", "4096", "--no-speed")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"ggfit: error: --rpc 127.0.0.1:{port}: the rpc-server does not answer (")
    assert line.endswith(f"start it there (rpc-server -H 0.0.0.0 -p {port}) or leave it out")


def test_budget_auto_reads_every_server(fake_server) -> None:
    a, b = fake_server([(3 * 2**30, 4 * 2**30)]), fake_server([(1 * 2**30, 4 * 2**30)])
    r = _ggfit("fit", "gemma3-270m", "--rpc", f"{a},{b}", "--budget", "auto", "-c", "4096", "--no-speed")
    assert r.returncode == 0, r.stderr
    assert f"RPC0 {a}: the rpc-server's free memory" in r.stdout
    assert f"--rpc {a},{b}" in r.stdout and "-ts 3,1" in r.stdout  # llama.cpp splits by the free memory


def test_a_local_gpu_beside_rpc_devices_has_a_budget_each() -> None:
    """--backend cuda with --rpc: devices RPC0, CUDA0 in llama.cpp's order, each against its own --budget; a local
    Metal GPU beside RPC devices is refused in one line."""
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:50052", "--backend", "cuda", "--budget", "2GiB,3GiB",
               "--no-speed", "-c", "4096", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out["split"]["device_totals"]) == ["RPC0", "CUDA0"]
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:50052", "--backend", "cuda", "--budget", "1GiB",
               "--no-speed", "-c", "4096", "-ts", "1,1,1")
    assert r.returncode == 2
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:50052", "--backend", "metal", "--budget", "8GiB",
               "--no-speed")
    assert r.returncode == 2 and "a CUDA GPU (--backend cuda)" in r.stderr


def test_the_python_probe_runner_refuses_rpc() -> None:
    r = subprocess.run([sys.executable, "cli.py", "probe", "gemma3-270m", "--rpc", "127.0.0.1:50052", "-c", "512"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "the python runner loads no RPC devices; use --runner server" in r.stderr


def test_server_flags_read_rpc_back() -> None:
    from fitter.llama.cparams import RunConfig

    cfg, _, unknown = RunConfig.from_server_args(["--rpc", "10.0.0.2:50052,10.0.0.3:50052", "-c", "4096"])
    assert cfg.rpc == "10.0.0.2:50052,10.0.0.3:50052" and not unknown


def test_json_gives_what_each_host_holds() -> None:
    import json

    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:1,127.0.0.1:2", "--budget", "2GiB", "-c", "4096", "--json",
               "--no-speed")
    d = json.loads(r.stdout)
    assert set(d["hosts"]) == {"127.0.0.1:1", "127.0.0.1:2", "main"}
    assert d["hosts"]["127.0.0.1:2"]["devices"] == {"RPC1": d["device_totals"]["RPC1"]}
    assert d["hosts"]["main"]["bytes"] == sum(b["tensor_bytes"] or b["bytes"] if b["device"].endswith("_Mapped")
                                              else b["bytes"] for b in d["buffers"] if not b["counts"])


def test_the_proposed_split_fits_a_longer_context_than_the_budgets_split() -> None:
    """Three 300 MiB RPC devices, Gemma 3 270M (its 170 MiB tied output on the last device): llama.cpp's split by
    the budgets (equal) fits -c 14080; fitter.fit.split moves layers off the last device, evenly onto the others, and
    fits the training context, every device within its budget."""
    from fitter.bundled import resolve_model
    from fitter.fit.memory import predict
    from fitter.fit.solver import largest_context
    from fitter.fit.split import propose_split
    from fitter.llama.cparams import Backend, Frontend, RunConfig
    from fitter.llama.model import load_model_spec

    header, spec = load_model_spec(resolve_model("gemma3-270m"))
    avail = {f"RPC{i}": 300 * 2**20 for i in range(3)}
    base = RunConfig(n_ubatch=512, rpc="a:1,b:2,c:3")
    sp = propose_split(header, spec, base, Backend.RPC, Frontend.SERVER, avail)
    assert sp.tensor_split == (9.0, 9.0, 1.0) and sp.n_ctx == spec.n_ctx_train == 32768
    pred = predict(header, spec, base.model_copy(update={"n_ctx": sp.n_ctx, "tensor_split": sp.tensor_split}),
                   Backend.RPC, Frontend.SERVER)
    assert all(pred.device_totals()[d] <= a for d, a in avail.items())
    even = largest_context(header, spec, base.model_copy(update={"tensor_split": (1.0, 1.0, 1.0)}), Backend.RPC,
                           Frontend.SERVER, avail, n_ubatch=512, type_k="f16", type_v="f16", with_draft=False,
                           draft=None, ctx_max=spec.n_ctx_train)
    assert even.n_ctx == 14080


def test_a_budget_per_device_must_name_every_server() -> None:
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:1,127.0.0.1:2", "--budget", "1GiB,1GiB,1GiB", "--no-speed")
    assert r.returncode == 2 and "3 values for 2 devices (RPC0, RPC1)" in r.stderr


def test_quants_takes_a_budget_per_rpc_device() -> None:
    """quants --rpc: every quant against each device's own budget (the fullest device's headroom), the layers split
    by the budgets as llama.cpp splits by free memory; a local CUDA GPU after the RPC devices."""
    r = _ggfit("quants", "gemma3-270m", "--rpc", "127.0.0.1:1", "--backend", "cuda", "--budget", "1200MiB,1400MiB",
               "--no-speed", "-c", "8192", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == "rpc-cuda" and out["best"]
    q1 = out["candidates"][0]
    pooled = (1200 + 1400) * 2**20 - 2 * out["margin_bytes"] - q1["total_device_bytes"]  # one budget for both
    assert q1["fits"] and 0 <= q1["headroom_bytes"] < pooled
    r = _ggfit("quants", "gemma3-270m", "--rpc", "127.0.0.1:1,127.0.0.1:2", "--budget", "1GiB,1GiB,1GiB",
               "--no-speed")
    assert r.returncode == 2 and "3 values for 2 devices" in r.stderr


def test_the_servers_buffer_type_says_its_backend(fake_server) -> None:
    """GET_ALIGNMENT: a CUDA server's buffer type answers 128, a CPU one's 32; --budget auto reads each server's
    backend so (RunConfig.rpc_backends), --rpc-backend says it without a live server."""
    from cli_rpc import rpc_backends

    cuda = fake_server([(8 * 2**30, 8 * 2**30)], align=128)
    cpu = fake_server([(8 * 2**30, 8 * 2**30)])
    assert [d.backend for d in query_devices([cuda, cpu])] == ["CUDA", "CPU"]
    assert rpc_backends(f"{cuda},{cpu}", "auto", None) == ("CUDA", "CPU")
    assert rpc_backends("a:1,b:2", "4GiB", "cuda") == ("CUDA", "CUDA")
    assert rpc_backends("a:1,b:2", "4GiB", None) == ()
