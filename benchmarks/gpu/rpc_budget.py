"""Issue 47's budget check on the device: a local CUDA GPU beside two CPU rpc-servers, CUDA0 held down to a budget.

1. Builds a synthetic Qwen3 of a few GiB (sparse: zeros, written in seconds; 128-wide heads, which CUDA's flash
   attention takes) and starts two `ggml-rpc-server -d CPU` on 127.0.0.1 (GGML_RPC_DEBUG=1).
2. benchmarks/gpu/hold.py holds CUDA0 so that --cuda-budget-mib stays free (B: what it reached).
3. ggfit's plan (fitter.fit.plan, as `fit --rpc A,B --backend cuda --budget R,R,B` with the default margin; the CLI
   needs typer, which the device lacks): its proposed -ts and -c (fitter.fit.split). With the defaults (R 3 GiB,
   B 6 GiB) it proposes -ts 5,4,8 -c 32768 at -ub 512, K/V f16, CUDA0 predicted at 3,732 of the 5,116 MiB B leaves
   (the 2026-12-06 run, without the CLI's -ts in the budgets' proportions: the same -ts at -ub 256, K/V q8_0).
4. llama-server loads that split and answers one completion (status ok), every buffer as printed recorded.
5. The same -c with layers moved onto CUDA0 until ggfit predicts CUDA0 at least --over-mib beyond B: it must end out
   of memory (llama-server's log: cudaMalloc failed / failed to allocate; status oom).
Everything, with the build, to --out (predicted bytes per device, measured as printed, status, log tails).

    python3 benchmarks/gpu/rpc_budget.py --bindir /tmp/rpcb/bin --out $OUT/rpc-budget.json
    python3 benchmarks/gpu/rpc_budget.py --cpu ...   # here: a CPU main host (backend rpc), no hold, small model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.rpc_here import _BUILD, Procs, _wait_ready, free_port, start_servers  # noqa: E402
from fitter.fit.memory import Prediction, predict  # noqa: E402
from fitter.llama.cparams import Backend, Frontend, RunConfig, served_config  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402
from fitter.llama_builds import PINNED_COMMIT  # noqa: E402
from fitter.oracle.llama_log import parse_log  # noqa: E402
from search.probe_result import oom_lines  # noqa: E402

MiB = 2**20
# a 16-layer Qwen3 at f16: ~370 MiB a layer, 6.0 GiB of weights; KV 128 KiB a token at f16
MODEL = dict(n_layer=16, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288, n_ctx_train=32768,
             ftype="f16", sparse=True)
SMALL = dict(n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_ff=3072, n_ctx_train=32768,
             ftype="f16", sparse=True)  # --cpu: ~100 MiB, for the script's logic here


def plan_split(path: str, eps: list[str], budgets_mib: list[int], be: Backend, *,
               budget_ts: bool = True) -> tuple[Any, RunConfig, dict]:
    """fitter.fit.plan for `fit MODEL --rpc EPS --backend cuda --budget R,R,B` (default margin, -c solved): the
    plan and the RunConfig of its proposed split (-ts and -c at the prediction's -ub and K/V types). `budget_ts`:
    the table solved at -ts in the budgets' proportions, as the CLI does (fitter.fit.budget.budget_split); the run of
    2026-12-06 (rpc-budget-h100.json) solved it without a -ts."""
    from fitter.fit.budget import budget_split, parse_budgets
    from fitter.fit.plan import plan
    from fitter.fit.request import Budgets, FitRequest
    from fitter.llama_builds import PINNED

    text = ",".join(f"{b}MiB" for b in budgets_mib)
    budgets = Budgets.parse(text, None, be, devices=parse_budgets(text, be.value))
    ts = budget_split(list(budgets.devices)) if budget_ts else None
    req = FitRequest(model=path, config=RunConfig(rpc=",".join(eps), tensor_split=ts), backend=be,
                     frontend=Frontend.SERVER, build=PINNED, budgets=budgets, solve_ctx=True)
    p = plan(req)
    split = p.rpc_split.json if p.rpc_split else {}
    if not split.get("n_ctx"):
        raise RuntimeError(f"ggfit proposes no split: {p.rpc_split.text if p.rpc_split else p.verdict}")
    cp = p.pred.context
    cfg = p.cfg.model_copy(update={"n_ubatch": cp.n_ubatch, "n_batch": cp.n_batch, "type_k": cp.type_k,
                                   "type_v": cp.type_v, "n_ctx": split["n_ctx"],
                                   "tensor_split": tuple(split["tensor_split"]),
                                   "n_gpu_layers": split["n_gpu_layers"]})
    info = {"budgets_mib": budgets_mib, "margin_bytes": budgets.margin_bytes, "avail": p.avail,
            "split": split, "split_line": p.rpc_split.text, "verdict": p.verdict}
    return p, cfg, info


def over_split(header, spec, cfg: RunConfig, be: Backend, device: str, target: int) -> tuple[RunConfig, int]:
    """-ts with layers moved one by one from the other devices onto `device` (the last), same -c, until ggfit
    predicts `device` at `target` bytes or more."""
    counts = [int(x) for x in cfg.tensor_split or ()]
    ngl = cfg.n_gpu_layers
    while True:
        c = cfg.model_copy(update={"tensor_split": tuple(float(x) for x in counts), "n_gpu_layers": ngl})
        got = predict(header, spec, c, be, Frontend.SERVER, terms=False).device_totals().get(device, 0)
        if got >= target:
            return c, got
        donors = [i for i in range(len(counts) - 1) if counts[i] > 0]
        if donors:
            counts[max(donors, key=lambda i: counts[i])] -= 1
        elif 0 <= ngl <= len(spec.layers):  # a layer of the CPU's offloaded too (-ngl one more)
            ngl += 1
        else:
            raise RuntimeError(f"every layer on {device} is {got / MiB:,.0f} MiB, below {target / MiB:,.0f} MiB")
        counts[-1] += 1


def load_and_ask(procs: Procs, bindir: Path, path: str, cfg: RunConfig, pred: Prediction, logdir: Path,
                 timeout: float) -> dict[str, Any]:
    """llama-server with this config (-fit off): ok when it answers a completion, oom when its log says an
    allocation failed, else how it ended; the buffers it printed and ggfit's prediction of each device."""
    port = free_port()
    flags = [w for g in served_config(pred.context, cfg, None).to_server_args(path) for w in g]
    cmd = [str(bindir / "llama-server"), *flags, "--host", "127.0.0.1", "--port", str(port), "-fit", "off", "-lv", "4"]
    log = logdir / f"server-{time.time_ns()}.log"
    t0 = time.time()
    p = procs.start(cmd, log)
    status = _wait_ready(p, log, timeout)
    answer = None
    if status == "ok":
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                     data=json.dumps({"prompt": "The capital of France is", "n_predict": 8}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                body = json.loads(r.read())
            answer = {"tokens_predicted": body.get("tokens_predicted"), "content": body.get("content")}
        except (OSError, ValueError) as e:
            status, answer = "no answer", {"error": str(e)}
    procs.stop(p)
    text = log.read_text(errors="replace")
    oom = oom_lines(text)
    if status != "ok" and oom:
        status = "oom"
    m = _BUILD.search(text)
    return {"status": status, "answer": answer, "command": cmd[1:], "wall_s": round(time.time() - t0, 1),
            "predicted": pred.device_totals(), "predicted_host_bytes": pred.host_bytes,
            "predicted_buffers": [b.model_dump(include={"device", "kind", "bytes"}) for b in pred.buffers],
            "measured": [{"buffer_type": b.buffer, "kind": b.kind, "mib": b.mib, "bytes": b.bytes}
                         for b in parse_log(text).buffers],
            "oom_lines": oom[:10], "log_tail": [] if status == "ok" else text.splitlines()[-25:],
            "build": {"number": int(m.group(1)), "commit": m.group(2)} if m else None}


def gpu() -> str:
    """nvidia-smi's name, memory and driver of the GPU ('none' without one)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "none"


@contextlib.contextmanager
def no_hold(free_bytes: int, out: Path) -> Iterator[int]:
    yield free_bytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.synth.common import build

    be = Backend.RPC if args.cpu else Backend.RPC_CUDA
    held = "RPC2" if args.cpu else "CUDA0"  # the device held down to the budget (the last in llama.cpp's order)
    t0 = time.time()
    path = str(build("qwen3", **(SMALL if args.cpu else MODEL)))
    header, spec = load_model_spec(path)
    doc: dict[str, Any] = {"llama_cpp": {"commit": PINNED_COMMIT, "binaries": args.bindir}, "device": gpu(),
                           "command": " ".join(sys.argv), "model": path,
                           "model_overrides": SMALL if args.cpu else MODEL, "backend": be.value, "held": held,
                           "build_s": round(time.time() - t0, 1)}
    procs = Procs()
    try:
        logdir = Path(tempfile.mkdtemp(prefix="ggfit-rpc-budget-"))  # the logs' tails go into the JSON
        n_servers = 3 if args.cpu else 2  # --cpu: the third server stands for CUDA0
        servers = start_servers(procs, Path(args.bindir), n_servers, logdir, ("-d", "CPU") if not args.cpu else ())
        eps = [ep for ep, _, _ in servers]
        doc["servers"] = [a for _, _, a in servers]
        hold = no_hold if args.cpu else __import__("measure").held_to
        with hold(args.cuda_budget_mib * MiB, logdir) as free:
            doc["held_free_bytes"] = free
            budget_mib = free // MiB
            p, cfg, doc["plan"] = plan_split(path, eps, [args.rpc_budget_mib] * 2 + [budget_mib], be)
            print(f"plan: {doc['plan']['split_line']}", flush=True)
            pred = predict(header, spec, cfg, be, Frontend.SERVER)
            doc["proposed"] = load_and_ask(procs, Path(args.bindir), path, cfg, pred, logdir, args.timeout)
            print(f"proposed -ts {cfg.tensor_split} -c {cfg.n_ctx}: {doc['proposed']['status']}", flush=True)
            over, got = over_split(header, spec, cfg, be, held, free + args.over_mib * MiB)
            pred = predict(header, spec, over, be, Frontend.SERVER)
            doc["over"] = {"target_bytes": free + args.over_mib * MiB, "predicted_held_bytes": got,
                           **load_and_ask(procs, Path(args.bindir), path, over, pred, logdir, args.timeout)}
            print(f"over -ts {over.tensor_split} -c {over.n_ctx} ({held} {got / MiB:,.1f} MiB predicted, "
                  f"{free / MiB:,.1f} free): {doc['over']['status']}", flush=True)
    finally:
        procs.stop_all()
    doc["wall_s"] = round(time.time() - t0, 1)
    doc["verdict"] = {"proposed_loads_and_answers": doc["proposed"]["status"] == "ok",
                      "over_is_oom": doc["over"]["status"] == "oom"}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bindir", required=True, help="llama-server and ggml-rpc-server (CUDA + RPC build)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cuda-budget-mib", type=int, default=6144, help="CUDA0's free memory while held (B)")
    ap.add_argument("--rpc-budget-mib", type=int, default=3072, help="each CPU rpc-server's budget")
    ap.add_argument("--over-mib", type=int, default=512, help="the OOM case: CUDA0 predicted this much beyond B")
    ap.add_argument("--timeout", type=float, default=150, help="seconds for one llama-server load")
    ap.add_argument("--cpu", action="store_true", help="here: CPU main host, three CPU servers, no hold")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run()'s finally: children stopped
    doc = run(args)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(doc["verdict"]), f"wrote {args.out}")
    return 0 if all(doc["verdict"].values()) or args.cpu else 1


if __name__ == "__main__":
    raise SystemExit(main())
