"""Compare the recorded CPU dry runs of several releases against the anchor (0.3.36).

    python3 benchmarks/eras/compare.py [--anchor 0.3.36] [--kind compute|output|kv|rs] [--arch qwen3 ...]

Reads benchmarks/results/eras-cpu-*.json (written by record.py) and prints, per architecture and grid
point, the printed MiB of each release next to the anchor's, only where some release differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ver(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def load() -> dict[str, dict]:
    out = {}
    for p in sorted((ROOT / "benchmarks/results").glob("eras-cpu-*.json")):
        d = json.loads(p.read_text())
        out[d["release"]] = d
    return dict(sorted(out.items(), key=lambda kv: _ver(kv[0])))


def value(run: dict, kind: str) -> float | None:
    if not run.get("ok"):
        return None
    if kind == "kv":
        return round(sum(run.get("kv_mib", {}).values()), 2) if run.get("kv_mib") else None
    if kind == "rs":
        return run.get("rs_mib")
    vals = [v for k, v in run["buffers"].items() if k.endswith(" " + kind)]
    return round(sum(vals), 2) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchor", default="0.3.36")
    ap.add_argument("--kind", default="compute", choices=["compute", "output", "kv", "rs"])
    ap.add_argument("--arch", nargs="*")
    a = ap.parse_args()
    data = load()
    rels = list(data)
    print(f"{a.kind} MiB; releases: {', '.join(rels)}; '-' = not loadable / refused / not recorded")
    anchor = data[a.anchor]
    for m in anchor["models"]:
        arch = m["arch"]
        if a.arch and arch not in a.arch:
            continue
        per_rel = {}
        for r in rels:
            mm = next((x for x in data[r]["models"] if x["arch"] == arch and x["overrides"] == m["overrides"]), None)
            per_rel[r] = {run["id"]: run for run in mm.get("runs", [])} if mm else {}
        rows = []
        for run in m.get("runs", []):
            vals = [value(per_rel[r].get(run["id"], {}), a.kind) for r in rels]
            if len({v for v in vals if v is not None}) > 1 or any(v is None for v in vals) and any(v is not None for v in vals):
                rows.append((run["id"], vals))
        if rows:
            print(f"\n{arch} {m['overrides'] or ''}")
            print("  " + " " * 34 + "".join(f"{r:>10}" for r in rels))
            for rid, vals in rows:
                print(f"  {rid:34}" + "".join(f"{('-' if v is None else f'{v:.2f}'):>10}" for v in vals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
