"""llama.cpp's RPC backend on this machine (issue 47): CPU rpc-servers on 127.0.0.1, llama-server --rpc, every buffer.

Starts two or three `ggml-rpc-server` processes of the pinned build (CPU device, GGML_RPC_DEBUG=1: each logs the exact
size of every buffer llama.cpp allocates on it), then for each model and config a real load with
`llama-server --rpc ... -fit off --no-repack` up to its warm-up, and records:
- every `<buffer> <kind> buffer size = X MiB` line llama.cpp printed, per buffer type (RPC0[127.0.0.1:P], CPU, ...);
- for each RPC device, the exact bytes of each buffer its server allocated (`[alloc_buffer] ... size: N`), paired in
  order with that device's printed lines (weights, then KV / recurrent state, then compute) and checked against
  their MiB to the printed 0.01 MiB;
- the devices llama.cpp used, in its order, with the free memory it read (`using device RPC0 (...) - N MiB free`),
  and what fitter.ggml.backends.rpc.protocol reads from each server (hello, device count, device memory).
Also llama.cpp's own dry run, `llama-fit-params --rpc ... --fit-print on`, where it runs.

    PYTHONPATH=. python3 benchmarks/rpc_here.py [--out benchmarks/results/rpc-cpu-here.json] [--only gemma3-270m]

Every process it starts is in its own session and killed (by its pid) on exit, Ctrl-C or SIGTERM included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fitter.ggml.backends.rpc.protocol import RPCError, query_server  # noqa: E402
from fitter.llama_builds import PINNED_COMMIT  # noqa: E402
from fitter.oracle.llama_log import PRINT_TOLERANCE_BYTES, parse_log  # noqa: E402
from search.build_server import build_llama_server, server_dir  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "rpc-cpu-here.json"
# label -> (synthetic builder or "bundled", overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-270m": ("bundled", {}),
    "qwen3-6l": ("qwen3", {"n_layer": 6}),
    "qwen3moe-6l": ("qwen3moe", {"n_layer": 6}),
    "qwen35-8l": ("qwen35", {}),
}
# With a local GPU beside the servers (benchmarks/gpu/rpc.sh cuda-main): -ts in llama.cpp's device order RPC0, RPC1
# [, RPC2], CUDA0, so that the local GPU holds layers too
CASES_LOCAL_GPU: list[tuple[int, dict[str, Any]]] = [
    (2, {"n_ctx": 4096, "n_ubatch": 512, "tensor_split": [1.0, 1.0, 2.0]}),
    (2, {"n_ctx": 16384, "n_ubatch": 1024, "n_batch": 2048, "tensor_split": [1.0, 2.0, 1.0]}),
    (2, {"n_ctx": 8192, "n_ubatch": 256, "tensor_split": [0.0, 1.0, 3.0]}),
    (2, {"n_ctx": 8192, "n_ubatch": 512, "n_gpu_layers": 4, "tensor_split": [1.0, 1.0, 1.0]}),
    (3, {"n_ctx": 8192, "n_ubatch": 512, "tensor_split": [1.0, 1.0, 1.0, 1.0]}),
    (3, {"n_ctx": 2048, "n_ubatch": 512, "flash_attn": "off", "tensor_split": [1.0, 1.0, 1.0, 3.0]}),
]
# (servers, config) per model: llama-server's defaults otherwise (4 slots, unified KV, -fa auto, mmap)
CASES: list[tuple[int, dict[str, Any]]] = [
    (2, {"n_ctx": 4096, "n_ubatch": 512}),
    (2, {"n_ctx": 16384, "n_ubatch": 1024, "n_batch": 2048}),
    (2, {"n_ctx": 4096, "n_ubatch": 256, "tensor_split": [1.0, 3.0]}),
    (2, {"n_ctx": 8192, "n_ubatch": 512, "n_gpu_layers": 3}),
    (3, {"n_ctx": 8192, "n_ubatch": 512}),
    (3, {"n_ctx": 4096, "n_ubatch": 128, "tensor_split": [2.0, 1.0, 1.0]}),
    (3, {"n_ctx": 2048, "n_ubatch": 512, "flash_attn": "off"}),
    (3, {"n_ctx": 32768, "n_ubatch": 512, "tensor_split": [13.0, 5.0, 1.0]}),  # fitter.fit.split's for Gemma 3
]
_ALLOC = re.compile(r"\[alloc_buffer\] device: (\d+), size: (\d+) -> remote_ptr: \w+, remote_size: (\d+)")
_USING = re.compile(r"using device (\S+) \((.+?)\) \([^()]*\) - (\d+) MiB free")  # RPC: the endpoint; CUDA0: its name
_BUILD = re.compile(r"build:? (\d+) \((\w+)\)")
_KIND_ORDER = {"model": 0, "kv": 1, "rs": 1, "compute": 2}


class Procs:
    """The processes this script started, each in its own session; all killed by pid on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        f = log.open("ab")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        f.close()
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 10.0) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(self.procs):
            self.stop(p, 3.0)


