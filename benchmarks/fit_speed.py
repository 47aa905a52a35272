"""How long ggfit's answers take on a ~20 GB model's header, beside one llama.cpp dry run of the same file.

The model is a full-size Qwen3.6-35B-A3B shape (qwen35moe, 40 layers, 256 experts, 248,320-token vocab)
written as a sparse header-only GGUF with a Q4_K_M type mix (no tensor data on disk). Whole-process medians
(wall and CPU) for `fit -c`, `fit` without `-c` (the table and the recommendation), `quants`, `inspect`, `fit -c` on a
missing file (the CLI's floor: everything a command does before it reads a model), the interpreter floor (`python -c
pass`), and an in-process `predict()` of a new config on an already-read header; each process figure also as a ratio
to llama.cpp's dry run, measured in the same run. Children run `python -m cli`, as the `ggfit` script imports it (a
script run as `python cli.py` is compiled from source every time: ~8 ms that no user pays), with byte-code caching on
(PYTHONDONTWRITEBYTECODE removed), as on a user's machine; each command twice, with ggfit's header cache warm (the
file was read before: the usual case) and cold (every run parses the header and stores it), both in a temporary
GGFIT_CACHE (never the user's). After one warm-up of each, the runs go in rounds (every command once a round, the dry
runs spread among them, and a child that times 200 predict() calls: their median and fastest are over every round's),
so that a drift in the machine's speed slows every figure alike. The machine may be shared:
compare CPU medians, and read the load average printed at the end.

    python benchmarks/fit_speed.py [--runs 7] [--dry-runs N]   # N: --runs by default
    python benchmarks/fit_speed.py --baseline DIR [--runs 7]   # A/B against another checkout, runs interleaved

With --baseline (a checkout of another commit, e.g. `git worktree add /tmp/base <rev>`), each command and the
in-process predict() run alternately from this tree and that one, and only the CPU medians of the two are printed:
on a machine whose speed drifts, only figures taken side by side compare.

    python benchmarks/fit_speed.py --instructions [--baseline DIR]

counts instructions instead (valgrind's callgrind; each command once, after a warm-up, PYTHONHASHSEED=0): the same
on every run, so a change of a few percent shows where this machine's clock would hide it. predict() is given per
call: (110 calls - 10 calls) / 100, ubatch cycling as above.

Issue 14's targets: fit -c < 0.25 s, fit < 0.4 s, quants < 0.6 s, each >= 4x faster than the dry run;
predict() < 2 ms. This script prints the figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_path() -> str:
    from tests.synth.shapes import build_shape, q4_k_m_types

    return str(build_shape("qwen36-35b-a3b", tensor_types=q4_k_m_types("qwen36-35b-a3b")))


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's Python caches byte code; this machine's shell does not
    return env


class Timer:
    """Whole-process wall and CPU (user + system) seconds of commands, each with its own header cache.

    cache: the header cache (fitter.gguf.header_cache) as it is for every run: "warm" (filled by the
    warm-up), "cold" (emptied before each run: each parses the header and stores it), None (the children's own).
    The rest of GGFIT_CACHE (gguf-py's constants, fitter.gguf.constants) is kept: it depends on the install only."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.env = child_env()

    def run(self, argv: list[str], cache: str | None = None) -> tuple[float, float]:
        if cache is not None:
            self.env["GGFIT_CACHE"] = os.path.join(self.tmp, cache)
            if cache == "cold":
                shutil.rmtree(os.path.join(self.tmp, cache, "headers"), ignore_errors=True)
        else:
            self.env.pop("GGFIT_CACHE", None)
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


# predict() of new configs (n_ctx and n_ubatch vary) on one already-read header, in a child run from a tree:
# `PATH N time` prints each call's milliseconds, `PATH N` only runs them (for the instruction counts)
_PREDICT = """
import sys, time
sys.path.insert(0, ".")
from fitter.fit.memory import predict
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import Frontend, RunConfig
from fitter.llama.model import load_model_spec
header, spec = load_model_spec(sys.argv[1])
ms = []
for i in range(int(sys.argv[2])):
    cfg = RunConfig(n_ctx=4096 + 256 * i, n_ubatch=(512, 1024, 2048)[i % 3])
    t = time.perf_counter()
    predict(header, spec, cfg, Backend.METAL, Frontend.SERVER)
    ms.append((time.perf_counter() - t) * 1e3)
if sys.argv[3:] == ["time"]:
    print(*ms)
"""


def predict_ms(tree: str, path: str, env: dict[str, str]) -> list[float]:
    """The milliseconds of each in-process predict() of 200 new configs, in a child run from `tree`."""
    out = subprocess.run([sys.executable, "-c", _PREDICT, path, "200", "time"], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def dry_run_s(path: str) -> float:
    from fitter.oracle.llama_run import LlamaParams, measure

    run = measure(path, LlamaParams(n_ctx=131072, n_ubatch=2048, type_k="q8_0", type_v="q8_0", flash_attn="on",
                                    n_seq_max=4, kv_unified=True, swa_full=False), mode="dry", log_level="info")
    return run.wall_s


def timings(cases: dict[str, list[str]], path: str, runs: int, dry_runs: int) -> None:
    """Every command with the header cache warm and cold, the interpreter floor and llama.cpp's dry run, in rounds
    (each round runs each once, the dry runs spread over the rounds), after a warm-up of each (the dry run's too): a
    machine whose speed drifts slows them all alike, where timing one command's runs after another's would charge the
    drift to one. No dry runs (--dry-runs 0): no ratios."""
    Job = tuple[str, str | None]  # (command, header cache)
    jobs: dict[Job, list[str]] = {(name, cache): [sys.executable, "-m", "cli", *argv]
                                  for name, argv in cases.items() for cache in ("warm", "cold")}
    jobs[("python -c pass", None)] = [sys.executable, "-c", "pass"]
    got: dict[Job, list[tuple[float, float]]] = {job: [] for job in jobs}
    dry: list[float] = []
    calls: list[float] = []  # predict()'s, 200 a round (one child each): a burst of load slows one round's
    with tempfile.TemporaryDirectory(prefix="ggfit-speed-") as tmp:
        timer = Timer(tmp)
        for (_, cache), argv in jobs.items():
            timer.run(argv, cache)
        if dry_runs:
            dry_run_s(path)  # its warm-up (the shared libraries read once)
        for r in range(runs):
            for job, argv in jobs.items():
                got[job].append(timer.run(argv, job[1]))
            calls += predict_ms(str(ROOT), path, child_env())
            if len(dry) < dry_runs and r * dry_runs // runs == len(dry):
                dry.append(dry_run_s(path))
    dry_s = statistics.median(dry) if dry else float("nan")

    def med(job: Job, i: int) -> float:
        return statistics.median(x[i] for x in got[job])

    print(f"{'':<40}{'header cache warm':^34}{'cold':^24}")
    print(f"{'':<40}{'wall median':>12}{'CPU median':>12}{'dry run /':>10}{'wall median':>12}{'CPU median':>12}")
    for name in cases:
        w, c = (name, "warm"), (name, "cold")
        print(f"{name:<40}{med(w, 0):>11.3f}s{med(w, 1):>11.3f}s{dry_s / med(w, 0):>9.1f}x"
              f"{med(c, 0):>11.3f}s{med(c, 1):>11.3f}s")
    floor = ("python -c pass", None)
    print(f"{'python -c pass (interpreter floor)':<40}{med(floor, 0):>11.3f}s{med(floor, 1):>11.3f}s")
    print(f"{'predict() of a new config, in-process':<40}{statistics.median(calls):>10.2f}ms{'':>12}"
          f"{min(calls):>8.2f}ms  (median and fastest of {len(calls)} calls, {runs} rounds)")
    print(f"{'llama.cpp dry run, same file (CPU)':<40}{dry_s:>11.3f}s  ({len(dry)} runs among the rounds)")


def compare(cases: dict[str, list[str]], baseline: str, path: str, runs: int) -> None:
    """Each command's CPU median from this tree and from `baseline`, run alternately (header cache warm)."""
    env = child_env()
    trees = (str(ROOT), os.path.abspath(baseline))
    with tempfile.TemporaryDirectory(prefix="ggfit-speed-") as tmp:
        env["GGFIT_CACHE"] = tmp

        def cpu(tree: str, argv: list[str]) -> float:
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, *argv], cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            return r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime

        print(f"{'':<40}{'this tree':>12}{'baseline':>12}  (CPU medians, {runs} runs each, interleaved)")
        for name, argv in cases.items():
            got: dict[str, list[float]] = {t: [] for t in trees}
            for t in trees:
                cpu(t, ["-m", "cli", *argv])  # warm-up: byte code, header cache
            for _ in range(runs):
                for t in trees:
                    got[t].append(cpu(t, ["-m", "cli", *argv]))
            print(f"{name:<40}" + "".join(f"{statistics.median(got[t]):>11.3f}s" for t in trees))
        pm: dict[str, list[float]] = {t: [] for t in trees}
        failed: set[str] = set()  # a tree whose fitter has no load_model_spec / predict of today's signature
        for _ in range(max(3, runs // 2)):
            for t in trees:
                if t not in failed:
                    try:
                        pm[t] += predict_ms(t, path, env)
                    except subprocess.CalledProcessError:
                        failed.add(t)
        print(f"{'predict() of a new config, in-process':<40}"
              + "".join(f"{'(no API)':>12}" if t in failed else f"{statistics.median(pm[t]):>10.2f}ms" for t in trees))


def instructions(cases: dict[str, list[str]], trees: list[str], path: str) -> None:
    """Each command's instruction count (callgrind), from each tree, after a warm-up; predict() per call."""
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (callgrind) on the PATH")
        return
    env = child_env()
    env["PYTHONHASHSEED"] = "0"

    def count(tree: str, argv: list[str]) -> int:
        subprocess.run([sys.executable, *argv], cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, *argv],
                             cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).stderr
        refs = [line for line in out.splitlines() if "Collected" in line or "I   refs" in line]
        return int(refs[-1].split()[-1].replace(",", ""))

    def has_predict(tree: str) -> bool:  # compare's (no API): a fitter older than load_model_spec
        return subprocess.run([sys.executable, "-c", _PREDICT, path, "1"], cwd=tree, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    with tempfile.TemporaryDirectory(prefix="ggfit-speed-") as tmp:
        env["GGFIT_CACHE"] = tmp
        print(f"{'':<40}" + "".join(f"{t[-24:]:>26}" for t in trees) + "  (instructions, callgrind)")
        for name, argv in cases.items():
            print(f"{name:<40}" + "".join(f"{count(t, ['-m', 'cli', *argv]) / 1e6:>25,.1f}M" for t in trees))
        per = [(count(t, ["-c", _PREDICT, path, "110"]) - count(t, ["-c", _PREDICT, path, "10"])) / 100
               if has_predict(t) else None for t in trees]
        print(f"{'predict() of a new config, a call':<40}"
              + "".join(f"{'(no API)':>26}" if n is None else f"{n / 1e6:>25,.2f}M" for n in per))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dry-runs", type=int, default=None,
                    help="llama.cpp dry runs among the rounds (default: one a round, as its time varies)")
    ap.add_argument("--baseline", help="another checkout to compare with, side by side")
    ap.add_argument("--instructions", action="store_true", help="count instructions (callgrind) instead of timing")
    args = ap.parse_args()

    path = model_path()
    print(f"model: {path} ({os.path.getsize(path) / 2**20:,.0f} MiB, sparse; qwen35moe 35B-A3B shape, Q4_K_M mix)")
    common = ["--budget", "25559MiB", "--backend", "metal"]
    cases = {
        "fit -c 131072": ["fit", path, *common, "-c", "131072", "-ctk", "q8_0", "-ctv", "q8_0", "-ub", "2048"],
        "fit (no -c: table + recommendation)": ["fit", path, *common],
        "quants (every ftype, largest context)": ["quants", path, *common],
        "inspect": ["inspect", path],
        # what every command pays before it reads a model: the interpreter, typer, ggfit's argument checks; then one
        # error line (exit 2)
        "fit on a missing file (the CLI's floor)": ["fit", os.path.join(os.path.dirname(path), "missing.gguf"),
                                                    *common, "-c", "131072", "-ctk", "q8_0", "-ctv", "q8_0",
                                                    "-ub", "2048"],
    }
    if args.instructions:
        instructions(cases, [str(ROOT)] + ([os.path.abspath(args.baseline)] if args.baseline else []), path)
        return 0
    if args.baseline:
        compare(cases, args.baseline, path, args.runs)
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        return 0
    timings(cases, path, args.runs, args.runs if args.dry_runs is None else args.dry_runs)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
