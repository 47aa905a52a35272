"""Record llama.cpp's CPU dry run of one llama-cpp-python release over a grid of synthetic models.

    python3 benchmarks/eras/record.py 0.3.23 [--site /work/eras/site/0.3.23] [--arch qwen3 ...]

The release's llama_cpp is imported in a child (benchmarks/eras/child.py) with PYTHONPATH = --site
(default /work/eras/site/<release>; `--site installed` uses the installed llama-cpp-python). Every
synthetic architecture of tests/synth is tried; one the release does not know (model load fails) is
recorded with status "unknown_arch". Writes benchmarks/results/eras-cpu-<release>.json: per model its
model buffers, and per grid point the params, the params the release lacked, and every context buffer
line (KV / RS / output / compute, as printed, in MiB) plus the KV and RS `size = ...` lines.
See benchmarks/eras/README.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fitter.oracle.llama_log import parse_log  # noqa: E402
from tests.synth import REGISTRY, build  # noqa: E402

# llama-cpp-python release -> vendored llama.cpp (vendor/llama.cpp submodule at the release tag), see ERAS.md
RELEASES = {
    "0.3.15": {"commit": "9a96389544a08fd829fccda28142ce2066017fde", "date": "2025-08-07", "build": 6110},
    "0.3.16": {"commit": "4227c9be4268ac844921b90f31595f81236bd317", "date": "2025-08-14", "build": None},
    "0.3.17": {"commit": "49bfddeca18e62fa3d39114a23e9fcbdf8a22388", "date": "2026-03-22", "build": None},
    "0.3.20": {"commit": "f49e9178767d557a522618b16ce8694f9ddac628", "date": "2026-04-02", "build": None},
    "0.3.23": {"commit": "7d442abf5c6244117fd5a1dc51a5d19f00792491", "date": "2026-05-11", "build": 9102},
    "0.3.25": {"commit": "210a6570ceda20c5d6439172c09ada08c3754cc9", "date": "2026-06-01", "build": None},
    "0.3.29": {"commit": "f05cf4676af46c2f017c0e6ba25b6e20204f700e", "date": "2026-06-13", "build": 9625},
    "0.3.34": {"commit": "e3546c7948e3af463d0b401e6421d5a4c2faf565", "date": "2026-07-11", "build": 9976},
    "0.3.35": {"commit": "4df29be4f4c3673f428170fda944a5b19f743bb8", "date": "2026-08-17", "build": 10454},
    "0.3.36": {"commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f", "date": "2026-10-01", "build": 11312},
}

GGML_TYPE = {"f16": 1, "q8_0": 8}  # enum ggml_type, stable across these releases
KV_FA = [("f16", "off"), ("f16", "on"), ("q8_0", "on")]  # quantized V needs flash attention
FRONTENDS = {
    # llama-server -np auto: 4 slots, unified KV, swa_full false; outputs capped at n_parallel (since n_outputs_max)
    "server": {"n_batch": 2048, "n_seq_max": 4, "kv_unified": True, "swa_full": False,
               "n_outputs_max": 4, "n_outputs_max_per_seq": 1},
    # llama_context_default_params with one sequence (swa_full true, kv_unified false, n_outputs_max 0 = n_batch)
    "library": {"n_batch": 2048, "n_seq_max": 1, "kv_unified": False, "swa_full": True},
}
# --frontend split (not in the default grid): llama-server -np 4 --no-kv-unified, one KV stream per slot (before #14959
# a build forced such a cache unified)
SPLIT = {"split": {"n_batch": 2048, "n_seq_max": 4, "kv_unified": False, "swa_full": False,
                   "n_outputs_max": 4, "n_outputs_max_per_seq": 1}}
N_CTX = [4096, 32768]
# the synthetic vocabularies are tiny (512 tokens), which hides the logits reservation: one model with a real-sized one
EXTRA_MODELS = [("qwen3", {"n_vocab": 32768})]
N_UBATCH = [512, 2048]


def grid(frontends: dict | None = None) -> list[dict]:
    frontends = frontends or FRONTENDS
    out = []
    for fe, n_ctx, n_ub, (kv, fa) in itertools.product(frontends, N_CTX, N_UBATCH, KV_FA):
        fields = {"n_ctx": n_ctx, "n_ubatch": n_ub, "type_k": GGML_TYPE[kv], "type_v": GGML_TYPE[kv],
                  "flash_attn": fa, "n_threads": 1, "n_threads_batch": 1, **frontends[fe]}
        out.append({"id": f"{fe}-c{n_ctx}-ub{n_ub}-{kv}-fa{fa}", "fields": fields})
    return out


def _buffers(rep, kinds) -> list[dict]:
    return [{"func": b.func, "buffer": b.buffer, "label": b.label, "mib": b.mib, **({"dummy": True} if b.dummy else {})}
            for b in rep.buffers if b.kind in kinds]


def _buffer_map(rep) -> dict:
    """{"<buffer> <label>": MiB} of the context's buffer lines, as printed; a repeated key sums (iSWA: two KV lines)."""
    out: dict[str, float] = {}
    for b in rep.buffers:
        if b.kind not in ("kv", "rs", "output", "compute") or b.dummy or (b.kind in ("kv", "rs") and b.mib == 0):
            continue
        key = f"{b.buffer} {b.label}"
        out[key] = round(out.get(key, 0.0) + b.mib, 2)
    return out


