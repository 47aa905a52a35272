"""Compare the recorded CPU dry runs of several releases against the anchor (0.3.36).

    python3 benchmarks/eras/compare.py [--anchor 0.3.36] [--kind compute|output|kv|rs] [--arch qwen3 ...]
    python3 benchmarks/eras/compare.py --pair 0.3.23 0.3.25     # every grid point that differs, all kinds

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


def pair(old: dict, new: dict, tol: float = 0.015) -> int:
    """Every (model, grid point, kind) whose printed MiB differs between two releases (more than the print rounding)."""
    for mo in old["models"]:
        mn = next((m for m in new["models"] if m["arch"] == mo["arch"] and m["overrides"] == mo["overrides"]), None)
        label = f"{mo['arch']} {mo['overrides'] or ''}".strip()
        if mo["status"] != "ok" or mn is None or mn["status"] != "ok":
            print(f"{label:30} status {mo['status']} -> {mn and mn['status']}")
            continue
        runs_new = {r["id"]: r for r in mn["runs"]}
        for ro in mo["runs"]:
            rn = runs_new.get(ro["id"], {})
            for kind in ("compute", "output", "kv", "rs"):
                x, y = value(ro, kind), value(rn, kind)
                if x != y and not (x is not None and y is not None and abs(x - y) < tol):
                    extra = "" if ro.get("ok") and rn.get("ok") else f"  (ok {ro.get('ok')} -> {rn.get('ok')}: {rn.get('error') or ro.get('error')})"
                    print(f"{label:30} {ro['id']:34} {kind:8} {x} -> {y}{extra}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchor", default="0.3.36")
    ap.add_argument("--kind", default="compute", choices=["compute", "output", "kv", "rs"])
    ap.add_argument("--arch", nargs="*")
    ap.add_argument("--pair", nargs=2, metavar=("OLD", "NEW"))
    a = ap.parse_args()
    data = load()
    if a.pair:
        return pair(data[a.pair[0]], data[a.pair[1]])
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
