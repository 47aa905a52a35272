"""llama-bench's rates from the work per token (fitter.speed.work) and a hardware profile.

A decoded token (tg at depth D) takes

    sum over devices of  bytes read / bandwidth x a_bw[type]  +  FLOPs / compute x a_dq[type]  (dequantization)
    + KV and recurrent state / bandwidth x a_kv  +  layers x a_layer  +  a_token  +  host<->GPU crossings x a_split

and a ubatch of U prompt tokens (pp<N> at -ub U)

    sum over devices of  U x FLOPs / compute x a_c[type]  +  attention FLOPs / compute x a_attn
    + every weight once / bandwidth x a_read  +  CPU weights streamed to the GPU / PCIe x a_copy
    (op offload: U >= 32 on CUDA)  +  CPU weights' FLOPs / (threads x 1 GFLOP/s) x a_cpu  +  layers x a_layer
    + a_ubatch.

Where the profile carries this CPU's measured rates (fitter.speed.cpu_rate, GFLOP/s per thread by type class), the
CPU backend's compute terms are FLOPs / (threads x that rate) with coefficient 1 (`cpum.<class>`, never fitted):
a ubatch's at the prefill rate, a decoded token's at the in-cache decode rate, and a decoded token then takes the
larger of a class's bytes over the bandwidth and its compute, not their sum (parts_of).

Each time is linear in its coefficients `a` (but for that larger of two), fitted per backend to measured llama-bench runs
(benchmarks/speed_model.py --fit writes fitter/speed/factors.py; `ggfit calibrate --bench` scales them to one
machine). The largest term names the resource that bounds the rate.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Literal

from fitter.ggml import backends
from fitter.ggml.backends.base import Backend
from fitter.llama.weights import CPU_DEV, device_buffer_name
from fitter.record import Record
from fitter.speed.hardware import HardwareProfile
from fitter.speed.work import OP_OFFLOAD_MIN_BATCH, DeviceWork, Work, experts_used

# (layer, ubatch tokens) -> the fraction of that layer's experts the ubatch uses; None: even routing (experts_used)
ExpertUse = Callable[[int, int], float]

Kind = Literal["decode", "prefill"]
_GB = 1e9
_APPLE_GEN = re.compile(r"apple-m(\d)")
MEASURED = "cpum"  # terms in seconds at this CPU's measured rate (fitter.speed.cpu_rate): coefficient 1, not fitted


class Rates(Record):
    prefill_tps: float
    decode_tps: float


class SpeedPrediction(Record):
    """llama-bench's pp<prompt_tokens> and tg at `depth`, with the range the truth set's errors give, and the resource
    that bounds each rate."""

    prefill_tps: float
    decode_tps: float
    prompt_tokens: int
    depth: int
    n_ubatch: int
    hardware: str
    low: Rates
    high: Rates
    bound: dict[str, str]  # "prefill" / "decode" -> e.g. "bandwidth (CUDA0)", "PCIe (CPU weights to CUDA0)"
    calibrated: str = ""  # the stored calibration used, if any

    def seconds(self, n_gen: int = 128) -> float:
        """A request's time: the prompt, then n_gen decoded tokens."""
        return self.prompt_tokens / self.prefill_tps + n_gen / self.decode_tps


def _dev_name(backend: Backend, d: int) -> str:
    impl = backends.get(backend)
    return "CPU" if d == CPU_DEV or not impl.is_gpu else device_buffer_name(impl, d)


def _gpu(backend: Backend) -> bool:
    return backends.get(backend).is_gpu


