"""The buffer-type protocol every backend implements, and what backends share.

A ggml backend's default buffer type answers get_alignment, get_max_size and get_alloc_size
(ggml/src/ggml-backend.cpp ggml_backend_buft_*), its device answers supports_op and offload_op
(ggml_backend_dev_supports_op / ggml_backend_dev_offload_op), and llama.cpp names its buffers after
the device ("CUDA0", "MTL0") and the host buffer type next to it ("CUDA_Host", or the CPU's).
`BackendImpl` is that protocol with the CPU's answers as defaults; fitter.ggml.backends.{cpu,cuda,metal}.backend
override what differs, and fitter.ggml.backends.get(backend) returns the one for a Backend.

`FlashAttnShape` describes one GGML_OP_FLASH_ATTN_EXT node, the op whose alloc size and support
differ most between backends; the alloc-size tables of each backend are in its module's docstring.
"""

from __future__ import annotations

import copy
import re
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

from fitter.errors import GGFitError
from fitter.ggml.tensor import Tensor, nbytes_strided
from fitter.ggml.types import nbytes, row_size, type_name
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.record import Record

if TYPE_CHECKING:
    from fitter.ggml.backends.probes import DeviceProbes, FreeMemory

SIZE_MAX = 2**64 - 1
HOST_ALIGNMENT = 32  # TENSOR_ALIGNMENT (ggml/src/ggml-impl.h): the CPU buffer type's, and CUDA_Host's


class Backend(str, Enum):
    """The backends ggfit models (--backend); BACKENDS in fitter.ggml.backends maps each to its module."""

    CPU = "cpu"
    CUDA = "cuda"
    METAL = "metal"
    RPC = "rpc"  # devices of rpc-servers on other hosts (--rpc), the main host's CPU beside them
    RPC_CUDA = "rpc-cuda"  # rpc-servers' devices, then the main host's CUDA GPU (--rpc with --backend cuda)


class Overhead(NamedTuple):
    """Memory a llama.cpp process holds outside the buffers it prints, and what it is (fitter.fit.margin)."""

    bytes: int
    what: str


class BackendError(GGFitError):
    """A backend name or a combination the chosen backend cannot run (the message says which)."""


