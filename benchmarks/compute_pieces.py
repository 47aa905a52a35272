"""The compute buffer as a function of n_ctx: its affine pieces, from a prediction at every 256-cell step.

    python benchmarks/compute_pieces.py [--backend metal] [--ubatch 512 2048] [--kv f16 q8_0] [--model PATH]

For each ubatch and K/V type (both caches), on fit_speed's 20 GB Qwen3.6-35B-A3B header unless --model is given,
it predicts every n_ctx from 256 to n_ctx_train in steps of 256 and prints where the device compute buffer's growth
per step changes (the pieces: first step, bytes there, bytes per step), and whether the device total grows at every
step. A solver that knew the pieces would need a prediction per piece, not two per answer (issue 14: `quants`
replays the graph at k and k + 1 for each distinct answer, 18 times on this model). Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fit_speed import model_path  # noqa: E402
from fitter.fit.memory import predict  # noqa: E402
from fitter.fit.solver import CTX_STEP as STEP  # noqa: E402  # the solver's n_ctx step (256)
from fitter.llama.cparams import Backend, Frontend, RunConfig  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402


def pieces(values: list[int]) -> list[tuple[int, int, int]]:
    """(first index, value there, growth per index) of each affine run of `values` (two or more of them)."""
    out: list[tuple[int, int, int]] = []
    for i in range(len(values) - 1):
        d = values[i + 1] - values[i]
        if not out or d != out[-1][2]:
            out.append((i, values[i], d))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: fit_speed's qwen35moe header)")
    ap.add_argument("--backend", default="metal", choices=[b.value for b in Backend])
    ap.add_argument("--ubatch", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--kv", nargs="+", default=["f16", "q8_0"])
    args = ap.parse_args()
    path = args.model or model_path()
    header, spec = load_model_spec(path)
    backend = Backend(args.backend)
    k_max = spec.n_ctx_train // STEP
    print(f"{path}: {spec.architecture}, n_ctx 256..{k_max * STEP} in steps of {STEP}, backend {backend.value}")
    for ub in args.ubatch:
        for kv in args.kv:
            compute, total = [], []
            t = time.perf_counter()
            for k in range(1, k_max + 1):
                cfg = RunConfig(n_ctx=k * STEP, n_ubatch=ub, n_batch=max(2048, ub), type_k=kv, type_v=kv)
                p = predict(header, spec, cfg, backend, Frontend.SERVER, None, terms=False)
                compute.append(sum(b.bytes for b in p.buffers if b.kind == "compute" and b.counts))
                total.append(p.total_device_bytes)
            s = time.perf_counter() - t
            runs = pieces(compute)
            grows = all(b > a for a, b in zip(total, total[1:]))
            print(f"-ub {ub} -ctk {kv} -ctv {kv}: {len(runs)} pieces over {k_max} steps "
                  f"({s:.1f} s, {s / k_max * 1e3:.2f} ms a prediction); device total grows at every step: {grows}")
            for i, v, d in runs:
                print(f"    from -c {(i + 1) * STEP:>7,}: {v / 2**20:>10,.2f} MiB, {d:>+12,} bytes a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
