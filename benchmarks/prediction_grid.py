"""A fixed grid of predictions, to prove that a restructure or a speed change moves no byte.

    python benchmarks/prediction_grid.py --write before.json.gz   # on the old tree
    python benchmarks/prediction_grid.py --compare before.json.gz  # on the new tree: exit 1 on any difference

The grid: every synthetic architecture of tests/synth (15), the bundled Gemma 3 270M and two full-size
shapes (Qwen3.6-35B-A3B, gpt-oss 20B; sparse header-only files), each on the CPU, CUDA and Metal backends,
over a fixed, seeded spread of n_ctx, n_ubatch, n_batch, K/V types, flash attention, -np, --kv-unified,
--swa-full and the front end; MTP heads and an external draft where the model has one. For each config it
records every buffer row (owner, device, kind, bytes, counts) and the resolved context, or llama.cpp's
refusal (ConfigError) verbatim. It also records the solver's table (`fit` without -c) per model and
backend, and the `quants` table for three models. The committed baseline is
benchmarks/results/prediction-grid.json.gz, replayed by tests/test_prediction_grid.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the only place that names ggfit's modules: a restructure edits these imports, nothing else
from fitter.fit.memory import predict  # noqa: E402
from fitter.fit.quant_fit import evaluate  # noqa: E402
from fitter.fit.solver import solve  # noqa: E402
from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402

BASELINE = ROOT / "benchmarks" / "results" / "prediction-grid.json.gz"
SYNTH = ("llama", "qwen2", "qwen3", "phi3", "mistral3", "gemma2", "gemma3", "gemma4", "qwen3moe", "qwen35",
         "qwen35moe", "qwen3next", "gpt-oss", "deepseek2", "glm4moe")
MTP = {"qwen35": {"n_nextn": 1}, "qwen35moe": {"n_nextn": 1}, "glm4moe": {"n_nextn": 1},
       "deepseek2": {"n_nextn": 1}}
SHAPES = ("qwen36-35b-a3b", "gpt-oss-20b")
CONFIGS_PER_MODEL = 12  # per backend
GIB = 1 << 30


def models() -> list[tuple[str, str, str | None]]:
    """(label, path, draft path or None)."""
    from fitter.bundled import resolve_model
    from tests.synth import build
    from tests.synth.shapes import build_shape

    out: list[tuple[str, str, str | None]] = []
    for arch in SYNTH:
        out.append((arch, str(build(arch)), None))
        if arch in MTP:
            out.append((arch + "+mtp", str(build(arch, **MTP[arch])), None))
    out.append(("qwen3+draft", str(build("qwen3")), str(build("qwen3", n_layer=2))))
    out.append(("gemma3-270m", resolve_model("gemma3-270m"), None))
    for shape in SHAPES:
        out.append((shape, str(build_shape(shape)), None))
    return out


def configs(rng: random.Random, mtp: bool, draft: bool) -> list[dict[str, Any]]:
    """A seeded spread of llama-server flags (as RunConfig fields)."""
    out = []
    for _ in range(CONFIGS_PER_MODEL):
        kv = rng.choice((("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f32", "f32"),
                         ("bf16", "bf16")))
        cfg: dict[str, Any] = {
            "n_ctx": rng.choice((256, 512, 1000, 4096, 8192, 32768, 131072)),
            "n_ubatch": rng.choice((None, 1, 64, 256, 512, 1024, 2048, 4096)),
            "n_batch": rng.choice((None, None, 512, 2048, 4096)),
            "type_k": kv[0], "type_v": kv[1],
            "flash_attn": rng.choice(("auto", "on", "off")),
            "n_parallel": rng.choice((None, 1, 2, 4)),
            "kv_unified": rng.choice((None, True, False)),
            "swa_full": rng.choice((None, True, False)),
        }
        if mtp and rng.random() < 0.5:
            cfg.update(spec_type="draft-mtp", draft_type_k=rng.choice(("f16", "q8_0")), draft_n_max=3)
        if draft and rng.random() < 0.7:
            cfg.update(spec_type="draft-simple", draft_type_k="q8_0", draft_type_v="q8_0")
        out.append(cfg)
    return out


def _pred(header, spec, cfg: dict[str, Any], be: Backend, fe: Frontend, draft) -> dict[str, Any]:
    try:
        rc = RunConfig(**cfg)
        p = predict(header, spec, rc, be, fe, draft if rc.spec_type == "draft-simple" else None)
    except ConfigError as e:
        return {"refused": str(e)}
    # the build is the pinned one throughout (the grid predates it as a field), and v_trans too where it is None (it
    # follows flash_attn; set only where -fa auto went off beside RPC devices)
    return {"context": _context(p.context), "draft_context": _context(p.draft_context) if p.draft_context else None,
            "buffers": [[b.owner, b.device, b.kind, b.bytes, b.counts] for b in p.buffers]}


def _context(cp) -> dict[str, Any]:
    return cp.model_dump(mode="json", exclude={"build"} | ({"v_trans"} if cp.v_trans is None else set()))


def grid(log=print) -> dict[str, Any]:
    rng = random.Random(20261130)
    rows: list[dict[str, Any]] = []
    tables: list[dict[str, Any]] = []
    for label, path, draft_path in models():
        header, spec = load_model_spec(path)
        draft = load_model_spec(draft_path) if draft_path else None
        t0 = time.perf_counter()
        for be in (Backend.CPU, Backend.CUDA, Backend.METAL):  # the grid predates RPC (it needs --rpc endpoints)
            for cfg in configs(rng, mtp=label.endswith("+mtp"), draft=draft is not None):
                fe = Frontend.LIBRARY if rng.random() < 0.25 else Frontend.SERVER
                rows.append({"model": label, "backend": be.value, "frontend": fe.value, "config": cfg,
                             **_pred(header, spec, cfg, be, fe, draft)})
            base = RunConfig(spec_type="draft-simple" if draft else "none", draft_model=draft_path)
            budget = 4 * GIB if spec.file_size < 4 * GIB else 24 * GIB
            sols = solve(header, spec, base, be, Frontend.SERVER, budget, GIB, draft=draft)
            tables.append({"model": label, "backend": be.value, "budget": budget,
                           "solutions": [s.model_dump(mode="json") for s in sols]})
        log(f"{label:<18} {time.perf_counter() - t0:6.2f} s")
    quants = []
    for label in ("qwen3", "gemma3-270m", "qwen36-35b-a3b"):
        path = next(p for lab, p, _ in models() if lab == label)
        header, spec = load_model_spec(path)
        cands = evaluate(header, spec, RunConfig(n_ctx=8192), Backend.METAL, Frontend.SERVER, 24 * GIB, GIB)
        quants.append({"model": label, "candidates": [c.model_dump(mode="json") for c in cands]})
    return {"rows": rows, "tables": tables, "quants": quants}


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    diffs = []
    for part in ("rows", "tables", "quants"):
        a, b = before[part], after[part]
        if len(a) != len(b):
            diffs.append(f"{part}: {len(a)} entries before, {len(b)} after")
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                diffs.append(f"{part}[{i}] {x.get('model')} {x.get('backend', '')} {x.get('config', '')}: "
                             f"{json.dumps(x, sort_keys=True)[:300]} != {json.dumps(y, sort_keys=True)[:300]}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="record the grid here (.json.gz)")
    ap.add_argument("--compare", type=Path, nargs="?", const=BASELINE, help="compare with a recorded grid")
    args = ap.parse_args()
    t0 = time.perf_counter()
    g = grid()
    n_rows, n_refused = len(g["rows"]), sum("refused" in r for r in g["rows"])
    print(f"{n_rows} configs ({n_refused} refused as llama.cpp would), {len(g['tables'])} solver tables, "
          f"{len(g['quants'])} quants tables in {time.perf_counter() - t0:.1f} s")
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.write, "wt") as f:
            json.dump(g, f, sort_keys=True)
        print(f"written: {args.write}")
    if args.compare:
        with gzip.open(args.compare, "rt") as f:
            before = json.load(f)
        diffs = compare(before, json.loads(json.dumps(g, sort_keys=True)))
        for d in diffs[:20]:
            print(d)
        print(f"{len(diffs)} differences against {args.compare}")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
