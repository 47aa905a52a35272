"""The speed model against measured llama-bench rates: fit its coefficients, print its errors.

    python benchmarks/speed_model.py            # errors of fitter/speed/factors.py on the truth set
    python benchmarks/speed_model.py --fit      # fit on the training rows, write fitter/speed/factors.py, print errors

The truth set: our llama-bench runs on one H200 (benchmarks/results/speed-h200.json: llama.cpp 0c1e570, CUDA,
dense, MoE, hybrid, SWA, MLA shapes, quants, -ngl partial, --n-cpu-moe, the host CPU alone) and published
llama-bench tables (benchmarks/results/speed-published.json: Apple M1-M5 and NVIDIA cards, each row cited). One row
in three is held out of the fit, by a hash of its hardware, model, quant and test, so that the same rows stay out
every time; the errors are printed for the training and the held-out rows, by family. Error = predicted /
measured - 1. Prefill rows of the synthetic MoE shapes under --n-cpu-moe, and published tables whose rate rises with
N, are printed apart and kept out of the fit (see `SYNTHETIC_ROUTING` and `rising_tables`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fitter.ggml.backends.base import Backend  # noqa: E402
from fitter.llama.cparams import RunConfig  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402
from fitter.speed import factors as factors_mod  # noqa: E402
from fitter.speed.hardware import HardwareProfile, get_profile  # noqa: E402
from fitter.speed.model import decode_terms, prefill_terms, seconds  # noqa: E402
from fitter.speed.work import work_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
H200_HOST_GBS = 90.0  # the device's host memory (DEVELOPERS.md: ~90 GB/s), its 16 cores
H200_THREADS = 16
# The random router of a synthetic MoE shape sends llama-bench's prompt tokens to a few experts, so that
# ggml_backend_sched_compute_splits copies only those of the CPU-held experts to the GPU (it copies the used
# experts alone): pp under --n-cpu-moe then runs 2-5x above what even routing (a real model) streams. Measured with
# llama.cpp's own router on the filled shapes (benchmarks/synthetic_routing.py): a 512-token ubatch uses 4-5 of 64
# experts a layer (deepseek2), 16-81 of 128 (qwen3moe), a median of 54-129 of 256 (qwen35moe), not ~all. Feeding
# those counts to the copy term does not explain the rows either (errors from -41% to +110%; qwen3moe's pp512
# measures 2.3x faster at depth 4096 than at depth 0): printed apart, out of the fit. gpt-oss 20B's filled router
# concentrates less (a median of 21 of 32); its rows stay in.
SYNTHETIC_ROUTING = ("qwen36-35b-a3b", "qwen3-30b-a3b", "deepseek2-30b-a3b")


# Each coefficient's prior: 1 / the efficiency a kernel reaches (bandwidth ~75%, matrix units ~40%), seconds for
# the fixed costs, 1 / GFLOP/s per CPU thread; the fit moves off them only as far as the rows ask (RIDGE)
PRIORS: dict[str, dict[str, float]] = {
    "decode": {"bw": 1.3, "kv": 1.3, "host": 1.5, "cpu": 0.05, "layer": 2e-5, "token": 3e-4, "split": 5e-5},
    "prefill": {"c": 2.5, "attn": 2.5, "attn.cpu": 0.1, "kq": 4.0, "read": 1.3, "act": 4.0, "copy": 8.0, "rec": 1.3, "cpu": 0.05, "layer": 5e-5, "ubatch": 1e-3,
                "split": 1e-4},
}
RIDGE = 0.05  # weight of a prior, against a measured row's 1
RIDGE_ZERO = 0.005
# few rows stream CPU weights: the copy's rate (pageable host memory to the GPU, ~8 GB/s on the H200 host: the
# -ngl 8..30 rows) is held near its prior
STRONG = {"copy": 3.0}  # terms without a prior (dequantization): kept near 0 unless the rows need them


# terms a backend's rows cannot pin down: Apple's prefill tracks its GPU cores, and a per-token cost per layer fitted
# on its 86 prefill rows (one model size each, mostly) trades off against them (held-out worst 155%)
LEFT_OUT: dict[str, set[str]] = {"metal": {"act"}}


@dataclass
class Case:
    hardware: str
    backend: Backend
    shape: str
    ftype: str
    kind: str  # decode | prefill
    n_prompt: int
    n_gen: int
    depth: int
    n_ubatch: int
    ngl: int
    n_cpu_moe: int
    threads: int
    flash_attn: bool
    tps: float
    family: str  # apple | nvidia | h200 | h200-partial | cpu
    source: str
    rises: bool = False  # its published table's rate rises with N (see `rising_tables`)

    @property
    def key(self) -> str:
        return f"{self.hardware}|{self.shape}|{self.ftype}|{self.kind}|{self.n_prompt}|{self.n_gen}|{self.depth}|" \
               f"{self.n_ubatch}|{self.ngl}|{self.n_cpu_moe}"

    @property
    def held_out(self) -> bool:
        if self.family in CPU_HERE or self.family in HELD_OUT_GPUS:
            return True  # held out whole: this machine's CPU rows (the CPU terms were fitted on the H200 host's),
            # and a GPU the fit never sees
        return int(hashlib.sha256(self.key.encode()).hexdigest(), 16) % 3 == 0

    @property
    def fit_excluded(self) -> bool:
        return self.rises or (self.kind == "prefill" and self.n_cpu_moe > 0 and self.shape in SYNTHETIC_ROUTING)


# GPUs of our own llama-bench runs that the fit never sees: family -> (results file, hardware profile), held out
# whole (benchmarks/gpu/speed.sh h100 on the device: an H100 SXM, no row of which is in the truth set otherwise)
HELD_OUT_GPUS = {"h100-sxm": ("speed-h100.json", "nvidia-h100-sxm")}


def _gpu_run_cases() -> list[Case]:
    """Our llama-bench runs on the device: the H200's, and each held-out GPU's where recorded."""
    return _device_cases("speed-h200.json", "nvidia-h200", "h200") + [
        c for fam, (name, hw) in HELD_OUT_GPUS.items() if (RESULTS / name).exists()
        for c in _device_cases(name, hw, fam)]


def _device_cases(name: str, hardware: str, family: str) -> list[Case]:
    d = json.load(open(RESULTS / name))
    out = []
    for r in d["rows"]:
        cpu = "-dev" in r["flags"]
        ngl = int(r["n_gpu_layers"])
        partial = bool(r["n_cpu_moe"]) or 0 <= ngl < 99
        out.append(Case(
            hardware="cpu" if cpu else hardware, backend=Backend.CPU if cpu else Backend.CUDA, shape=r["shape"],
            ftype=r["ftype"], kind="decode" if r["n_gen"] else "prefill", n_prompt=r["n_prompt"], n_gen=r["n_gen"],
            depth=r["n_depth"], n_ubatch=r["n_ubatch"], ngl=-1 if ngl >= 99 or cpu else ngl,
            n_cpu_moe=r["n_cpu_moe"], threads=r["n_threads"], flash_attn=True, tps=r["avg_ts"],
            family="cpu" if cpu else (f"{family}-partial" if partial else family),
            source=f"benchmarks/results/{name} ({r['group'] if 'group' in r else 'dense/moe'})"))
    return out


def _published_cases() -> list[Case]:
    d = json.load(open(RESULTS / "speed-published.json"))
    out = []
    for r in d["rows"]:
        hw = r["hardware"]
        out.append(Case(
            hardware=hw, backend=Backend.METAL if hw.startswith("apple") else Backend.CUDA, shape=r["model"],
            ftype=r["ftype"], kind="decode" if r["n_gen"] else "prefill", n_prompt=r["n_prompt"], n_gen=r["n_gen"],
            depth=r["depth"], n_ubatch=r.get("n_ubatch") or 512, ngl=-1, n_cpu_moe=0, threads=8,
            flash_attn=bool(r.get("flash_attn")), tps=r["tps"],
            family="apple" if hw.startswith("apple") else "nvidia", source=r["source"]))
    return out


# this machine's CPU rows, by the profile (and family) they go under: held out whole. The machine changed under the
# name: speed-cpu-here.json was taken on an Intel Xeon (2026-12-04, no CPU rate measured), speed-cpu-here-epyc.json on
# the AMD EPYC (Zen 4) that replaced it, with its CPU rate (fitter.speed.cpu_rate) measured in the same run
CPU_HERE = {"cpu-here": "speed-cpu-here.json", "cpu-epyc": "speed-cpu-here-epyc.json"}


def _cpu_here_cases() -> list[Case]:
    """`ggfit probe` on this machine's CPU (benchmarks/cpu_speed.py): pp512 from depth 0, tg128 after it."""
    out = []
    for hw, name in CPU_HERE.items():
        path = RESULTS / name
        if not path.exists():
            continue
        for r in json.load(open(path))["rows"]:
            if r.get("status") != "ok":
                continue
            for kind, n_prompt, n_gen, depth, tps in (("prefill", 512, 0, 0, r["prefill_tps"]),
                                                      ("decode", 0, 128, r["depth_decode"], r["decode_tps"])):
                out.append(Case(hardware=hw, backend=Backend.CPU, shape=r["shape"], ftype=r["ftype"], kind=kind,
                                n_prompt=n_prompt, n_gen=n_gen, depth=depth, n_ubatch=512, ngl=-1, n_cpu_moe=0,
                                threads=r["threads"], flash_attn=True, tps=tps, family=hw,
                                source=f"benchmarks/results/{name}"))
    return out


