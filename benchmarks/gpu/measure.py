"""ggfit on a real NVIDIA GPU, in phases (benchmarks/gpu/run.sh runs them on the device machine):

  dry     ggfit's CUDA prediction against llama.cpp's CUDA dry run (no_alloc) on full-size sparse
          shapes, per buffer type, over a grid of n_ctx, n_ubatch, K/V type and flash attention.
  load    the same against a real load of the shape filled with valid random blocks: llama.cpp's
          breakdown of what it allocated, and the device's free memory (cudaMemGetInfo) before and after
          the model, the context and a decode of two full ubatches.
  budget  another process holds the GPU so that exactly --budget-mib is free; the config that
          `ggfit fit --budget auto` recommends must load and decode, one predicted 1 GiB over the budget
          must end as `oom`.
  study   `ggfit optimise --study prefill` and `--study decode` under that budget.

Each phase writes OUT/<phase>.json as it goes (a killed run keeps what it measured).

    python benchmarks/gpu/measure.py --out DIR --phase dry [--shapes qwen36-35b-a3b,llama-8b]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fitter.fit.memory import predict  # noqa: E402
from fitter.llama.cparams import Backend, Frontend, RunConfig  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402
from fitter.llama_builds import LLAMA_CPP_COMMIT  # noqa: E402
from fitter.oracle.check import llama_params  # noqa: E402
from fitter.oracle.llama_run import measure  # noqa: E402
from tests.synth.shapes import SHAPES, build_shape, fill_weights, q4_k_m_types  # noqa: E402

MiB = 2**20
ALL_SHAPES = "qwen36-35b-a3b,qwen35-0.8b,llama-8b,gpt-oss-20b,gemma3-27b"


def grid(n_ctx_train: int) -> list[RunConfig]:
    """n_ctx 4K..262K x (K/V type, n_ubatch) with flash attention on, and off at small contexts."""
    out = []
    for n_ctx in (4096, 32768, 131072, 262144):
        if n_ctx > n_ctx_train:
            continue
        for kv, ub in (("f16", 512), ("f16", 2048), ("q8_0", 256), ("q8_0", 4096)):
            out.append(RunConfig(n_ctx=n_ctx, n_ubatch=ub, n_batch=max(2048, ub), type_k=kv, type_v=kv,
                                 flash_attn="on", no_mmap=True))
        if n_ctx <= 32768:
            out.append(RunConfig(n_ctx=n_ctx, n_ubatch=512, flash_attn="off", no_mmap=True))
    return out


def load_grid(n_ctx_train: int) -> list[RunConfig]:
    """Fewer configs for real loads (each reads the whole model into the GPU)."""
    big = min(n_ctx_train, 131072)
    return [
        RunConfig(n_ctx=4096, n_ubatch=512, flash_attn="off", no_mmap=True),
        RunConfig(n_ctx=32768, n_ubatch=2048, type_k="f16", type_v="f16", flash_attn="on", no_mmap=True),
        RunConfig(n_ctx=big, n_ubatch=4096, n_batch=4096, type_k="q8_0", type_v="q8_0", flash_attn="on", no_mmap=True),
    ]


def split(pred, owner: str = "target") -> dict[str, int]:
    out: dict[str, int] = {}
    for b in pred.buffers:
        if b.owner != owner:
            continue
        key = f"{b.kind}:{'device' if b.counts else 'host'}"
        out[key] = out.get(key, 0) + b.bytes
    return out


def compare(pred, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """ggfit minus llama.cpp, per buffer type and kind (model, context = KV + recurrent state, compute)."""
    diff: dict[str, dict[str, int]] = {}
    for m in measured:
        ours = [b for b in pred.buffers if b.owner == "target" and b.device == m["buffer_type"]]
        diff[m["buffer_type"]] = {
            "model": sum(b.bytes for b in ours if b.kind == "model") - m["model"],
            "context": sum(b.bytes for b in ours if b.kind in ("kv", "rs")) - m["context"],
            "compute": sum(b.bytes for b in ours if b.kind == "compute") - m["compute"],
        }
    return diff


def model_file(shape: str, filled: bool) -> str:
    path = build_shape(shape, tensor_types=q4_k_m_types(shape))
    mark = Path(str(path) + ".filled")
    if filled and not mark.exists():
        t = time.time()
        fill_weights(path)
        mark.write_text(f"{time.time() - t:.1f} s\n")
        print(f"filled {shape}: {path.stat().st_size / 2**30:.2f} GiB in {time.time() - t:.1f} s", flush=True)
    return str(path)


def drop_file(shape: str) -> None:
    path = build_shape(shape, tensor_types=q4_k_m_types(shape))
    Path(str(path) + ".filled").unlink(missing_ok=True)
    path.unlink(missing_ok=True)


class Log:
    def __init__(self, out: Path, phase: str):
        self.path = out / f"{phase}.json"
        self.doc: dict[str, Any] = {"llama_cpp": LLAMA_CPP_COMMIT, "phase": phase, "gpu": gpu_name(), "rows": []}

    def add(self, row: dict[str, Any]) -> None:
        self.doc["rows"].append(row)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=1))


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def nvidia_smi_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# --- dry ------------------------------------------------------------------------------------------------------


def phase_dry(out: Path, shapes: list[str], workers: int) -> None:
    log = Log(out, "dry")
    jobs = []
    for shape in shapes:
        path = model_file(shape, filled=False)
        header, spec = load_model_spec(path)
        for cfg in grid(spec.n_ctx_train):
            jobs.append((shape, path, cfg, predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER)))

    def one(job):
        shape, path, cfg, pred = job
        t = time.time()
        run = measure(path, llama_params(pred.context, cfg), mode="dry", log_level="info", timeout=180)
        return job, run, time.time() - t

    with ThreadPoolExecutor(workers) as pool:
        for (shape, _path, cfg, pred), run, wall in pool.map(one, jobs):
            measured = [r.model_dump() for r in run.breakdown or []]
            diff = compare(pred, measured)
            log.add({"shape": shape, "config": cfg.model_dump(exclude_defaults=True), "status": run.status,
                     "message": run.message, "wall_s": round(wall, 2), "predicted": split(pred),
                     "predicted_rows": [b.model_dump() for b in pred.buffers], "measured": measured,
                     "diff": diff, "build": run.build.commit})
            worst = max((abs(v) for d in diff.values() for v in d.values()), default=None)
            print(f"dry {shape} c={cfg.n_ctx} ub={cfg.n_ubatch} kv={cfg.type_k} fa={cfg.flash_attn}: {run.status} "
                  f"worst |diff| {worst} B {'' if run.ok else run.message}", flush=True)


# --- placement ------------------------------------------------------------------------------------------------


def placement_grid(shape: str, n_layer: int, moe: bool) -> list[RunConfig]:
    """-ngl 0 / half / all, --n-cpu-moe at several values, --cpu-moe, -ot patterns, -nkvo, --no-op-offload."""
    base = dict(n_ctx=32768, n_ubatch=512, flash_attn="on", no_mmap=True)
    half = n_layer // 2
    cfgs: list[dict[str, Any]] = [
        {"n_gpu_layers": 0}, {"n_gpu_layers": half}, {"n_gpu_layers": n_layer}, {},
        {"no_kv_offload": True}, {"n_gpu_layers": half, "no_kv_offload": True},
        {"n_gpu_layers": half, "no_op_offload": True}, {"n_gpu_layers": half, "n_ubatch": 2048, "n_batch": 2048},
        {"override_tensor": (r"attn_.*=CPU",)}, {"override_tensor": ("token_embd=CUDA0",)},
        {"override_tensor": ("output=CPU",)},
    ]
    if moe:
        cfgs += [
            {"n_cpu_moe": 4}, {"n_cpu_moe": half}, {"n_cpu_moe": n_layer - 1}, {"n_cpu_moe": n_layer}, {"cpu_moe": True},
            {"n_cpu_moe": half, "n_ubatch": 2048, "n_batch": 2048}, {"n_cpu_moe": half, "no_op_offload": True},
            {"n_cpu_moe": half, "type_k": "q8_0", "type_v": "q8_0", "n_ctx": 131072},
            {"n_gpu_layers": half, "n_cpu_moe": 4}, {"n_cpu_moe": 4, "no_kv_offload": True},
            {"override_tensor": (r"blk\.(1|3|5)\.ffn_.*_exps=CPU",)}, {"override_tensor": (r"ffn_down_exps=CPU",)},
            {"override_tensor": (r"blk\.[0-9]\.ffn_(up|gate)_exps=CPU",), "n_ubatch": 1024, "n_batch": 2048},
        ]
    else:
        cfgs += [{"n_gpu_layers": 1}, {"n_gpu_layers": n_layer + 1}, {"n_gpu_layers": n_layer - 1},
                 {"override_tensor": (r"blk\.(1|2)\.ffn_.*=CPU",)}]
    return [RunConfig(**{**base, **c}) for c in cfgs]


def split_grid(n_layer: int, moe: bool) -> list[RunConfig]:
    """Two GPUs: -sm layer (by free memory, -ts ratios), -sm none with -mg, partial offload and overrides."""
    base = dict(n_ctx=32768, n_ubatch=512, flash_attn="on", no_mmap=True)
    cfgs: list[dict[str, Any]] = [
        {}, {"tensor_split": (3.0, 1.0)}, {"tensor_split": (1.0, 3.0)}, {"split_mode": "none"},
        {"split_mode": "none", "main_gpu": 1}, {"n_gpu_layers": n_layer // 2}, {"no_kv_offload": True},
        {"tensor_split": (1.0, 1.0), "n_ubatch": 2048, "n_batch": 2048}, {"split_mode": "row"},
    ]
    if moe:
        cfgs += [{"n_cpu_moe": n_layer // 2}, {"n_cpu_moe": 4, "tensor_split": (1.0, 1.0)}]
    return [RunConfig(**{**base, **c}) for c in cfgs]


def phase_placement(out: Path, shapes: list[str], workers: int, n_gpus: int) -> None:
    """llama.cpp's CUDA dry run per device and buffer type with the placement flags; one GPU
    (CUDA_VISIBLE_DEVICES=0), then, with two GPUs, the split modes."""
    log = Log(out, "placement")
    jobs = []
    for shape in shapes:
        path = model_file(shape, filled=False)
        header, spec = load_model_spec(path)
        moe = spec.n_expert > 0
        for cfg in placement_grid(shape, spec.n_layer, moe):
            jobs.append((shape, path, cfg, 1))
        if n_gpus > 1:
            for cfg in split_grid(spec.n_layer, moe):
                jobs.append((shape, path, cfg, 2))

    def one(job):
        shape, path, cfg, n_dev = job
        header, spec = load_model_spec(path)
        pred, err = None, None
        try:
            pred = predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER)
        except Exception as e:  # noqa: BLE001 - the recorded llama.cpp numbers matter, not today's prediction
            err = f"{type(e).__name__}: {e}"
        from fitter.llama.cparams import resolve_context
        cp = pred.context if pred else resolve_context(spec, cfg, Frontend.SERVER)
        env = {"CUDA_VISIBLE_DEVICES": "0"} if n_dev == 1 else None
        t = time.time()
        run = measure(path, llama_params(cp, cfg), mode="dry", log_level="info", timeout=180, env=env)
        return job, pred, err, run, time.time() - t

    with ThreadPoolExecutor(workers) as pool:
        for (shape, _path, cfg, n_dev), pred, err, run, wall in pool.map(one, jobs):
            measured = [r.model_dump() for r in run.breakdown or []]
            diff = compare(pred, measured) if pred else None
            log.add({"shape": shape, "gpus": n_dev, "config": cfg.model_dump(exclude_defaults=True),
                     "status": run.status, "message": run.message, "wall_s": round(wall, 2),
                     "predict_error": err, "measured": measured, "diff": diff, "build": run.build.commit,
                     "log_lines": [ln for ln in run.log.splitlines()
                                   if any(k in ln for k in ("buffer size", "pipeline", "graph", "offloaded", "copies"))][-60:]})
            worst = max((abs(v) for d in (diff or {}).values() for v in d.values()), default=None)
            print(f"placement {shape} gpus={n_dev} {cfg.model_dump(exclude_defaults=True, exclude={'n_ctx', 'n_ubatch', 'flash_attn', 'no_mmap'})}: "
                  f"{run.status} worst |diff| {worst} B {'' if run.ok else run.message} {err or ''}", flush=True)


# --- load -----------------------------------------------------------------------------------------------------


def phase_load(out: Path, shapes: list[str], keep: set[str]) -> None:
    log = Log(out, "load")
    for shape in shapes:
        path = model_file(shape, filled=True)
        header, spec = load_model_spec(path)
        for cfg in load_grid(spec.n_ctx_train):
            pred = predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER)
            used0 = nvidia_smi_used_mib()
            t = time.time()
            run = measure(path, llama_params(pred.context, cfg), mode="load", log_level="info", timeout=300,
                          device_memory=True, decode_tokens=2 * (cfg.n_ubatch or 512))
            measured = [r.model_dump() for r in run.breakdown or []]
            free = {m["stage"]: (m["devices"][0]["free"] if m["devices"] else None) for m in run.device_memory}
            total = next((m["devices"][0]["total"] for m in run.device_memory if m["devices"]), None)
            p = split(pred)
            dev_pred = sum(v for k, v in p.items() if k.endswith(":device"))
            row = {"shape": shape, "config": cfg.model_dump(exclude_defaults=True), "status": run.status,
                   "message": run.message, "wall_s": round(time.time() - t, 2), "timings": run.timings,
                   "predicted": p, "predicted_device_bytes": dev_pred, "measured": measured,
                   "diff": compare(pred, measured), "free_bytes": free, "total_bytes": total,
                   "nvidia_smi_used_mib_before": used0, "build": run.build.commit}
            if free.get("start") is not None and free.get("context") is not None:
                row["allocated_by_load_bytes"] = free["start"] - free["context"]  # model + context buffers
                row["unbuffered_after_load_bytes"] = row["allocated_by_load_bytes"] - dev_pred
            if free.get("start") is not None and free.get("decode") is not None:
                row["allocated_after_decode_bytes"] = free["start"] - free["decode"]
                row["unbuffered_after_decode_bytes"] = row["allocated_after_decode_bytes"] - dev_pred
            if total and free.get("start") is not None and used0 is not None:
                row["cuda_context_bytes"] = total - free["start"] - used0 * MiB  # this process before any buffer
            log.add(row)
            print(f"load {shape} c={cfg.n_ctx} ub={cfg.n_ubatch} kv={cfg.type_k} fa={cfg.flash_attn}: {run.status} "
                  f"pred {dev_pred / MiB:,.1f} MiB, cudaMemGetInfo after load {row.get('allocated_by_load_bytes', 0) / MiB:,.1f}"
                  f" / after decode {row.get('allocated_after_decode_bytes', 0) / MiB:,.1f} MiB, CUDA context "
                  f"{row.get('cuda_context_bytes', 0) / MiB:,.1f} MiB, diff {row['diff']} {run.message or ''}", flush=True)
        if shape not in keep:
            drop_file(shape)


# --- budget: hold the rest of the GPU ---------------------------------------------------------------------------


@contextlib.contextmanager
def held_to(free_bytes: int, out: Path) -> Iterator[int]:
    """Another process holds the GPU's memory so that `free_bytes` is free (to 2 MiB); yields what is free."""
    ready = out / "hold.ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("hold.py")), str(free_bytes), str(ready)])
    try:
        for _ in range(600):
            if ready.exists() and ready.read_text().strip():
                break
            if proc.poll() is not None:
                raise RuntimeError(f"hold.py exited with {proc.returncode}")
            time.sleep(0.2)
        yield int(ready.read_text())
    finally:
        proc.terminate()
        proc.wait(30)