class FlashAttnShape(Record):
    """The shapes of one GGML_OP_FLASH_ATTN_EXT node as llm_graph_context::build_attn_mha builds it.

    Q [d_k, n_q, n_head, n_stream] f32 (n_q: tokens per stream), K [d_k, n_kv, n_head_kv, n_stream]
    and V [d_v, n_kv, n_head_kv, n_stream] views of the KV cache (llama_kv_cache::get_k / get_v,
    permuted), mask [n_kv, n_q, 1, n_stream] f16 (build_attn_inp_kq_mask). k_row_bytes /
    v_row_bytes are K's / V's stride between KV cells (nb[1] after the permute); None means a
    KV-cache view: ggml_row_size(type, d * n_head_kv).
    """

    d_k: int
    d_v: int
    n_q: int
    n_head: int
    n_head_kv: int
    n_kv: int
    type_k: str = "f16"
    type_v: str = "f16"
    n_stream: int = 1
    has_mask: bool = True
    v_is_view_of_k: bool = False  # MLA: V is the first d_v elements of each K row
    n_kv_max: int = 0  # ggml_flash_attn_ext_set_n_kv_max (op_params[4]); 0 except DSA top-k attention
    max_bias: float = 0.0  # ALiBi
    logit_softcap: float = 0.0
    k_row_bytes: int | None = None
    v_row_bytes: int | None = None

    @property
    def nb11(self) -> int:
        return self.k_row_bytes if self.k_row_bytes is not None else row_size(self.type_k, self.d_k * self.n_head_kv)

    @property
    def nb21(self) -> int:
        if self.v_row_bytes is not None:
            return self.v_row_bytes
        if self.v_is_view_of_k:
            return self.nb11
        return row_size(self.type_v, self.d_v * self.n_head_kv)

    @property
    def gqa_ratio(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def out_nbytes(self) -> int:
        """ggml_nbytes of the output: f32 [d_v, n_head, n_q, n_stream] (ggml_flash_attn_ext)."""
        return 4 * self.d_v * self.n_head * self.n_q * self.n_stream

    @property
    def mask_nbytes(self) -> int:
        """The f16 mask input [n_kv, n_q, 1, n_stream]: built on the CPU, copied to the device."""
        return 2 * self.n_kv * self.n_q * self.n_stream if self.has_mask else 0


def _ne4(t: Any) -> tuple[int, int, int, int]:
    ne = tuple(x if isinstance(x, int) else int(x) for x in t.ne)  # ints kept as they are (a traced Sym too)
    return (ne + (1, 1, 1, 1))[:4]  # type: ignore[return-value]


def _op(t: Any) -> str:
    op = str(getattr(t, "op", "NONE") or "NONE").upper()
    return op.removeprefix("GGML_OP_")


def _view_src(t: Any) -> Any:
    return getattr(t, "view_src", None) or getattr(t, "vs", None)  # fitter.ggml.tensor.Tensor calls it vs


def _nbytes_of(t: Any) -> int:
    n = getattr(t, "nbytes", None)
    if callable(n):
        n = n()
    return int(n) if n else nbytes(t.type, _ne4(t))


def flash_attn_shape_of(t: Any) -> FlashAttnShape:
    """Build a FlashAttnShape from a FLASH_ATTN_EXT tensor-like (`.src` = [Q, K, V, mask, sinks])."""
    q, k, v = t.src[0], t.src[1], t.src[2]
    mask = t.src[3] if len(t.src) > 3 else None
    qne, kne, vne = _ne4(q), _ne4(k), _ne4(v)
    knb = getattr(k, "nb", None)
    vnb = getattr(v, "nb", None)
    v_src, k_src = _view_src(v), _view_src(k)
    v_is_view_of_k = bool(getattr(t, "v_is_view_of_k", False)) or (
        v_src is not None and (v_src is k or (v_src is k_src
                                              and getattr(v, "view_offs", 0) == getattr(k, "view_offs", 0))))
    params = list(getattr(t, "op_params", ()) or ())
    return FlashAttnShape(
        d_k=qne[0], d_v=vne[0], n_q=qne[1], n_head=qne[2], n_head_kv=kne[2], n_kv=kne[1],
        type_k=type_name(k.type), type_v=type_name(v.type), n_stream=qne[3], has_mask=mask is not None,
        v_is_view_of_k=v_is_view_of_k, n_kv_max=int(params[4]) if len(params) > 4 else 0,
        k_row_bytes=int(knb[1]) if knb else None, v_row_bytes=int(vnb[1]) if vnb else None,
    )


def is_host_buffer(buffer: str) -> bool:
    """Whether llama.cpp's buffer (type) name is host memory, whichever backend printed it: the CPU's ("CPU",
    "CPU_Mapped", "CPU_REPACK") or a GPU backend's pinned host buffer type ("CUDA_Host"); else a device's own
    ("CUDA0", "MTL0", "MTL0_Mapped", "Vulkan1")."""
    return buffer.startswith("CPU") or buffer.endswith("_Host")


class BackendImpl:
    """One backend: its default buffer type, the host buffer type next to it, and its device's op rules.

    The defaults are the CPU's (ggml_backend_cpu_buffer_type, ggml_backend_cpu_device_supports_op).
    """

    kind: Backend = Backend.CPU
    name = "CPU"  # the device's buffer name in llama.cpp's logs ("CUDA0", "MTL0")
    host_buffer_name = "CPU"  # the host buffer type used for inputs, outputs and CPU ops next to it
    registry = "CPU"  # ggml_backend_reg_name of the device's backend registry
    alignment = HOST_ALIGNMENT  # get_alignment of the default buffer type
    host_alignment = HOST_ALIGNMENT
    maps_host_memory = True  # ggml_backend_dev_get_props(...).caps.buffer_from_host_ptr (mmapped weights)
    # the device is the host (CPU): every buffer is the one RAM and counts against the one budget; no GPU flags
    is_gpu = False
    remote = False  # devices on other hosts (RPC: rpc-servers named by --rpc), the main host's CPU beside them
    label = "CPU"  # how llama.cpp's logs and ggfit's messages name the backend ("CUDA", "Metal"; fitter.llama_builds.changes)
    single_device = False  # one device at most (Metal: MTL0): no -ts, -mg, nor a --budget per GPU
    # the device's memory is the host's RAM (Apple Silicon): weights moved to the CPU (-ngl, --n-cpu-moe, -ot =CPU)
    # stay in the same RAM and free nothing, and no host budget of its own is needed unless asked for
    unified_memory = False
    # get_host_buffer_type: pinned host memory next to the device (CUDA_Host), which takes the CPU weights it
    # multiplies before the CPU's extra buffer types (llama-model.cpp make_cpu_buft_list)
    has_host_buffer_type = False
    # whose figures ggfit mirrors: a real load's scheduler, which keeps llama_context::graph_get_cb's assignments (a
    # layer's norm on its layer's device: one split input fewer at each device boundary), or llama.cpp's dry run,
    # whose ggml_backend_sched_reserve_size drops them (CUDA's and Metal's figures are checked against dry runs)
    keeps_layer_pins = False
    # how llama.cpp's build info (system_info, llama-bench's `backends`) names a build with this backend, any case
    log_names: tuple[str, ...] = ()
    # the default --margin's facts (fitter.fit.margin): what the process holds outside the device's buffers, outside its
    # host buffers next to a GPU (None: nothing modelled), and whether a safety share goes on top
    overhead: Overhead | None = None
    host_overhead: Overhead | None = None
    margin_safety = True
    build: LlamaBuild = PINNED  # whose ggml this is: the per-build rules ask build.has() (fitter.llama_builds.changes)
    local_gpus = 0  # GPUs of the main host after the RPC devices (--rpc beside a local GPU: fitter.ggml.backends.rpc)
    # the host buffer type of CPU weights without mmap (make_cpu_buft_list: the first device's that has one); None:
    # host_buffer_name
    cpu_weight_buffer: str | None = None

    def on(self, device: int) -> BackendImpl:
        """The backend of device id `device` of a placement (fitter.llama.weights): itself where every device is of one
        kind; RPC devices beside a local GPU each answer for their own."""
        return self

    def device_ids(self, n_gpus: int, remote: tuple[str, ...] = ()) -> list[int]:
        """The device ids of a placement over n_gpus devices, in llama.cpp's order (llama_model::devices); `remote`:
        the backend each RPC device's server runs (RunConfig.rpc_backends)."""
        return list(range(n_gpus))

    def device_names(self, n_gpus: int) -> list[str]:
        """llama.cpp's names of n_gpus devices, in its order (a --budget per device is keyed by them)."""
        return [self.device_name(i) for i in range(n_gpus)]

    def buffer_name(self, device: int) -> str:
        """Device id `device`'s buffer type name (ggml_backend_cuda_buffer_type(i): CUDA0, CUDA1, ...)."""
        return re.sub(r"\d+$", str(device), self.name)

    def device_name(self, index: int) -> str:
        """llama.cpp's name of the device at `index` ("CUDA1"): its registry's name and the index (a --budget per GPU
        is keyed by it, as the prediction's buffers are)."""
        return f"{self.registry}{index}"

    def for_build(self, build: LlamaBuild) -> BackendImpl:
        """This backend as `build`'s ggml has it (a bound copy; itself for the build it already mirrors)."""
        if build == self.build:
            return self
        bound = copy.copy(self)
        bound.build = build
        return bound

    def placement_refusal(self) -> str | None:
        """Why moving weights off the device (--n-cpu-moe, -ot =CPU, a lower -ngl) frees none of its memory; None
        on a GPU with memory of its own."""
        if not self.is_gpu:
            return "the CPU backend has no GPU to offload from"
        if self.unified_memory:
            return (f"{self.label}'s memory is unified: weights moved to the CPU (--n-cpu-moe, -ot =CPU, a lower -ngl) "
                    "stay in the same RAM, so they free nothing; lower the context, the K/V type or the quant instead")
        return None

    def named_in(self, build_info: str) -> bool:
        """Whether llama.cpp's build info (system_info, llama-bench's `backends`) names this backend."""
        text = build_info.lower()
        return any(n.lower() in text for n in self.log_names)

    def machine_kind(self) -> str | None:
        """The device's model and memory as its driver names them, for results that only mix within a kind of
        machine (None: the host's CPU says it)."""
        return None

    def free_memory(self, probes: DeviceProbes) -> FreeMemory:
        """What the device has for llama.cpp now, as `--budget auto` reads it (ggml_backend_dev_memory's counterpart
        on this machine; fitter.fit.device_memory): each backend's <name>/memory.py, imported only then (its probes
        import ctypes)."""
        raise NotImplementedError

    def fa_auto_unsupported_reason(self, heads: Iterable[tuple[int, int]], type_k: str, type_v: str) -> str | None:
        """Why `-fa auto` turns flash attention off for a model whose attention layers have these (K, V) head sizes,
        in layer order, and these cache types (llama_context::resolve_fused_ops: a layer's FLASH_ATTN_EXT cannot run on
        the device); None: it stays as asked. The CPU runs every FA node."""
        return None

    def fa_auto_unsupported_reason_on(self, shapes: list[FlashAttnShape]) -> str | None:
        """-fa auto where devices of several backends hold layers (local_gpus): why the FA node of one of these layers,
        on the main host's GPU, cannot run there; None: it stays as asked."""
        return None

    def fa_alloc_reads_kv_type(self, build: LlamaBuild, queries_per_stream: int) -> bool:
        """Whether FLASH_ATTN_EXT's alloc size depends on the K/V cache type beyond its block size (the views'
        strides, a scratch per type): then two cache types of one block size are not the same compute bytes. The
        CPU's: ggml_nbytes, never."""
        return False

    def is_device_buffer(self, buffer: str) -> bool:
        """Whether llama.cpp's buffer (type) name is this device's own memory ("CUDA0"), not host memory next to it
        ("CPU", "CPU_Mapped", "CUDA_Host")."""
        return buffer == self.name

    def max_size(self, *, metal_max_buffer_length: int | None = None) -> int:
        """get_max_size of the default buffer type (NULL -> SIZE_MAX: ggml-alloc never splits a buffer)."""
        return SIZE_MAX

    def alloc_size(self, t: Any) -> int:
        """ggml_backend_buft_get_alloc_size for a tensor-like in the default buffer type (unaligned).

        `t` needs `.op` (ggml op name, "FLASH_ATTN_EXT" or "GGML_OP_FLASH_ATTN_EXT"), `.type` (ggml type
        name, enum or int value), `.ne`, and `.src` for the ops that look at their sources (ggml's own
        order: FLASH_ATTN_EXT [q, k, v, mask, sinks], MUL_MAT_ID [as, b, ids], TOP_K [a]); optional
        `.nbytes` (attribute or method; else computed for a contiguous tensor), `.nb`, `.op_params`,
        `.view_src` / `.vs`. A MUL_MAT_ID whose weight is not in `.src` (fitter.ggml passes (b, ids))
        must carry `.n_expert`. The CPU has no get_alloc_size: ggml_nbytes.
        """
        return _nbytes_of(t)

    # the ops whose alloc_size may differ from ggml_nbytes in this buffer type (its get_alloc_size's cases)
    sized_ops: frozenset[str] = frozenset()

    def compute_size(self, t: Tensor) -> int:
        """alloc_size of a compute tensor of fitter.ggml (op names as ggml's, shapes known): ggml_nbytes unless its op
        is one of `sized_ops`; the allocator asks it of every tensor it places whose size it has not kept."""
        return self.alloc_size(t) if t.op in self.sized_ops else t.nbytes()

    def tensor_alloc_size(self, t: Any, ne: tuple[int, ...], size: int | None = None) -> int:
        """A weight's or cache's get_alloc_size (unaligned): ggml_nbytes (`size` when known)."""
        return nbytes(t, ne) if size is None else size

    def copy_size(self, t: Tensor) -> int:
        """A split input copy in this backend's compute buffer (ggml_dup_tensor_layout keeps the strides)."""
        return nbytes_strided(t)

    def flash_attn_unsupported_reason(self, s: FlashAttnShape, *, has_bfloat: bool = True) -> str | None:
        """Why the device cannot run this FLASH_ATTN_EXT node (None: it can).

        What llama.cpp then does (src/llama-context.cpp): with -fa auto the probe in
        llama_context::resolve_fused_ops sees the FA node on another device than its layer and turns
        flash attention off (the non-FA graph, with its n_kv x n_q x n_head score matrix, is built);
        with -fa on, or a quantized V cache (llama_init_from_model forces FA on), the node runs on the
        CPU and the scheduler copies Q, K, V and the mask views into the CPU compute buffer.
        """
        return None

    def gated_delta_net_unsupported_reason(self, head_v_dim: int) -> str | None:
        """GGML_OP_GATED_DELTA_NET (qwen35, qwen35moe, qwen3next fused path; cparams.fused_gdn_ar/ch)."""
        return None

    def ssm_conv_unsupported_reason(self, conv_channels: int) -> str | None:
        """GGML_OP_SSM_CONV; conv_channels is src[0]->ne[1] (d_inner + 2*n_group*d_state)."""
        return None

    def mul_mat_unsupported_reason(self, weight_type: str, *, mul_mat_id: bool = False,
                                   prec_f32_src1: bool = False) -> str | None:
        """GGML_OP_MUL_MAT / MUL_MAT_ID with f32 activations, by weight type."""
        return None

    def supports_op(self, t: Tensor) -> bool:
        """ggml_backend_dev_supports_op for the ops whose support depends on shapes."""
        op = t.op
        if op == "FLASH_ATTN_EXT":
            return self.flash_attn_unsupported_reason(flash_attn_shape_of(t)) is None
        if op == "GATED_DELTA_NET":
            return self.gated_delta_net_unsupported_reason(t.src[2].ne[0]) is None
        if op == "SSM_CONV":
            return self.ssm_conv_unsupported_reason(t.src[0].ne[1]) is None
        return True

    def op_batch_size(self, t: Tensor) -> int:  # get_op_batch_size (ggml-cuda.cu, ggml-metal.cpp)
        op = t.op
        if op == "MUL_MAT":
            return t.ne[1]
        if op == "MUL_MAT_ID":
            return t.ne[2]
        return t.ne[1] * t.ne[2] * t.ne[3]

    def offload_op(self, t: Tensor) -> bool:
        """ggml_backend_dev_offload_op: take an op whose weight is in host memory (op_offload_min_batch_size 32)."""
        return self.is_gpu and self.op_batch_size(t) >= 32

    @property
    def reorders_graph(self) -> bool:
        """Whether graph_optimize moves nodes across layers (Metal): the layers are then not replayed one by one
        (fitter.llama.layer_segments._prepare)."""
        return False

    def graph_optimize(self, segments: list) -> None:
        """ggml_backend graph_optimize: nothing on the CPU."""

    def graph_optimize_on(self, own: frozenset[int]) -> Any:
        """graph_optimize where devices of several backends share the graph: over the splits of scheduler ids `own`
        (the devices of this backend's kind of graph_optimize) only."""
        return self.graph_optimize