# A published table whose rate rises with N: ppN and tgN from an empty context read a KV cache that grows with N, so
# on one machine, model and quant the rate falls (or holds) as N grows; a rise of more than RISE between two tests
# is something other than the kernels (the note of speed-published.json: the 8 GB M1's tg4096 above its tg512 and
# pp4096 above its pp1024, with 8192 out of memory; the L40S F16's pp512 .. pp8192 rising 47%, with large spreads).
# Such a table's rows of that kind are printed apart and kept out of the fit.
RISE = 1.05


def rising_tables(rows: list[Case]) -> set[tuple[str, str, str, str, str]]:
    """(hardware, model, quant, source, kind) of every published table whose rate rises with N beyond RISE."""
    tables: dict[tuple[str, str, str, str, str], list[tuple[int, float]]] = {}
    for c in rows:
        if c.depth == 0 and c.family in ("apple", "nvidia"):
            n = c.n_gen if c.kind == "decode" else c.n_prompt
            tables.setdefault((c.hardware, c.shape, c.ftype, c.source, c.kind), []).append((n, c.tps))
    out = set()
    for key, pts in tables.items():
        pts.sort()
        if any(b > a * RISE for (_, a), (_, b) in zip(pts, pts[1:])):
            out.add(key)
    return out


def cases() -> list[Case]:
    every = _gpu_run_cases() + _published_cases() + _cpu_here_cases()
    rising = rising_tables(every)
    for c in every:
        c.rises = (c.hardware, c.shape, c.ftype, c.source, c.kind) in rising
    return every