def ggfit(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def over_by(header, spec, target: int) -> tuple[RunConfig, int]:
    """The config whose predicted device total is closest above `target` (n_ctx in 256 steps)."""
    best: tuple[RunConfig, int] | None = None
    for kv in ("f16", "q8_0"):
        for ub in (512, 1024, 2048, 4096):
            lo, hi = 256, spec.n_ctx_train
            base = RunConfig(n_ubatch=ub, n_batch=max(2048, ub), type_k=kv, type_v=kv, flash_attn="on")

            def total(c: int, base: RunConfig = base) -> int:
                return predict(header, spec, base.model_copy(update={"n_ctx": c}), Backend.CUDA,
                               Frontend.SERVER).total_device_bytes

            if total(hi) < target:
                continue
            while hi - lo > 256:  # smallest n_ctx whose total reaches target
                mid = (lo + hi) // 512 * 256
                lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
            t = total(hi)
            if best is None or t < best[1]:
                best = (base.model_copy(update={"n_ctx": hi}), t)
    if best is None:
        raise RuntimeError("no config reaches the target")
    return best


def phase_budget(out: Path, budget_mib: int, only: str = "") -> None:
    from search.probe import run_probe
    from search.workload import Workload

    log = Log(out, "budget")
    path = model_file("qwen36-35b-a3b", filled=True)
    draft = model_file("qwen35-0.8b", filled=True)
    header, spec = load_model_spec(path)
    draft_spec = load_model_spec(draft)
    work = Workload(kind="prose", prompt_tokens=4096, gen_tokens=32, repeats=1, warmup=0)
    with held_to(budget_mib * MiB, out) as free:
        log.doc["free_bytes_held_to"] = free
        print(f"GPU held: {free / MiB:,.1f} MiB free (asked {budget_mib:,} MiB)", flush=True)
        cases: list[tuple[str, RunConfig]] = []
        r = ggfit("fit", path, "--backend", "cuda", "--budget", "auto", "--json", "--model-draft", draft)
        if r.returncode != 0:
            raise RuntimeError(f"ggfit fit failed: {r.stderr.strip() or r.stdout[-2000:]}")
        fit = json.loads(r.stdout)
        log.doc["fit"] = {k: fit[k] for k in ("budget_bytes", "budget_source", "margin_bytes", "recommended", "solutions")}

        def solution(s: dict[str, Any]) -> RunConfig:
            cfg = RunConfig(n_ctx=s["n_ctx"], n_ubatch=s["n_ubatch"], n_batch=s["n_batch"], type_k=s["type_k"],
                            type_v=s["type_v"], flash_attn="on")
            return cfg.model_copy(update={"draft_model": draft, "spec_type": "draft-simple"}) if s["draft"] else cfg

        cases.append(("fits (recommended)", solution(fit["recommended"])))
        for label, kv, ub, with_draft in (("fits (largest -c at f16, -ub 512)", "f16", 512, False),
                                          ("fits with the drafter (largest -c at q8_0, -ub 512)", "q8_0", 512, True)):
            for s in fit["solutions"]:
                if s["type_k"] == kv and s["n_ubatch"] == ub and s["draft"] == with_draft and s["n_ctx"] > 0:
                    cases.append((label, solution(s)))
        over, _ = over_by(header, spec, budget_mib * MiB + 1024 * MiB)
        cases.append(("1 GiB over the budget", over))
        for label, cfg in [c for c in cases if only in c[0]]:
            pred = predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER, draft_spec if cfg.draft_model else None)
            t = time.time()
            res = run_probe(path, cfg, work, timeout=400)
            row = {"case": label, "config": cfg.model_dump(exclude_defaults=True),
                   "predicted_device_bytes": pred.total_device_bytes, "budget_bytes": budget_mib * MiB,
                   "free_bytes": free, "status": res.status, "message": res.message,
                   "summary": res.summary(), "wall_s": round(time.time() - t, 1),
                   "prefill_tps": res.prefill_tps, "decode_tps": res.decode_tps}
            log.add(row)
            print(f"budget: {label}: -c {cfg.n_ctx} -ub {cfg.n_ubatch} -ctk {cfg.type_k} predicted "
                  f"{pred.total_device_bytes / MiB:,.1f} MiB of {budget_mib:,} -> {res.status}: {res.summary()}", flush=True)


