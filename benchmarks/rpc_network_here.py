"""What llama.cpp's RPC backend sends over the network per ubatch and per token, and what it costs (issue 47's network
term in the speed model of issue 46; fitter.speed.network mirrors it).

For each model, llama-server (-t 1) with 0, 1 and 2 CPU rpc-servers on 127.0.0.1 (-t 1 each, GGML_RPC_DEBUG=1: each
logs every command it serves with its size), then `--requests` completions of a `--prompt`-token prompt (token ids,
so the count is exact) and `--gen` decoded tokens, no prompt cache, no context checkpoints. Recorded:
- llama-server's own timings per request (prompt_ms over prompt_n, predicted_ms over predicted_n);
- for the first request, each server's commands split into ubatches (the set_tensors before a graph command, the
  graph command -- graph_compute with n_nodes, n_tensors, or graph_recompute -- and the get_tensors after it): the
  first is the prompt's, the others the decoded tokens';
- the loopback link itself: the median TCP round trip of 1 byte, and the rate of a 256 MiB send.

    PYTHONPATH=. nice -n 10 python3 benchmarks/rpc_network_here.py [--out benchmarks/results/rpc-network-here.json]
    (on the device, CUDA rpc-servers against llama-server on its local GPU: bash benchmarks/gpu/rpc.sh cuda-network)

Every process it starts is in its own session and killed by its pid on exit (benchmarks/rpc_here.Procs).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rpc_here import Procs, free_port, model_path, start_servers  # noqa: E402

from fitter.llama_builds import PINNED_COMMIT  # noqa: E402
from search.build_server import server_dir  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "rpc-network-here.json"
MODELS = ("gemma3-270m", "qwen3-6l", "qwen3moe-6l", "qwen35-8l")  # rpc_here's
DEFAULT_MODELS = MODELS[:2]
_CMD = re.compile(r"^\[(set_tensor|get_tensor|graph_compute|graph_recompute|copy_tensor|set_tensor_hash)\] (.*)$",
                  re.MULTILINE)
_SIZE = re.compile(r"size: (\d+)")
_GRAPH = re.compile(r"n_nodes: (\d+), n_tensors: (\d+)")


def ubatches(text: str) -> list[dict[str, Any]]:
    """A server's commands since a point, as ubatches: the sets before a graph command, it, the gets after it."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] = {"sets": [], "gets": [], "graph": None, "copies": 0}
    for m in _CMD.finditer(text):
        cmd, rest = m.group(1), m.group(2)
        if cmd in ("set_tensor", "set_tensor_hash"):
            if cur["graph"] is not None:  # the next ubatch's inputs
                out.append(cur)
                cur = {"sets": [], "gets": [], "graph": None, "copies": 0}
            s = _SIZE.search(rest)
            cur["sets"].append(int(s.group(1)) if s else 0)
        elif cmd == "get_tensor":
            s = _SIZE.search(rest)
            cur["gets"].append(int(s.group(1)) if s else 0)
        elif cmd == "copy_tensor":
            cur["copies"] += 1
        else:
            g = _GRAPH.search(rest)
            cur["graph"] = ({"cmd": "graph_compute", "n_nodes": int(g.group(1)), "n_tensors": int(g.group(2))}
                            if g else {"cmd": "graph_recompute"})
    if cur["graph"] is not None or cur["sets"]:
        out.append(cur)
    return out