@lru_cache(maxsize=None)
def _model(shape: str, ftype: str) -> tuple[Any, Any]:
    from tests.synth.shapes import SHAPES, build_shape, quant_types

    if shape not in SHAPES:  # a bundled model (Gemma 3 270M)
        from fitter.bundled import resolve_model

        return load_model_spec(resolve_model(shape))
    return load_model_spec(str(build_shape(shape, tensor_types=quant_types(shape, ftype))))


@lru_cache(maxsize=None)
def _profile(name: str) -> HardwareProfile:
    if name in CPU_HERE:
        d = json.load(open(RESULTS / CPU_HERE[name]))
        rate = d.get("cpu_rate") or {}
        return get_profile("cpu").model_copy(update={
            "host_bandwidth_gbs": d["host_bandwidth_gbs"], "host_bandwidth_source": d["host_bandwidth_source"],
            "cpu_prefill_gflops": rate.get("prefill_gflops", {}), "cpu_decode_gflops": rate.get("decode_gflops", {}),
            "cpu_rate_source": rate.get("source", "")})
    p = get_profile(name)
    if name in ("nvidia-h200", "cpu"):
        p = p.model_copy(update={"host_bandwidth_gbs": H200_HOST_GBS, "host_bandwidth_source": "the H200 host"})
    return p


