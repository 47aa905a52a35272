"""How long `ggfit fit` takes as a whole process on a ~20 GB model's header, beside llama.cpp's dry run.

The model is a full-size Qwen3.6-35B-A3B shape (qwen35moe, 40 layers, 256 experts, 248,320-token
vocab) written as a sparse header-only GGUF with a Q4_K_M type mix (no tensor data on disk). Target:
under 300 ms per `ggfit fit` process. Prints medians and the spread; exits 1 with --check if missed.

    python benchmarks/fit_speed.py [--runs 7] [--check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_path() -> str:
    from tests.synth.shapes import build_shape, q4_k_m_types

    return str(build_shape("qwen36-35b-a3b", tensor_types=q4_k_m_types("qwen36-35b-a3b")))


def time_process(argv: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    path = model_path()
    size = os.path.getsize(path)
    print(f"model: {path} ({size / 2**20:,.0f} MiB, sparse; qwen35moe 35B-A3B shape, Q4_K_M mix)")
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    cases = {
        "ggfit fit -c 131072 (fixed config that fits)": ["-c", "131072", "-ctk", "q8_0", "-ctv", "q8_0", "-ub", "2048"],
        "ggfit fit -c 262144 (over budget: + what fits instead)": ["-c", "262144", "-ctk", "q8_0", "-ctv", "q8_0",
                                                                   "-ub", "2048"],
        "ggfit fit (solve ctx for 5 ubatch x 3 KV types)": [],
    }
    ok = True
    for name, extra in cases.items():
        argv = [sys.executable, "cli.py", "fit", path, "--budget", "25559MiB", "--backend", "metal", *extra]
        ts = time_process(argv, args.runs)
        med = statistics.median(ts)
        print(f"{name:<56} median {med * 1000:7.1f} ms  (min {min(ts) * 1000:.1f}, max {max(ts) * 1000:.1f})")
        if "fits)" in name:
            ok = ok and med < 0.300
    for label, code in (("python -c pass (interpreter start)", "pass"),
                        ("import typer, pydantic (the CLI's floor)", "import typer, pydantic")):
        ts = time_process([sys.executable, "-c", code], args.runs)
        print(f"{label:<56} median {statistics.median(ts) * 1000:7.1f} ms")

    from fitter.oracle.llama_run import LlamaParams, measure

    walls = []
    for _ in range(3):
        run = measure(path, LlamaParams(n_ctx=262144, n_ubatch=2048, type_k="q8_0", type_v="q8_0", flash_attn="on",
                                        n_seq_max=4, kv_unified=True, swa_full=False), mode="dry", log_level="info")
        walls.append(run.wall_s)
    print(f"{'llama.cpp dry run, same file (CPU backend)':<56} median {statistics.median(walls) * 1000:7.1f} ms  "
          f"(status {run.status})")
    if args.check and not ok:
        print("target missed: ggfit fit with a fixed config should take under 300 ms")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
