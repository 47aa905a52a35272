"""Prefill and decode rates on this machine's CPU, the speed model's CPU truth (issue 46).

    python benchmarks/cpu_speed.py [--out benchmarks/results/speed-cpu-here.json] [--threads 2]

Each model runs in `ggfit probe` (the pinned llama-cpp-python, llama.cpp's extra CPU buffer types off: this CPU
advertises AMX), the llama-bench way: one warm-up, then `--repeats 3` measured runs, their median; a 512-token
prompt from depth 0 (pp512) and 128 decoded tokens after it (tg128 at depth 512). Run it on an idle machine: the
rates are the machine's. Models: the bundled Gemma 3 270M Q4_K_M and synthetic shapes filled with random valid
blocks (tests/synth/shapes.py), quantized as fitter.fit.quants predicts llama-quantize would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = [("gemma3-270m", None), ("qwen35-0.8b", "Q4_K_M"), ("gemma3-4b", "Q4_K_M"), ("llama2-7b", "Q4_0")]
# --cases more: the type classes the CPU rate measures (fitter.speed.cpu_rate), at sizes a 2-core machine runs
MORE = [("gemma3-270m", None), ("qwen35-0.8b", "Q4_K_M"), ("qwen35-0.8b", "Q8_0"), ("gemma3-4b", "Q4_K_M"),
        ("gemma3-4b", "Q8_0")]


def _model(shape: str, ftype: str | None) -> str:
    if ftype is None:
        return shape  # a bundled model
    from tests.synth.shapes import build_shape, fill_weights, quant_types

    path = build_shape(shape, tensor_types=quant_types(shape, ftype))
    marker = path.with_suffix(".filled")
    if not marker.exists():
        fill_weights(path)
        marker.touch()
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed-cpu-here.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", choices=("default", "more"), default="default")
    args = ap.parse_args()
    from fitter.speed.cpu_rate import measure_cpu_rate
    from fitter.speed.hardware import measure_host_bandwidth

    gbs, source = measure_host_bandwidth(refresh=True)
    rate = measure_cpu_rate(args.threads, refresh=True)  # the speed model's CPU rates, the same hour as the rows
    load = os.getloadavg()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    rows = []
    for shape, ftype in (CASES if args.cases == "default" else MORE):
        model = _model(shape, ftype)
        t = time.time()
        p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "probe", model, "-c", "1024", "-t", str(args.threads),
                            "--prompt-tokens", "512", "--gen-tokens", "128", "--repeats", "3", "--json"],
                           capture_output=True, text=True, timeout=1800)
        r = json.loads(p.stdout) if p.stdout.strip() else {"status": "error", "stderr": p.stderr[-500:]}
        rows.append({"shape": shape, "ftype": ftype or "Q4_K_M", "threads": args.threads, "n_prompt": 512,
                     "n_gen": 128, "depth_decode": 512, "status": r.get("status"), "prefill_tps": r.get("prefill_tps"),
                     "decode_tps": r.get("decode_tps"), "build": r.get("build")})
        print(f"{shape} {ftype}: pp512 {r.get('prefill_tps')}, tg128 @ d512 {r.get('decode_tps')} "
              f"({time.time() - t:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps({
        "note": f"ggfit probe on this machine's CPU ({cpu}, {args.threads} threads, extra CPU buffer types off), one "
                "warm-up and the median of 3 runs: pp512 from depth 0 and tg128 after it (depth 512); "
                "`python3 benchmarks/cpu_speed.py`.",
        "cpu_info": cpu, "host_bandwidth_gbs": gbs, "host_bandwidth_source": source,
        "cpu_rate": {"prefill_gflops": rate.prefill_gflops, "decode_gflops": rate.decode_gflops,
                     "threads": rate.threads, "source": rate.source, "build": rate.build},
        "load_before": load, "load_after": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