def phase_experts(out: Path, budget_mib: int, n_ctx: int = 262144) -> None:
    """Issue 15's held-down case (a 3090-sized GPU): with `budget_mib` free, `ggfit fit -c 262144` on the
    Qwen3.6-35B-A3B shape proposes --n-cpu-moe N; that config must load and decode, one predicted 512 MiB over
    the free memory must end as `oom`, and the process's peak RSS must stay within the predicted host bytes plus the
    Python/llama.cpp baseline (recorded, not asserted here). The llama-fit-params comparison is left to a later run."""
    from search.probe import run_probe
    from search.workload import Workload

    log = Log(out, "experts")
    path = model_file("qwen36-35b-a3b", filled=True)
    header, spec = load_model_spec(path)
    work = Workload(kind="prose", prompt_tokens=4096, gen_tokens=32, repeats=1, warmup=0)
    with held_to(budget_mib * MiB, out) as free:
        log.doc["free_bytes_held_to"] = free
        r = ggfit("fit", path, "--backend", "cuda", "--budget", "auto", "-c", str(n_ctx), "--json")
        fit = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
        log.doc["fit"] = {k: fit.get(k) for k in ("budget_bytes", "margin_bytes", "placement", "host_budget_bytes")}
        p = fit.get("placement")
        if not p:
            raise RuntimeError(f"ggfit fit proposed no placement: {r.stderr.strip() or r.stdout[-2000:]}")
        cfg = RunConfig.from_server_args([a for f in p["flags"][1:] for a in f.split(" ", 1)]).config
        cases = [("placement from ggfit fit", cfg)]
        # 512 MiB over what is free: fewer experts on the CPU, the total just above free + 512 MiB
        for n in range(cfg.n_cpu_moe, -1, -1):
            c = cfg.model_copy(update={"n_cpu_moe": n})
            if predict(header, spec, c, Backend.CUDA, Frontend.SERVER).total_device_bytes >= free + 512 * MiB:
                cases.append((f"512 MiB over (--n-cpu-moe {n})", c))
                break
        for label, c in cases:
            pred = predict(header, spec, c, Backend.CUDA, Frontend.SERVER)
            t = time.time()
            res = run_probe(path, c, work, timeout=240)
            log.add({"case": label, "config": c.model_dump(exclude_defaults=True),
                     "predicted_device_bytes": pred.total_device_bytes, "predicted_host_bytes": pred.host_bytes,
                     "free_bytes": free, "status": res.status, "message": res.message, "summary": res.summary(),
                     "peak_rss_bytes": res.peak_rss_bytes, "wall_s": round(time.time() - t, 1),
                     "prefill_tps": res.prefill_tps, "decode_tps": res.decode_tps})
            print(f"experts: {label}: predicted {pred.total_device_bytes / MiB:,.1f} MiB device, "
                  f"{pred.host_bytes / MiB:,.1f} MiB host -> {res.status}: {res.summary()}", flush=True)


