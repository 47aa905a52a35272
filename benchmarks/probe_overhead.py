"""What a probe costs beyond llama.cpp's own work, and how the two runners' rates compare.

    python benchmarks/probe_overhead.py [MODEL] [--runs N] [--server] [--prompt-tokens P] [--gen-tokens G]

For each probe: wall time (parent side, spawn to exit) minus llama.cpp's own time (model load + context
creation + every prefill and decode, as llama.cpp timed them). The difference is what ggfit adds: the child
interpreter's start and `import llama_cpp`, tokenizing, JSON, process teardown (python runner); server start-up
outside the model load, HTTP and /tokenize, shutdown (server runner, where the load is inside "startup").
Target: under 1 s per probe. With --server, the same config also goes through llama-server and the decode
rates of both runners are printed side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.bundled import resolve_model  # noqa: E402
from fitter.llama.cparams import RunConfig  # noqa: E402
from search.probe import run_probe  # noqa: E402
from search.workload import Workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--server", action="store_true", help="also probe through llama-server and compare rates")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: os.cpu_count(), as llama-server)")
    a = ap.parse_args()

    model = resolve_model(a.model)
    config = RunConfig(n_ctx=a.ctx, n_parallel=1)
    wl = Workload(prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, repeats=3, warmup=1)
    runners = ["python"] + (["server"] if a.server else [])
    rates: dict[str, list[float]] = {r: [] for r in runners}
    print(f"model {model}\nconfig {config.model_dump(exclude_defaults=True)}  workload {wl.model_dump()}  "
          f"threads {a.threads or 'default'}")
    for runner in runners:
        over = []
        for i in range(a.runs):
            r = run_probe(model, config, wl, runner=runner, llama_server=a.llama_server, threads=a.threads)
            if not r.ok:
                print(f"{runner}: {r.status}: {r.message}")
                return 1
            over.append(r.overhead_s)
            rates[runner].append(r.decode_tps)
            extra = f"startup {r.timings.get('startup_s', 0):.2f} s, " if runner == "server" else (
                f"import {r.timings.get('import_s', 0):.2f} s, load {r.timings.get('load_model_s', 0):.2f} s, ")
            print(f"{runner} #{i + 1}: wall {r.wall_s:.2f} s, llama.cpp {r.llama_s:.2f} s, overhead {r.overhead_s:.2f} s "
                  f"({extra}prefill {r.prefill_tps:.1f} tok/s, decode {r.decode_tps:.1f} tok/s "
                  f"[{r.decode_spread.min:.1f}-{r.decode_spread.max:.1f}])")
            if runner == "server" and i == 0:
                print("   command: " + " ".join(r.command or []))
        print(f"{runner}: overhead per probe median {statistics.median(over):.2f} s (target < 1 s)")
    if a.server:
        p, s = statistics.median(rates["python"]), statistics.median(rates["server"])
        print(f"decode rate: python {p:.1f} tok/s, server {s:.1f} tok/s, server/python {s / p:.3f} "
              f"({abs(s - p) / p:.1%} apart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