def loopback() -> dict[str, float]:
    """The loopback link: median round trip of 1 byte (ms) and the rate of one 256 MiB send (GB/s)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def echo() -> None:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            b = c.recv(1 << 20)
            if not b:
                break
            if len(b) == 1:
                c.sendall(b)
        c.close()

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    cl = socket.create_connection(("127.0.0.1", port))
    cl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(2000):
        t = time.perf_counter()
        cl.sendall(b"x")
        cl.recv(1)
        rtts.append(time.perf_counter() - t)
    blob = b"\0" * (16 << 20)
    t = time.perf_counter()
    for _ in range(16):
        cl.sendall(blob)
    dt = time.perf_counter() - t
    cl.close()
    th.join(5)
    srv.close()
    return {"rtt_ms": 1e3 * statistics.median(rtts), "send_gbs": (256 << 20) / dt / 1e9}


def complete(port: int, n_prompt: int, n_gen: int) -> dict[str, Any]:
    body = json.dumps({"prompt": [10 + (i % 500) for i in range(n_prompt)], "n_predict": n_gen, "cache_prompt": False,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["timings"]


def run_case(procs: Procs, bindir: Path, model: str, n_servers: int, logdir: Path, args: argparse.Namespace) -> dict:
    servers = (start_servers(procs, bindir, n_servers, logdir / f"s{n_servers}", tuple(args.server_args.split()))
               if n_servers else [])
    port = free_port()
    log = logdir / f"main-{n_servers}-{time.time_ns()}.log"
    cmd = [str(bindir / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-fit", "off",
           "--no-repack", "-t", "1", "-c", str(args.ctx), "-np", "1", "-ub", "512", "-cram", "0", "-ctxcp", "0"]
    if servers:
        cmd += ["--rpc", ",".join(ep for ep, _, _ in servers)]
        if args.rpc_devices_only:  # the main process's own GPU left out
            cmd += ["-dev", ",".join(f"RPC{i}" for i in range(n_servers))]
    cmd += args.main_args.split()
    p = procs.start(cmd, log)
    t0 = time.time()
    while "listening on http" not in log.read_text(errors="replace"):
        if p.poll() is not None or time.time() - t0 > 180:
            raise RuntimeError(f"llama-server: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    timings, per_server = [], []
    for k in range(args.requests):
        offsets = [srv_log.stat().st_size for _, srv_log, _ in servers]
        timings.append(complete(port, args.prompt, args.gen))
        if k == 0:
            per_server = [ubatches(srv_log.read_bytes()[off:].decode(errors="replace"))
                          for (_, srv_log, _), off in zip(servers, offsets)]
    for pr in list(procs.procs):
        procs.stop(pr)
    return {"servers": n_servers, "command": cmd[1:], "timings": timings, "ubatches": per_server}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", action="append", choices=list(MODELS))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--bindir", help="llama-server and ggml-rpc-server of another build (CUDA: benchmarks/gpu/rpc.sh)")
    ap.add_argument("--server-args", default="", help="more rpc-server flags, e.g. '-d CUDA0'")
    ap.add_argument("--main-args", default="", help="more llama-server flags, e.g. '-fa off'")
    ap.add_argument("--rpc-devices-only", action="store_true", help="llama-server -dev RPC0,...: no local GPU")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bindir = Path(args.bindir) if args.bindir else server_dir() / "bin"
    procs = Procs()
    rows = []
    link = loopback()
    print(f"loopback: {link}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="ggfit-rpcnet-") as tmp:
            for label in args.only or DEFAULT_MODELS:
                path = model_path(label)
                for n in (0, 1, 2):
                    row = run_case(procs, bindir, path, n, Path(tmp), args)
                    row["model"] = label
                    rows.append(row)
                    t = row["timings"]
                    print(f"{label} {n} servers: prompt {[round(x['prompt_ms'], 1) for x in t]} ms, decode "
                          f"{[round(x['predicted_per_token_ms'], 2) for x in t]} ms/token", flush=True)
    finally:
        procs.stop_all()
    Path(args.out).write_text(json.dumps({
        "llama_cpp": {"commit": PINNED_COMMIT, "binaries": str(bindir), "version": subprocess.run(
            [str(bindir / "llama-server"), "--version"], capture_output=True, text=True).stderr.strip().splitlines()},
        "what": f"llama-server -t 1 with 0, 1, 2 rpc-servers ({args.server_args or 'no -d'}, -t 1, GGML_RPC_DEBUG=1) "
                "on 127.0.0.1: timings per request and each server's commands per ubatch (first request)",
        "prompt": args.prompt, "gen": args.gen, "ctx": args.ctx, "server_args": args.server_args,
        "main_args": args.main_args, "loopback": link, "rows": rows,
        "date": time.strftime("%Y-%m-%d")}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
