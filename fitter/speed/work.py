"""What one token costs llama.cpp, by device: the bytes it reads and the FLOPs it does (the speed model's inputs).

Built from what the memory model knows exactly: every tensor llama.cpp creates and the device that holds it
(fitter.llama.weights.tensor_instances and the placement of -ngl, --n-cpu-moe, -ot, -ts), and the KV or recurrent
state each layer keeps. A decoded token reads every weight on its layers' devices once, of a MoE layer's experts only
the `n_expert_used / n_expert` it routes to (shared experts and dense parts in full), the token embedding's one row
(a GET_ROWS) and the KV of the D positions before it (a sliding-window layer at most its window); a recurrent layer
reads and writes its state. A prompt of N tokens runs in ubatches of `-ub`: each reads every weight once (all
experts), does 2 FLOPs per weight and token of the weights it uses, and attends to the positions before it.
"""

from __future__ import annotations

import re
from dataclasses import field

from fitter.ggml import backends
from fitter.ggml.backends.base import Backend
from fitter.ggml.types import row_size
from fitter.gguf.header import TensorInfo
from fitter.gguf.reader import GGUFHeader
from fitter.llama.cparams import RunConfig
from fitter.llama.hparams import LayerKind, ModelSpec
from fitter.llama.weights import CPU_DEV, tensor_instances
from fitter.record import Record

# ggml types by how their matrix kernels behave (dequantization work per byte differs)
TYPE_CLASSES: dict[str, str] = {
    "F32": "float", "F16": "float", "BF16": "float",
    "Q8_0": "q8",
    "Q4_0": "q4", "Q4_1": "q4", "Q5_0": "q4", "Q5_1": "q4", "MXFP4": "q4",
    "Q2_K": "k", "Q3_K": "k", "Q4_K": "k", "Q5_K": "k", "Q6_K": "k",
}
CLASSES = ("float", "q8", "q4", "k", "iq")
_EXPERTS = re.compile(r"_exps\.")
OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu ggml_backend_cuda_device_offload_op: min_batch_size


def type_class(type_name: str) -> str:
    return TYPE_CLASSES.get(type_name.upper(), "iq")


class DeviceWork(Record, frozen=False):
    """One device's share of a token: bytes and FLOPs by type class."""

    device: int  # a GPU index, or CPU_DEV
    bytes_all: dict[str, float] = field(default_factory=dict)  # every weight held (a ubatch reads them all)
    bytes_matmul: float = 0.0  # of bytes_all: the matrices a ubatch multiplies (not the token embedding's GET_ROWS)
    bytes_token: dict[str, float] = field(default_factory=dict)  # what one decoded token reads
    flops_token: dict[str, float] = field(default_factory=dict)  # 2 x the weights a token multiplies
    # F32 activations a token's matmuls read and write (src1 rows of ne00, dst rows of ne01: ggml_cuda_mul_mat),
    # which the norms, activations, adds and the q8_1 quantization of src1 around them also pass through
    act_bytes_token: float = 0.0
    # of flops_token: the output matrix's (the logits), which a prompt computes for its last token only
    # (llama_batch_allocr::init: without a logits array only the last token outputs; the graph's
    # ggml_get_rows(inp_out_ids) drops the other rows before the output)
    out_flops_token: dict[str, float] = field(default_factory=dict)
    expert_bytes: float = 0.0  # of bytes_all: MoE expert tensors (--n-cpu-moe / -ot moves these)
    expert_bytes_layer: dict[int, float] = field(default_factory=dict)  # expert_bytes by layer
    n_layers: int = 0  # repeating layers whose attention runs here
    kv_bytes_per_pos: float = 0.0  # KV bytes one token reads per earlier position (full-attention layers)
    kv_swa_bytes_per_pos: float = 0.0  # the same for sliding-window layers (capped at the window)
    state_bytes: float = 0.0  # recurrent state read and written per token
    attn_flops_per_pos: float = 0.0  # QK and KV products per earlier position (full layers)
    attn_swa_flops_per_pos: float = 0.0
    # without flash attention (llm_graph_context::build_attn_mha) KQ is an F32 matrix of n_head rows per query and
    # earlier position, written by the product and read and written again by ggml_soft_max_ext: bytes per position
    kq_bytes_per_pos: float = 0.0
    kq_swa_bytes_per_pos: float = 0.0

    def add(self, table: dict[str, float], cls: str, v: float) -> None:
        table[cls] = table.get(cls, 0.0) + v

    def add_matrix(self, t: TensorInfo, cls: str, f: float, n_used: int, il: int) -> None:
        """A weight matrix of layer `il` a token multiplies `f` of (the experts it routes to), `n_used` times."""
        self.bytes_matmul += t.nbytes
        if f < 1.0:
            self.expert_bytes += t.nbytes
            self.expert_bytes_layer[il] = self.expert_bytes_layer.get(il, 0.0) + t.nbytes
        self.add(self.bytes_token, cls, t.nbytes * f)
        self.add(self.flops_token, cls, 2.0 * t.n_elements * f)
        if t.name.startswith("output"):
            self.add(self.out_flops_token, cls, 2.0 * t.n_elements)
        else:
            self.act_bytes_token += 4.0 * (t.shape[0] + t.shape[1]) * n_used