N_GPU_LAYERS = 0  # --gpu: -1, every layer on the GPU


def _run_child(env, model_path: str, contexts: list[dict], timeout: int = 600) -> list[dict]:
    req = {"model_path": model_path, "n_gpu_layers": N_GPU_LAYERS,
           "contexts": [{"id": c["id"], "fields": c["fields"]} for c in contexts]}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/eras/child.py"), json.dumps(req)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    events = []
    for line in p.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    if not any(e.get("event") == "done" for e in events):
        events.append({"event": "died", "rc": p.returncode, "stderr_tail": p.stderr[-600:]})
    return events


def record_model(env, arch: str, overrides: dict, points: list[dict]) -> dict:
    path = build(arch, **overrides)
    entry = {"arch": arch, "overrides": overrides, "file": path.name}
    events = _run_child(env, str(path), points)
    model_ev = next((e for e in events if e.get("event") == "model"), None)
    if model_ev is None:
        entry.update(status="child_died", detail=events[-1])
        return entry
    if not model_ev["ok"]:
        rep_log = model_ev["log"]
        unknown = "unknown model architecture" in rep_log
        entry.update(status="unknown_arch" if unknown else "load_failed",
                     error=next((ln.strip() for ln in rep_log.splitlines() if "error" in ln.lower()), None))
        return entry
    mrep = parse_log(model_ev["log"])
    entry.update(status="ok", load_applied=model_ev["applied"], model_buffers=_buffers(mrep, {"model"}))
    by_id = {e["id"]: e for e in events if e.get("event") == "context"}
    missing = [c for c in points if c["id"] not in by_id]
    for c in missing:  # the child died on one context: run the rest one per child to isolate the crash
        evs = _run_child(env, str(path), [c])
        hit = next((e for e in evs if e.get("event") == "context"), None)
        by_id[c["id"]] = hit or {"ok": False, "skipped": [], "log": "", "died": evs[-1]}
    runs = []
    for c in points:
        ev = by_id[c["id"]]
        rep = parse_log(ev["log"])
        run = {"id": c["id"], "ok": ev["ok"]}
        if ev["skipped"]:
            run["params_missing"] = ev["skipped"]
        if "died" in ev:
            run["died"] = ev["died"]
        if rep.abort:
            run["abort"] = rep.abort
        if rep.context is not None and rep.context.flash_attn_resolved is not None:
            run["fa"] = rep.context.flash_attn_resolved
        if rep.context is not None and rep.context.n_outputs_max is not None:
            run["n_outputs_max"] = rep.context.n_outputs_max
        run["buffers"] = _buffer_map(rep)
        if rep.kv_caches:  # the authoritative `size = ...` line per cache (no_alloc prints a 0 MiB KV buffer)
            run["kv_mib"] = {(k.role or "kv") + f" {k.cells}": round(k.k_mib + k.v_mib, 2) for k in rep.kv_caches}
        if rep.recurrent:
            run["rs_mib"] = round(sum(r.r_mib + r.s_mib for r in rep.recurrent), 2)
        if not ev["ok"]:
            lines = [ln.strip() for ln in ev["log"].splitlines() if ln.strip()]
            run["error"] = next((ln for ln in lines if "llama_init_from_model" in ln or "failed" in ln), lines[-1] if lines else None)
        runs.append(run)
    entry["runs"] = runs
    return compact(entry)