def gpu_compute_tflops(hw: HardwareProfile, cls: str = "k", batched: bool = False) -> float:
    """The device's compute scale for weights of a type class: on Apple its GPU cores (prefill tracks cores there;
    the factor per generation is fitted); on NVIDIA a quantized matrix runs on the integer tensor cores (mmq.cu,
    a quarter of the INT8 TOPS: GeForce cards' FP16 rate with FP32 accumulation) and an F16 one through cuBLAS with
    FP16 accumulation, half the INT8 TOPS on every tensor-core generation (twice the FP32-accumulate figure of
    GeForce cards), both `batched` (a ubatch; a decoded token's vector kernels, mmvq.cu and mmvf.cu, keep the
    unbatched scale); else a guess from the bandwidth where the profile has neither."""
    if backends.get(hw.backend).unified_memory and hw.gpu_cores:  # Apple
        return float(hw.gpu_cores)
    if cls != "float" and hw.int8_tops:  # ggml_cuda_mul_mat_q: mma.sync (mma.cuh), not wgmma
        return hw.int8_tops / 4 * (hw.mma_sync_share if batched else 1.0)
    if cls == "float" and hw.int8_tops and batched:
        # ggml_cuda_mul_mat_cublas: F16 weights at a batch past mmf run cublasGemmEx with CUBLAS_COMPUTE_16F
        return hw.int8_tops / 2
    if hw.fp16_tflops:
        return hw.fp16_tflops
    if hw.int8_tops:
        return hw.int8_tops / 4
    if hw.memory_bandwidth_gbs:
        return hw.memory_bandwidth_gbs / 10
    return 10.0


def attention_tflops(hw: HardwareProfile) -> float:
    """Flash attention's products: FP16 tensor-core MMA with FP32 accumulation (fattn-mma-f16.cuh), the profile's
    FP16 figure; Apple's cores."""
    if hw.fp16_tflops and not (backends.get(hw.backend).unified_memory and hw.gpu_cores):
        return hw.fp16_tflops * hw.mma_sync_share  # ggml_cuda_flash_attn_ext_mma_f16: mma.sync, not wgmma
    return gpu_compute_tflops(hw, "float")


def apple_generation(hw: HardwareProfile) -> str:
    m = _APPLE_GEN.match(hw.name)
    return f"m{m.group(1)}" if m else "m4"


def host_bandwidth(hw: HardwareProfile) -> float:
    if hw.host_bandwidth_gbs:
        return hw.host_bandwidth_gbs
    if not _gpu(hw.backend) and hw.memory_bandwidth_gbs:
        return hw.memory_bandwidth_gbs
    return 60.0  # no figure: a dual-channel DDR5 desktop's order


def _bandwidth(hw: HardwareProfile, d: int) -> float:
    if d == CPU_DEV or not _gpu(hw.backend):
        return host_bandwidth(hw) * _GB
    return (hw.memory_bandwidth_gbs or host_bandwidth(hw)) * _GB


def decode_terms(work: Work, hw: HardwareProfile, backend: Backend, depth: int, threads: int) -> dict[str, float]:
    """Seconds per decoded token at unit coefficients, by term ("bw.k@CUDA0", "kv@CPU", "layer", ...)."""
    out: dict[str, float] = {}

    def add(k: str, v: float) -> None:
        if v:
            out[k] = out.get(k, 0.0) + v

    for d, w in work.devices.items():
        host = d == CPU_DEV and _gpu(backend)
        bw = _bandwidth(hw, d)
        where = "host" if host else "dev"
        for cls, b in w.bytes_token.items():
            add(f"bw.{cls}" if not host else "host", b / bw)
        if not _gpu(backend) and hw.cpu_decode_gflops:  # measured: bw.<cls> and cpum.<cls> overlap (seconds)
            for cls, f in w.flops_token.items():
                add(f"{MEASURED}.{cls}", f / (threads * cpu_gflops(hw.cpu_decode_gflops, cls) * 1e9))
        elif host or not _gpu(backend):
            add("cpu", sum(w.flops_token.values()) / (threads * 1e9))
        else:
            for cls, f in w.flops_token.items():
                add(f"dq.{cls}", f / (gpu_compute_tflops(hw, cls) * 1e12))
        kv = w.kv_bytes_per_pos * (depth + 1) + w.kv_swa_bytes_per_pos * (min(depth, work.n_swa or depth) + 1)
        add(f"kv.{where}", (kv + w.state_bytes) / bw)
        if d != CPU_DEV or not _gpu(backend):
            add("layer", float(w.n_layers))
    add("token", 1.0)
    add("split", float(work.splits))
    return out


def _offloaded(backend: Backend, n_ubatch: int, op_offload: bool) -> bool:
    # ggml_backend_sched: a matmul on a host weight runs on the GPU when the GPU backend's offload_op accepts it
    # (ggml_backend_dev_offload_op: a batch of op_offload_min_batch_size (32) or more; Metal: matmuls only)
    return _gpu(backend) and op_offload and n_ubatch >= OP_OFFLOAD_MIN_BATCH