def terms_of(c: Case) -> dict[str, float]:
    header, spec = _model(c.shape, c.ftype)
    cfg = RunConfig(n_gpu_layers=c.ngl, n_cpu_moe=c.n_cpu_moe, n_ubatch=c.n_ubatch, flash_attn="on")
    work = work_of(header, spec, cfg, c.backend)
    hw = _profile(c.hardware)
    if c.kind == "decode":
        t = decode_terms(work, hw, c.backend, c.depth + c.n_gen // 2, c.threads)  # tg<n> runs from d to d + n
        return {k: v * c.n_gen for k, v in t.items()}
    return prefill_terms(work, hw, c.backend, c.n_prompt, c.n_ubatch, c.depth, c.threads, op_offload=True,
                         flash_attn=c.flash_attn)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    try:
        from scipy.optimize import nnls  # only here, offline

        return nnls(a, b, maxiter=5000)[0]
    except ImportError:  # projected least squares
        x = np.linalg.lstsq(a, b, rcond=None)[0]
        for _ in range(50):
            keep = x > 0
            x = np.zeros_like(x)
            x[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
            if (x >= 0).all():
                break
        return np.clip(x, 0, None)


def fit(train: list[Case]) -> dict[str, dict[str, dict[str, float]]]:
    """Coefficients per backend and kind: non-negative least squares on the relative error (each row's terms over its
    measured seconds, against 1)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for backend in (Backend.CUDA, Backend.METAL, Backend.CPU):
        out[backend.value] = {}
        for kind in ("decode", "prefill"):
            rows = [c for c in train if c.backend == backend and c.kind == kind and not c.fit_excluded]
            if not rows:
                continue
            terms = [terms_of(c) for c in rows]
            names = sorted({k for t in terms for k in t} - LEFT_OUT.get(backend.value, set()))
            sec = np.array([(c.n_gen if kind == "decode" else c.n_prompt) / c.tps for c in rows])
            a = np.array([[t.get(k, 0.0) for k in names] for t in terms]) / sec[:, None]
            b = np.ones(len(rows))
            # a ridge toward each term's physical prior (relative), so that sparse families keep plausible values
            prior = [PRIORS[kind].get(k, PRIORS[kind].get(k.split(".")[0], 0.0)) for k in names]
            w = [STRONG.get(k.split(".")[0], RIDGE) for k in names]
            reg = np.array([[w[i] / p if p and i == j else (RIDGE_ZERO if not p and i == j else 0.0)
                             for j in range(len(names))] for i, p in enumerate(prior)])
            x = _nnls(np.vstack([a, reg]), np.concatenate([b, [w[i] if p else 0.0 for i, p in enumerate(prior)]]))
            # every term the rows had, 0 included: a missing one takes its family's median (model.coefficient)
            out[backend.value][kind] = {k: float(f"{v:.6g}") for k, v in zip(names, x)}
    return out


def profile_scales(train: list[Case], coef: dict) -> dict[str, dict[str, float]]:
    """Per profile and kind: the median of measured / predicted seconds over its training rows (the published tables
    calibrate their own hardware as `ggfit calibrate --bench` does a user's), kept where a profile has rows; `fit`
    applies them (fitter.speed.predict.profile_scale). Not `cpu`: that profile is whatever CPU runs ggfit."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for c in train:
        if c.fit_excluded or c.backend == Backend.CPU:
            continue
        co = coef.get(c.backend.value, {}).get(c.kind, {})
        s = seconds(terms_of(c), co)
        if s > 0:
            n = c.n_gen if c.kind == "decode" else c.n_prompt
            ratios.setdefault(c.hardware, {}).setdefault(c.kind, []).append((n / c.tps) / s)
    return {hw: {k: float(f"{np.median(v):.4g}") for k, v in kinds.items()} for hw, kinds in sorted(ratios.items())}


def predicted_tps(c: Case, coef: dict[str, dict[str, dict[str, float]]],
                  scales: dict[str, dict[str, float]] | None = None) -> float:
    co = coef.get(c.backend.value, {}).get(c.kind, {})
    s = seconds(terms_of(c), co) * (scales or {}).get(c.hardware, {}).get(c.kind, 1.0)
    n = c.n_gen if c.kind == "decode" else c.n_prompt
    return n / s if s > 0 else float("nan")


def _stats(errs: list[float]) -> str:
    if not errs:
        return "-"
    a = np.abs(np.array(errs))
    return f"n={len(a):3d} median {np.median(a) * 100:5.1f}%  p90 {np.percentile(a, 90) * 100:5.1f}%  " \
           f"worst {a.max() * 100:6.1f}%"


def report(all_cases: list[Case], coef: dict, scales: dict | None = None, *,
           verbose: bool = False) -> dict[str, dict[str, float]]:
    groups: dict[tuple[str, str, str], list[float]] = {}
    spreads: dict[str, dict[str, float]] = {}
    print("with per-profile scales" if scales else "the generic model (no profile's own rows)")
    for c in all_cases:
        p = predicted_tps(c, coef, scales)
        e = p / c.tps - 1
        split = "apart" if c.fit_excluded else ("held-out" if c.held_out else "train")
        groups.setdefault((split, c.kind, c.family), []).append(e)
        if verbose:
            print(f"{split:8s} {c.family:12s} {c.hardware:28s} {c.shape:20s} {c.ftype:7s} {c.kind:7s} "
                  f"p{c.n_prompt} g{c.n_gen} d{c.depth} ub{c.n_ubatch} ngl{c.ngl} ncmoe{c.n_cpu_moe}: "
                  f"measured {c.tps:9.1f} predicted {p:9.1f} ({e * 100:+6.1f}%)")
    for split in ("train", "held-out", "apart"):
        for kind in ("decode", "prefill"):
            every: list[float] = []
            for fam in ("apple", "nvidia", "h200", "h200-partial", *HELD_OUT_GPUS, "cpu", *CPU_HERE):
                es = groups.get((split, kind, fam), [])
                every += es
                if es:
                    print(f"{split:8s} {kind:7s} {fam:12s} {_stats(es)}")
            if every:
                print(f"{split:8s} {kind:7s} {'all':12s} {_stats(every)}")
                if split == "train":
                    spreads[kind] = {"p80": float(np.percentile(np.abs(every), 80))}
    return spreads


def write_factors(coef: dict, spreads: dict, scales: dict, n_train: int) -> None:
    path = ROOT / "fitter" / "speed" / "factors.py"
    path.write_text(
        '"""The speed model\'s coefficients per backend (fitter.speed.model), fitted by `python benchmarks/speed_model.py\n'
        f'--fit` on {n_train} training rows of the truth set (our H200 llama-bench runs, llama.cpp 0c1e570, and the\n'
        'published tables of benchmarks/results/speed-published.json). Generated: edit the fit, not this file.\n'
        'SPREAD: the 80th percentile of the training rows\' relative error, the range `fit` shows."""\n\n'
        f"COEFFICIENTS: dict[str, dict[str, dict[str, float]]] = {json.dumps(coef, indent=4, sort_keys=True)}\n\n"
        f"SPREAD: dict[str, float] = {json.dumps({k: round(v['p80'], 4) for k, v in spreads.items()})}\n\n"
        "# per hardware profile: measured / predicted seconds (decode, prefill) over its training rows\n"
        f"PROFILE_SCALE: dict[str, dict[str, float]] = {json.dumps(scales, indent=4, sort_keys=True)}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="fit on the training rows and write fitter/speed/factors.py")
    ap.add_argument("-v", "--verbose", action="store_true", help="every row")
    args = ap.parse_args()
    every = cases()
    if args.fit:
        train = [c for c in every if not c.held_out]
        coef = fit(train)
        scales = profile_scales(train, coef)
        report(every, coef, verbose=args.verbose)
        spreads = report(every, coef, scales, verbose=args.verbose)
        write_factors(coef, spreads, scales, len([c for c in train if not c.fit_excluded]))
    else:
        report(every, factors_mod.COEFFICIENTS, verbose=args.verbose)
        report(every, factors_mod.COEFFICIENTS, factors_mod.PROFILE_SCALE, verbose=args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