def compact(entry: dict) -> dict:
    """Keep the recording small: the params a release lacks go to the model once per front end
    (`params_missing: {"server": [...]}`) when all its runs agree; `fa` only where it differs from the
    requested -fa (never, on CPU, so far)."""
    runs = entry.get("runs", [])
    by_fe: dict[str, set] = {}
    for r in runs:
        by_fe.setdefault(r["id"].split("-")[0], set()).add(tuple(r.get("params_missing", [])))
    moved = {fe: list(next(iter(v))) for fe, v in by_fe.items() if len(v) == 1}
    for r in runs:
        if r["id"].split("-")[0] in moved:
            r.pop("params_missing", None)
    moved = {fe: v for fe, v in moved.items() if v}
    if moved:
        entry["params_missing"] = {**entry.get("params_missing", {}), **moved}
    for r in runs:
        if "fa" in r and r["fa"] == r["id"].endswith("-faon"):
            del r["fa"]
    return entry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("release")
    ap.add_argument("--site", default=None)
    ap.add_argument("--arch", nargs="*", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu", action="store_true", help="every layer on the GPU (a CUDA build): eras-cuda-<release>.json")
    ap.add_argument("--frontend", choices=["split"], default=None,
                    help="record only this front end instead of server + library (split: -np 4 --no-kv-unified)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for llama.cpp (LLAMA_SET_ROWS=0: the KV update of builds before #14959); "
                         "recorded in the output as `env`")
    a = ap.parse_args()
    global N_GPU_LAYERS
    N_GPU_LAYERS = -1 if a.gpu else 0
    site = a.site or f"/work/eras/site/{a.release}"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if site != "installed":
        env["PYTHONPATH"] = site
    env["OMP_NUM_THREADS"] = "1"
    llama_env = dict(e.split("=", 1) for e in a.env)
    env.update(llama_env)
    archs = a.arch or sorted(REGISTRY)
    frontends = {a.frontend: SPLIT[a.frontend]} if a.frontend else FRONTENDS
    points = grid(frontends)
    meta = RELEASES.get(a.release, {})
    ver = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__, llama_cpp.__file__)"],
                         env=env, capture_output=True, text=True).stdout.split()
    if not ver or ver[0] != a.release:
        sys.exit(f"record: {site} holds llama-cpp-python {ver or 'nothing'}, not {a.release}")
    out = {"release": a.release, "llama_cpp_commit": meta.get("commit"), "llama_cpp_date": meta.get("date"),
           "llama_cpp_build": meta.get("build"), "backend": "CUDA" if a.gpu else "CPU", "dry_run": None,
           "grid": {"id": "<frontend>-c<n_ctx>-ub<n_ubatch>-<type_k = type_v>-fa<flash_attn>", "frontends": frontends, "n_ctx": N_CTX, "n_ubatch": N_UBATCH,
                    "kv_fa": [{"type_kv": k, "flash_attn": f} for k, f in KV_FA]}, "models": []}
    if llama_env:
        out["env"] = llama_env
    models = [(arch, {}) for arch in archs] + [m for m in EXTRA_MODELS if not a.arch or m[0] in a.arch]
    for arch, overrides in models:
        entry = record_model(env, arch, overrides, points)
        print(f"{a.release} {arch} {overrides or ''}: {entry['status']}", flush=True)
        out["models"].append(entry)
        if entry["status"] == "ok" and out["dry_run"] is None:
            out["dry_run"] = bool(entry["load_applied"].get("no_alloc", False))
    dest = Path(a.out or ROOT / f"benchmarks/results/eras-{'cuda' if a.gpu else 'cpu'}-{a.release}.json")
    dest.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {dest} ({dest.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