def phase_fitparams(out: Path, budget_mib: int, n_ctx: int = 262144, repeats: int = 1) -> None:
    """ggfit's placement against llama.cpp's own --fit (llama-fit-params of the pinned build, path in
    $LLAMA_FIT_PARAMS; run.sh builds it) on the same held budget: each tool's flags, whether they load, and prefill /
    decode tok/s at 4K and 32K prompts, in the same run (`repeats` measured runs per prompt after one warm-up:
    medians and ranges)."""
    import os
    import shlex

    from search.probe import run_probe
    from search.workload import Workload

    log = Log(out, "fitparams")
    path = model_file("qwen36-35b-a3b", filled=True)
    binary = os.environ.get("LLAMA_FIT_PARAMS", "llama-fit-params")
    with held_to(budget_mib * MiB, out) as free:
        log.doc["free_bytes_held_to"] = free
        r = ggfit("fit", path, "--backend", "cuda", "--budget", "auto", "-c", str(n_ctx), "--json")
        fit = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
        p = fit.get("placement") or {}
        configs: dict[str, RunConfig] = {}
        if p:
            configs["ggfit"] = RunConfig.from_server_args([a for f in p["flags"][1:] for a in f.split(" ", 1)]).config
        f = subprocess.run([binary, "-m", path, "-c", str(n_ctx), "-fa", "on"], capture_output=True, text=True,
                           timeout=600)
        line = (f.stdout.strip().splitlines() or [""])[-1]  # "-c N -ngl N [-ts ...] [-ot "a=CPU,b=CPU"]"
        log.doc["llama_fit_params"] = {"rc": f.returncode, "stdout": line, "stderr_tail": f.stderr[-3000:]}
        if f.returncode == 0 and line:
            args = shlex.split(line)
            # the server defaults ggfit's flags spell out (-np auto: 4 slots, unified KV), for the same runs
            configs["llama.cpp --fit"] = RunConfig.from_server_args(args + ["-fa", "on", "-np", "4", "--kv-unified"]).config
        server = os.environ.get("LLAMA_SERVER")  # run.sh builds it beside llama-fit-params: probe with it
        for label, cfg in configs.items():
            cfg = cfg.model_copy(update={"no_repack": True})  # both: this host's AMX kills repacked CPU experts
            for prompt in (4096, 32768):
                work = Workload(kind="prose", prompt_tokens=prompt, gen_tokens=64, repeats=repeats,
                                warmup=1 if repeats > 1 else 0)
                t = time.time()
                res = (run_probe(path, cfg, work, timeout=400 + 200 * repeats, runner="server", llama_server=server)
                       if server else run_probe(path, cfg, work, timeout=400 + 200 * repeats))
                log.add({"tool": label, "prompt_tokens": prompt, "flags": cfg.to_server_args(), "status": res.status,
                         "message": res.message, "prefill_tps": res.prefill_tps, "decode_tps": res.decode_tps,
                         "prefill_spread": res.prefill_spread and res.prefill_spread.model_dump(),
                         "decode_spread": res.decode_spread and res.decode_spread.model_dump(),
                         "peak_rss_bytes": res.peak_rss_bytes, "wall_s": round(time.time() - t, 1)})
                print(f"fitparams: {label} @ {prompt}: {res.status}: {res.summary()}", flush=True)