class Work(Record, frozen=False):
    """A config's work per token on each device, and what the run crosses between them."""

    devices: dict[int, DeviceWork]
    n_swa: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    splits: int  # host <-> GPU crossings per token along the layers (graph splits the scheduler makes)

    @property
    def gpus(self) -> list[int]:
        return sorted(d for d in self.devices if d != CPU_DEV)


def _kv_row_bytes(spec: ModelSpec, config: RunConfig, il: int) -> float:
    lay = spec.layers[il]
    if lay.kind == LayerKind.RECURRENT or not lay.has_kv:
        return 0.0
    k = row_size(config.type_k, lay.n_embd_k_gqa)
    if spec.is_mla:
        return float(k)  # llama_kv_cache: MLA caches K (the latent) only
    return float(k + row_size(config.type_v, lay.n_embd_v_gqa))


def _state_bytes(spec: ModelSpec) -> float:
    # llama_memory_recurrent: r and s are f32 rows of n_embd_r / n_embd_s per layer; a token reads and writes both
    return 0.0 if spec.ssm is None else 2.0 * 4 * (spec.ssm.n_embd_r + spec.ssm.n_embd_s)


def work_of(header: GGUFHeader, spec: ModelSpec, config: RunConfig, backend: Backend, n_gpus: int = 1) -> Work:
    """Each device's bytes and FLOPs per token for this placement (the memory model's placement, unchanged)."""
    from fitter.fit.memory import placement_of

    wp = placement_of(spec, config, backend, n_gpus)
    devs: dict[int, DeviceWork] = {}
    frac = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0

    def dev(d: int) -> DeviceWork:
        return devs.setdefault(d, DeviceWork(device=d))

    tied = not any(t.name == "output.weight" for t in header.tensors)
    for inst in tensor_instances(header, spec):
        t = inst.tensor
        if inst.duplicated:
            continue  # a tied output or a per-layer global: the same bytes
        d = dev(wp.device_of(t.name, inst.where))
        cls = type_class(t.ggml_type.name)
        d.add(d.bytes_all, cls, t.nbytes)
        if t.name.startswith("token_embd") or len(t.shape) < 2:
            d.add(d.bytes_token, cls, t.nbytes / t.shape[-1] if len(t.shape) >= 2 else t.nbytes)
            if t.name.startswith("token_embd") and tied:
                out = dev(wp.default_dev("output"))  # a tied output: token_embd multiplied again for the logits
                out.add(out.bytes_token, cls, t.nbytes)
                out.add(out.flops_token, cls, 2.0 * t.n_elements)
                out.add(out.out_flops_token, cls, 2.0 * t.n_elements)
            continue
        experts = bool(_EXPERTS.search(t.name))
        d.add_matrix(t, cls, frac if experts else 1.0, spec.n_expert_used if experts else 1,
                     inst.where if isinstance(inst.where, int) else -1)  # tensor_instances' layer
    state = _state_bytes(spec)
    for il in range(spec.n_layer):
        lay = spec.layers[il]
        d = dev(CPU_DEV if config.no_kv_offload else wp.default_dev(il))
        dev(wp.default_dev(il)).n_layers += 1
        if lay.kind == LayerKind.RECURRENT:
            d.state_bytes += state
            continue
        kv = _kv_row_bytes(spec, config, il)
        fl = 2.0 * lay.n_head * (lay.n_embd_head_k + lay.n_embd_head_v)
        kq = 4.0 * lay.n_head
        if lay.kind == LayerKind.SWA:
            d.kv_swa_bytes_per_pos += kv
            d.attn_swa_flops_per_pos += fl
            d.kq_swa_bytes_per_pos += kq
        else:
            d.kv_bytes_per_pos += kv
            d.attn_flops_per_pos += fl
            d.kq_bytes_per_pos += kq
    layer_devs = [wp.default_dev(il) for il in range(spec.n_layer)]
    splits = sum(1 for a, b in zip(layer_devs, layer_devs[1:]) if (a == CPU_DEV) != (b == CPU_DEV))
    if any(d.expert_bytes and d.device == CPU_DEV for d in devs.values()) and backends.get(backend).is_gpu:
        splits += 2 * sum(1 for il in range(spec.n_layer) if _layer_experts_on_cpu(wp, il))
    return Work(devices=devs, n_swa=spec.n_swa, n_layer=spec.n_layer, n_expert=spec.n_expert,
                n_expert_used=spec.n_expert_used, splits=splits)


def experts_used(n_expert: int, n_expert_used: int, n_tokens: int) -> float:
    """The fraction of a layer's experts that a ubatch of n_tokens routes to, when each token picks n_expert_used of
    n_expert independently and evenly (a trained router, on average): 1 - (1 - k/n)^U."""
    if not n_expert:
        return 1.0
    return 1.0 - (1.0 - n_expert_used / n_expert) ** n_tokens


def _layer_experts_on_cpu(wp, il: int) -> bool:
    return wp.device_of(f"blk.{il}.ffn_up_exps.weight", il) == CPU_DEV and wp.default_dev(il) != CPU_DEV