def alive(procs: Procs, pid: int) -> bool:
    return any(p.pid == pid and p.poll() is None for p in procs.procs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_path(label: str) -> str:
    kind, over = MODELS[label]
    if kind == "bundled":
        from fitter.bundled import resolve_model

        return resolve_model(label)
    from tests.synth.common import build

    return str(build(kind, **over))


def server_flags(cfg: dict[str, Any]) -> list[str]:
    out = ["-c", str(cfg["n_ctx"]), "-ub", str(cfg["n_ubatch"])]
    if "n_batch" in cfg:
        out += ["-b", str(cfg["n_batch"])]
    if "tensor_split" in cfg:
        out += ["-ts", ",".join(f"{x:g}" for x in cfg["tensor_split"])]
    if "n_gpu_layers" in cfg:
        out += ["-ngl", str(cfg["n_gpu_layers"])]
    if "flash_attn" in cfg:
        out += ["-fa", cfg["flash_attn"]]
    return out


def start_servers(procs: Procs, bindir: Path, n: int, logdir: Path,
                  server_args: tuple[str, ...] = ()) -> list[tuple[str, Path, dict[str, Any]]]:
    """n CPU rpc-servers; each answered ggfit's protocol client (hello, device count, memory) before use."""
    out = []
    logdir.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        port = free_port()
        log = logdir / f"rpc-{i}.log"
        procs.start([str(bindir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1", *server_args], log,
                    {"GGML_RPC_DEBUG": "1"})
        ep = f"127.0.0.1:{port}"
        for _ in range(100):
            try:
                devs = query_server(ep, timeout=2.0)
                break
            except RPCError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"rpc-server {ep} did not answer: {log.read_text()[-2000:]}")
        out.append((ep, log, {"devices": [d._asdict() for d in devs], "pid": procs.procs[-1].pid,
                                "idle_rss": rss_bytes(procs.procs[-1].pid)}))
    return out


def _wait_ready(p: subprocess.Popen, log: Path, timeout: float) -> str:
    t0 = time.time()
    while time.time() - t0 < timeout:
        text = log.read_text(errors="replace")
        if "listening on http" in text:  # llama_server: the model is loaded and warmed up
            return "ok"
        if p.poll() is not None:
            return "exit"
        time.sleep(0.2)
    return "timeout"


def rss_bytes(pid: int) -> int | None:
    try:
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def remote_allocs(log: Path, offset: int) -> list[int]:
    text = log.read_bytes()[offset:].decode(errors="replace")
    return [int(m.group(2)) for m in _ALLOC.finditer(text)]


def pair_device(lines: list[dict[str, Any]], allocs: list[int]) -> tuple[list[dict[str, Any]], str | None]:
    """The device's printed buffers (in llama.cpp's order) with the exact sizes its server allocated, in order."""
    printed = [ln for ln in lines if ln["bytes"] > 0]
    if len(printed) != len(allocs):
        return lines, f"{len(printed)} printed buffers, {len(allocs)} allocations: {allocs}"
    for ln, size in zip(printed, allocs):
        if abs(size - ln["bytes"]) > PRINT_TOLERANCE_BYTES:
            return lines, f"{ln['kind']} printed {ln['mib']} MiB, allocated {size} B"
        ln["bytes"], ln["exact"] = size, True
    return lines, None


def measure_one(procs: Procs, bindir: Path, servers: list, model: str, cfg: dict[str, Any],
                logdir: Path, main_args: tuple[str, ...] = ()) -> dict[str, Any]:
    eps = [ep for ep, _, _ in servers]
    offsets = [log.stat().st_size for _, log, _ in servers]
    log = logdir / f"server-{time.time_ns()}.log"
    cmd = [str(bindir / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(free_port()),
           "-fit", "off", "--no-repack", "-lv", "4", "--rpc", ",".join(eps), *server_flags(cfg),
           *main_args]
    p = procs.start(cmd, log)
    status = _wait_ready(p, log, 180)
    rss = [rss_bytes(a["pid"]) for _, _, a in servers]  # each rpc-server holding this load's buffers
    main_rss = rss_bytes(p.pid)
    procs.stop(p)
    text = log.read_text(errors="replace")
    rep = parse_log(text)
    row: dict[str, Any] = {"status": status, "command": cmd[1:], "config": cfg,
                           "devices": [{"name": n, "endpoint": e, "free_mib": int(f)} for n, e, f in _USING.findall(text)]}
    lines: list[dict[str, Any]] = [{"buffer_type": b.buffer, "kind": b.kind, "label": b.label, "mib": b.mib, "bytes": b.bytes, "exact": False}
             for b in rep.buffers]
    problems = []
    for i, ep in enumerate(eps):
        mine = [ln for ln in lines if ln["buffer_type"].endswith(f"[{ep}]")]
        mine.sort(key=lambda ln: _KIND_ORDER.get(ln["kind"], 9))
        _, err = pair_device(mine, remote_allocs(servers[i][1], offsets[i]))
        if err:
            problems.append(f"{ep}: {err}")
    row["measured"] = lines
    row["problems"] = problems
    row["rss"] = {"servers": rss, "main": main_rss}  # VmRSS after the warm-up: the margins' evidence
    if status != "ok":
        row["log_tail"] = text.splitlines()[-30:]
        row["server_log_tails"] = [log_tail(srv[1], off) for srv, off in zip(servers, offsets)]
    m = _BUILD.search(text)
    row["build"] = {"number": int(m.group(1)), "commit": m.group(2)} if m else None
    return row


def log_tail(log: Path, offset: int, n: int = 15) -> list[str]:
    """An rpc-server's last lines since `offset`, without its per-call debug lines."""
    text = log.read_bytes()[offset:].decode(errors="replace").splitlines()
    return [ln for ln in text if not ln.startswith("[")][-n:]


def dry_run(bindir: Path, eps: list[str], model: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama-fit-params --rpc: llama.cpp's own no_alloc estimate per device, as it prints it (whole MiB)."""
    cmd = [str(bindir / "llama-fit-params"), "-m", model, "--rpc", ",".join(eps), "--fit-print", "on",
           "--no-repack", *server_flags(cfg)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"command": cmd[1:], "status": "timeout"}
    keep = r.stdout.splitlines() + [ln for ln in r.stderr.splitlines() if "MiB" in ln or "error" in ln.lower()]
    return {"command": cmd[1:], "status": "ok" if r.returncode == 0 else f"exit {r.returncode}", "lines": keep[:60]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    bindir = Path(args.bindir) if args.bindir else server_dir() / "bin"
    if not (bindir / "ggml-rpc-server").exists() and not args.bindir:
        bindir = build_llama_server().parent
    procs = Procs()
    rows: list[dict[str, Any]] = []
    dry: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    cases = CASES_LOCAL_GPU if args.local_gpu else CASES
    try:
        with tempfile.TemporaryDirectory(prefix="ggfit-rpc-") as tmp:
            logdir = Path(tmp)
            for n in sorted({n for n, _ in cases}):
                servers = start_servers(procs, bindir, n, logdir / f"s{n}", tuple(args.server_args.split()))
                probes.append({"servers": n, "answers": [a for _, _, a in servers]})
                for label in args.only or MODELS:
                    path = model_path(label)
                    for n_cases, cfg in cases:
                        if n_cases != n:
                            continue
                        main_args = tuple(args.main_args.split())
                        if args.rpc_devices_only:  # the main process's own GPUs left out
                            main_args += ("-dev", ",".join(f"RPC{i}" for i in range(n)))
                        if not all(alive(procs, a["pid"]) for _, _, a in servers):  # a remote aborted: a fresh group
                            for pr in list(procs.procs):
                                procs.stop(pr)
                            servers = start_servers(procs, bindir, n, logdir / f"s{n}-{len(rows)}",
                                                    tuple(args.server_args.split()))
                        row = measure_one(procs, bindir, servers, path, cfg, logdir, main_args)
                        row.update(model=label, servers=n)
                        rows.append(row)
                        print(f"{label:<14} {n} servers {cfg}: {row['status']} {row['problems'] or ''}", flush=True)
                    if not args.no_dry:
                        first = next(cfg for k, cfg in cases if k == n)
                        dry.append({"model": label, "servers": n, **dry_run(bindir, [s[0] for s in servers], path,
                                                                           first)})
                for p in list(procs.procs):
                    procs.stop(p)
    finally:
        procs.stop_all()
    builds = {json.dumps(r["build"]) for r in rows if r.get("build")}
    return {"llama_cpp": {"commit": PINNED_COMMIT, "builds_seen": sorted(builds), "binaries": str(bindir)},
            "what": "rpc-servers on 127.0.0.1 (GGML_RPC_DEBUG=1), llama-server --rpc real loads to warm-up",
            "server_args": args.server_args, "main_args": args.main_args,
            "models": {k: {"builder": v[0], "overrides": v[1]} for k, v in MODELS.items()},
            "protocol": probes, "rows": rows, "dry_runs": dry}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", action="append", choices=list(MODELS))
    ap.add_argument("--no-dry", action="store_true", help="skip llama-fit-params")
    ap.add_argument("--bindir", help="llama-server, llama-fit-params and ggml-rpc-server of another build (CUDA)")
    ap.add_argument("--server-args", default="", help="more rpc-server flags, e.g. '-d CPU' or '-d CUDA0'")
    ap.add_argument("--main-args", default="", help="more llama-server flags")
    ap.add_argument("--local-gpu", action="store_true",
                    help="the cases for a main process with its own GPU beside the servers (CASES_LOCAL_GPU)")
    ap.add_argument("--rpc-devices-only", action="store_true", help="llama-server -dev RPC0,...: no local GPU")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run()'s finally
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    bad = [r for r in result["rows"] if r["status"] != "ok" or r["problems"]]
    print(f"{len(result['rows'])} runs, {len(bad)} with a problem; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