def phase_hostrss(out: Path, budget_mib: int, host_budget_mib: int, n_ctx: int = 262144) -> None:
    """Issue 15's host budget, measured with the process's resident memory: with `budget_mib` free on the GPU,
    `ggfit fit -c N --no-mmap --host-budget H` on the Qwen3.6-35B-A3B shape proposes a placement whose predicted host
    bytes are within H; llama-server (the pinned build, $LLAMA_SERVER) runs it with `-lm none` (weights read into
    process memory, not mapped), and its peak RSS (wait4) is recorded beside the prediction and H. Without mmap the
    CPU experts are anonymous memory, so the RSS is what the host budget bounds; with mmap it also counts the page
    cache of the whole file (see the experts phase). A second fit with a host budget below that placement's host
    bytes must refuse it (one line, exit 1) rather than propose one that spills."""
    import os

    from search.probe import run_probe
    from search.workload import Workload

    log = Log(out, "hostrss")
    path = model_file("qwen36-35b-a3b", filled=True)
    header, spec = load_model_spec(path)
    server = os.environ.get("LLAMA_SERVER")
    work = Workload(kind="prose", prompt_tokens=4096, gen_tokens=32, repeats=1, warmup=0)
    with held_to(budget_mib * MiB, out) as free:
        log.doc["free_bytes_held_to"] = free
        log.doc["host_budget_bytes"] = host_budget_mib * MiB
        r = ggfit("fit", path, "--backend", "cuda", "--budget", "auto", "-c", str(n_ctx), "--no-mmap",
                  "--host-budget", f"{host_budget_mib}MiB", "--json")
        fit = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
        log.doc["fit"] = {k: fit.get(k) for k in ("budget_bytes", "margin_bytes", "placement", "host_budget_bytes",
                                                   "host_bytes")}
        p = fit.get("placement")
        if not p:
            raise RuntimeError(f"ggfit fit proposed no placement: {r.stderr.strip() or r.stdout[-2000:]}")
        cfg = RunConfig.from_server_args([a for f in p["flags"][1:] for a in f.split(" ", 1)]).config
        cfg = cfg.model_copy(update={"no_mmap": True, "no_repack": True})
        pred = predict(header, spec, cfg, Backend.CUDA, Frontend.SERVER)
        t = time.time()
        res = (run_probe(path, cfg, work, timeout=400, runner="server", llama_server=server) if server
               else run_probe(path, cfg, work, timeout=400))
        log.add({"case": "placement from ggfit fit --no-mmap --host-budget", "flags": cfg.to_server_args(),
                 "predicted_device_bytes": pred.total_device_bytes, "predicted_host_bytes": pred.host_bytes,
                 "host_budget_bytes": host_budget_mib * MiB, "free_bytes": free, "status": res.status,
                 "message": res.message, "summary": res.summary(), "peak_rss_bytes": res.peak_rss_bytes,
                 "wall_s": round(time.time() - t, 1), "prefill_tps": res.prefill_tps, "decode_tps": res.decode_tps})
        print(f"hostrss: {' '.join(a for f in cfg.to_server_args() for a in f)}: predicted {pred.total_device_bytes / MiB:,.1f} MiB device, "
              f"{pred.host_bytes / MiB:,.1f} MiB host (budget {host_budget_mib:,}) -> {res.status}: {res.summary()}",
              flush=True)
        tight = max(1, pred.host_bytes // MiB - 1024)
        r2 = ggfit("fit", path, "--backend", "cuda", "--budget", "auto", "-c", str(n_ctx), "--no-mmap",
                   "--host-budget", f"{tight}MiB", "--json")
        fit2 = json.loads(r2.stdout) if r2.stdout.strip().startswith("{") else {}
        log.add({"case": f"host budget {tight} MiB (1 GiB below that placement's host bytes)", "rc": r2.returncode,
                 "placement": fit2.get("placement"), "placement_note": fit2.get("placement_note"),
                 "stderr_tail": r2.stderr[-1500:]})
        print(f"hostrss: --host-budget {tight}MiB -> rc {r2.returncode}: {fit2.get('placement_note') or fit2.get('placement')}",
              flush=True)


def phase_study(out: Path, budget_mib: int, trials: int, studies: list[str], study_args: list[str]) -> None:
    """`study_args` replace `--budget auto` (e.g. an overstated --budget with --margin 0, so that trials
    ggfit believes fit run out of the GPU's real memory and must end as failed trials, not a dead study)."""
    log = Log(out, "study")
    path = model_file("qwen36-35b-a3b", filled=True)
    storage = f"sqlite:///{out / 'studies.db'}"
    with held_to(budget_mib * MiB, out) as free:
        log.doc["free_bytes_held_to"] = free
        for name in studies:
            t = time.time()
            if name.endswith(".toml"):
                name = str(Path(__file__).with_name(name))
            r = ggfit("optimise", path, "--study", name, "--backend", "cuda", *(study_args or ["--budget", "auto"]),
                      "--trials", str(trials), "--storage", storage, "--seed", "1")
            log.add({"study": name, "rc": r.returncode, "wall_s": round(time.time() - t, 1),
                     "stdout": r.stdout, "stderr_tail": r.stderr[-4000:]})
            print(f"study {name}: rc {r.returncode} in {time.time() - t:.0f} s\n{r.stdout}\n{r.stderr[-1500:]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", required=True, choices=["dry", "load", "budget", "study", "placement", "experts", "fitparams",
                                                           "hostrss"])
    ap.add_argument("--shapes", default=ALL_SHAPES)
    ap.add_argument("--keep", default="qwen36-35b-a3b,qwen35-0.8b", help="load: filled files kept for later phases")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=1, help="placement: 2 adds the split-mode grid")
    ap.add_argument("--budget-mib", type=int, default=25559)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="fitparams: measured runs per prompt (after a warm-up)")
    ap.add_argument("--host-budget-mib", type=int, default=8192, help="hostrss: the --host-budget given to ggfit fit")
    ap.add_argument("--cases", default="", help="budget: only the cases whose label contains this")
    ap.add_argument("--studies", default="prefill,decode", help="named studies or .toml files beside this script")
    ap.add_argument("--study-args", default="", help="ggfit optimise flags instead of --budget auto")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}")
    if args.phase == "dry":
        phase_dry(out, shapes, args.workers)
    elif args.phase == "experts":
        phase_experts(out, args.budget_mib)
    elif args.phase == "fitparams":
        phase_fitparams(out, args.budget_mib, repeats=args.repeats)
    elif args.phase == "hostrss":
        phase_hostrss(out, args.budget_mib, args.host_budget_mib)
    elif args.phase == "placement":
        phase_placement(out, shapes, args.workers, args.gpus)
    elif args.phase == "load":
        phase_load(out, shapes, set(args.keep.split(",")))
    elif args.phase == "budget":
        phase_budget(out, args.budget_mib, args.cases)
    else:
        phase_study(out, args.budget_mib, args.trials, args.studies.split(","), args.study_args.split())
    return 0


if __name__ == "__main__":
    sys.exit(main())
