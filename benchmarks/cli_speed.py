"""How long `ggfit fit -c` takes as a whole process, this tree beside another (issue 45: the request/plan path must not
slow it). Each command runs `python -m cli` in a child, alternately from this tree and the baseline's, after one
warm-up each, with ggfit's header cache in a temporary GGFIT_CACHE (warm after the warm-up: the usual case); the
medians of the children's CPU time (user + system) and wall time are printed. The machine may be shared: compare CPU
medians, and take figures only from one run (side by side).

    python benchmarks/cli_speed.py --baseline DIR [--runs 15]
    python benchmarks/cli_speed.py --baseline DIR --instructions   # callgrind's count, each command once a tree
    (DIR: another commit's tree, e.g. `git archive 984d4d7 | tar -x -C /tmp/old`)

The commands: `fit` on the bundled gemma3-270m at -c 8192 (CPU, no rates; and with a named hardware's rates), and on
a full-size sparse Qwen3-30B-A3B header at -c 32768 on CUDA where it does not fit (the placement path)."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def commands() -> dict[str, list[str]]:
    from tests.synth.shapes import build_shape, q4_k_m_types

    moe = str(build_shape("qwen3-30b-a3b", tensor_types=q4_k_m_types("qwen3-30b-a3b")))
    return {
        "fit -c 8192 (cpu, --no-speed)": ["fit", "gemma3-270m", "-c", "8192", "--budget", "1GiB", "--backend", "cpu",
                                         "--no-speed"],
        "fit -c 8192 (cpu, rates)": ["fit", "gemma3-270m", "-c", "8192", "--budget", "1GiB", "--backend", "cpu",
                                    "--hardware", "cpu", "--host-bandwidth", "50GB/s"],
        "fit -c 32768 (cuda, placement)": ["fit", moe, "-c", "32768", "--budget", "12GiB", "--backend", "cuda",
                                          "--host-budget", "64GiB", "--hardware", "nvidia-rtx-4090",
                                          "--host-bandwidth", "60GB/s"],
    }


def run_once(tree: Path, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one child `python -m cli ARGS` run in `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def instructions(trees: dict[str, Path], env: dict[str, str]) -> None:
    """Each command's instruction count (valgrind's callgrind, PYTHONHASHSEED=0) from each tree, after a warm-up:
    the same on every run, so a change of a fraction of a percent shows where the clock would hide it."""
    env = {**env, "PYTHONHASHSEED": "0"}
    for name, args in commands().items():
        print(name)
        for t, tree in trees.items():
            run_once(tree, args, env)  # warm-up: byte code, header cache
            out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                                  "-m", "cli", *args], cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                                 capture_output=True, text=True, check=False).stderr
            count = next((int(line.split()[-1].replace(",", "")) for line in out.splitlines()
                          if "Collected" in line), 0)
            print(f"  {t:<10} {count:>15,} instructions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="another tree to compare with (run alternately)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--instructions", action="store_true", help="count instructions (callgrind) instead of timing")
    a = ap.parse_args()
    trees = {"this tree": ROOT, "baseline": Path(a.baseline).resolve()}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GGFIT_CACHE=cache)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        if a.instructions:
            instructions(trees, env)
            return
        for name, args in commands().items():
            times: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}
            for tree in trees.values():
                run_once(tree, args, env)  # warm-up: byte code, header cache
            for _ in range(a.runs):
                for t, tree in trees.items():
                    times[t].append(run_once(tree, args, env))
            print(name)
            for t in trees:
                cpu = statistics.median(x[0] for x in times[t])
                wall = statistics.median(x[1] for x in times[t])
                print(f"  {t:<10} CPU {cpu * 1000:7.1f} ms  wall {wall * 1000:7.1f} ms  (median of {a.runs})")
    print(f"load average {os.getloadavg()[0]:.2f}; {sys.executable} {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
