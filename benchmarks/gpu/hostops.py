"""On the device: ops whose inputs live in host memory (issue 49, items 1, 2 and 5), against llama.cpp's CUDA runs.

  dry   llama.cpp's CUDA dry run (no_alloc) on full-size sparse shapes with -ngl 0 and -ngl 1 (op offload on: the
        scheduler runs a batch's matmuls on the GPU and copies the host weights there), -nkvo with flash attention
        on and off (the K/V in host memory), for both frontends (llama-server's and the library's, whose worst-case
        graph computes logits for the whole ubatch), mmap on (llama.cpp's default).
  load  a few of them loaded for real, with a decode of one full ubatch.
  lora  real loads of small random-weight models with LoRA adapters, every layer / none / one on the GPU.

TRACE=1 (and a build with ggml-alloc's AT_PRINTF on, run.sh's TRACE_ALLOC=1) keeps the debug log of the cases in
TRACED (every allocation of the reserve, GGML_SCHED_DEBUG=2's split assignment) under OUT/traces/.

    python benchmarks/gpu/hostops.py --out DIR [--parts dry,load,lora] [--workers 8]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.measure import Log, compare, model_file  # noqa: E402
from fitter.fit.memory import predict  # noqa: E402
from fitter.llama.cparams import Backend, Frontend, RunConfig, resolve_context  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402
from fitter.oracle.check import llama_params  # noqa: E402
from fitter.oracle.llama_run import measure  # noqa: E402

SHAPES = ("llama-8b", "gemma3-27b", "qwen36-35b-a3b", "gpt-oss-20b", "qwen35-0.8b")
KEYS = ("buffer size", "offloaded", "graph", "copies", "n_ctx", "n_batch", "n_ubatch", "flash_attn")
# (shape, frontend, config) of the runs whose full debug log is kept
TRACED = {
    ("llama-8b", "library", "ngl0 fa=on c=32768 ub=512"), ("llama-8b", "server", "nkvo fa=off c=32768 ub=512"),
    ("llama-8b", "library", "ngl1 fa=on c=65536 ub=2048"), ("gemma3-27b", "library", "ngl0 fa=off c=8192 ub=512"),
    ("llama-8b", "server", "ngl0 fa=on c=32768 ub=512"), ("qwen36-35b-a3b", "library", "ngl0 fa=on c=32768 ub=512"),
}


def configs(n_layer: int, n_ctx_train: int) -> list[tuple[str, RunConfig]]:
    out: list[tuple[str, RunConfig]] = []

    def add(tag: str, fa: str, c: int, ub: int, **kw: Any) -> None:
        c = min(c, n_ctx_train)
        out.append((f"{tag} fa={fa} c={c} ub={ub}",
                    RunConfig(n_ctx=c, n_ubatch=ub, n_batch=max(2048, ub), flash_attn=fa, **kw)))

    for fa in ("on", "off"):
        for c, ub in ((8192, 512), (32768, 512), (32768, 2048)):
            add("ngl0", fa, c, ub, n_gpu_layers=0)
            add("nkvo", fa, c, ub, no_kv_offload=True)
    add("ngl1", "on", 65536, 2048, n_gpu_layers=1)
    add("ngl1", "on", 8192, 512, n_gpu_layers=1)
    add("ngl1", "off", 8192, 512, n_gpu_layers=1)
    add("nkvo-half", "off", 8192, 512, no_kv_offload=True, n_gpu_layers=n_layer // 2)
    add("nkvo-half", "on", 8192, 512, no_kv_offload=True, n_gpu_layers=n_layer // 2)
    add("nkvo-q8", "on", 32768, 512, no_kv_offload=True, type_k="q8_0", type_v="q8_0")
    return out


def lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if any(k in ln for k in KEYS)][-80:]


def run_one(shape: str, path: str, fe: Frontend, tag: str, cfg: RunConfig, mode: str, trace_dir: Path | None,
            decode: int = 0, loras: tuple[tuple[str, float], ...] = ()) -> dict[str, Any]:
    header, spec = load_model_spec(path)
    pred, err = None, None
    try:
        pred = predict(header, spec, cfg, Backend.CUDA, fe)
    except Exception as e:  # noqa: BLE001 - llama.cpp's numbers are what this records
        err = f"{type(e).__name__}: {e}"
    cp = pred.context if pred else resolve_context(spec, cfg, fe)
    traced = trace_dir is not None and (shape, fe.value, tag) in TRACED
    env = {"CUDA_VISIBLE_DEVICES": "0", **({"GGML_SCHED_DEBUG": "2"} if traced else {})}
    t = time.time()
    run = measure(path, llama_params(cp, cfg), mode=mode, log_level="debug" if traced else "info", timeout=300,
                  env=env, decode_tokens=decode, loras=loras)
    wall = time.time() - t
    if traced and trace_dir is not None:
        name = f"{mode}-{shape}-{fe.value}-{tag}".replace(" ", "_").replace("=", "")
        with gzip.open(trace_dir / f"{name}.log.gz", "wt") as f:
            f.write(run.log)
    measured = [r.model_dump() for r in run.breakdown or []]
    diff = compare(pred, measured) if pred else None
    row = {"shape": shape, "frontend": fe.value, "case": tag, "config": cfg.model_dump(exclude_defaults=True),
           "mode": mode, "status": run.status, "message": run.message, "wall_s": round(wall, 2),
           "predict_error": err, "measured": measured, "diff": diff, "build": run.build.commit,
           "context": {"n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "n_seq_max": cp.n_seq_max,
                       "n_outputs_max": cp.n_outputs_max}, "log_lines": lines(run.log)}
    if pred:
        row["predicted_rows"] = [b.model_dump() for b in pred.buffers]
    worst = max((abs(v) for d in (diff or {}).values() for v in d.values()), default=None)
    print(f"{mode} {shape} {fe.value} {tag}: {run.status} worst |diff| {worst} B "
          f"{diff if worst else ''} {'' if run.ok else run.message} {err or ''}", flush=True)
    return row


def part_dry(out: Path, shapes: list[str], workers: int, trace_dir: Path | None) -> None:
    log = Log(out, "hostops-dry")
    jobs = []
    for shape in shapes:
        path = model_file(shape, filled=False)
        _, spec = load_model_spec(path)
        for fe in (Frontend.LIBRARY, Frontend.SERVER):
            for tag, cfg in configs(spec.n_layer, spec.n_ctx_train):
                jobs.append((shape, path, fe, tag, cfg))
    with ThreadPoolExecutor(workers) as pool:
        for row in pool.map(lambda j: run_one(*j, mode="dry", trace_dir=trace_dir), jobs):
            log.add(row)


LOADS = [("llama-8b", "library", "ngl0 fa=on c=32768 ub=512"), ("llama-8b", "server", "nkvo fa=off c=32768 ub=512"),
         ("llama-8b", "library", "ngl1 fa=on c=65536 ub=2048"), ("llama-8b", "server", "nkvo fa=on c=32768 ub=512"),
         ("gemma3-27b", "library", "ngl0 fa=off c=8192 ub=512"), ("qwen35-0.8b", "library", "ngl0 fa=on c=32768 ub=512"),
         ("qwen35-0.8b", "server", "nkvo fa=off c=8192 ub=512")]


def part_load(out: Path, trace_dir: Path | None) -> None:
    log = Log(out, "hostops-load")
    for shape, fe, tag in LOADS:
        path = model_file(shape, filled=False)  # sparse: the kernels do the same work on zeros
        _, spec = load_model_spec(path)
        cfg = dict(configs(spec.n_layer, spec.n_ctx_train))[tag]
        log.add(run_one(shape, path, Frontend(fe), tag, cfg, "load", trace_dir, decode=cfg.n_ubatch or 512))


def part_lora(out: Path, workers: int) -> None:
    """The CPU test's adapters (tests/llama/test_lora.py CASES) on CUDA: every layer, none and one on the GPU."""
    from tests.llama.test_lora import CASES, _base
    from tests.synth.lora import build_lora

    log = Log(out, "hostops-lora")
    jobs = []
    for i, (arch, adapters, cfg, _moves) in enumerate(CASES):
        base = _base(arch)
        loras = tuple((str(build_lora(base, targets, **opts)), scale) for targets, opts, scale in adapters)
        for ngl in (99, 0, 1):
            kw = {**cfg, "n_gpu_layers": ngl}
            jobs.append((f"{arch}-{i}", str(base), Frontend.SERVER, f"lora{i} ngl{ngl}",
                         RunConfig(**kw, lora=loras), loras))
    with ThreadPoolExecutor(workers) as pool:
        for row in pool.map(lambda j: run_one(*j[:5], mode="load", trace_dir=None, decode=8, loras=j[5]), jobs):
            log.add(row)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="dry,load,lora")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_dir = None
    if os.environ.get("TRACE"):
        trace_dir = out / "traces"
        trace_dir.mkdir(exist_ok=True)
    parts = args.parts.split(",")
    if "lora" in parts:
        part_lora(out, 4)
    if "dry" in parts:
        part_dry(out, [s for s in args.shapes.split(",") if s], args.workers, trace_dir)
    if "load" in parts:
        part_load(out, trace_dir)
    print(json.dumps({"done": time.strftime("%T")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