def _copied(w: DeviceWork, work: Work, n_tokens: int, expert_use: ExpertUse | None) -> float:
    """Bytes of the host's weights a ubatch copies to the GPU: ggml_backend_sched_compute_splits copies the inputs of
    an offloaded op whole, but of a MUL_MAT_ID's experts only those the ubatch's ids use."""
    dense = w.bytes_matmul - w.expert_bytes
    even = experts_used(work.n_expert, work.n_expert_used, n_tokens)
    return dense + sum(b * (expert_use(il, n_tokens) if expert_use else even) for il, b in w.expert_bytes_layer.items())


def ubatch_terms(work: Work, hw: HardwareProfile, backend: Backend, n_tokens: int, pos: float, threads: int,
                 op_offload: bool, flash_attn: bool = True, expert_use: ExpertUse | None = None,
                 n_out: int = 1) -> dict[str, float]:
    """Seconds for one ubatch of n_tokens whose tokens sit at mean position `pos`, of which n_out output logits, at
    unit coefficients."""
    out: dict[str, float] = {}

    def add(k: str, v: float) -> None:
        if v:
            out[k] = out.get(k, 0.0) + v

    c_gpu = attention_tflops(hw) * 1e12
    gen = apple_generation(hw) if backends.get(backend).unified_memory else ""
    offload = _offloaded(backend, n_tokens, op_offload)
    pcie = (hw.pcie_gbs or 16.0) * _GB
    for d, w in work.devices.items():
        on_cpu = d == CPU_DEV or not _gpu(backend)
        flops = {cls: f * n_tokens - w.out_flops_token.get(cls, 0.0) * (n_tokens - n_out)
                 for cls, f in w.flops_token.items()}
        if on_cpu and not _gpu(backend) and hw.cpu_prefill_gflops:  # this CPU's rate, measured: coefficient 1
            for cls, f in flops.items():
                add(f"{MEASURED}.{cls}", f / (threads * cpu_gflops(hw.cpu_prefill_gflops, cls) * 1e9))
        elif on_cpu and not (offload and d == CPU_DEV):
            add("cpu", sum(flops.values()) / (threads * 1e9))
        else:
            for cls, f in flops.items():
                add(f"c.{gen or cls}", f / (gpu_compute_tflops(hw, cls, batched=True) * 1e12))
            if d == CPU_DEV:  # streamed to the GPU once per ubatch, from pageable host memory (mmap)
                add("copy", _copied(w, work, n_tokens, expert_use) / min(pcie, host_bandwidth(hw) * _GB))
            else:
                add("read", sum(w.bytes_all.values()) / _bandwidth(hw, d))
        if w.state_bytes:  # the recurrent layers' scan: the state read and written per token
            add("rec.cpu" if on_cpu else "rec", n_tokens * w.state_bytes / _bandwidth(hw, d))
        n_pos = pos + 1
        n_swa = min(n_pos, work.n_swa or n_pos)
        attn = n_tokens * (w.attn_flops_per_pos * n_pos + w.attn_swa_flops_per_pos * n_swa)
        if on_cpu and not _gpu(backend) and hw.cpu_prefill_gflops:
            # ggml_compute_forward_flash_attn_ext_tiled: Q tiles against F16 K and V tiles, at the F16 matmul's rate
            add(f"{MEASURED}.attn", attn / (threads * cpu_gflops(hw.cpu_prefill_gflops, "float") * 1e9))
        else:
            add("attn.cpu" if on_cpu else ("attn" if flash_attn else "attn.nofa"),
                attn / (threads * 1e9 if on_cpu else c_gpu))
        if not (on_cpu or flash_attn):  # the KQ matrix goes through memory: bound by bandwidth at long prompts
            add("kq", n_tokens * (w.kq_bytes_per_pos * n_pos + w.kq_swa_bytes_per_pos * n_swa) / _bandwidth(hw, d))
        if not on_cpu or not _gpu(backend):
            add("layer", float(w.n_layers))  # per ubatch: the kernels' launches and syncs
            add("act", n_tokens * w.act_bytes_token / _bandwidth(hw, d))  # per token: the small ops on activations
    add("ubatch", 1.0)
    add("split", float(work.splits))
    return out


