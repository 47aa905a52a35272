"""ggfit's CUDA prediction against llama.cpp's CUDA dry run (no_alloc, load_mode none) on full-size
model shapes written as sparse header-only GGUFs. Exact bytes come from llama.cpp's memory breakdown
per buffer type. Writes rows to OUT/gpu-memory.json as it goes (a killed run keeps what it measured).

    python benchmarks/gpu/measure.py --out DIR [--shapes qwen36-35b-a3b,llama-8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fitter.build import LLAMA_CPP_COMMIT  # noqa: E402
from fitter.check import llama_params  # noqa: E402
from fitter.config import Backend, Frontend, RunConfig  # noqa: E402
from fitter.llama_run import measure  # noqa: E402
from fitter.memory import predict  # noqa: E402
from fitter.model_spec import load_model_spec  # noqa: E402
from tests.synth.shapes import build_shape, q4_k_m_types  # noqa: E402


def grid(n_ctx_train: int) -> list[RunConfig]:
    out = []
    for n_ctx in (4096, 32768, 131072, 262144):
        if n_ctx > n_ctx_train:
            continue
        for ub in (512, 2048):
            for kv in ("f16", "q8_0"):
                out.append(RunConfig(n_ctx=n_ctx, n_ubatch=ub, type_k=kv, type_v=kv, flash_attn="on", no_mmap=True))
        if n_ctx <= 32768:
            out.append(RunConfig(n_ctx=n_ctx, n_ubatch=512, flash_attn="off", no_mmap=True))
    return out


def split(pred, owner="target") -> dict[str, int]:
    out: dict[str, int] = {}
    for b in pred.buffers:
        if b.owner != owner:
            continue
        key = f"{b.kind}:{'device' if b.counts else 'host'}"
        out[key] = out.get(key, 0) + b.bytes
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen36-35b-a3b,llama-8b")
    args = ap.parse_args()
    out = Path(args.out)
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        path = str(build_shape(shape, tensor_types=q4_k_m_types(shape)))
        header, spec = load_model_spec(path)
        for cfg in grid(spec.n_ctx_train):
            pred = predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER)
            t = time.time()
            run = measure(path, llama_params(pred.context, cfg), mode="dry", log_level="info", timeout=120)
            row = {"shape": shape, "config": cfg.model_dump(exclude_defaults=True), "status": run.status,
                   "message": run.message, "wall_s": round(time.time() - t, 2), "predicted": split(pred),
                   "predicted_rows": [b.model_dump() for b in pred.buffers],
                   "measured": [r.model_dump() for r in run.breakdown or []],
                   "build": run.build.commit}
            rows.append(row)
            (out / "gpu-memory.json").write_text(json.dumps({"llama_cpp": LLAMA_CPP_COMMIT, "rows": rows}, indent=1))
            meas = {r.buffer_type: (r.model, r.context, r.compute) for r in run.breakdown or []}
            p = row["predicted"]
            print(f"{shape} c={cfg.n_ctx} ub={cfg.n_ubatch} kv={cfg.type_k} fa={cfg.flash_attn}: {run.status} "
                  f"pred model {p.get('model:device', 0) / 2**20:.1f} kv {p.get('kv:device', 0) / 2**20:.1f} "
                  f"rs {p.get('rs:device', 0) / 2**20:.1f} compute {p.get('compute:device', 0) / 2**20:.1f}"
                  f"/{p.get('compute:host', 0) / 2**20:.1f} | llama.cpp " + ", ".join(
                      f"{k} m{v[0] / 2**20:.1f} c{v[1] / 2**20:.1f} x{v[2] / 2**20:.1f}" for k, v in meas.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
