"""llama-bench's pp512 and tg128 (at depth 512) on this machine's CPU, the best of a few runs: the speed model's CPU
truth on a shared machine (issue 46), with the CPU rate (fitter.speed.cpu_rate) and host bandwidth measured in the
same run.

    python benchmarks/cpu_bench.py [--out benchmarks/results/speed-cpu-here-epyc.json] [--threads 2] [--runs 3]

Each model runs in a child process (fitter.speed._cpu_rate_child's llama-cpp-python calls, extra CPU buffer types
off): one llama_decode of a 512-token ubatch from depth 0 (pp512), then 128 single-token llama_decode calls (tg128 at
depth 512); `--runs` times, the fastest of each kept. Other processes on a 2-core machine stall llama.cpp's threads
at every ggml_barrier, so the fastest run is the machine's rate and a median is not (benchmarks/cpu_speed.py's
ggfit probe takes the median of 3: on 2026-12-05 it measured gemma3-4b Q4_K_M's tg128 at 0.99 tok/s beside
others' tests, Q8_0's at 4.1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_speed import MORE, _model  # noqa: E402

_CHILD = """
import json, sys, time
import llama_cpp as l
from fitter.speed._cpu_rate_child import _context, _load, _run
path, threads, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
l.llama_backend_init()
model = _load(l, path)
ctx = _context(l, model, 1024, 512, threads)
batch = l.llama_batch_init(512, 0, 1)
pp, tg = [], []
for rep in range(runs + 1):
    l.llama_memory_clear(l.llama_get_memory(ctx), True)
    t = _run(l, ctx, batch, 512, 0)
    t2 = sum(_run(l, ctx, batch, 1, 512 + i) for i in range(128 if rep else 4))
    if rep:
        pp.append(512 / t)
        tg.append(128 / t2)
print(json.dumps({"pp512": pp, "tg128": tg, "system_info": l.llama_print_system_info().decode().strip()}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed-cpu-here-epyc.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--merge", help="an earlier sweep's output: its runs and CPU rates join this sweep's (the fastest "
                                    "of all kept)")
    args = ap.parse_args()
    from fitter.bundled import resolve_model
    from fitter.speed.cpu_rate import measure_cpu_rate
    from fitter.speed.hardware import _cpu_model, measure_host_bandwidth

    load = os.getloadavg()
    gbs, source = measure_host_bandwidth(refresh=True)
    rates = [measure_cpu_rate(args.threads, refresh=True)]
    prev = json.loads(Path(args.merge).read_text()) if args.merge else None
    rows = []
    for shape, ftype in MORE:
        t = time.time()
        path = _model(shape, ftype) if ftype else resolve_model(shape)  # None: a bundled model
        p = subprocess.run([sys.executable, "-c", _CHILD, path, str(args.threads), str(args.runs)],
                           capture_output=True, text=True, timeout=1800, cwd=str(ROOT))
        r = json.loads(p.stdout.splitlines()[-1]) if p.returncode == 0 else {}
        old = next((o for o in (prev or {}).get("rows", []) if (o["shape"], o["ftype"]) == (shape, ftype or "Q4_K_M")),
                   None)
        for k in ("pp512", "tg128"):
            r[k] = (r.get(k) or []) + ((old or {}).get("runs", {}).get(k) or [])
        rows.append({"shape": shape, "ftype": ftype or "Q4_K_M", "threads": args.threads, "n_prompt": 512,
                     "n_gen": 128, "depth_decode": 512, "status": "ok" if r["pp512"] and r["tg128"] else "error",
                     "prefill_tps": max(r.get("pp512") or [0]), "decode_tps": max(r.get("tg128") or [0]),
                     "runs": {"pp512": r.get("pp512"), "tg128": r.get("tg128")},
                     "build": {"llama_cpp_python": rates[0].build, "system_info": r.get("system_info"),
                               "pinned_commit": "0c1e57098bba"}})
        print(f"{shape} {ftype}: {rows[-1]['runs']} ({time.time() - t:.0f} s)", flush=True)
    rates.append(measure_cpu_rate(args.threads, refresh=True))  # at the end too: the faster of the two kept
    cands = [(gbs, source), measure_host_bandwidth(refresh=True)]
    if prev:
        cands.append((prev["host_bandwidth_gbs"], prev["host_bandwidth_source"]))
    gbs, source = max(cands, key=lambda x: x[0])  # the fastest copy: the others' load only slows it
    cpu_rate = {kind: {c: max(getattr(r, kind)[c] for r in rates) for c in rates[0].prefill_gflops}
                for kind in ("prefill_gflops", "decode_gflops")}
    if prev:
        cpu_rate = {kind: {c: max(v, prev["cpu_rate"][kind].get(c, 0.0)) for c, v in rates_.items()}
                    for kind, rates_ in cpu_rate.items()}
    Path(args.out).write_text(json.dumps({
        "note": f"benchmarks/cpu_bench.py on this machine's CPU ({_cpu_model()}, {args.threads} threads, extra CPU "
                f"buffer types off): pp512 from depth 0 and tg128 after it (depth 512), the fastest of {args.runs} "
                "runs after a warm-up (with --merge, of every sweep's); the CPU rate and host bandwidth measured in the same run.",
        "cpu_info": _cpu_model(), "host_bandwidth_gbs": gbs, "host_bandwidth_source": source,
        "cpu_rate": {**cpu_rate, "threads": args.threads, "build": rates[0].build,
                     "source": f"fitter.speed.cpu_rate measured here at the start and the end of the sweep"
                               f"{' and of ' + args.merge if prev else ''}: the faster of each",
                     "each": [{"prefill_gflops": r.prefill_gflops, "decode_gflops": r.decode_gflops} for r in rates]
                     + ((prev or {}).get("cpu_rate", {}).get("each") or [])},
        "load_before": load, "load_after": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
