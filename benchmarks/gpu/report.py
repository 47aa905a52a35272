"""A short report of measure.py's results: worst error per kind, memory outside llama.cpp's buffers,
the budget cases and the studies.

    python benchmarks/gpu/report.py [DIR]    # DIR holds dry.json, load.json, budget.json, study.json
                                             # (default: benchmarks/results/, the recorded H200 run)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

MiB = 2**20
RECORDED = {"dry": "gpu-memory-h200.json", "load": "gpu-load-h200.json", "budget": "gpu-budget-h200.json",
            "study": "gpu-studies-h200.json"}


def _load(d: Path, phase: str) -> dict | None:
    for name in (f"{phase}.json", RECORDED[phase]):
        if (d / name).is_file():
            return json.loads((d / name).read_text())
    return None


def memory_lines(doc: dict, what: str) -> list[str]:
    rows = doc["rows"]
    worst: dict[str, int] = {}
    for r in rows:
        for per in r.get("diff", {}).values():
            for kind, v in per.items():
                worst[kind] = max(worst.get(kind, 0), abs(v))
    bad = [r for r in rows if r["status"] != "ok"]
    shapes = sorted({r["shape"] for r in rows})
    out = [f"{what}: {len(rows)} configs on {', '.join(shapes)} ({doc.get('gpu', '?')}, llama.cpp {doc['llama_cpp'][:12]})",
           "  worst |ggfit - llama.cpp| per kind, any buffer type: "
           + ", ".join(f"{k} {v:,} B" for k, v in sorted(worst.items())) + (f"; {len(bad)} runs failed" if bad else "")]
    return out


def load_lines(doc: dict) -> list[str]:
    rows = [r for r in doc["rows"] if r["status"] == "ok" and "unbuffered_after_decode_bytes" in r]
    if not rows:
        return []
    ub_load = [r["unbuffered_after_load_bytes"] for r in rows]
    ub_dec = [r["unbuffered_after_decode_bytes"] for r in rows]
    ctx = sorted({r["cuda_context_bytes"] for r in rows})
    return ["  cudaMemGetInfo outside llama.cpp's buffers (this process): "
            f"CUDA context {ctx[0] / MiB:,.1f}..{ctx[-1] / MiB:,.1f} MiB; after the load +{min(ub_load) / MiB:,.1f}.."
            f"{max(ub_load) / MiB:,.1f} MiB (allocation rounding); after a decode of two ubatches "
            f"+{min(ub_dec) / MiB:,.1f}..{max(ub_dec) / MiB:,.1f} MiB (the CUDA memory pool, cuBLAS)"]


def budget_lines(doc: dict) -> list[str]:
    out = [f"budget: another process holds the GPU to {doc['free_bytes_held_to'] / MiB:,.1f} MiB free"]
    for r in doc["rows"]:
        c = r["config"]
        flags = f"-c {c.get('n_ctx')} -ub {c.get('n_ubatch')} -ctk {c.get('type_k', 'f16')}" + (
            " -md drafter" if c.get("draft_model") else "")
        out.append(f"  {r['case']}: {flags}, predicted {r['predicted_device_bytes'] / MiB:,.1f} MiB -> {r['status']}"
                   + (f" ({r['message']})" if r["status"] != "ok" else
                      f" (prefill {r['prefill_tps']:,.0f} tok/s, decode {r['decode_tps']:,.1f} tok/s)"))
    return out


def study_lines(doc: dict) -> list[str]:
    out = ["studies (Qwen3.6-35B-A3B shape, Q4_K_M mix):"]
    for s in doc["studies"]:
        text = s.get("stdout", "")
        head = re.search(r"^trials: .*$", text, re.MULTILINE)
        miss = re.search(r"^memory-model misses.*$", text, re.MULTILINE)
        verdict = re.search(r"^(the best config .*|llama\.cpp's defaults were not measured.*)$", text, re.MULTILINE)
        out.append(f"  {s['study']}: " + "; ".join(m.group(0) for m in (head, miss, verdict) if m))
    return out


def main() -> int:
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "results"
    lines: list[str] = []
    if (doc := _load(d, "dry")) is not None:
        lines += memory_lines(doc, "dry run")
    if (doc := _load(d, "load")) is not None:
        lines += memory_lines(doc, "real load") + load_lines(doc)
    if (doc := _load(d, "budget")) is not None:
        lines += budget_lines(doc)
    if (doc := _load(d, "study")) is not None and "studies" in doc:
        lines += study_lines(doc)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
