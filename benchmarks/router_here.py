"""llama-server's router mode with a three-model preset (issue 48), measured here.

    PYTHONPATH=. python3 benchmarks/router_here.py [--out benchmarks/results/router-cpu-here.json]

The preset: the synthetic SWA gemma3 and hybrid qwen35 of benchmarks/session_here.py and a small llama, with
`--cache-ram` per model. ggfit (`ggfit router`) sizes each model and, for a budget between its two largest and all
three, predicts `--models-max 2`; the pinned llama-server runs the router with that, each model is loaded in turn
(POST /models/load) and served one request, and the resident children's VmRSS / RssAnon and the router's eviction
line ("models_max limit reached, removing LRU") are recorded. tests/session/test_router_recorded.py replays it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = [("sgemma", "synth-gemma3", ["c = 4096", "cache-ram = 64"]),
          ("sqwen", "synth-qwen35", ["ctx-size = 8192", "cache-ram = 64"]),
          ("sllama", None, ["c = 4096", "cache-ram = 0"])]
BUDGET_MIB = 1100


def write_preset(path: Path) -> None:
    from session_here import model_path

    from tests.synth import build

    lines = ["version = 1", "[*]", "no-repack = true", ""]
    for name, key, opts in MODELS:
        lines += [f"[{name}]", f"model = {model_path(key) if key else build('llama')}", *opts, ""]
    path.write_text("\n".join(lines))


def _children(ppid: int) -> dict[str, dict]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != ppid:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if ln.startswith(("VmRSS", "RssAnon"))}
            out[argv[argv.index("--alias") + 1]] = mem
        except (OSError, ValueError, IndexError):
            pass
    return out


def main() -> None:
    from search.server import LlamaServer, find_llama_server, free_port, parse_build, server_version

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/router-cpu-here.json"))
    a = ap.parse_args()
    preset = Path("/tmp/ggfit-router-preset.ini")
    write_preset(preset)
    import subprocess

    pred = json.loads(subprocess.run([sys.executable, str(ROOT / "cli.py"), "router", "--models-preset", str(preset),
                                      "--budget", f"{BUDGET_MIB}MiB", "--backend", "cpu", "--json"],
                                     capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout)
    n_max = pred["models_max_fits"]
    binary = find_llama_server()
    port = free_port()
    cmd = [binary, "--models-preset", str(preset), "--models-max", str(n_max), "--host", "127.0.0.1", "--port", str(port)]
    srv = LlamaServer(cmd, port=port)
    steps = []
    try:
        assert srv.wait_healthy(time.perf_counter() + 60), srv.log[-2000:]
        for name, _, _ in MODELS:
            srv.request("POST", "/models/load", {"model": name}, 300)
            for _ in range(600):
                st = {m["id"]: m["status"]["value"] for m in srv.request("GET", "/models", None, 10)["data"]}
                if st[name] == "loaded":
                    break
                time.sleep(0.2)
            srv.request("POST", "/completion", {"model": name, "prompt": "hello " * 50, "n_predict": 4}, 300)
            time.sleep(0.3)
            steps.append({"loaded": name, "status": st, "children": _children(srv.proc.pid)})
            print(name, steps[-1]["children"], file=sys.stderr)
    finally:
        srv.stop()
    doc = {"build": parse_build(server_version(binary)), "how": "PYTHONPATH=. python3 benchmarks/router_here.py",
           "budget_mib": BUDGET_MIB, "preset": preset.read_text(), "command": cmd[1:], "predicted": pred,
           "steps": steps, "log": [ln for ln in srv.proc.lines if "LRU" in ln or "spawning server instance with name" in ln]}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