def prefill_terms(work: Work, hw: HardwareProfile, backend: Backend, n_prompt: int, n_ubatch: int, depth: int,
                  threads: int, op_offload: bool, flash_attn: bool = True,
                  expert_use: ExpertUse | None = None) -> dict[str, float]:
    """Seconds for a prompt of n_prompt tokens after `depth` (llama-bench pp<n_prompt> -d depth), at unit
    coefficients: llama_decode splits it into ubatches of n_ubatch."""
    out: dict[str, float] = {}
    done = 0
    while done < n_prompt:
        n = min(n_ubatch, n_prompt - done)
        for k, v in ubatch_terms(work, hw, backend, n, depth + done + n / 2, threads, op_offload,
                                 flash_attn, expert_use, n_out=1 if done + n >= n_prompt else 0).items():
            out[k] = out.get(k, 0.0) + v
        done += n
    return out


def cpu_gflops(rates: dict[str, float], cls: str) -> float:
    """A measured per-thread rate of a type class; a class not measured (iq) takes the median of those measured."""
    if cls in rates:
        return rates[cls]
    v = sorted(rates.values())
    return v[len(v) // 2]


def coefficient(coef: dict[str, float], key: str) -> float:
    """A term's coefficient; a type class or generation the fit never saw ("bw.iq", "c.m6") takes the median of its
    family's ("bw.*", "c.*"), a term of no fitted family 0; a measured CPU rate's (cpum.*) is 1 unless set."""
    if key in coef:
        return coef[key]
    if key.startswith(MEASURED + "."):
        return 1.0
    family = key.split(".")[0] + "."
    same = sorted(v for k, v in coef.items() if k.startswith(family))
    return same[len(same) // 2] if same else 0.0


def parts_of(terms: dict[str, float], coef: dict[str, float]) -> dict[str, float]:
    """Each term's seconds. A type class's weight bytes and its measured CPU compute (bw.<cls>, cpum.<cls>) overlap:
    ggml_graph_compute_thread runs each node on every thread and ggml_barrier waits for the last; in
    ggml_compute_forward_mul_mat a decoded token's src0 rows are handed out in chunks, each thread's vec_dot
    streams its rows while it computes, so a matmul takes the longer of reading its weights and computing them,
    not their sum. A class's matmuls share its bytes per FLOP: the sum over them of the larger is the larger of
    the class's sums. The smaller of the pair counts 0."""
    parts = {k: v * coefficient(coef, k) for k, v in terms.items()}
    for k in [k for k in parts if k.startswith(MEASURED + ".")]:
        mem = "bw." + k.split(".", 1)[1]
        if mem in parts:
            lo = min((mem, k), key=lambda x: parts[x])
            parts[lo] = 0.0
    return parts


def seconds(terms: dict[str, float], coef: dict[str, float]) -> float:
    return sum(parts_of(terms, coef).values())


def bound_of(terms: dict[str, float], coef: dict[str, float], backend: Backend, work: Work) -> str:
    parts = parts_of(terms, coef)
    if not parts:
        return "unknown"
    key = max(parts, key=lambda k: parts[k])
    gpu = _dev_name(backend, work.gpus[0]) if work.gpus else "CPU"
    head = key.split(".")[0]
    return {
        "bw": f"bandwidth ({gpu})", "kv": "KV cache reads", "dq": f"dequantization ({gpu})", "host": "host memory (CPU)",
        "cpu": "CPU compute", MEASURED: "CPU compute", "c": f"compute ({gpu})", "attn": "attention", "read": f"bandwidth ({gpu})",
        "copy": f"PCIe (CPU weights to {gpu})", "layer": "fixed per-layer cost", "token": "fixed per-token cost",
        "ubatch": "fixed per-ubatch cost", "split": "host<->GPU syncs", "act": "small ops per token (activations)",
        "rec": "recurrent state", "kq": "attention scores (KQ) in memory",
        "net": "network (RPC)",
    }.get(head, head)


def spread(x: float, rel: float) -> tuple[float, float]:
    return x / (1 + rel), x * (1 + rel)


def finite(x: float) -> float:
    return x if math.isfinite(x) and x > 0 else 0.0
