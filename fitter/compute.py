"""Compute buffers: what llama.cpp's scheduler reserves for the worst-case graph, to the byte.

llama.cpp sizes its compute buffers by building the worst-case graph (`llama_context::sched_reserve`
-> `graph_reserve`: n_tokens = min(n_ctx, n_ubatch) rounded up to a multiple of n_seq_max, n_seqs =
n_seq_max, n_outputs = min(n_tokens, n_outputs_max), attention over the whole KV cache), letting the
scheduler assign every op a backend and split the graph (`ggml_backend_sched_split_graph`), and
running ggml's graph allocator over it without allocating (`ggml_gallocr_reserve_n_size`): best fit
in graph order, in-place reuse of a dying parent, a tensor freed after its last use. Each buffer is
that allocator's high-water mark.

This module does the same in Python, from ModelSpec + ContextParams (+ GraphDetails, the few header
facts ModelSpec lacks):

  1. a miniature ggml (`_T` and the op constructors below): every tensor's type, shape, strides,
     view source and op, as ggml.c computes them;
  2. each architecture's graph builder (src/models/<arch>.cpp and the shared builders of
     src/llama-graph.cpp, src/llama-kv-cache.cpp), ported node for node, in llama.cpp's order
     (`ggml_build_forward_expand`'s depth-first walk); `_graph_mtp` for MTP draft contexts;
  3. for GPU backends, the scheduler (`_schedule`: passes 1-5 of ggml_backend_sched_split_graph, op
     offload of host weights, split input copies) and CUDA's graph_optimize allocation dependencies
     (`_cuda_alloc_deps`);
  4. ggml-alloc.c's allocator (`_Gallocr`, `_Alloc`: ggml_gallocr_alloc_graph_impl,
     ggml_dyn_tallocr_alloc / _free_bytes, chunks for a maximum buffer size), one per buffer type,
     which yields the sizes and the tensors alive at each peak (`ComputeBuffer.terms`).

Speed: layers repeat. One sub-graph ("segment") is built per distinct layer, and `_simulate` replays
the allocator layer by layer; once its state at a layer boundary repeats with the same layers ahead,
the rest of the period cannot raise the high-water mark and is skipped. ~1-3 ms per call for real
models of 24-94 layers, memoized on (spec, context, backend).

Checked against llama.cpp (tests/test_compute.py, benchmarks/compute_error.py): byte-exact on the
CPU for the 15 architectures ggfit models (real-size sparse GGUFs and small variants, n_ctx 256 to
262144, n_ubatch 1 to 4096, every KV type, FA on/off, 1-4 sequences split or unified, MTP); CUDA
recorded from an H200 (full, partial and zero offload, MTP) exact to the printed 0.01 MiB. Metal
uses the same scheduler with Metal's alloc sizes (fitter.compute_backend) but not Metal's
graph_optimize (fusion alloc deps, concurrency reordering): unverified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from fitter.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from pydantic import BaseModel, ConfigDict

from fitter.config import ContextParams, ggml_type
from fitter.errors import UnsupportedModelError
from fitter.kv_cache import swa_cells
from fitter.model_spec import LayerKind, LayerSpec, ModelSpec

MIB = 1 << 20

# --------------------------------------------------------------------------------------------------
# ggml types (ggml.h enum ggml_type)

F32 = int(GGMLQuantizationType.F32)
F16 = int(GGMLQuantizationType.F16)
I32 = int(GGMLQuantizationType.I32)
I64 = int(GGMLQuantizationType.I64)

_BLCK: dict[int, int] = {}
_TSIZE: dict[int, int] = {}
for _t, (_b, _s) in GGML_QUANT_SIZES.items():
    _BLCK[int(_t)] = _b
    _TSIZE[int(_t)] = _s


def _row_size(t: int, ne: int) -> int:  # ggml_row_size
    return _TSIZE[t] * ne // _BLCK[t]


# ggml ops whose result may take over a dying parent's memory (ggml-alloc.c ggml_op_can_inplace)
_INPLACE_OPS = frozenset(
    (
        "FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV",
        "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK",
        "CLAMP", "SOFT_MAX", "SOFT_MAX_BACK",
    )
)

FLAG_INPUT = 1
FLAG_OUTPUT = 2

_TRACK: list | None = None  # while the simulator builds a segment, every new tensor is appended here
_SEGDEV = 0  # while building: the backend of the layer being built (0 device, 1 host CPU)
_SEGLAYER: int | None = None  # while building: the layer being built (None: prologue / epilogue)


class _T:
    """A ggml_tensor as far as the graph allocator can see it."""

    __slots__ = ("op", "type", "ne", "nb", "src", "vs", "flags", "name", "ext", "vis", "inpl", "nc", "nv", "own", "addr",
                 "size", "glob", "be", "w", "n_expert", "uop", "sid")

    def __init__(self, op: str, type_: int, ne: list[int], nb: list[int], src: tuple, vs: "_T | None", name: str, ext: bool = False):
        self.op = op
        self.type = type_
        self.ne = ne
        self.nb = nb
        self.src = src
        self.vs = vs  # view_src (always the base tensor, as ggml_new_tensor_impl resolves it)
        self.flags = 0
        self.name = name
        self.ext = ext  # lives in a buffer the graph allocator does not own (weights, KV / RS caches)
        self.vis = False
        self.inpl = op in _INPLACE_OPS
        # allocator state (ggml-alloc.c struct hash_node)
        self.nc = 0  # n_children
        self.nv = 0  # n_views
        self.own = False  # allocated by the graph allocator and not yet freed
        self.addr = 0
        self.size = 0
        self.glob = False  # created by an architecture's prologue (inputs, masks, ...): shared by all layers
        self.be = 0  # buffer / backend: 0 the device (or the only CPU buffer), 1 the host CPU
        self.w = -1  # IS_WEIGHT for model weights
        self.n_expert = 0
        self.uop = ""  # UNARY: which (only the MoE gating ones are named: "sigmoid", "softplus")
        self.sid = -1  # the scheduler split the node belongs to (GPU backends)
        if _TRACK is not None:
            _TRACK.append(self)

    def nbytes(self) -> int:  # ggml_nbytes for the contiguous tensors the allocator places
        ne = self.ne
        return _TSIZE[self.type] * ne[0] // _BLCK[self.type] * ne[1] * ne[2] * ne[3]

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"<{self.name} {self.op} t{self.type} {self.ne}>"


def _contig_nb(type_: int, ne: list[int]) -> list[int]:  # ggml_new_tensor_impl strides
    nb0 = _TSIZE[type_]
    nb1 = nb0 * (ne[0] // _BLCK[type_])
    nb2 = nb1 * ne[1]
    return [nb0, nb1, nb2, nb2 * ne[2]]


def _new(op: str, type_: int, ne: Iterable[int], src: tuple, name: str = "") -> _T:  # ggml_new_tensor
    ne = list(ne) + [1] * (4 - len(list(ne)))
    return _T(op, type_, ne, _contig_nb(type_, ne), src, None, name)


def _view_of(a: _T, op: str, ne: list[int], nb: list[int], src: tuple, name: str) -> _T:
    return _T(op, a.type, ne, nb, src, a.vs if a.vs is not None else a, name)


def is_contiguous_mn(t: _T, m: int, n: int = 4) -> bool:  # ggml_is_contiguous_m_n
    nxt = _TSIZE[t.type]
    if t.ne[0] != _BLCK[t.type] and t.nb[0] != nxt:
        return False
    nxt *= t.ne[0] // _BLCK[t.type]
    for i in range(1, n):
        if i > m:
            if t.ne[i] != 1 and t.nb[i] != nxt:
                return False
            nxt *= t.ne[i]
        else:
            nxt = t.ne[i] * t.nb[i]
    return True


def is_contiguous(t: _T) -> bool:
    return is_contiguous_mn(t, 0)


def nelements(t: _T) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


# --- op constructors (ggml.c), only what shapes and ownership need ---------------------------------


IS_WEIGHT = 2  # _T.w of a weight tensor (a model tensor in a WEIGHTS buffer)
HOST = 1  # backend / buffer index of the CPU next to a GPU (the lowest-priority backend)

# Weights only matter to the GPU scheduler (ops run where their weights are, and a CPU weight used by
# an offloaded op is copied into the GPU's compute buffer); the CPU path leaves them out of the graph.
_WEIGHTS = False
_WTYPE: Callable[[str], int] = lambda name: F16  # noqa: E731  (ggml type of the current layer's weight `name`)

# what the graph builders call a matmul's output -> the weight's GGUF suffix (for its type)
_WEIGHT_OF = {
    "Qcur": "attn_q", "Kcur": "attn_k", "Vcur": "attn_v", "wqkv": "attn_qkv", "attn_out": "attn_output",
    "ffn_up": "ffn_up", "ffn_gate": "ffn_gate", "ffn_out": "ffn_down", "ffn_moe_logits": "ffn_gate_inp",
    "ffn_moe_up": "ffn_up_exps", "ffn_moe_gate": "ffn_gate_exps", "ffn_moe_down": "ffn_down_exps",
    "ffn_moe_gate_up": "ffn_gate_up_exps", "result_output": "output", "q_a": "attn_q_a", "q": "attn_q_b",
    "kv_cmpr_pe": "attn_kv_a_mqa", "q_nope_absorbed": "attn_k_b", "kv": "attn_kv_b", "fattn_mla": "attn_v_b",
    "kqv_mla": "attn_v_b", "qkv_mixed": "attn_qkv", "z": "attn_gate", "beta": "ssm_beta", "alpha": "ssm_alpha",
    "mixed_ba": "ssm_ba", "mixed_qkvz": "ssm_in", "ssm_out": "ssm_out", "Qcur_full": "attn_q",
    "shared_gate": "ffn_gate_inp_shexp", "per_layer_inp_gate": "inp_gate", "per_layer_proj": "proj",
}


def weight(ne: Iterable[int], name: str = "w", host: bool = False, type_: int = F32) -> _T:
    ne = list(ne) + [1] * (4 - len(list(ne)))
    t = _T("NONE", type_, ne, _contig_nb(type_, ne), (), None, name, ext=True)
    t.w = IS_WEIGHT
    t.be = HOST if host else _SEGDEV
    return t


def _w(ne: Iterable[int], name: str, small: bool = False) -> _T | None:
    """The weight an op reads, when the scheduler needs to see it (see _WEIGHTS)."""
    if not _WEIGHTS:
        return None
    base = name.split("-", 1)[0]
    t = F32 if small else _WTYPE(_WEIGHT_OF.get(base, base))
    ne = list(ne)
    if _BLCK[t] > 1 and ne[0] % _BLCK[t]:
        t = F16
    return weight(ne, base, type_=t)


def cache(type_: int, ne: Iterable[int], name: str) -> _T:
    ne = list(ne) + [1] * (4 - len(list(ne)))
    t = _T("NONE", type_, ne, _contig_nb(type_, ne), (), None, name, ext=True)
    t.be = _SEGDEV  # a layer's KV / recurrent state lives on that layer's device
    return t


def inp(type_: int, ne: Iterable[int], name: str) -> _T:  # ggml_new_tensor + ggml_set_input
    t = _new("NONE", type_, ne, (), name)
    t.flags |= FLAG_INPUT
    return t


def dup(op: str, a: _T, src: tuple, name: str = "") -> _T:  # ggml_dup_tensor + op
    return _T(op, a.type, list(a.ne), _contig_nb(a.type, a.ne), src, None, name)


def view_tensor(a: _T, op: str, src: tuple, name: str = "") -> _T:  # ggml_view_tensor
    return _view_of(a, op, list(a.ne), list(a.nb), src, name)


def mul_mat(a: _T | None, b: _T, name: str = "") -> _T:
    # a = None stands for a weight whose only relevant dim is ne1 (pass via mm())
    return _new("MUL_MAT", F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), (a, b), name)


def mm(rows: int, b: _T, name: str = "", wne: Iterable[int] | None = None) -> _T:
    """ggml_mul_mat(W, b) for a weight W with ne1 = rows (wne: W's shape when it is not [b.ne0, rows])."""
    w = _w(wne or (b.ne[0], rows), name)
    return _new("MUL_MAT", F32, (rows, b.ne[1], b.ne[2], b.ne[3]), (w, b) if w is not None else (b,), name)


def mul_mat_id(rows: int, b: _T, ids: _T, name: str = "", n_expert: int = 0) -> _T:  # ggml_mul_mat_id(as, b, ids)
    w = _w((b.ne[0], rows, n_expert), name)
    t = _new("MUL_MAT_ID", F32, (rows, ids.ne[0], b.ne[2], 1), (w, b, ids) if w is not None else (b, ids), name)
    t.n_expert = n_expert
    return t


def _srcs(*src: _T | None) -> tuple:
    return tuple(x for x in src if x is not None)


def add(a: _T, b: _T | None = None, name: str = "") -> _T:  # b None: a weight (bias)
    if b is None:
        b = _w((a.ne[0],), "bias", small=True)
    return dup("ADD", a, (a, b) if b is not None else (a,), name)


def mul(a: _T, b: _T | None = None, name: str = "") -> _T:  # b None: a weight (norm, scale)
    if b is None:
        b = _w((a.ne[0],), "norm", small=True)
    return dup("MUL", a, (a, b) if b is not None else (a,), name)


def div(a: _T, b: _T, name: str = "") -> _T:
    return dup("DIV", a, (a, b), name)


def sub(a: _T, b: _T, name: str = "") -> _T:
    return dup("SUB", a, (a, b), name)


def scale(a: _T, name: str = "") -> _T:
    return dup("SCALE", a, (a,), name)


def clamp(a: _T, name: str = "") -> _T:
    return dup("CLAMP", a, (a,), name)


def unary(a: _T, name: str = "", uop: str = "") -> _T:  # ggml_silu / gelu / tanh / sigmoid / exp / softplus / neg ...
    t = dup("UNARY", a, (a,), name)
    t.uop = uop
    return t


def sqr(a: _T, name: str = "") -> _T:
    return dup("SQR", a, (a,), name)


def sqrt(a: _T, name: str = "") -> _T:
    return dup("SQRT", a, (a,), name)


def rms_norm(a: _T, name: str = "") -> _T:
    return dup("RMS_NORM", a, (a,), name)


def norm(a: _T, name: str = "") -> _T:
    return dup("NORM", a, (a,), name)


def rope(a: _T, pos: _T, factors: _T | None = None, name: str = "") -> _T:
    return dup("ROPE", a, (a, pos, factors) if factors is not None else (a, pos), name)


def soft_max(a: _T, mask: _T | None = None, sinks: _T | None = None, name: str = "") -> _T:  # soft_max_ext (+ add_sinks)
    return dup("SOFT_MAX", a, _srcs(a, mask, sinks), name)


def cont(a: _T, name: str = "") -> _T:
    return dup("CONT", a, (a,), name)


def cont_nd(a: _T, ne: Iterable[int], name: str = "") -> _T:  # ggml_cont_2d/3d/4d
    return _new("CONT", a.type, ne, (a,), name)


def cast(a: _T, type_: int, name: str = "") -> _T:  # ggml_cast (src[1] = itself)
    t = _new("CPY", type_, a.ne, (a,), name)
    t.src = (a, t)
    return t


def cpy(a: _T, b: _T, name: str = "") -> _T:  # ggml_cpy: a view of b
    return view_tensor(b, "CPY", (a, b), name)


def reshape(a: _T, ne: Iterable[int], name: str = "") -> _T:  # ggml_reshape_Nd
    ne = list(ne) + [1] * (4 - len(list(ne)))
    return _view_of(a, "RESHAPE", ne, _contig_nb(a.type, ne), (a,), name)


def view(a: _T, ne: Iterable[int], nbs: Iterable[int] = (), name: str = "") -> _T:  # ggml_view_1d..4d
    ne = list(ne)
    nd = len(ne)
    nbs = list(nbs)
    full = ne + [1] * (4 - nd)
    nb = _contig_nb(a.type, full)
    for i, v in enumerate(nbs):
        nb[i + 1] = v
    if nd == 2:
        nb[2] = nb[1] * full[1]
        nb[3] = nb[2]
    elif nd == 3:
        nb[3] = nb[2] * full[2]
    return _view_of(a, "VIEW", full, nb, (a,), name)


def permute(a: _T, ax0: int, ax1: int, ax2: int, ax3: int, name: str = "") -> _T:
    ne = [0] * 4
    nb = [0] * 4
    for src_i, dst_i in enumerate((ax0, ax1, ax2, ax3)):
        ne[dst_i] = a.ne[src_i]
        nb[dst_i] = a.nb[src_i]
    return _view_of(a, "PERMUTE", ne, nb, (a,), name)


def transpose(a: _T, name: str = "") -> _T:
    ne = [a.ne[1], a.ne[0], a.ne[2], a.ne[3]]
    nb = [a.nb[1], a.nb[0], a.nb[2], a.nb[3]]
    return _view_of(a, "TRANSPOSE", ne, nb, (a,), name)


def get_rows(a: _T, b: _T, name: str = "") -> _T:
    return _new("GET_ROWS", I32 if a.type == I32 else F32, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), (a, b), name)


def set_rows(a: _T, b: _T, c: _T, name: str = "") -> _T:  # a view of a; src = (b, c, a)
    return view_tensor(a, "SET_ROWS", (b, c, a), name)


def glu_split(a: _T, b: _T, name: str = "") -> _T:  # ggml_swiglu_split / geglu_split / swiglu_oai
    return _new("GLU", a.type, a.ne, (a, b), name)


def glu(a: _T, name: str = "") -> _T:  # fused ggml_swiglu(a): half of ne0
    return _new("GLU", a.type, (a.ne[0] // 2, a.ne[1], a.ne[2], a.ne[3]), (a,), name)


def argsort(a: _T, name: str = "") -> _T:
    return _new("ARGSORT", I32, a.ne, (a,), name)


def argsort_top_k(a: _T, k: int, name: str = "") -> _T:
    r = argsort(a, name)
    return view(r, (k, r.ne[1], r.ne[2], r.ne[3]), (r.nb[1], r.nb[2], r.nb[3]), name)


def sum_rows(a: _T, name: str = "") -> _T:
    return _new("SUM_ROWS", a.type, (1, a.ne[1], a.ne[2], a.ne[3]), (a,), name)


def concat(a: _T, b: _T, dim: int, name: str = "") -> _T:
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return _new("CONCAT", a.type, ne, (a, b), name)


def pad(a: _T, p0: int, p1: int = 0, p2: int = 0, p3: int = 0, name: str = "") -> _T:
    return _new("PAD", a.type, (a.ne[0] + p0, a.ne[1] + p1, a.ne[2] + p2, a.ne[3] + p3), (a,), name)


def fill(a: _T, name: str = "") -> _T:
    return dup("FILL", a, (a,), name)


def repeat_4d(a: _T, ne: Iterable[int], name: str = "") -> _T:
    return _new("REPEAT", a.type, ne, (a,), name)


def flash_attn_ext(q: _T, k: _T, v: _T, mask: _T | None, sinks: _T | None = None, name: str = "") -> _T:
    src = (q, k, v, mask) if sinks is None else (q, k, v, mask, sinks)
    return _new("FLASH_ATTN_EXT", F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), src, name)


# --------------------------------------------------------------------------------------------------
# graph (ggml_cgraph) and the allocator (ggml-alloc.c)


class _Graph:
    def __init__(self) -> None:
        self.nodes: list[_T] = []
        self.leafs: list[_T] = []

    def expand(self, t: _T) -> None:
        """ggml_build_forward_expand: depth-first over src[0..], post-order, each tensor once."""
        if t.vis:
            return
        t.vis = True
        stack = [(t, 0)]
        nodes, leafs = self.nodes, self.leafs
        while stack:
            node, i = stack[-1]
            src = node.src
            if i < len(src):
                stack[-1] = (node, i + 1)
                s = src[i]
                if s is not None and not s.vis:
                    s.vis = True
                    stack.append((s, 0))
                continue
            stack.pop()
            if node.op == "NONE":
                if not node.ext:
                    leafs.append(node)
            else:
                nodes.append(node)


SIZE_MAX = (1 << 64) - 1
MAX_CHUNKS = 16  # GGML_VBUFFER_MAX_CHUNKS


class _Alloc:
    """ggml_dyn_tallocr: per chunk, free blocks sorted by offset; best fit, the last block grows a chunk.

    An address is chunk << 56 | offset. Backends without a maximum buffer size (CPU, CUDA) only ever
    have one chunk; Metal splits a buffer into chunks of at most maxBufferLength.
    """

    __slots__ = ("align", "max_chunk", "chunks", "maxes")

    def __init__(self, align: int, max_buffer_size: int = SIZE_MAX) -> None:
        self.align = align
        self.max_chunk = min(max_buffer_size, SIZE_MAX // 2)
        self.chunks: list[list[list[int]]] = []  # free blocks [offset, size] per chunk
        self.maxes: list[int] = []  # max_size per chunk

    @property
    def max_size(self) -> int:
        return sum(self.maxes)

    def _new_chunk(self, min_size: int) -> int:  # ggml_dyn_tallocr_new_chunk
        size = max(min_size, self.max_chunk)
        if len(self.chunks) == MAX_CHUNKS - 1:
            size = SIZE_MAX // 2
        self.chunks.append([[0, size]])
        self.maxes.append(0)
        return len(self.chunks) - 1

    def alloc(self, size: int) -> int:  # ggml_dyn_tallocr_alloc
        a = self.align
        size = (size + a - 1) // a * a
        chunks = self.chunks
        best_c = best_b = -1
        for c, blocks in enumerate(chunks):  # best fit among all blocks but the last of each chunk
            best_fit = SIZE_MAX
            for i in range(len(blocks) - 1):
                bs = blocks[i][1]
                if bs >= size and bs <= best_fit:
                    best_c, best_b, best_fit = c, i, bs
        if best_b == -1:  # the last block of some chunk: least growth, or the tightest fit
            best_reuse = None
            for c, blocks in enumerate(chunks):
                if not blocks:
                    continue
                last = blocks[-1]
                reuse = self.maxes[c] - last[0] - size
                better_reuse = (best_reuse is None or best_reuse < 0) and (best_reuse is None or reuse > best_reuse)
                better_fit = reuse >= 0 and best_reuse is not None and reuse < best_reuse
                if last[1] >= size and (better_reuse or better_fit):
                    best_c, best_b, best_reuse = c, len(blocks) - 1, reuse
        if best_b == -1:
            best_c = self._new_chunk(size)
            best_b = 0
        blocks = chunks[best_c]
        b = blocks[best_b]
        off = b[0]
        b[0] += size
        b[1] -= size
        if b[1] == 0:
            del blocks[best_b]
        if off + size > self.maxes[best_c]:
            self.maxes[best_c] = off + size
        return best_c << 56 | off

    def free(self, addr: int, size: int) -> None:  # ggml_dyn_tallocr_free_bytes
        a = self.align
        size = (size + a - 1) // a * a
        blocks = self.chunks[addr >> 56]
        off = addr & ((1 << 56) - 1)
        n = len(blocks)
        for i in range(n):
            b = blocks[i]
            if b[0] + b[1] == off:
                b[1] += size
                if i < n - 1 and b[0] + b[1] == blocks[i + 1][0]:
                    b[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if off + size == b[0]:
                b[0] = off
                b[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == b[0]:
                    blocks[i - 1][1] += b[1]
                    del blocks[i]
                return
        j = 0
        while j < n and blocks[j][0] < off:
            j += 1
        blocks.insert(j, [off, size])

    def state(self) -> tuple:
        return tuple(tuple(map(tuple, blocks)) for blocks in self.chunks)


def _same_layout(a: _T, b: _T) -> bool:  # ggml_are_same_layout
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


class _Gallocr:
    """ggml_gallocr: allocate_node / free_node and the passes of ggml_gallocr_alloc_graph_impl.

    One dynamic allocator per buffer type (`_T.be` picks it: 0 the device, 1 the host CPU when a GPU
    backend is used), each with its alignment and its `get_alloc_size`.
    """

    def __init__(self, align: int | list[int], alloc_size: Callable[[_T], int] | list | None = None,
                 trace: bool = False, max_buffer_size: int | list[int] = SIZE_MAX) -> None:
        aligns = align if isinstance(align, list) else [align]
        maxes = max_buffer_size if isinstance(max_buffer_size, list) else [max_buffer_size] * len(aligns)
        sizes = alloc_size if isinstance(alloc_size, list) else [alloc_size or _T.nbytes] * len(aligns)
        self.tallocs = [_Alloc(a, m) for a, m in zip(aligns, maxes)]
        self.talloc = self.tallocs[0]
        self.aligns = aligns
        self.alloc_sizes = [f or _T.nbytes for f in sizes]
        self.trace = trace
        self.live: dict[int, _T] = {}
        self.peaks = [0] * len(aligns)
        self.peak_lives: list[list[tuple[str, int]]] = [[] for _ in aligns]

    def _allocate(self, t: _T) -> None:  # ggml_gallocr_allocate_node
        if t.own or t.ext or t.vs is not None:
            return
        t.own = True
        if t.inpl:
            # try to reuse a parent's buffer. A view parent is never "own" (views are not allocated),
            # so the view branch of ggml_gallocr_allocate_node cannot fire.
            for p in t.src:
                if p is None or not p.own:
                    continue
                if p.flags & FLAG_OUTPUT:
                    continue
                if p.nc == 1 and p.nv == 0 and _same_layout(t, p):
                    t.addr = p.addr
                    t.be = p.be  # hn->buffer_id = p_hn->buffer_id
                    if not t.size:
                        t.size = self.alloc_sizes[t.be](t)
                    p.own = False
                    self._handover(p, t)
                    self._free_extra(t, p)
                    return
        be = t.be
        if not t.size:
            t.size = self.alloc_sizes[be](t)
        talloc = self.tallocs[be]
        t.addr = talloc.alloc(t.size)
        if self.trace:
            self.live[id(t)] = t
            hw = talloc.max_size
            if hw > self.peaks[be]:
                self.peaks[be] = hw
                self.peak_lives[be] = [(x.name, x.size) for x in self.live.values() if x.be == be]

    def _handover(self, old: _T, new: _T) -> None:
        if self.trace and self.live.pop(id(old), None) is not None:
            self.live[id(new)] = new

    def _free_extra(self, t: _T, parent: _T) -> None:  # ggml_gallocr_free_extra_space
        a = self.aligns[parent.be]
        ps = (parent.size + a - 1) // a * a
        ns = (t.size + a - 1) // a * a
        if ps > ns:
            self.tallocs[parent.be].free(parent.addr + ns, ps - ns)

    def _free(self, t: _T) -> None:  # ggml_gallocr_free_node
        if t.flags & FLAG_OUTPUT:
            return
        self.tallocs[t.be].free(t.addr, t.size)
        t.own = False
        if self.trace:
            self.live.pop(id(t), None)

    def sizes(self) -> list[int]:
        return [t.max_size for t in self.tallocs]

    def run(self, nodes: list[_T], leafs: list[_T]) -> int:
        """ggml_gallocr_alloc_graph_impl over a whole graph; returns the high-water mark."""
        for leaf in leafs:
            self._allocate(leaf)
        for node in nodes:
            vs = node.vs
            if vs is not None and node.op != "NONE":
                vs.nv += 1
            if node.flags & FLAG_INPUT:
                self._allocate(node)
            for s in node.src:
                if s is None:
                    continue
                s.nc += 1
                if s.flags & FLAG_INPUT:
                    self._allocate(s)
        self.process(nodes)
        return self.talloc.max_size

    def process(self, nodes: list[_T]) -> None:
        """The allocation pass of ggml_gallocr_alloc_graph_impl (children and views already counted)."""
        allocate = self._allocate
        for node in nodes:
            src = node.src
            for p in src:
                if p is not None and not p.own:
                    allocate(p)
            allocate(node)
            for p in src:
                if p is None:
                    continue
                p.nc -= 1
                if p.nc == 0 and p.nv == 0:
                    vs = p.vs
                    if vs is not None:
                        vs.nv -= 1
                        if vs.nv == 0 and vs.nc == 0 and vs.own:
                            self._free(vs)
                    elif p.own:
                        self._free(p)


# --------------------------------------------------------------------------------------------------
# graph details: the few GGUF facts beyond ModelSpec that change a graph's shape


class GraphDetails(BaseModel):
    """Hparams and tensor presence that change llama.cpp's graph but are not in ModelSpec.

    `graph_details(header)` reads them from a GGUF header; without one, `compute_buffers` uses
    `default_details(spec)`: the values of the released models of each architecture. The tensors
    they add are small ([n_expert, n_tokens] router scratch, biases applied in place), so a wrong
    default moves the prediction by well under a MiB in practice.
    """

    model_config = ConfigDict(frozen=True)

    layer_tensors: dict[str, frozenset[int]] = {}  # "attn_q.bias" -> layers that have blk.N.attn_q.bias.*
    global_tensors: frozenset[str] = frozenset()  # "output.bias", "rope_freqs.weight", ...
    final_logit_softcapping: float = 0.0
    attn_temperature_scale: float = 0.0  # f_attn_temp_scale (mistral3, deepseek2): adds inp_attn_scale
    expert_gating_func: int = 0  # LLAMA_EXPERT_GATING_FUNC_TYPE_*: 0 none (arch default), 1 softmax, 2 sigmoid, 3 softmax_weight
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0
    n_expert_groups: int = 0
    n_group_used: int = 0
    n_lora_q: int = 0
    n_rot: int = 0
    mrope: bool = False  # rope.dimension_sections present (glm4moe: ggml_rope_multi, 4 positions per token)
    n_embd_per_layer: int = 0  # gemma4 per-layer embeddings (embedding_length_per_layer_input)
    layer_types: dict[str, dict[int, int]] = {}  # "ffn_down" -> {layer: ggml type} (GPU op offload copies)
    global_types: dict[str, int] = {}  # "output" -> ggml type

    def has(self, suffix: str, il: int | None = None) -> bool:
        layers = self.layer_tensors.get(suffix)
        if layers is None:
            return False
        return il is None or il in layers


def graph_details(header) -> GraphDetails:
    """GraphDetails from a fitter.gguf.reader.GGUFHeader."""
    md = header.metadata
    arch = md.get("general.architecture", "")

    def key(k: str, default=0):
        v = md.get(f"{arch}.{k}", default)
        return default if v is None or isinstance(v, (list, dict)) else v

    layer_tensors: dict[str, set[int]] = {}
    layer_types: dict[str, dict[int, int]] = {}
    global_types: dict[str, int] = {}
    glob: set[str] = set()
    for t in header.tensors:
        name = t.name
        if name.startswith("blk."):
            _, il, rest = name.split(".", 2)
            suffix = rest.rsplit(".", 1)[0] if rest.endswith((".weight", ".bias", ".scale")) else rest
            kind = rest[len(suffix) + 1:] if rest != suffix else ""
            full = f"{suffix}.{kind}" if kind == "bias" else suffix
            layer_tensors.setdefault(full, set()).add(int(il))
            if kind == "weight":
                layer_types.setdefault(suffix, {})[int(il)] = int(t.ggml_type)
        else:
            glob.add(name)
            global_types[name.rsplit(".", 1)[0]] = int(t.ggml_type)
    return GraphDetails(
        layer_tensors={k: frozenset(v) for k, v in layer_tensors.items()},
        global_tensors=frozenset(glob),
        final_logit_softcapping=float(key("final_logit_softcapping", 0.0) or 0.0),
        attn_temperature_scale=float(key("attention.temperature_scale", 0.0) or 0.0),
        expert_gating_func=int(key("expert_gating_func", 0) or 0),
        expert_weights_norm=bool(key("expert_weights_norm", False)),
        expert_weights_scale=float(key("expert_weights_scale", 0.0) or 0.0),
        n_expert_groups=int(key("expert_group_count", 0) or 0),
        n_group_used=int(key("expert_group_used_count", 0) or 0),
        n_lora_q=int(key("attention.q_lora_rank", 0) or 0),
        n_rot=int(key("rope.dimension_count", 0) or 0),
        mrope=f"{arch}.rope.dimension_sections" in md,
        n_embd_per_layer=int(key("embedding_length_per_layer_input", 0) or 0) if "per_layer_token_embd.weight" in glob else 0,
        layer_types=layer_types,
        global_types=global_types,
    )


def default_details(spec: ModelSpec) -> GraphDetails:
    """What released models of spec.architecture look like (used without a header)."""
    arch = spec.architecture
    n = len(spec.layers)
    every = frozenset(range(n))
    moe_layers = frozenset(range(spec.n_layer_dense_lead, n)) if spec.n_expert else frozenset()
    dense_layers = every - moe_layers
    lt: dict[str, frozenset[int]] = {}
    kw: dict = {}
    if arch == "qwen2":
        lt |= {"attn_q.bias": every, "attn_k.bias": every, "attn_v.bias": every}
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        lt |= {"attn_q_norm": every, "attn_k_norm": every}
    if arch == "gemma2":
        kw["final_logit_softcapping"] = 30.0
    if arch == "mistral3":
        kw["attn_temperature_scale"] = 0.1
    if arch == "gpt-oss":
        lt |= {"attn_q.bias": every, "attn_k.bias": every, "attn_v.bias": every, "attn_output.bias": every,
               "ffn_gate_inp.bias": every, "ffn_up_exps.bias": every, "ffn_gate_exps.bias": every, "ffn_down_exps.bias": every}
        kw["expert_gating_func"] = 3
    if arch == "glm4moe":
        lt |= {"attn_q.bias": every, "attn_k.bias": every, "attn_v.bias": every, "exp_probs_b.bias": moe_layers}
        kw |= dict(expert_gating_func=2, expert_weights_norm=True, expert_weights_scale=2.5)
    if arch == "deepseek2":
        lt |= {"exp_probs_b.bias": moe_layers, "attn_q_a": every}
        kw |= dict(expert_gating_func=2, expert_weights_norm=True, expert_weights_scale=2.5,
                   n_expert_groups=8, n_group_used=4, n_lora_q=1536)
        if spec.is_mla:
            kw["n_rot"] = spec.layers[0].n_embd_head_k - spec.n_lora_kv
    if arch in ("qwen35moe", "qwen3next"):
        lt |= {"ffn_gate_inp_shexp": moe_layers}
    if arch == "gemma4":
        lt |= {"attn_v": every, "layer_output_scale": every}
        if any(not l.has_kv for l in spec.layers):  # E2B / E4B: shared-KV layers and per-layer embeddings
            kw["n_embd_per_layer"] = 256
        kw["final_logit_softcapping"] = 30.0
    if spec.n_expert_shared or spec.n_ff_shexp:
        lt |= {"ffn_up_shexp": moe_layers}
    lt |= {"ffn_up": dense_layers} if spec.n_expert else {"ffn_up": every}
    if spec.n_expert:
        lt |= {"ffn_up_exps": moe_layers, "ffn_gate_exps": moe_layers}
    return GraphDetails(layer_tensors=lt, **kw)


# --------------------------------------------------------------------------------------------------
# the graph builder: llm_graph_context (src/llama-graph.cpp) and its KV-cache helpers


@dataclass
class _KVCache:
    """A llama_kv_cache as the reserve graph sees it (llama_kv_cache_context built by init_full)."""

    size: int  # cells per stream; n_kv = size in the reserve (llama_kv_cache_context: n_kv = get_size())
    n_stream: int
    type_k: int
    type_v: int
    v_trans: bool
    rot_k: int  # Hadamard rotation size of attn_inp_k_rot (0 = none; llama_kv_cache::build_input_k_rot)
    rot_v: int
    layers: list[int] = field(default_factory=list)  # the layers with their own K/V tensors
    share: dict[int, int] = field(default_factory=dict)  # layer -> the layer whose K/V it reuses
    tensors: dict[int, tuple[_T, _T | None]] = field(default_factory=dict)  # created on first use


class _Ctx:
    """llm_graph_context: shared builders; each architecture's graph is a function below."""

    def __init__(self, spec: ModelSpec, cp: ContextParams, details: GraphDetails):
        self.spec = spec
        self.cp = cp
        self.d = details
        self.arch = spec.architecture
        self.fa = cp.flash_attn
        n_seqs = cp.n_seq_max
        n_tokens = min(cp.n_ctx, cp.n_ubatch)  # llama_context::sched_reserve
        self.n_outputs = min(n_tokens, cp.n_outputs_max)
        if n_tokens % n_seqs:  # llama_context::graph_reserve
            n_tokens = (n_tokens + n_seqs - 1) // n_seqs * n_seqs
        self.n_tokens = n_tokens
        self.n_seqs = n_seqs
        self.n_stream = 1 if cp.kv_unified else n_seqs
        self.g = _Graph()
        self.v_gqa_max = max((l.n_embd_v_gqa for l in spec.layers), default=0)
        self.n_embd = spec.n_embd
        self.mtp = False  # the MTP draft context's graph (graph_mtp)

    # ---- inputs ------------------------------------------------------------------------------

    def build_inp_embd(self, n_embd_inp: int | None = None) -> _T:  # llm_graph_context::build_inp_embd
        n_embd_inp = n_embd_inp or self.n_embd
        tokens = inp(I32, (self.n_tokens,), "inp_tokens")
        embd = inp(F32, (n_embd_inp, self.n_tokens), "inp_embd")
        cur = get_rows(weight((n_embd_inp, self.spec.n_vocab), "token_embd", host=True), tokens, "embd")
        # ggml_build_forward_select: both alternatives enter the graph, the unused one as a leaf
        self.g.expand(cur)
        self.g.expand(embd)
        return cur

    def build_inp_pos(self, n_pos_per_embd: int = 1) -> _T:
        return inp(I32, (self.n_tokens * n_pos_per_embd,), "inp_pos")

    def build_inp_out_ids(self) -> _T:
        return inp(I32, (self.n_outputs,), "out_ids")

    def _kv(self, layers: list[int], size: int) -> _KVCache:
        cp = self.cp
        tk, tv = ggml_type(cp.type_k), ggml_type(cp.type_v)
        # llama_kv_cache::llama_kv_cache: attn_rot_k / attn_rot_v (Hadamard rotation for quantized caches)
        hk = {self.spec.layers[il].n_embd_head_k for il in layers}
        hv = {self.spec.layers[il].n_embd_head_v for il in layers}
        head_k_all = hk.pop() if len(hk) == 1 else (-1 if hk else 0)
        head_v_all = hv.pop() if len(hv) == 1 else (-1 if hv else 0)
        if self.spec.is_mla:
            head_v_all = 0  # MLA caches have no V
        # hparams.n_embd_head_k() / n_embd_head_v(): the default argument is layer 0
        full_k = self.spec.layers[0].n_embd_head_k
        full_v = self.spec.layers[0].n_embd_head_v
        rot_k = rot_v = 0
        if head_k_all > 0 and _BLCK[tk] > 1 and full_k % 64 == 0:
            n = 64
            while head_k_all % n == 0:
                n *= 2
            rot_k = n // 2
        if head_v_all > 0 and _BLCK[tv] > 1 and full_v % 64 == 0 and not self.spec.is_mla:
            rot_v = 64
        return _KVCache(size, self.n_stream, tk, tv, not self.fa, rot_k, rot_v, list(layers))

    def kv_tensors(self, kv: _KVCache, il: int) -> tuple[_T, _T | None]:
        """The layer's K and V cache tensors (llama_kv_cache::layers[map_layer_ids[il]])."""
        il = kv.share.get(il, il)
        t = kv.tensors.get(il)
        if t is None:
            l = self.spec.layers[il]
            k = cache(kv.type_k, (l.n_embd_k_gqa, kv.size, kv.n_stream), f"cache_k_l{il}")
            v = None
            if not self.spec.is_mla:
                v = cache(kv.type_v, ((self.v_gqa_max if kv.v_trans else l.n_embd_v_gqa), kv.size, kv.n_stream), f"cache_v_l{il}")
            t = kv.tensors[il] = (k, v)
        return t

    def _kq_mask(self, kv: _KVCache) -> _T:  # build_attn_inp_kq_mask
        return inp(F16 if self.fa else F32, (kv.size, self.n_tokens // self.n_stream, 1, self.n_stream), "attn_inp_kq_mask")

    def _attn_inputs(self, kv: _KVCache, with_v: bool = True) -> dict:
        d = {"kv": kv, "k_idxs": inp(I64, (self.n_tokens,), "attn_inp_k_idxs")}
        if with_v:
            n = self.n_tokens * self.v_gqa_max if kv.v_trans else self.n_tokens
            d["v_idxs"] = inp(I64, (n,), "attn_inp_v_idxs")
        d["mask"] = self._kq_mask(kv)
        d["k_rot"] = inp(F32, (kv.rot_k, kv.rot_k), "attn_inp_k_rot") if kv.rot_k else None
        d["v_rot"] = inp(F32, (kv.rot_v, kv.rot_v), "attn_inp_v_rot") if (kv.rot_v and with_v) else None
        return d

    def build_attn_inp_kv(self, layers: list[int] | None = None) -> dict:  # build_attn_inp_kv
        if layers is None:
            layers = [l.index for l in self.spec.layers[: self.spec.n_layer] if l.has_kv]
        return self._attn_inputs(self._kv(layers, self.cp.n_ctx_seq))

    def build_inp_mem_hybrid(self) -> tuple[dict, dict]:  # build_inp_mem_hybrid: (recurrent, attention)
        sp = self.spec
        n_rs = max(1, self.cp.n_seq_max)  # llama_memory_recurrent_context (full): n_rs = mem size
        s_copy = inp(I32, (n_rs,), "rs_s_copy")
        rs = {
            "s_copy_main": view(s_copy, (self.n_seqs,), (), "s_copy_main"),
            "s_copy_extra": view(s_copy, (n_rs - self.n_seqs,), (), "s_copy_extra"),
            "n_rs": n_rs,
            "rows": n_rs * (1 + self.cp.n_rs_seq),
        }
        attn_layers = [l.index for l in sp.layers[: sp.n_layer] if l.kind != LayerKind.RECURRENT]
        return rs, self.build_attn_inp_kv(attn_layers)

    def build_rs(self, rs: dict, s: _T, state_size: int) -> _T:  # llm_graph_context::build_rs
        g = self.g
        states = reshape(s, (state_size, s.ne[1]))
        state_zero = view(states, (state_size,), (), "state_zero")
        g.expand(view_tensor(state_zero, "SCALE", (state_zero,), "state_zero (scaled)"))  # ggml_scale_inplace
        out = get_rows(states, rs["s_copy_main"], "rs_states")
        g.expand(out)
        extra = get_rows(states, rs["s_copy_extra"], "rs_states_extra")
        dst = view(s, (state_size, rs["n_rs"] - self.n_seqs), (s.nb[1],), "rs_extra_dst")
        g.expand(cpy(extra, dst))
        return out

    def build_attn_inp_k(self) -> dict:  # build_attn_inp_k (MLA: K cache only, no rotation inputs)
        return self._attn_k_inputs([l.index for l in self.spec.layers[: self.spec.n_layer] if l.has_kv])

    def _attn_k_inputs(self, layers: list[int]) -> dict:
        kv = self._kv(layers, self.cp.n_ctx_seq)
        return {"kv": kv, "k_idxs": inp(I64, (self.n_tokens,), "attn_inp_k_idxs"), "mask": self._kq_mask(kv), "k_only": True}

    def build_attn_inp_kv_iswa(self) -> dict:  # build_attn_inp_kv_iswa
        sp = self.spec
        trunk = [l for l in sp.layers[: sp.n_layer] if l.has_kv]
        base = self._kv([l.index for l in trunk if l.kind != LayerKind.SWA], self.cp.n_ctx_seq)
        swa = self._kv([l.index for l in trunk if l.kind == LayerKind.SWA], swa_cells(sp, self.cp))
        # llama_model::create_memory (gemma3n / gemma4): layers past n_layer_kv_from_start reuse the KV
        # of the last layer of their kind that has one
        for l in sp.layers[: sp.n_layer]:
            if not l.has_kv:
                kv = swa if l.kind == LayerKind.SWA else base
                srcs = [il for il in kv.layers if il < l.index]
                if srcs:
                    kv.share[l.index] = max(srcs)
        b = self._attn_inputs(base)
        s = self._attn_inputs(swa)
        # creation order: k_idxs, v_idxs, mask (base) then (swa), then the rotations
        return {"iswa": True, "base": b, "swa": s}

    # ---- shared layer builders ---------------------------------------------------------------

    def build_norm(self, cur: _T, with_weight: bool = True, bias: bool = False, kind: str = "rms", name: str = "norm") -> _T:
        cur = rms_norm(cur, name) if kind == "rms" else norm(cur, name)
        if with_weight:
            cur = mul(cur, None, name + "_w")
        if bias:
            cur = add(cur, None, name + "_b")
        return cur

    def build_qkv(self, layer: LayerSpec, cur: _T, bias: bool = False, fused: bool = False,
                  head_q: int | None = None, n_head_q: int | None = None) -> tuple[_T, _T, _T]:
        hq = head_q or layer.n_embd_head_k
        nq = n_head_q or layer.n_head
        hk, nk = layer.n_embd_head_k, layer.n_head_kv
        hv = layer.n_embd_head_v
        n_tokens = cur.ne[1]
        if fused:  # layer.wqkv
            qkv = mm(hq * nq + hk * nk + hv * nk, cur, "wqkv")
            if bias:
                qkv = add(qkv, None, "wqkv_b")
            rs = lambda n: _row_size(qkv.type, n)
            q = view(qkv, (hq, nq, n_tokens), (rs(hq), qkv.nb[1]), "Qcur")
            k = view(qkv, (hk, nk, n_tokens), (rs(hk), qkv.nb[1]), "Kcur")
            v = view(qkv, (hv, nk, n_tokens), (rs(hv), qkv.nb[1]), "Vcur")
            return q, k, v
        q = mm(hq * nq, cur, "Qcur")
        if bias:
            q = add(q, None, "Qcur")
        k = mm(hk * nk, cur, "Kcur")
        if bias:
            k = add(k, None, "Kcur")
        v = mm(hv * nk, cur, "Vcur")
        if bias:
            v = add(v, None, "Vcur")
        q = reshape(q, (hq, nq, n_tokens), "Qcur")
        k = reshape(k, (hk, nk, n_tokens), "Kcur")
        v = reshape(v, (hv, nk, n_tokens), "Vcur")
        return q, k, v

    def build_ffn(self, cur: _T, n_ff: int, *, up: bool = True, gate: str | None = "par", act: str = "silu",
                  up_rows: int | None = None, down: int | None = None, il: int = -1) -> _T:
        """llm_graph_context::build_ffn. gate: 'par', 'seq' or None; act: silu, gelu, relu, relu_sqr, swiglu, geglu."""
        tmp = mm(up_rows or n_ff, cur, "ffn_up") if up else cur
        if gate == "seq":
            cur = mm(n_ff, tmp, "ffn_gate")
        elif gate == "par":
            cur = mm(n_ff, cur, "ffn_gate")
        else:
            cur = tmp
        par = gate == "par"
        if act in ("silu", "gelu", "relu"):
            if par:
                cur = glu_split(cur, tmp, f"ffn_{act}glu")
                par = False
            else:
                cur = unary(cur, f"ffn_{act}")
        elif act == "relu_sqr":
            cur = sqr(unary(cur, "ffn_relu"), "ffn_sqr")
        elif act in ("swiglu", "geglu", "reglu"):
            cur = glu(cur, "ffn_" + act)
        elif act == "swiglu_oai":
            cur = glu_split(cur, tmp, "ffn_swiglu_oai")
            par = False
        if par:
            cur = mul(cur, tmp, "ffn_gate_par")
        return mm(down or self.n_embd, cur, "ffn_out")

    def build_moe_ffn(self, cur: _T, l: LayerSpec, il: int, *, gating: int = 1, probs_b: bool = False,
                      norm_w: bool = True, w_scale: float = 0.0, gate_inp_b: bool = False, exps_b: bool = False,
                      act: str = "silu", gate_up: bool = False, has_gate: bool = True, probs_in: _T | None = None) -> _T:
        """llm_graph_context::build_moe_ffn. gating: 1 softmax, 2 sigmoid, 3 softmax_weight, 4 sqrt_softplus."""
        g = self.g
        n_embd, n_tokens = cur.ne[0], cur.ne[1]
        n_expert = self.spec.n_expert
        n_used = l.n_expert_used or self.spec.n_expert_used
        n_ff = l.n_ff_exp
        logits = mm(n_expert, cur, f"ffn_moe_logits-{il}") if probs_in is None else probs_in
        if gate_inp_b:
            logits = add(logits, None, f"ffn_moe_logits_biased-{il}")
        if gating == 2:
            probs = unary(logits, f"ffn_moe_probs-{il}", "sigmoid")
        elif gating == 3:
            probs = logits
        elif gating == 4:
            probs = sqrt(unary(logits, "", "softplus"), f"ffn_moe_probs-{il}")
        else:
            probs = soft_max(logits, None, None, f"ffn_moe_probs-{il}")
        selection = probs
        if probs_b:
            selection = add(probs, None, f"ffn_moe_probs_biased-{il}")
        n_groups = self.d.n_expert_groups
        if n_groups > 1 and n_tokens > 0:
            per = n_expert // n_groups
            groups = reshape(selection, (per, n_groups, n_tokens))
            scores = argsort_top_k(groups, 2, f"group_scores-{il}")
            scores = get_rows(reshape(groups, (1, groups.ne[0], groups.ne[1], groups.ne[2])), scores)
            scores = sum_rows(reshape(scores, (scores.ne[1], scores.ne[2], scores.ne[3])))
            scores = reshape(scores, (scores.ne[1], scores.ne[2]))
            expert_groups = argsort_top_k(scores, self.d.n_group_used, f"ffn_moe_group_topk-{il}")
            selection = get_rows(groups, expert_groups)
            selection = set_rows(fill(groups), selection, expert_groups)
            selection = reshape(selection, (n_expert, n_tokens))
        selected = argsort_top_k(selection, n_used, f"ffn_moe_topk-{il}")
        probs = reshape(probs, (1, n_expert, n_tokens))
        weights = get_rows(probs, selected, f"ffn_moe_weights-{il}")
        if gating == 3:
            weights = reshape(weights, (n_used, n_tokens))
            weights = soft_max(weights, None, None, f"ffn_moe_weights_softmax-{il}")
            weights = reshape(weights, (1, n_used, n_tokens))
        if norm_w:
            weights = reshape(weights, (n_used, n_tokens))
            wsum = sum_rows(weights, f"ffn_moe_weights_sum-{il}")
            wsum = clamp(wsum)
            weights = div(weights, wsum, f"ffn_moe_weights_norm-{il}")
            weights = reshape(weights, (1, n_used, n_tokens))
        if w_scale != 0.0 and w_scale != 1.0:
            weights = scale(weights, f"ffn_moe_weights_scaled-{il}")
        g.expand(weights)
        cur = reshape(cur, (n_embd, 1, n_tokens))
        if gate_up:
            gu = mul_mat_id(2 * n_ff, cur, selected, f"ffn_moe_gate_up-{il}", n_expert)
            if exps_b:
                gu = dup("ADD_ID", gu, _srcs(gu, _w((gu.ne[0], n_expert), "bias", True), selected))
            cur = view(gu, (n_ff, gu.ne[1], gu.ne[2]), (gu.nb[1], gu.nb[2]), f"ffn_moe_gate-{il}")
            up = view(gu, (n_ff, gu.ne[1], gu.ne[2]), (gu.nb[1], gu.nb[2]), f"ffn_moe_up-{il}")
        else:
            up = mul_mat_id(n_ff, cur, selected, f"ffn_moe_up-{il}", n_expert)
            if exps_b:
                up = dup("ADD_ID", up, _srcs(up, _w((up.ne[0], n_expert), "bias", True), selected), f"ffn_moe_up_biased-{il}")
            if has_gate:
                cur = mul_mat_id(n_ff, cur, selected, f"ffn_moe_gate-{il}", n_expert)
            else:
                cur = up
            if exps_b:
                cur = dup("ADD_ID", cur, _srcs(cur, _w((cur.ne[0], n_expert), "bias", True), selected), f"ffn_moe_gate_biased-{il}")
        if act == "swiglu_oai" or has_gate or gate_up:
            cur = glu_split(cur, up, f"ffn_moe_{act}-{il}")
        else:
            cur = unary(cur, f"ffn_moe_{act}-{il}")
        experts = mul_mat_id(n_embd, cur, selected, f"ffn_moe_down-{il}", n_expert)
        if exps_b:
            experts = dup("ADD_ID", experts, _srcs(experts, _w((experts.ne[0], n_expert), "bias", True), selected), f"ffn_moe_down_biased-{il}")
        experts = mul(experts, weights, f"ffn_moe_weighted-{il}")
        g.expand(experts)
        views = []
        for i in range(n_used):
            v = view(experts, (n_embd, n_tokens), (experts.nb[2],), f"ffn_moe_view-{il}")
            g.expand(v)
            views.append(v)
        moe_out = views[0]
        for i in range(1, n_used):
            moe_out = add(moe_out, views[i], f"ffn_moe_out-{il}")
            g.expand(moe_out)
        if n_used == 1:
            moe_out = cont(moe_out, f"ffn_moe_out-{il}")
        return moe_out

    def moe_args(self, il: int) -> dict:
        """The build_moe_ffn arguments an architecture passes (from GraphDetails)."""
        d = self.d
        arch = self.arch
        gating = d.expert_gating_func
        if arch == "gpt-oss":
            return dict(gating=3, norm_w=False, w_scale=d.expert_weights_scale, gate_inp_b=True, exps_b=True, act="swiglu_oai")
        if arch in ("glm4moe", "deepseek2"):
            if gating == 0:
                gating = 2 if arch == "glm4moe" else 1
            return dict(gating=gating, probs_b=d.has("exp_probs_b.bias", il), norm_w=d.expert_weights_norm,
                        w_scale=d.expert_weights_scale, gate_up=d.has("ffn_gate_up_exps", il) and not d.has("ffn_up_exps", il))
        return dict(gating=1, norm_w=True, w_scale=d.expert_weights_scale,
                    gate_up=d.has("ffn_gate_up_exps", il) and not d.has("ffn_up_exps", il))

    def hadamard(self, cur: _T, rot: _T) -> _T:  # llama_mul_mat_hadamard
        n = rot.ne[0]
        if not is_contiguous(cur):
            res = cont_nd(cur, (n, nelements(cur) // n))
        else:
            res = reshape(cur, (n, nelements(cur) // n))
        res = mul_mat(rot, res)
        return reshape(res, cur.ne)

    def cpy_k(self, kv: _KVCache, k_cur: _T, k_idxs: _T, il: int) -> _T:  # llama_kv_cache::cpy_k
        k = self.kv_tensors(kv, il)[0]
        n_embd_gqa = k_cur.ne[0] * k_cur.ne[1]
        n_tokens = k_cur.ne[2]
        k_cur = view(k_cur, (n_embd_gqa, n_tokens), (k_cur.nb[2],), "k_cur")
        if k.ne[2] > 1:
            k = reshape(k, (n_embd_gqa, kv.size * k.ne[2]))
        return set_rows(k, k_cur, k_idxs, f"cache_k_l{il} (view)")

    def cpy_v(self, kv: _KVCache, v_cur: _T, v_idxs: _T, il: int) -> _T:  # llama_kv_cache::cpy_v
        v = self.kv_tensors(kv, il)[1]
        n_embd_gqa = v_cur.ne[0] * v_cur.ne[1]
        n_tokens = v_cur.ne[2]
        if not kv.v_trans:
            v_cur = view(v_cur, (n_embd_gqa, n_tokens), (v_cur.nb[2],), "v_cur")
            if v.ne[2] > 1:
                v = reshape(v, (n_embd_gqa, kv.size * v.ne[2]))
            return set_rows(v, v_cur, v_idxs, f"cache_v_l{il} (view)")
        if _row_size(v_cur.type, n_embd_gqa) == v_cur.nb[2]:
            v_cur = reshape(v_cur, (n_embd_gqa, n_tokens))
        else:
            v_cur = cont_nd(v_cur, (n_embd_gqa, n_tokens))
        if n_embd_gqa < v.ne[0]:  # [TAG_V_CACHE_VARIABLE]
            v_cur = pad(v_cur, v.ne[0] - n_embd_gqa)
        v_view = reshape(v, (1, nelements(v)))
        v_cur = reshape(v_cur, (1, nelements(v_cur)))
        return set_rows(v_view, v_cur, v_idxs, f"cache_v_l{il} (view)")

    def get_k(self, kv: _KVCache, il: int) -> _T:  # llama_kv_cache::get_k
        k = self.kv_tensors(kv, il)[0]
        l = self.spec.layers[il]
        rs = lambda n: _row_size(k.type, n)
        return view(k, (l.n_embd_head_k, l.n_head_kv, kv.size, kv.n_stream),
                    (rs(l.n_embd_head_k), rs(k.ne[0]), rs(k.ne[0] * kv.size)), "k")

    def get_v(self, kv: _KVCache, il: int) -> _T:  # llama_kv_cache::get_v
        v = self.kv_tensors(kv, il)[1]
        l = self.spec.layers[il]
        rs = lambda n: _row_size(v.type, n)
        if not kv.v_trans:
            return view(v, (l.n_embd_head_v, l.n_head_kv, kv.size, kv.n_stream),
                        (rs(l.n_embd_head_v), rs(v.ne[0]), rs(v.ne[0] * kv.size)), "v")
        return view(v, (kv.size, l.n_head_kv, l.n_embd_head_v, kv.n_stream),
                    (rs(kv.size * l.n_embd_head_v), rs(kv.size), rs(kv.size * v.ne[0])), "v")

    def build_attn_mha(self, q: _T, k: _T, v: _T, mask: _T, *, kq_b: _T | None = None, sinks: bool = False,
                       v_mla: int = 0, softcap: bool = False, il: int = -1) -> _T:  # build_attn_mha
        v_trans = v.nb[1] > v.nb[2]
        n_stream = k.ne[3]
        q = view(q, (q.ne[0], q.ne[1], q.ne[2] // n_stream, n_stream), (q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // n_stream)), "q")
        q = permute(q, 0, 2, 1, 3)
        k = permute(k, 0, 2, 1, 3)
        v = permute(v, 0, 2, 1, 3)
        if self.fa and kq_b is None:
            if v_trans:
                v = transpose(v)
            if k.type == F32:
                k = cast(k, F16)
            if v.type == F32:
                v = cast(v, F16)
            cur = flash_attn_ext(q, k, v, mask, _w((q.ne[2],), "attn_sinks", True) if sinks else None, f"fattn-{il}")
            if v_mla:
                cur = permute(cur, 0, 2, 1, 3)
                cur = mm(v_mla, cur, f"fattn_mla-{il}")
                cur = permute(cur, 0, 2, 1, 3)
                cur = cont(cur)
            cur = reshape(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
        else:
            kq = mul_mat(k, q, f"kq-{il}")
            if softcap:
                kq = scale(kq, f"kq_scaled_1-{il}")
                kq = unary(kq, f"kq_tanh-{il}")
                kq = scale(kq, f"kq_scaled_2-{il}")
            if kq_b is not None:
                kq = add(kq, kq_b, f"kq_plus_kq_b-{il}")
            kq = soft_max(kq, mask, _w((kq.ne[2],), "attn_sinks", True) if sinks else None, f"kq_soft_max-{il}")
            if not v_trans:
                v = cont(transpose(v), f"v_cont-{il}")
            kqv = mul_mat(v, kq, f"kqv-{il}")
            if v_mla:
                kqv = mm(v_mla, kqv, f"kqv_mla-{il}")
            cur = permute(kqv, 0, 2, 1, 3)
            cur = cont_nd(cur, (cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), f"kqv_out-{il}")
        self.g.expand(cur)
        return cur

    def build_attn(self, ai: dict, q: _T, k: _T | None, v: _T | None, il: int, *, wo: int | None = None,
                   wo_b: bool = False, sinks: bool = False, softcap: bool = False, v_mla: int = 0) -> _T:
        """llm_graph_context::build_attn for llm_graph_input_attn_kv / _kv_iswa (K+V caches)."""
        g = self.g
        if ai.get("k_only"):  # build_attn(llm_graph_input_attn_k *): the cached K doubles as V
            kv = ai["kv"]
            g.expand(q)
            g.expand(v)
            g.expand(k)
            g.expand(self.cpy_k(kv, k, ai["k_idxs"], il))
            kk = self.get_k(kv, il)
            vv = view(kk, (v.ne[0], kk.ne[1], kk.ne[2], kk.ne[3]), (kk.nb[1], kk.nb[2], kk.nb[3]), "v")
            cur = self.build_attn_mha(q, kk, vv, ai["mask"], v_mla=v_mla, il=il)
            return mm(wo if wo is not None else self.n_embd, cur, f"attn_out-{il}")
        iswa = ai.get("iswa", False)
        if iswa:
            ai = ai["swa"] if self.spec.layers[il].kind == LayerKind.SWA else ai["base"]
        kv: _KVCache = ai["kv"]
        k_rot, v_rot = ai["k_rot"], ai["v_rot"]
        if k_rot is not None:
            q = self.hadamard(q, k_rot)
            if k is not None:
                k = self.hadamard(k, k_rot)
        if v_rot is not None and v is not None:
            v = self.hadamard(v, v_rot)
        if iswa:
            g.expand(q)
            if k is not None:
                g.expand(k)
            if v is not None:
                g.expand(v)
        else:
            g.expand(q)
            g.expand(v)
            g.expand(k)
        if k is not None:
            g.expand(self.cpy_k(kv, k, ai["k_idxs"], il))
        if v is not None:
            g.expand(self.cpy_v(kv, v, ai["v_idxs"], il))
        kk = self.get_k(kv, il)
        vv = self.get_v(kv, il)
        cur = self.build_attn_mha(q, kk, vv, ai["mask"], sinks=sinks, softcap=softcap, v_mla=v_mla, il=il)
        if v_rot is not None:
            cur = self.hadamard(cur, v_rot)
        if wo == 0:  # no output projection inside build_attn (the caller applies it)
            return cur
        cur = mm(wo if wo is not None else self.n_embd, cur, f"attn_out-{il}")
        if wo_b:
            cur = add(cur, None, f"attn_out_b-{il}")
        return cur

    def finish(self, *outputs: _T) -> None:
        for t in outputs:
            if t is not None:
                t.flags |= FLAG_OUTPUT
        self.g.expand(outputs[-1])


# --------------------------------------------------------------------------------------------------
# architectures (src/models/<arch>.cpp)


def _graph_llama_like(c: _Ctx) -> Iterator:
    """llama, mistral3, qwen2, qwen3 (and their MoE FFN branch): src/models/{llama,mistral3,qwen2,qwen3}.cpp."""
    sp = c.spec
    arch = c.arch
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos()
    attn_scale = inp(F32, (1, 1, c.n_tokens), "inp_attn_scale") if c.d.attn_temperature_scale else None
    ai = c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    qk_norm = arch in ("qwen3", "qwen3moe")
    bias = c.d.has("attn_q.bias")
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur, bias=bias)
        if qk_norm:
            q = c.build_norm(q, name=f"Qcur_normed-{il}")
            q = rope(q, inp_pos, None, f"Qcur-{il}")
            k = c.build_norm(k, name=f"Kcur_normed-{il}")
            k = rope(k, inp_pos, None, f"Kcur-{il}")
        else:
            q = rope(q, inp_pos, None, f"Qcur-{il}")
            k = rope(k, inp_pos, None, f"Kcur-{il}")
        if attn_scale is not None:
            q = mul(q, attn_scale, f"Qcur_scaled-{il}")
        cur = c.build_attn(ai, q, k, v, il)
        if il == sp.n_layer - 1:
            cur = get_rows(cur, out_ids)
            inpSA = get_rows(inpSA, out_ids)
        ffn_inp = add(cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"ffn_norm-{il}")
        if sp.n_expert > 0 and l.n_ff_exp > 0:
            cur = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
        else:
            cur = c.build_ffn(cur, l.n_ff, il=il)
        il, inpL = yield add(cur, ffn_inp, f"l_out-{il}")
    cur = c.build_norm(inpL, name="result_norm")
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(cur, logits)


def _graph_gemma(c: _Ctx) -> Iterator:
    """gemma2 and gemma3: src/models/gemma2.cpp, gemma3.cpp."""
    sp = c.spec
    gemma3 = c.arch == "gemma3"
    inpL = c.build_inp_embd()
    inpL = scale(inpL, "inp_scaled")
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv_iswa() if sp.is_swa_any else c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur)
        if gemma3:
            q = c.build_norm(q, name=f"Qcur_normed-{il}")
            q = rope(q, inp_pos, None, f"Qcur-{il}")
            k = c.build_norm(k, name=f"Kcur_normed-{il}")
            k = rope(k, inp_pos, None, f"Kcur-{il}")
        else:
            q = rope(q, inp_pos, None, f"Qcur-{il}")
            k = rope(k, inp_pos, None, f"Kcur-{il}")
        q = scale(q, f"Qcur_scaled-{il}")
        cur = c.build_attn(ai, q, k, v, il, softcap=not gemma3)
        if il == sp.n_layer - 1:
            cur = get_rows(cur, out_ids)
            inpL = get_rows(inpL, out_ids)
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        sa_out = add(cur, inpL, f"sa_out-{il}")
        cur = c.build_norm(sa_out, name=f"ffn_norm-{il}")
        cur = c.build_ffn(cur, l.n_ff, act="gelu", il=il)
        cur = c.build_norm(cur, name=f"ffn_post_norm-{il}")
        il, inpL = yield add(cur, sa_out, f"l_out-{il}")
    cur = c.build_norm(inpL, name="result_norm")
    logits = mm(sp.n_vocab, cur, "result_output")
    if not gemma3 or c.d.final_logit_softcapping:
        logits = scale(logits)
        logits = unary(logits)
        logits = scale(logits, "result_output")
    c.finish(cur, logits)


def _graph_phi3(c: _Ctx) -> Iterator:
    """phi3 (llama.cpp disables its sliding window): src/models/phi3.cpp."""
    sp = c.spec
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        residual = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur, fused=True)
        q = rope(q, inp_pos, None, f"Qcur-{il}")
        k = rope(k, inp_pos, None, f"Kcur-{il}")
        q = scale(q, f"Qcur_scaled-{il}")
        cur = c.build_attn(ai, q, k, v, il)
        if il == sp.n_layer - 1:
            cur = get_rows(cur, out_ids)
            residual = get_rows(residual, out_ids)
        cur = add(cur, residual, f"ffn_inp-{il}")
        residual = cur
        cur = c.build_norm(cur, name=f"ffn_norm-{il}")
        if sp.n_expert > 0 and l.n_ff_exp > 0:
            cur = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
        else:
            cur = c.build_ffn(cur, l.n_ff, gate=None, act="swiglu", up_rows=2 * l.n_ff, il=il)
        il, inpL = yield add(residual, cur, f"l_out-{il}")
    cur = c.build_norm(inpL, name="result_norm")
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(cur, logits)


def _graph_gpt_oss(c: _Ctx) -> Iterator:
    """gpt-oss: src/models/openai-moe.cpp (iSWA, attention sinks, biased experts)."""
    sp = c.spec
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv_iswa() if sp.is_swa_any else c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        q, k, v = c.build_qkv(l, cur, bias=c.d.has("attn_q.bias", il))
        q = rope(q, inp_pos, None, f"Qcur-{il}")
        k = rope(k, inp_pos, None, f"Kcur-{il}")
        cur = c.build_attn(ai, q, k, v, il, wo_b=c.d.has("attn_output.bias", il), sinks=True)
        ffn_inp = add(cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"attn_post_norm-{il}")
        cur = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
        il, inpL = yield add(cur, ffn_inp, f"l_out-{il}")
    h_nextn = inpL
    cur = get_rows(inpL, out_ids)
    cur = c.build_norm(cur, name="result_norm")
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(h_nextn, cur, logits)


def _shared_expert(c: _Ctx, cur: _T, il: int) -> _T:
    """build_ffn over the shared expert (glm4moe, deepseek2: n_ff_exp * n_expert_shared wide)."""
    sp = c.spec
    n_ff = sp.layers[il].n_ff_exp * sp.n_expert_shared
    if n_ff == 0:  # build_ffn with no weights: silu(cur)
        return unary(cur, f"ffn_silu-{il}")
    return c.build_ffn(cur, n_ff, il=il)


def _routed_and_shared(c: _Ctx, cur: _T, il: int) -> _T:
    """The MoE FFN of glm4moe and deepseek2 (graph and MTP): routed experts plus the shared expert."""
    routed = c.build_moe_ffn(cur, c.spec.layers[il], il, **c.moe_args(il))
    return add(routed, _shared_expert(c, cur, il), f"ffn_out-{il}")


def _glm4moe_attn(c: _Ctx, cur: _T, inp_pos: _T, ai: dict, il: int) -> _T:
    """The attention block of glm4-moe.cpp's graph and its MTP layer (optional Q/K norms, NeoX RoPE)."""
    d = c.d
    q, k, v = c.build_qkv(c.spec.layers[il], cur, bias=d.has("attn_q.bias", il))
    if d.has("attn_q_norm", il):
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
    if d.has("attn_k_norm", il):
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
    q = rope(q, inp_pos, None, f"Qcur-{il}")
    k = rope(k, inp_pos, None, f"Kcur-{il}")
    return c.build_attn(ai, q, k, v, il)


def _graph_glm4moe(c: _Ctx) -> Iterator:
    """glm4moe: src/models/glm4-moe.cpp (leading dense layers, routed + shared experts)."""
    sp = c.spec
    d = c.d
    inpL = c.build_inp_embd()
    inp_pos = c.build_inp_pos(4 if d.mrope else 1)
    ai = c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        cur = _glm4moe_attn(c, cur, inp_pos, ai, il)
        if il == sp.n_layer - 1:
            cur = get_rows(cur, out_ids)
            inpSA = get_rows(inpSA, out_ids)
        ffn_inp = add(cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"attn_post_norm-{il}")
        cur = c.build_ffn(cur, l.n_ff, il=il) if il < sp.n_layer_dense_lead else _routed_and_shared(c, cur, il)
        il, inpL = yield add(cur, ffn_inp, f"l_out-{il}")
    cur = c.build_norm(inpL, name="result_norm")
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(cur, logits)


def _deepseek2_attn(c: _Ctx, cur: _T, inp_pos: _T, ai: dict, il: int, attn_scale: _T | None) -> _T:
    """The attention block of deepseek2's graph and graph_mtp (MLA with the absorbed K/V projections, or MHA)."""
    sp = c.spec
    d = c.d
    n_tokens = c.n_tokens
    l0 = sp.layers[0]
    n_head = l0.n_head
    kvr = sp.n_lora_kv
    if sp.is_mla:
        hk, hv = sp.n_embd_head_k_mla, sp.n_embd_head_v_mla
        n_rot = d.n_rot or (l0.n_embd_head_k - kvr)
    else:
        hk, hv = l0.n_embd_head_k, l0.n_embd_head_v
        n_rot = d.n_rot or 64
    nope = hk - n_rot
    if d.has("attn_q_a"):
        q = mm(d.n_lora_q, cur, f"q_a-{il}")
        q = c.build_norm(q, name=f"q_a_norm-{il}")
        q = mm(n_head * hk, q, f"q-{il}")
    else:  # V2-Lite: no q LoRA
        q = mm(n_head * hk, cur, f"q-{il}")
    q = reshape(q, (hk, n_head, n_tokens))
    kv_pe = mm(kvr + n_rot, cur, f"kv_cmpr_pe-{il}")
    rs = _row_size(kv_pe.type, kvr + n_rot)
    kv_cmpr = view(kv_pe, (kvr, n_tokens), (rs,), f"kv_cmpr-{il}")
    k_pe = view(kv_pe, (n_rot, 1, n_tokens), (rs, rs), f"k_pe-{il}")
    k_pe = rope(k_pe, inp_pos, None, f"k_pe-{il}")
    kv_cmpr = c.build_norm(kv_cmpr, name=f"kv_cmpr_norm-{il}")
    if sp.is_mla:
        q_nope = view(q, (nope, n_head, n_tokens), (q.nb[1], q.nb[2]), f"q_nope-{il}")
        q_pe = view(q, (n_rot, n_head, n_tokens), (q.nb[1], q.nb[2]), f"q_pe-{il}")
        q_pe = rope(q_pe, inp_pos, None, f"q_pe-{il}")
        q_nope = permute(q_nope, 0, 2, 1, 3)
        q_abs = mm(kvr, q_nope, f"q_nope_absorbed-{il}", wne=(nope, kvr, n_head))
        q_abs = permute(q_abs, 0, 2, 1, 3)
        Qcur = concat(q_abs, q_pe, 0, f"Qcur-{il}")
        kv_cmpr = reshape(kv_cmpr, (kvr, 1, n_tokens))
        Kcur = concat(kv_cmpr, k_pe, 0, f"Kcur-{il}")
        Vcur = kv_cmpr
        if attn_scale is not None:
            Qcur = mul(Qcur, attn_scale)
        return c.build_attn(ai, Qcur, Kcur, Vcur, il, v_mla=hv)
    kv = mm(n_head * (nope + hv), kv_cmpr, f"kv-{il}")
    rsk = _row_size(kv.type, nope + hv)
    k_nope = view(kv, (nope, n_head, n_tokens), (rsk, rsk * n_head), f"k_nope-{il}")
    Vcur = view(kv, (hv, n_head, n_tokens), (rsk, rsk * n_head), f"Vcur-{il}")
    Vcur = cont(Vcur, f"Vcur-{il}")
    Qcur = rope(q, inp_pos, None, f"Qcur-{il}")
    Kcur = concat(k_nope, repeat_4d(k_pe, (n_rot, n_head, n_tokens, 1)), 0, f"Kcur-{il}")
    if attn_scale is not None:
        Qcur = mul(Qcur, attn_scale)
    return c.build_attn(ai, Qcur, Kcur, Vcur, il)


def _graph_deepseek2(c: _Ctx) -> Iterator:
    """deepseek2: src/models/deepseek2.cpp (MLA with the absorbed K/V projections, or legacy MHA)."""
    sp = c.spec
    d = c.d
    inpL = c.build_inp_embd()
    attn_scale = inp(F32, (1, 1, c.n_tokens), "inp_attn_scale") if d.attn_temperature_scale else None
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_k() if sp.is_mla else c.build_attn_inp_kv()
    out_ids = c.build_inp_out_ids()
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        cur = _deepseek2_attn(c, cur, inp_pos, ai, il, attn_scale)
        if il == sp.n_layer - 1:
            cur = get_rows(cur, out_ids)
            inpSA = get_rows(inpSA, out_ids)
        ffn_inp = add(cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"ffn_norm-{il}")
        cur = c.build_ffn(cur, l.n_ff, il=il) if il < sp.n_layer_dense_lead else _routed_and_shared(c, cur, il)
        il, inpL = yield add(cur, ffn_inp, f"l_out-{il}")
    cur = c.build_norm(inpL, name="result_norm")
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(cur, logits)


def _gdn_layer(c: _Ctx, rs: dict, cur: _T, il: int) -> _T:
    """build_layer_attn_linear of qwen35 / qwen35moe / qwen3next (gated delta net, fused op)."""
    sp = c.spec
    ssm = sp.ssm
    g = c.g
    arch = c.arch
    n_seqs = c.n_seqs
    nst = c.n_tokens // n_seqs
    d_inner, hk, nkh, nvh = ssm.d_inner, ssm.d_state, ssm.n_group, ssm.dt_rank
    hv = d_inner // nvh
    conv_channels = d_inner + 2 * nkh * hk
    # build_qkvz
    if arch == "qwen3next" and c.d.has("ssm_in", il):
        qkvz_dim = 2 * hk + 2 * hv * (nvh // nkh)
        mixed = mm(nkh * qkvz_dim, cur, f"mixed_qkvz-{il}")
        mixed = reshape(mixed, (qkvz_dim, nkh, nst, n_seqs))
        sizes = (hk, hk, hv * nvh // nkh, hv * nvh // nkh)
        nb = (mixed.nb[1], mixed.nb[2], mixed.nb[3])
        query = view(mixed, (sizes[0], nkh, nst, n_seqs), nb)
        key = view(mixed, (sizes[1], nkh, nst, n_seqs), nb)
        value = view(mixed, (sizes[2], nkh, nst, n_seqs), nb)
        z = view(mixed, (sizes[3], nkh, nst, n_seqs), nb)
        z = cont(z, f"z-{il}")
        qf = cont_nd(query, (hk * nkh, nst, n_seqs))
        kf = cont_nd(key, (hk * nkh, nst, n_seqs))
        vf = cont_nd(value, (hv * nvh, nst, n_seqs))
        qkv_mixed = concat(concat(qf, kf, 0), vf, 0, f"qkv_mixed-{il}")
    else:
        qkv_mixed = mm(conv_channels, cur, f"qkv_mixed-{il}")
        qkv_mixed = reshape(qkv_mixed, (qkv_mixed.ne[0], nst, n_seqs))
        z = mm(d_inner, cur, f"z-{il}")
    if arch == "qwen3next":
        ba = mm(2 * nvh, cur, f"mixed_ba-{il}")
        ba = reshape(ba, (2 * nvh // nkh, nkh, nst, n_seqs))
        nb = (ba.nb[1], ba.nb[2], ba.nb[3])
        b = view(ba, (nvh // nkh, nkh, nst, n_seqs), nb)
        a = view(ba, (nvh // nkh, nkh, nst, n_seqs), nb)
        b = cont(b)
        beta = unary(b, f"beta-{il}")
        alpha = cont_nd(a, (nvh, nst, n_seqs))
        alpha = unary(add(alpha, None), f"alpha_softplus-{il}")
        gate = mul(alpha, None, f"gate-{il}")
        beta = reshape(beta, (1, nvh, nst, n_seqs))
        gate = reshape(gate, (1, nvh, nst, n_seqs))
    else:
        beta = mm(nvh, cur, f"beta-{il}")
        beta = reshape(beta, (1, nvh, nst, n_seqs))
        beta = unary(beta, f"beta-{il}")
        alpha = mm(nvh, cur, f"alpha-{il}")
        alpha = reshape(alpha, (nvh, nst, n_seqs))
        alpha = unary(add(alpha, None), f"alpha_softplus-{il}")
        gate = mul(alpha, None, f"gate-{il}")
        gate = reshape(gate, (1, nvh, nst, n_seqs))
    conv_all = cache(F32, (ssm.n_embd_r, rs["rows"]), f"cache_r_l{il}")
    ssm_all = cache(F32, (ssm.n_embd_s, rs["rows"]), f"cache_s_l{il}")
    # build_conv_state
    conv_states = c.build_rs(rs, conv_all, ssm.n_embd_r)
    conv_states = reshape(conv_states, (ssm.d_conv - 1, conv_channels, n_seqs))
    qkv_t = transpose(qkv_mixed)
    conv_input = concat(conv_states, qkv_t, 0, f"conv_input-{il}")
    K = c.cp.n_rs_seq + 1
    for t in range(1, K + 1) if c.cp.n_rs_seq else (None,):
        last = view(conv_input, (ssm.d_conv - 1, conv_channels, n_seqs), (conv_input.nb[1], conv_input.nb[2]), "conv_state_last")
        upd = view(conv_all, (ssm.n_embd_r, n_seqs), (conv_all.nb[1],), "conv_state_update")
        g.expand(cpy(last, upd))
    state = c.build_rs(rs, ssm_all, ssm.n_embd_s)
    state = reshape(state, (hv, hv, nvh, n_seqs))
    conv_out = _new("SSM_CONV", F32, (conv_channels, conv_input.ne[0] - ssm.d_conv + 1, conv_input.ne[2]),
                    _srcs(conv_input, _w((ssm.d_conv, conv_channels), "ssm_conv1d", True)), f"conv_out-{il}")
    conv_out = unary(conv_out, f"conv_out_silu-{il}")
    qkv_dim = hk * nkh * 2 + hv * nvh
    nb1 = _row_size(F32, qkv_dim)
    q_conv = view(conv_out, (hk, nkh, nst, n_seqs), (_row_size(F32, hk), nb1, nb1 * nst), "q_conv")
    k_conv = view(conv_out, (hk, nkh, nst, n_seqs), (_row_size(F32, hk), nb1, nb1 * nst), "k_conv")
    v_conv = view(conv_out, (hv, nvh, nst, n_seqs), (_row_size(F32, hv), nb1, nb1 * nst), "v_conv")
    q_conv = scale(rms_norm(q_conv), f"q_conv-{il}")  # build_gdn_l2_norm
    k_conv = scale(rms_norm(k_conv), f"k_conv-{il}")
    if nkh != nvh:
        rf = nvh // nkh
        if arch == "qwen3next":
            qr = reshape(q_conv, (hk, 1, nkh, nst * n_seqs))
            kr = reshape(k_conv, (hk, 1, nkh, nst * n_seqs))
            q_conv = reshape(repeat_4d(qr, (hk, rf, nkh, nst * n_seqs)), (hk, nkh * rf, nst, n_seqs))
            k_conv = reshape(repeat_4d(kr, (hk, rf, nkh, nst * n_seqs)), (hk, nkh * rf, nst, n_seqs))
        # qwen35 / qwen35moe repeat only without the fused GDN ops (always fused: cparams.fused_gdn_*)
    # build_recurrent_attn -> build_delta_net_fused
    S_v, H_v = v_conv.ne[0], v_conv.ne[1]
    Kk = c.cp.n_rs_seq + 1 if c.cp.n_rs_seq else 1
    res = _new("GATED_DELTA_NET", F32, (S_v * H_v, nst * n_seqs + Kk * S_v * n_seqs), (q_conv, k_conv, v_conv, gate, beta, state), f"gdn-{il}")
    rsz = lambda n: _row_size(F32, n)
    output = view(res, (S_v, H_v, nst, n_seqs), (rsz(S_v), rsz(S_v * H_v), rsz(S_v * H_v * nst)), "gdn_out")
    if not c.cp.n_rs_seq:
        new_state = view(res, (S_v, S_v, H_v, n_seqs), (rsz(S_v), rsz(S_v * S_v), rsz(S_v * S_v * H_v)), "gdn_state")
        g.expand(cpy(new_state, view(ssm_all, (ssm.n_embd_s, n_seqs), (ssm_all.nb[1],), "ssm_dst")))
    else:
        D = S_v * S_v * H_v
        n_written = min(nst, Kk)
        src = view(res, (D, n_seqs, n_written), (rsz(D), rsz(D * n_seqs)), "gdn_states")
        dst = view(ssm_all, (D, n_seqs, n_written), (ssm_all.nb[1], ssm_all.nb[1] * rs["n_rs"]), "ssm_dst")
        g.expand(cpy(src, dst))
    z_2d = reshape(z, (hv, nvh, nst, n_seqs))
    normalized = c.build_norm(output, name=f"ssm_norm-{il}")
    gated = unary(z_2d, f"z_silu-{il}")
    out = mul(normalized, gated, f"attn_out_norm-{il}")
    out = reshape(out, (hv * nvh, nst, n_seqs))
    cur = mm(c.n_embd, out, f"ssm_out-{il}")
    return reshape(cur, (c.n_embd, nst * n_seqs))


def _gated_attn_layer(c: _Ctx, ai: dict, cur: _T, inp_pos: _T, il: int) -> _T:
    """build_layer_attn of qwen35 / qwen35moe / qwen3next (Q with an output gate)."""
    l = c.spec.layers[il]
    hd, nh, nkv = l.n_embd_head_k, l.n_head, l.n_head_kv
    n_tokens = c.n_tokens
    q_full = mm(hd * 2 * nh, cur, f"Qcur_full-{il}")
    k = mm(hd * nkv, cur, f"Kcur-{il}")
    v = mm(hd * nkv, cur, f"Vcur-{il}")
    es = _TSIZE[F32]
    if c.arch == "qwen3next":
        q_full = reshape(q_full, (hd * 2, nh, n_tokens, 1))
        nb = (q_full.nb[1], q_full.nb[2], q_full.nb[3])
        q = view(q_full, (hd, nh, n_tokens, 1), nb, "Qcur")
        gate = view(q_full, (hd, nh, n_tokens, 1), nb, "gate")
        k = reshape(k, (hd, nkv, n_tokens))
        v = reshape(v, (hd, nkv, n_tokens))
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
        q = rope(q, inp_pos, None, f"Qcur-{il}")
        k = rope(k, inp_pos, None, f"Kcur-{il}")
        cur = c.build_attn(ai, q, k, v, il, wo=0)
        gate = cont_nd(gate, (hd * nh, n_tokens))
        gate = unary(gate, f"gate_sigmoid-{il}")
        cur = mul(cur, gate)
    else:
        q = view(q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "Qcur")
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        k = reshape(k, (hd, nkv, n_tokens))
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
        gate = view(q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "gate")
        gate = cont_nd(gate, (hd * nh, n_tokens))
        v = reshape(v, (hd, nkv, n_tokens))
        q = rope(q, inp_pos, None, f"Qcur-{il}")
        k = rope(k, inp_pos, None, f"Kcur-{il}")
        cur = c.build_attn(ai, q, k, v, il, wo=0)
        gate = unary(gate, f"gate_sigmoid-{il}")
        cur = mul(cur, gate)
    return mm(c.n_embd, cur, f"attn_out-{il}")


def _graph_gdn_hybrid(c: _Ctx) -> Iterator:
    """qwen35, qwen35moe, qwen3next: src/models/{qwen35,qwen35moe,qwen3next}.cpp + delta-net-base.cpp."""
    sp = c.spec
    inpL = c.build_inp_embd()
    rs, ai = c.build_inp_mem_hybrid()
    inp_pos = c.build_inp_pos(1 if c.arch == "qwen3next" else 4)
    out_ids = c.build_inp_out_ids()
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        inpSA = inpL
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        c.g.expand(cur)
        if l.kind == LayerKind.RECURRENT:
            cur = _gdn_layer(c, rs, cur, il)
        else:
            cur = _gated_attn_layer(c, ai, cur, inp_pos, il)
        cur = add(cur, inpSA, f"attn_residual-{il}")
        ffn_residual = cur
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        if sp.n_expert and l.n_ff_exp:
            moe_out = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
            if sp.n_ff_shexp:
                shexp = c.build_ffn(cur, sp.n_ff_shexp, il=il)
                sgate = unary(mm(1, cur, f"shared_gate-{il}"))
                shexp = mul(shexp, sgate)
                cur = add(moe_out, shexp, f"ffn_out-{il}")
            else:
                cur = moe_out
        else:
            cur = c.build_ffn(cur, l.n_ff, il=il)
        il, inpL = yield add(cur, ffn_residual, f"l_out-{il}")
    h = c.build_norm(inpL, name="result_norm")
    cur = get_rows(h, out_ids)
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(h, cur, logits)


def _graph_gemma4(c: _Ctx) -> Iterator:
    """gemma4: src/models/gemma4.cpp (per-layer heads, shared-KV layers, per-layer embeddings, MoE)."""
    sp = c.spec
    d = c.d
    n_tokens = c.n_tokens
    n_layer = sp.n_layer
    ple = d.n_embd_per_layer
    inpL = c.build_inp_embd()
    inpL = scale(inpL, "inp_scaled")
    inp_pos = c.build_inp_pos()
    ai = c.build_attn_inp_kv_iswa()
    out_ids = c.build_inp_out_ids()
    inp_per_layer = None
    if ple:
        tokens = inp(I32, (n_tokens,), "inp_tokens_ple")
        x = get_rows(weight((ple * n_layer, sp.n_vocab), "per_layer_token_embd", host=True), tokens, "inp_per_layer")
        x = reshape(x, (ple, n_layer, n_tokens))
        x = scale(x, "inp_per_layer_scaled")
        c.g.expand(x)
        proj = mm(ple * n_layer, inpL, "per_layer_proj")
        proj = scale(proj)
        proj = reshape(proj, (ple, n_layer, n_tokens))
        proj = c.build_norm(proj, name="per_layer_proj_norm")
        x = add(proj, x)
        x = scale(x)
        inp_per_layer = cont(permute(x, 0, 2, 1, 3), "inp_per_layer")
    il, inpL = yield inpL  # the driver sends (layer, input) pairs: see _simulate / _build_full
    while il is not None:
        l = sp.layers[il]
        hd, nh, nkv = l.n_embd_head_k, l.n_head, l.n_head_kv
        cur = c.build_norm(inpL, name=f"attn_norm-{il}")
        fused = d.has("attn_qkv", il)
        if fused:
            qkv = mm(hd * nh + 2 * hd * nkv, cur, f"wqkv-{il}")
            q = cont(view(qkv, (hd * nh, n_tokens), (qkv.nb[1],)))
        else:
            q = mm(hd * nh, cur, f"Qcur-{il}")
        q = reshape(q, (hd, nh, n_tokens))
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        q = rope(q, inp_pos, None, f"Qcur-{il}")
        if l.has_kv:
            if fused:
                k = cont(view(qkv, (hd * nkv, n_tokens), (qkv.nb[1],)))
                v = cont(view(qkv, (hd * nkv, n_tokens), (qkv.nb[1],)))
            else:
                k = mm(hd * nkv, cur, f"Kcur-{il}")
                v = mm(hd * nkv, cur, f"Vcur-{il}") if d.has("attn_v", il) else k
            k = reshape(k, (hd, nkv, n_tokens))
            v = reshape(v, (hd, nkv, n_tokens))
            k = c.build_norm(k, name=f"Kcur_normed-{il}")
            v = rms_norm(v, f"Vcur_normed-{il}")
            k = rope(k, inp_pos, None, f"Kcur-{il}")
            cur = c.build_attn(ai, q, k, v, il)
        else:
            cur = c.build_attn(ai, q, None, None, il)
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        attn_out = add(cur, inpL, f"attn_out-{il}")
        if d.has("ffn_gate_inp", il):
            mlp = c.build_norm(attn_out, name=f"ffn_norm-{il}")
            mlp = c.build_ffn(mlp, l.n_ff, act="gelu", il=il)
            mlp = c.build_norm(mlp, name=f"ffn_post_norm_1-{il}")
            moe = c.build_norm(attn_out, name=f"ffn_pre_norm_2-{il}")
            tmp = rms_norm(attn_out)
            tmp = scale(tmp)
            tmp = mul(tmp, None)
            logits = mm(sp.n_expert, tmp, f"ffn_moe_logits-{il}")
            moe = c.build_moe_ffn(moe, l, il, gating=1, norm_w=True, w_scale=1.0, act="gelu",
                                  gate_up=d.has("ffn_gate_up_exps", il) and not d.has("ffn_up_exps", il), probs_in=logits)
            moe = c.build_norm(moe, name=f"ffn_post_norm_2-{il}")
            cur = add(mlp, moe, f"ffn_out-{il}")
        else:
            cur = c.build_norm(attn_out, name=f"ffn_norm-{il}")
            cur = c.build_ffn(cur, l.n_ff, act="gelu", il=il)
        cur = c.build_norm(cur, name=f"ffn_post_norm-{il}")
        cur = add(cur, attn_out, f"ffn_residual-{il}")
        if inp_per_layer is not None:
            pe_in = cur
            cur = mm(ple, cur, f"per_layer_inp_gate-{il}")
            cur = unary(cur)
            this = view(inp_per_layer, (inp_per_layer.ne[0], inp_per_layer.ne[1]), (_row_size(F32, inp_per_layer.ne[0]),), f"inp_per_layer-{il}")
            cur = mul(cur, this)
            cur = mm(c.n_embd, cur, f"per_layer_proj-{il}")
            cur = c.build_norm(cur, name=f"per_layer_post_norm-{il}")
            cur = add(pe_in, cur, f"ple_out-{il}")
        if d.has("layer_output_scale", il):
            cur = mul(cur, None, f"out_scaled-{il}")
        il, inpL = yield cur
    h = c.build_norm(inpL, name="result_norm")
    cur = get_rows(h, out_ids)
    logits = mm(sp.n_vocab, cur, "result_output")
    if d.final_logit_softcapping:
        logits = scale(logits)
        logits = unary(logits)
        logits = scale(logits, "result_output")
    c.finish(h, cur, logits)


def _graph_mtp(c: _Ctx) -> None:
    """The draft graph of an MTP context (LLM_GRAPH_TYPE_DECODER_MTP): one NextN block after the trunk.

    graph_mtp of src/models/{qwen35,qwen35moe,qwen3next,glm4-moe,deepseek2}.cpp. Not a generator: the
    whole graph is one segment.
    """
    sp = c.spec
    d = c.d
    arch = c.arch
    n_tokens = c.n_tokens
    il = sp.n_layer
    l = sp.layers[il]
    tokens = inp(I32, (n_tokens,), "inp_tokens")
    tok = get_rows(weight((c.n_embd, sp.n_vocab), "token_embd", host=True), tokens, "mtp_tok_embd")
    h = inp(F32, (c.n_embd, n_tokens), "mtp_h_input")
    qwen = arch in ("qwen35", "qwen35moe", "qwen3next")
    inp_pos = c.build_inp_pos(4 if arch in ("qwen35", "qwen35moe") or (arch == "glm4moe" and d.mrope) else 1)
    out_ids = c.build_inp_out_ids()
    layers = [x.index for x in sp.layers if x.index >= sp.n_layer]
    if arch == "deepseek2" and sp.is_mla:
        ai = c._attn_k_inputs(layers)
    else:
        ai = c.build_attn_inp_kv(layers)
    h_norm = c.build_norm(h, name=f"mtp_hnorm-{il}")
    e_norm = c.build_norm(tok, name=f"mtp_enorm-{il}")
    cur = concat(e_norm, h_norm, 0, f"mtp_concat-{il}")
    cur = mm(c.n_embd, cur, f"mtp_eh_proj-{il}")
    inpSA = cur
    cur = c.build_norm(cur, name=f"mtp_attn_norm-{il}")
    if qwen:
        hd, nh, nkv = l.n_embd_head_k, l.n_head, l.n_head_kv
        q_full = mm(hd * 2 * nh, cur, f"Qcur_full-{il}")
        k = mm(hd * nkv, cur, f"Kcur-{il}")
        v = mm(hd * nkv, cur, f"Vcur-{il}")
        es = _TSIZE[F32]
        q = view(q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "Qcur")
        q = c.build_norm(q, name=f"Qcur_normed-{il}")
        if arch != "qwen3next":
            gate = view(q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "gate")
            gate = cont_nd(gate, (hd * nh, n_tokens), f"gate-{il}")
        k = reshape(k, (hd, nkv, n_tokens))
        k = c.build_norm(k, name=f"Kcur_normed-{il}")
        v = reshape(v, (hd, nkv, n_tokens))
        q = rope(q, inp_pos, None, f"Qcur-{il}")
        k = rope(k, inp_pos, None, f"Kcur-{il}")
        cur = c.build_attn(ai, q, k, v, il, wo=0)
        if arch == "qwen3next":
            gate = view(q_full, (hd, nh, n_tokens), (es * hd * 2, es * hd * 2 * nh), "gate")
            gate = cont_nd(gate, (hd * nh, n_tokens), f"gate-{il}")
        cur = mul(cur, unary(gate, f"gate_sigmoid-{il}"))
        cur = mm(c.n_embd, cur, f"attn_out-{il}")
        if arch == "qwen3next":
            cur = get_rows(cur, out_ids)
            inpSA = get_rows(inpSA, out_ids)
        cur = add(cur, inpSA, f"attn_residual-{il}")
        ffn_residual = cur
        cur = c.build_norm(cur, name=f"attn_post_norm-{il}")
        if arch == "qwen35":
            cur = c.build_ffn(cur, l.n_ff, il=il)
        else:
            moe_out = c.build_moe_ffn(cur, l, il, **c.moe_args(il))
            if sp.n_ff_shexp:
                shexp = c.build_ffn(cur, sp.n_ff_shexp, il=il)
                shexp = mul(shexp, unary(mm(1, cur, f"shared_gate-{il}")))
                cur = add(moe_out, shexp, f"ffn_out-{il}")
            else:
                cur = moe_out
        cur = add(cur, ffn_residual, f"l_out-{il}")
    else:
        if arch == "deepseek2":
            cur = _deepseek2_attn(c, cur, inp_pos, ai, il, None)
        else:  # glm4moe
            cur = _glm4moe_attn(c, cur, inp_pos, ai, il)
        ffn_inp = add(cur, inpSA, f"ffn_inp-{il}")
        cur = c.build_norm(ffn_inp, name=f"ffn_norm-{il}")
        cur = _routed_and_shared(c, cur, il)
        cur = add(cur, ffn_inp, f"l_out-{il}")
    h_out = c.build_norm(cur, name="result_norm")
    cur = h_out if arch == "qwen3next" else get_rows(h_out, out_ids)
    logits = mm(sp.n_vocab, cur, "result_output")
    c.finish(h_out, logits)


_MTP_ARCHS = frozenset(("qwen35", "qwen35moe", "qwen3next", "glm4moe", "deepseek2"))


_GRAPHS: dict[str, Callable[[_Ctx], None]] = {
    "gemma4": _graph_gemma4,
    "qwen35": _graph_gdn_hybrid,
    "qwen35moe": _graph_gdn_hybrid,
    "qwen3next": _graph_gdn_hybrid,
    "glm4moe": _graph_glm4moe,
    "deepseek2": _graph_deepseek2,
    "gpt-oss": _graph_gpt_oss,
    "llama": _graph_llama_like,
    "mistral3": _graph_llama_like,
    "qwen2": _graph_llama_like,
    "qwen3": _graph_llama_like,
    "qwen3moe": _graph_llama_like,
    "gemma2": _graph_gemma,
    "gemma3": _graph_gemma,
    "phi3": _graph_phi3,
}


def _build_full(spec: ModelSpec, cp: ContextParams, details: GraphDetails | None = None) -> _Ctx:
    """The whole graph, layer after layer, exactly as llama_model::build_graph emits it."""
    c = _Ctx(spec, cp, details or default_details(spec))
    gen = _GRAPHS[spec.architecture](c)
    x = next(gen)
    for il in range(spec.n_layer):
        x = gen.send((il, x))
    try:
        gen.send((None, x))
    except StopIteration:
        pass
    return c


def _emulate_full(spec: ModelSpec, cp: ContextParams, details: GraphDetails | None = None, align: int = 32):
    """Reference path: build every node, allocate the whole graph (slow for deep models)."""
    c = _build_full(spec, cp, details)
    ga = _Gallocr(align)
    return ga.run(c.g.nodes, c.g.leafs)


class _Segment:
    """The nodes one layer (or the prologue / epilogue) adds to the graph, ready to be re-allocated."""

    __slots__ = ("nodes", "steady", "leafs", "inp", "out", "created", "locals", "first_counts", "steady_counts",
                 "glob_first", "glob_steady", "dev")

    def __init__(self, nodes: list[_T], leafs: list[_T], created: list[_T], inp: _T | None, out: _T | None, dev: int = 0):
        self.nodes = nodes
        self.leafs = leafs
        self.created = created
        self.inp = inp
        self.out = out
        self.dev = dev

    def finalize(self) -> None:
        nodes = self.nodes
        self.steady = [n for n in nodes if not n.glob]  # prologue tensors are emitted once, at their first use
        local = {id(t): t for t in self.created if not t.glob and not t.ext}
        for n in nodes:  # scheduler copies are created after the segment
            if not n.glob and not n.ext:
                local[id(n)] = n
        if self.inp is not None:
            local[id(self.inp)] = self.inp
        self.locals = list(local.values())
        self.first_counts, self.glob_first = self._counts(nodes)
        self.steady_counts, self.glob_steady = self._counts(self.steady)

    @staticmethod
    def _counts(nodes: list[_T]) -> tuple[list[tuple[_T, int, int]], list[tuple[_T, int, int]]]:
        """n_children / n_views these nodes add, split into (segment-local, prologue-global) tensors."""
        nc: dict[int, list] = {}
        for node in nodes:
            vs = node.vs
            if vs is not None and node.op != "NONE" and not vs.ext:
                e = nc.setdefault(id(vs), [vs, 0, 0])
                e[2] += 1
            for t in node.src:
                if t is not None and not t.ext:
                    e = nc.setdefault(id(t), [t, 0, 0])
                    e[1] += 1
        local = [(t, a, b) for t, a, b in nc.values() if not t.glob]
        glob = [(t, a, b) for t, a, b in nc.values() if t.glob]
        return local, glob


def _layer_keys(c: _Ctx) -> list[tuple]:
    """A key per layer: layers with equal keys build identical sub-graphs (up to weights and names)."""
    sp = c.spec
    n = sp.n_layer
    n_all = len(sp.layers)
    partial = [(k, v) for k, v in c.d.layer_tensors.items() if len(v) != n_all]
    keys = []
    for il in range(n):
        l = sp.layers[il]
        keys.append((
            il == n - 1, il < sp.n_layer_dense_lead, l.kind, l.has_kv, l.n_head, l.n_head_kv, l.n_embd_head_k,
            l.n_embd_head_v, l.n_ff, l.n_ff_exp, l.n_expert_used, tuple(k for k, v in partial if il in v),
        ))
    return keys


@dataclass
class _Result:
    sizes: list[int]  # high-water mark per buffer (0: device or the only CPU buffer, 1: host)
    peaks: list[list[tuple[str, int]]]  # per buffer: (tensor name, bytes) alive when its mark was last raised
    layers_simulated: int

    @property
    def size(self) -> int:
        return self.sizes[0]

    @property
    def peak(self) -> list[tuple[str, int]]:
        return self.peaks[0]


@dataclass
class _Placement:
    """Which backend runs each op: a port of ggml_backend_sched_split_graph for a GPU plus the CPU.

    Backend 0 is the GPU, 1 the CPU (the lowest-priority backend, whose buffer type is the host one).
    Weights, KV caches and recurrent states live on their layer's device (`layer_dev`; the token
    embeddings always on the CPU). `supports(node)` says whether the GPU runs an op, `offload(node)`
    whether it takes an op whose weight is in host memory (ggml_backend_dev_offload_op, op_offload).
    Not modelled: the backends' graph_optimize (CUDA and Metal keep some tensors alive longer around
    fusible patterns; Metal also reorders nodes for concurrency).
    """

    layer_dev: list[int]
    dev_in: int  # the prologue's weights (layer 0's device)
    dev_out: int  # the output layer
    supports: Callable[[_T], bool]
    offload: Callable[[_T], bool]
    cuda: bool = False  # apply ggml_backend_cuda_graph_optimize's alloc deps


_VIEW_OPS = frozenset(("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))  # ggml_is_view_op


def _nbytes_strided(t: _T) -> int:  # ggml_nbytes of a possibly non-contiguous tensor
    ne, nb = t.ne, t.nb
    if min(ne) <= 0:
        return 0
    if _BLCK[t.type] == 1:
        n = _TSIZE[t.type]
        for i in range(4):
            n += (ne[i] - 1) * nb[i]
        return n
    n = ne[0] * nb[0] // _BLCK[t.type]
    for i in range(1, 4):
        n += (ne[i] - 1) * nb[i]
    return n


def _schedule(seq: list[_Segment], pl: _Placement, copy_size: Callable[[_T], int], src_of: dict[int, _Segment]) -> None:
    """ggml_backend_sched_split_graph passes 1-5 over the segments (each distinct layer once, in order):
    assign every node a backend, split where it changes, copy foreign sources into the split's backend."""
    GPU = 0
    nodes: list[_T] = []
    for seg in seq:
        for leaf in seg.leafs:
            leaf.be = -1
        for node in seg.nodes:
            node.be = -1
        nodes += seg.nodes

    def sup(b: int, node: _T) -> bool:  # ggml_backend_supports_op
        return b == HOST or pl.supports(node)

    def from_cur(t: _T) -> int:  # ggml_backend_sched_backend_id_from_cur
        vs = t.vs
        if vs is not None and vs.ext:  # a view of a pre-allocated tensor (KV cache, state) stays with it
            return vs.be if sup(vs.be, t) else -1
        if t.flags & FLAG_INPUT:
            return HOST
        if t.op not in ("ROPE", "FLASH_ATTN_EXT"):
            for src in t.src:
                if src is not None and src.w == IS_WEIGHT:
                    b = src.be
                    if b == HOST and sup(GPU, t) and pl.offload(t):
                        return GPU  # "1.off"
                    return b if sup(b, t) else -1
        return -1

    # pass 1: pre-allocated inputs, graph inputs, ops with weights
    for seg in seq:
        for leaf in seg.leafs:
            leaf.be = HOST if leaf.flags & FLAG_INPUT else -1
    for node in nodes:
        node.be = from_cur(node)

    # pass 2: expand the GPU assignments down and up over unassigned ops, then any backend
    def expand(order: Iterable[_T], gpu_only: bool) -> None:
        cur = -1
        for node in order:
            if node.op in _VIEW_OPS:
                continue
            if node.be != -1:
                cur = -1 if (gpu_only and node.be == HOST) else node.be
            elif cur != -1 and sup(cur, node):
                node.be = cur

    expand(nodes, True)
    expand(reversed(nodes), True)
    expand(nodes, False)
    expand(reversed(nodes), False)

    def be_of(t: _T) -> int:
        if t.be == -1 and t.vs is not None:
            return t.vs.be
        return t.be

    # placeholders stand for the previous layer's output: its backend
    for seg in seq:
        if seg.inp is not None:
            seg.inp.be = src_of[id(seg)].out.be

    # pass 3: an op left unassigned goes to the backend with the most usable inputs
    for node in nodes:
        if node.op in _VIEW_OPS or node.be != -1:
            continue
        best = -1
        for b in (GPU, HOST):
            if not sup(b, node):
                continue
            n = sum(1 for src in node.src if src is not None and be_of(src) != -1 and be_of(src) == b)
            if n > best:
                best = n
                node.be = b

    # pass 4: views follow their source; unassigned sources follow their consumer
    for node in nodes:
        if node.vs is not None and node.be == -1:
            node.be = node.vs.be
        for src in node.src:
            if src is not None and src.be == -1:
                src.be = src.vs.be if src.vs is not None else node.be
        if node.be == -1:
            node.be = GPU if sup(GPU, node) else HOST
    for seg in seq:
        if seg.inp is not None:
            seg.inp.be = src_of[id(seg)].out.be

    # pass 5: splits and the copies of their inputs
    copies: dict[tuple[int, int], _T] = {}
    cur = -1
    n_inputs = 0
    pending: list[_T] = []
    start: tuple[_Segment, int] | None = None
    inserts: list[tuple[_Segment, int, list[_T]]] = []
    sid = 0
    for seg in seq:
        for i, node in enumerate(seg.nodes):
            node.sid = sid
            if node.op in _VIEW_OPS:
                continue
            need_new = False
            if node.be == cur and n_inputs > 0:
                # a weight on another backend starts a new split, so that its copy can be freed early
                need_new = any(src is not None and src.w == IS_WEIGHT and src.be != cur for src in node.src)
            if node.be != cur or need_new:
                if pending:
                    inserts.append((start[0], start[1], pending))
                sid += 1
                node.sid = sid
                cur = node.be
                n_inputs = 0
                pending = []
                start = (seg, i)
            srcs = None
            for j, src in enumerate(node.src):
                if src is None or src is node:
                    continue
                sb = be_of(src)
                if sb == cur:
                    continue
                cp = copies.get((id(src), cur))
                if cp is None:
                    cp = _T("NONE", src.type, list(src.ne), list(src.nb), (), None, src.name + "#copy")
                    cp.be = cur
                    cp.glob = src.glob
                    cp.size = copy_size(cp) if cur == GPU else _nbytes_strided(cp)
                    dep = _T("NONE", src.type, list(src.ne), list(src.nb), (src,), src.vs or src, src.name + "#dep")
                    dep.be = sb
                    dep.glob = src.glob
                    copies[(id(src), cur)] = cp
                    pending += [dep, cp]
                    n_inputs += 1
                if srcs is None:
                    srcs = list(node.src)
                srcs[j] = cp
            if srcs is not None:
                node.src = tuple(srcs)
    if pending:
        inserts.append((start[0], start[1], pending))
    for seg, at, new in reversed(inserts):
        seg.nodes[at:at] = new


def _cuda_alloc_deps(seq: list[_Segment]) -> None:
    """ggml_backend_cuda_graph_optimize: tensors kept alive for CUDA's fusions, split by split.

    Two matchers: the MoE weighted reduction (ggml_cuda_match_moe_weighted_reduction: experts and
    router weights live until the last ADD of the per-expert views) and the top-k MoE routing fusion
    (ggml_cuda_topk_moe_fusion: every node of the gating pattern and its sources live until the node
    after it). Each kept set becomes a GGML_OP_NONE node after its `until` node (graph_copy).
    """
    for seg in seq:
        nodes = [n for n in seg.nodes if not n.name.endswith(("#dep", "#copy"))]
        uses: dict[int, int] = {}
        for n in seg.nodes:
            for s_ in n.src:
                if s_ is not None:
                    uses[id(s_)] = uses.get(id(s_), 0) + 1
        deps: dict[int, list[_T]] = {}
        until_of: dict[int, _T] = {}

        def dep(t: _T | None, until: _T) -> None:
            if t is None:
                return
            lst = deps.setdefault(id(until), [])
            until_of[id(until)] = until
            if all(x is not t for x in lst):
                lst.append(t)

        n_nodes = len(nodes)
        i = 0
        while i < n_nodes:
            node = nodes[i]
            if node.be != 0:
                i += 1
                continue
            m = _match_moe_reduction(nodes, i, uses)
            if m is not None:
                experts, weights, scale, dst, count = m
                dep(experts, dst)
                dep(weights, dst)
                dep(scale, dst)
                i += count - 1
                node = nodes[i]
            if node.op in ("UNARY", "SOFT_MAX", "ARGSORT"):
                ops = _match_topk_moe(nodes, i, uses)
                if ops is not None and i + ops < n_nodes:
                    last = nodes[i + ops]
                    for k in range(i, i + ops):
                        dep(nodes[k], last)
                        for s_ in nodes[k].src:
                            dep(s_, last)
                    i += ops - 1
            i += 1
        if not deps:
            continue
        out: list[_T] = []
        for n in seg.nodes:
            out.append(n)
            keep = deps.get(id(n))
            if keep:
                for k in range(0, len(keep), 10):
                    d = _T("NONE", keep[k].type, list(keep[k].ne), list(keep[k].nb), tuple(keep[k:k + 10]),
                           keep[k].vs or keep[k], "alloc_dep")
                    d.be = n.be
                    d.glob = n.glob
                    out.append(d)
        seg.nodes = out


def _same_split(nodes: list[_T], i: int, count: int) -> bool:
    sid = nodes[i].sid
    return i + count <= len(nodes) and all(nodes[k].sid == sid for k in range(i, i + count))


def _can_fuse(nodes: list[_T], i: int, ops: list[str], outputs: tuple[_T, ...], uses: dict[int, int]) -> bool:
    """ggml_can_fuse_subgraph: the ops match, and every non-output node is only used inside the pattern."""
    count = len(ops)
    if not _same_split(nodes, i, count):
        return False
    sub = nodes[i:i + count]
    for k, node in enumerate(sub):
        if node.op != ops[k]:
            return False
        if any(node is o for o in outputs):
            continue
        if node.flags & FLAG_OUTPUT:
            return False
        n_uses = sum(1 for other in sub[k + 1:] for s_ in other.src if s_ is node)
        if n_uses != uses.get(id(node), 0):
            return False
        vs = node.vs
        if vs is not None and all(vs is not x for x in sub) and vs.w != IS_WEIGHT:
            return False
    return True


def _match_moe_reduction(nodes: list[_T], i: int, uses: dict[int, int]):
    """ggml_cuda_match_moe_weighted_reduction."""
    first = nodes[i]
    if first.op != "MUL" or first.type != F32 or not is_contiguous(first):
        return None

    def split_mul(mul: _T):
        def is_weights(t):
            return (t is not None and t.type == F32 and is_contiguous(t) and t.ne[0] == 1 and t.ne[1] == mul.ne[1]
                    and t.ne[2] == mul.ne[2] and t.ne[3] == mul.ne[3])

        def is_experts(t):
            return t is not None and t.type == F32 and is_contiguous(t) and t.ne == mul.ne

        a = mul.src[0] if len(mul.src) > 0 else None
        b = mul.src[1] if len(mul.src) > 1 else None
        if is_experts(a) and is_weights(b):
            return a, b
        if is_experts(b) and is_weights(a):
            return b, a
        return None

    weighted, experts, scale, weights, mul_count = first, None, None, None, 1
    if i + 1 < len(nodes):
        second = nodes[i + 1]
        if second.op == "MUL" and second.type == F32 and is_contiguous(second):
            r2, r1 = split_mul(second), split_mul(first)
            if r2 is not None and r2[0] is first and r1 is not None:
                weighted, experts, scale, weights, mul_count = second, r1[0], r1[1], r2[1], 2
    if experts is None:
        r = split_mul(first)
        if r is None:
            return None
        experts, weights = r
    n_used = weighted.ne[1]
    n_tokens = weighted.ne[2] * weighted.ne[3]
    if n_used < 2 or n_used > 15 or n_tokens <= 0:
        return None
    count = 2 * n_used + mul_count - 1
    if i + count > len(nodes):
        return None
    ops = ["VIEW"] * count
    ops[0] = "MUL"
    if mul_count == 2:
        ops[1] = "MUL"
    views: list[_T] = []
    prev = None
    n_adds = 0
    for off in range(mul_count, count):
        cand = nodes[i + off]
        ops[off] = cand.op
        if cand.op == "VIEW":
            if (len(views) >= n_used or cand.src[0] is not weighted or cand.vs is not weighted or cand.type != F32
                    or cand.ne != [weighted.ne[0], n_tokens, 1, 1] or cand.nb[0] != weighted.nb[0]
                    or cand.nb[1] != weighted.nb[2]):
                return None
            views.append(cand)
            continue
        if cand.op != "ADD" or len(views) < 2 or n_adds + 1 >= len(views):
            return None
        lhs = views[0] if n_adds == 0 else prev
        if cand.src[0] is not lhs or cand.src[1] is not views[n_adds + 1] or cand.type != F32:
            return None
        prev = cand
        n_adds += 1
    if len(views) != n_used or n_adds != n_used - 1 or prev is None:
        return None
    if not is_contiguous(prev) or prev.ne != [weighted.ne[0], n_tokens, 1, 1]:
        return None
    dst = nodes[i + count - 1]
    if not _can_fuse(nodes, i, ops, (dst,), uses):
        return None
    return experts, weights, scale, dst, count


def _match_topk_moe(nodes: list[_T], i: int, uses: dict[int, int]) -> int | None:
    """ggml_cuda_topk_moe_fusion + the pattern check of ggml_backend_cuda_graph_optimize: its length, or None."""
    n = len(nodes)
    node = nodes[i]
    sigmoid = softplus = softmax = False
    idx = i
    if node.op == "SOFT_MAX":
        softmax = True
    elif node.op == "UNARY":
        if node.uop == "sigmoid":
            sigmoid = True
        elif node.uop == "softplus" and idx + 1 < n and nodes[idx + 1].op == "SQRT" and nodes[idx + 1].src[0] is node:
            softplus = True
            idx += 1
        else:
            return None
    else:
        return None  # ARGSORT first: the delayed-softmax form adds no dependency
    idx += 1

    def at(k: int, op: str) -> _T | None:
        return nodes[k] if k < n and nodes[k].op == op else None

    r = at(idx, "RESHAPE")
    if r is None or r.src[0] is not nodes[idx - 1]:
        return None
    probs_reshaped = r
    idx += 1
    if idx >= n:
        return None
    prob_bias = nodes[idx].op == "ADD" and nodes[idx].src[0] is nodes[idx - 2]
    if prob_bias:
        idx += 1
    a = at(idx, "ARGSORT")
    if a is None or a.src[0] is not (nodes[idx - 1] if prob_bias else nodes[idx - 2]):
        return None
    idx += 1
    v = at(idx, "VIEW")
    if v is None or v.src[0] is not nodes[idx - 1]:
        return None
    idx += 1
    g = at(idx, "GET_ROWS")
    if g is None or g.src[0] is not probs_reshaped or g.src[1] is not nodes[idx - 1]:
        return None
    idx += 1
    norm = scale = False
    if idx < n:
        norm = True
        k = idx
        for op in ("RESHAPE", "SUM_ROWS", "CLAMP"):
            if k < n and nodes[k].op == op and nodes[k].src[0] is nodes[k - 1]:
                k += 1
            else:
                norm = False
                break
        if norm:
            if not (k < n and nodes[k].op == "DIV" and nodes[k].src[1] is nodes[k - 1] and nodes[k].src[0] is nodes[k - 3]):
                norm = False
            else:
                k += 1
                if not (k < n and nodes[k].op == "RESHAPE" and nodes[k].src[0] is nodes[k - 1]):
                    norm = False
                else:
                    idx = k + 1
        if norm or nodes[idx].op != "RESHAPE":
            if idx < n and nodes[idx].op == "SCALE" and nodes[idx].src[0] is nodes[idx - 1]:
                scale = True
    # the op list of ggml_backend_cuda_graph_optimize
    ops = ["UNARY"] if sigmoid else (["UNARY", "SQRT"] if softplus else ["SOFT_MAX"])
    i_probs = i + len(ops) - 1
    ops += ["RESHAPE", "ADD", "ARGSORT", "VIEW", "GET_ROWS"] if prob_bias else ["RESHAPE", "ARGSORT", "VIEW", "GET_ROWS"]
    ids = nodes[i_probs + (4 if prob_bias else 3)]
    if norm:
        ops += ["RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"]
    if scale:
        ops += ["SCALE"]
    if i + len(ops) > n:
        return None
    weights = nodes[i + len(ops) - 1]
    if not _can_fuse(nodes, i, ops, (ids, weights), uses):
        return None
    # ggml_cuda_should_use_topk_moe
    n_expert = ids.nb[1] // ids.nb[0]
    if ((n_expert & (n_expert - 1)) != 0 or n_expert > 512) and n_expert not in (288, 576):
        return None
    logits = node.src[0]
    if not is_contiguous(weights) or not is_contiguous(logits):
        return None
    if node.op == "SOFT_MAX" and (not is_contiguous(node.src[0]) or len([x for x in node.src if x is not None]) > 1):
        return None
    return len(ops)


def _simulate(c: _Ctx, ga: "_Gallocr", pl: _Placement | None = None, copy_size: Callable[[_T], int] | None = None) -> _Result:
    """Build one segment per distinct layer, then allocate layer after layer, jumping over repeats.

    Equivalent to `_Gallocr.run` over the full graph: the allocator's state at a layer boundary (its
    free blocks and where the residual stream lives) fully determines what follows, given the layers
    still to come. When the state at the start of layer i equals the state at the start of layer
    j < i and the layers after i repeat those after j (same sub-graph, and no prologue tensor used
    for the last time), the allocator replays the same offsets: the high-water mark cannot move, so
    the simulation jumps ahead by whole periods.
    """
    global _TRACK, _SEGDEV, _SEGLAYER, _WEIGHTS, _WTYPE
    sp = c.spec
    n = sp.n_layer
    gen = _GRAPHS[sp.architecture](c)
    dev = (lambda il: pl.layer_dev[il]) if pl else (lambda il: 0)
    if pl:
        _WEIGHTS = True
        lt, gt, dflt = c.d.layer_types, c.d.global_types, _default_weight_type(sp)

        def _wtype(suffix: str) -> int:
            if _SEGLAYER is None:
                return gt.get(suffix, dflt)
            return lt.get(suffix, {}).get(_SEGLAYER, dflt)

        _WTYPE = _wtype
    try:
        _TRACK = []
        _SEGDEV = pl.dev_in if pl else 0
        _SEGLAYER = None
        c.g = _Graph()
        x0 = next(gen)
        c.g.expand(x0)
        for t in _TRACK:
            t.glob = True
        pro = _Segment(c.g.nodes, c.g.leafs, [], None, None, _SEGDEV)

        def build(il: int | None, x: _T, placeholder: _T | None) -> _Segment:
            global _TRACK, _SEGDEV, _SEGLAYER
            _TRACK = []
            _SEGDEV = dev(il) if il is not None else (pl.dev_out if pl else 0)
            _SEGLAYER = il
            c.g = _Graph()
            out = None
            try:
                out = gen.send((il, x))
                c.g.expand(out)
            except StopIteration:
                pass
            return _Segment(c.g.nodes, c.g.leafs, _TRACK, placeholder, out, _SEGDEV)

        def placeholder(like: _T) -> _T:
            t = _T("NONE", like.type, list(like.ne), list(like.nb), (), None, "inpL")
            t.vis = True
            return t

        keys = _layer_keys(c)
        if pl:  # a layer's sub-graph also depends on where it, its neighbours and (if offloaded) its weights are
            lt = c.d.layer_types

            def wkey(il: int) -> tuple:
                if dev(il) != HOST:
                    return ()
                return tuple(sorted((k, v[il]) for k, v in lt.items() if il in v))

            keys = [k + (dev(il), dev(il - 1) if il else pl.dev_in, dev(il + 1) if il + 1 < n else pl.dev_out, wkey(il))
                    for il, k in enumerate(keys)]
        seg0 = build(0, x0, None)
        templates: dict[tuple, _Segment] = {}
        order = [pro, seg0]
        prev_of: dict[tuple, int] = {}
        for il in range(1, n):
            if keys[il] not in templates:
                ph = placeholder(seg0.out)
                templates[keys[il]] = build(il, ph, ph)
                order.append(templates[keys[il]])
                prev_of[keys[il]] = il - 1
        last_seg = templates[keys[n - 1]] if n > 1 else seg0
        ph = placeholder(last_seg.out)  # the epilogue reads the last layer's output
        epi = build(None, ph, ph)
        order.append(epi)
    finally:
        _TRACK = None
        _SEGDEV = 0
        _SEGLAYER = None
        _WEIGHTS = False
    if pl:
        # a placeholder sits where the previous layer's output was computed
        src_of = {id(t): (seg0 if prev_of[k] == 0 else templates[keys[prev_of[k]]]) for k, t in templates.items()}
        src_of[id(epi)] = last_seg
        _schedule(order, pl, copy_size or _T.nbytes, src_of)
        if pl.cuda:
            _cuda_alloc_deps(order)
    for seg in order:
        seg.finalize()
    return _run_segments(c, ga, pro, seg0, templates, keys, epi)


def _simulate_mtp(c: _Ctx, ga: "_Gallocr", pl: _Placement | None = None, copy_size: Callable[[_T], int] | None = None) -> _Result:
    """The MTP draft graph: one NextN block, built and allocated whole."""
    global _TRACK, _SEGDEV, _SEGLAYER, _WEIGHTS, _WTYPE
    sp = c.spec
    il = sp.n_layer
    dev = pl.layer_dev[il] if pl else 0
    if pl:
        _WEIGHTS = True
        lt, dflt = c.d.layer_types, _default_weight_type(sp)
        _WTYPE = lambda suffix: lt.get(suffix, {}).get(il, dflt)  # noqa: E731
    try:
        _TRACK = []
        _SEGDEV = dev
        _SEGLAYER = il
        c.g = _Graph()
        _graph_mtp(c)
        seg = _Segment(c.g.nodes, c.g.leafs, _TRACK, None, None, dev)
    finally:
        _TRACK = None
        _SEGDEV = 0
        _SEGLAYER = None
        _WEIGHTS = False
    if pl:
        _schedule([seg], pl, copy_size or _T.nbytes, {})
        if pl.cuda:
            _cuda_alloc_deps([seg])
    ga.run(seg.nodes, seg.leafs)
    return _Result(ga.sizes(), ga.peak_lives, 1)


def _default_weight_type(spec: ModelSpec) -> int:
    """The ggml type of most of the model's bytes (for weights whose type the header did not give)."""
    for name in spec.bytes_by_type:
        try:
            return int(GGMLQuantizationType[name])
        except KeyError:
            continue
    return F16


def _state_key(ga: "_Gallocr", carried: _T) -> tuple:
    # The high-water marks are left out: with a single chunk they never steer a decision (the last
    # free block always fits), and a replayed period cannot raise them. Chunked allocators keep them.
    key = [carried.addr, carried.size, carried.own, carried.be]
    for t in ga.tallocs:
        key.append(t.state())
        if t.max_chunk < SIZE_MAX // 2:
            key.append(tuple(t.maxes))
    return tuple(key)


def _run_segments(c: _Ctx, ga: "_Gallocr", pro: _Segment, seg0: _Segment, templates: dict[tuple, _Segment],
                  keys: list[tuple], epi: _Segment) -> _Result:
    n = c.spec.n_layer
    # which variant each layer runs: a template's first instance also emits the prologue tensors it
    # reaches first (views of inputs, gemma4's per-layer projection); later instances do not
    seen: set[tuple] = set()
    first = [False] * n
    for il in range(1, n):
        if keys[il] not in seen:
            seen.add(keys[il])
            first[il] = True

    def glob_of(il: int) -> list[tuple[_T, int, int]]:
        t = templates[keys[il]]
        return t.glob_first if first[il] else t.glob_steady

    # total n_children / n_views of prologue tensors, and the layer where each is used for the last time
    totals: dict[int, list] = {}
    last: dict[int, int] = {}

    def add(entries: list[tuple[_T, int, int]], il: int) -> None:
        for t, a, b in entries:
            e = totals.get(id(t))
            if e is None:
                totals[id(t)] = [t, a, b]
            else:
                e[1] += a
                e[2] += b
            last[id(t)] = il

    add(pro.glob_first, -1)
    add(seg0.glob_first, 0)
    for il in range(1, n):
        add(glob_of(il), il)
    add(epi.glob_first, n)
    finals: dict[int, set[int]] = {}
    for tid, il in last.items():
        finals.setdefault(il, set()).add(tid)
    sigs = [(keys[il], first[il], frozenset(finals.get(il, ()))) for il in range(n)]

    # ggml_gallocr_alloc_graph_impl: leafs first (in graph order), then the children/views counts
    leafs = list(pro.leafs) + list(seg0.leafs)
    for t in templates.values():
        leafs += t.leafs
    leafs += epi.leafs
    for leaf in leafs:
        ga._allocate(leaf)
    for t, a, b in totals.values():
        t.nc = a
        t.nv = b

    def run(seg: _Segment, variant: list[_T], counts: list[tuple[_T, int, int]], carried: _T | None) -> None:
        if carried is not None:
            own, addr, size, be = carried.own, carried.addr, carried.size, carried.be
        for t in seg.locals:
            t.own = False
            t.nc = 0
            t.nv = 0
        if carried is not None:
            p = seg.inp
            p.own, p.addr, p.size, p.be = own, addr, size, be
            ga._handover(carried, p)
        for t, a, b in counts:
            t.nc = a
            t.nv = b
        ga.process(variant)

    run(pro, pro.nodes, pro.first_counts, None)
    run(seg0, seg0.nodes, seg0.first_counts, None)
    carried = seg0.out
    simulated = 1
    hist: dict[tuple, list[int]] = {}
    il = 1
    while il < n:
        if not first[il]:
            key = _state_key(ga, carried)
            prev = hist.setdefault(key, [])
            best = 0
            for j in prev:  # any earlier boundary with this state: the period is il - j
                p = il - j
                t = il
                while t < n and sigs[t] == sigs[t - p]:
                    t += 1
                best = max(best, (t - il) // p * p)
            if best:
                for l2 in range(il, il + best):  # the skipped layers still use the prologue tensors
                    for g, a, b in glob_of(l2):
                        g.nc -= a
                        g.nv -= b
                il += best  # the history stays valid: skipped boundaries replay recorded states
                if il >= n:
                    break
                continue
            prev.append(il)
        seg = templates[keys[il]]
        if first[il]:
            run(seg, seg.nodes, seg.first_counts, carried)
        else:
            run(seg, seg.steady, seg.steady_counts, carried)
        carried = seg.out
        simulated += 1
        il += 1
    run(epi, epi.nodes, epi.first_counts, carried)
    return _Result(ga.sizes(), ga.peak_lives, simulated)


# --------------------------------------------------------------------------------------------------
# public API


class ComputeBuffer(BaseModel):
    """One `sched_reserve: <buffer> compute buffer size = X MiB` line of llama.cpp."""

    model_config = ConfigDict(frozen=True)

    device: str  # llama.cpp's buffer type name: CPU, CUDA0, CUDA_Host, MTL0 ...
    bytes: int  # the buffer size llama.cpp reserves (the graph allocator's high-water mark)
    terms: dict[str, int]  # what was alive when the high-water mark was set, by kind, + "fragmentation"
    peak_tensors: list[tuple[str, int]] = []  # the largest tensors alive at that moment (name, bytes)


# what each tensor name (as llama.cpp's graph callback names them, more or less) is, for the terms
_TERM_PREFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logits", ("result_output",)),
    ("output_norm", ("result_norm",)),
    ("kq_mask", ("attn_inp_kq_mask",)),
    ("inputs", ("inp_", "attn_inp_", "out_ids", "rs_s_copy", "embd", "token_embd", "per_layer_token_embd")),
    ("kq_scores", ("kq-", "kq_")),
    ("v_transposed", ("v_cont",)),
    ("attention", ("fattn", "kqv", "Qcur", "Kcur", "Vcur", "q-", "q_", "k_", "kv", "wqkv", "attn_out", "gate", "q")),
    ("moe", ("ffn_moe", "group_scores", "shared_gate")),
    ("ffn", ("ffn_out", "ffn_up", "ffn_gate", "ffn_silu", "ffn_gelu", "ffn_relu", "ffn_sqr", "ffn_swiglu", "ffn_geglu", "ffn_reglu")),
    ("recurrent", ("gdn", "conv_", "ssm_", "qkv_mixed", "z", "beta", "alpha", "mixed_", "rs_states", "state")),
    ("per_layer_embd", ("per_layer", "ple_")),
)


def _term(name: str) -> str:
    base = name.split("#", 1)[0]
    for term, prefixes in _TERM_PREFIXES:
        if base.startswith(prefixes):
            return term
    return "residual" if base else "other"


def _terms(peak: list[tuple[str, int]], total: int, align: int) -> tuple[dict[str, int], list[tuple[str, int]]]:
    terms: dict[str, int] = {}
    used = 0
    for name, size in peak:
        size = (size + align - 1) // align * align
        used += size
        k = _term(name)
        terms[k] = terms.get(k, 0) + size
    if total > used:
        terms["fragmentation"] = total - used
    terms = dict(sorted(terms.items(), key=lambda kv: -kv[1]))
    top = sorted(((n or "(unnamed)", s) for n, s in peak), key=lambda x: -x[1])[:8]
    return terms, top


_CACHE: dict[tuple, tuple] = {}
_CACHE_MAX = 512


def _cp_key(cp: ContextParams) -> tuple:
    return (cp.n_ctx, cp.n_ctx_seq, cp.n_seq_max, cp.n_batch, cp.n_ubatch, cp.n_outputs_max, cp.kv_unified,
            cp.swa_full, cp.flash_attn, cp.type_k, cp.type_v, cp.n_rs_seq, cp.embeddings)


def compute_buffers(
    spec: ModelSpec,
    cp: ContextParams,
    backend: str = "cpu",
    n_gpu_layers: int = -1,
    *,
    details: GraphDetails | None = None,
    metal_max_buffer_length: int | None = None,
    mtp: bool = False,
) -> list[ComputeBuffer]:
    """The compute buffers llama.cpp reserves for this model and context (llama_context::sched_reserve).

    backend "cpu": one CPU buffer, exact. "cuda" / "metal": the device buffer, then the host buffer
    that holds the graph inputs and the CPU-side ops (token embeddings); see `_Placement` for what
    is and is not modelled there. Pass `details=graph_details(header)` for the exact graph of a file;
    without it the architecture's usual tensors are assumed (`default_details`). `mtp=True`: the
    draft context of native MTP speculative decoding (its graph is the NextN block alone).
    """
    if spec.architecture not in _GRAPHS:
        raise UnsupportedModelError(f"compute buffers: architecture '{spec.architecture}' has no graph model")
    if mtp and (spec.architecture not in _MTP_ARCHS or not spec.has_mtp):
        raise UnsupportedModelError(f"compute buffers: {spec.architecture} has no MTP draft graph")
    be = str(getattr(backend, "value", backend)).lower()
    key = (id(spec), id(details), _cp_key(cp), be, n_gpu_layers, metal_max_buffer_length, mtp)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is spec and hit[1] is details:
        return hit[2]
    d = details or default_details(spec)
    c = _Ctx(spec, cp, d)
    c.mtp = mtp
    if be == "cpu":
        ga = _Gallocr(32, trace=True)
        r = _simulate_mtp(c, ga) if mtp else _simulate(c, ga)
        terms, top = _terms(r.peaks[0], r.sizes[0], 32)
        out = [ComputeBuffer(device="CPU", bytes=r.sizes[0], terms=terms, peak_tensors=top)]
    elif be in ("cuda", "metal"):
        out = _gpu_buffers(c, be, n_gpu_layers, metal_max_buffer_length)
    else:
        raise ValueError(f"backend '{backend}': use cpu, cuda or metal")
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (spec, details, out)
    return out


def _gpu_buffers(c: _Ctx, be: str, n_gpu_layers: int, metal_max_buffer_length: int | None) -> list[ComputeBuffer]:
    from fitter import compute_backend as cb

    sp = c.spec
    n_all = len(sp.layers)
    n_gpu = n_all + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_all + 1)
    i_gpu_start = max(n_all + 1 - n_gpu, 0)  # llama_model::load_tensors
    layer_dev = [0 if il >= i_gpu_start else 1 for il in range(n_all)]
    rules = cb.buffer_rules(be, metal_max_buffer_length=metal_max_buffer_length) if be == "metal" else cb.buffer_rules(be)
    host_align = cb.host_buffer_alignment(be)

    def supports(t: _T) -> bool:
        op = t.op
        try:
            if op == "FLASH_ATTN_EXT":
                return cb.flash_attn_unsupported_reason(be, cb.flash_attn_shape_of(t)) is None
            if op == "GATED_DELTA_NET":
                return cb.gated_delta_net_unsupported_reason(be, t.src[2].ne[0]) is None
            if op == "SSM_CONV":
                return cb.ssm_conv_unsupported_reason(be, t.src[0].ne[1]) is None
        except Exception:  # a shape the backend helper does not know: assume the GPU runs it
            return True
        return True

    def dev_size(t: _T) -> int:
        if t.op == "NONE":  # a split input copy (ggml_dup_tensor_layout): strides kept, CUDA pads quantized rows
            n = _nbytes_strided(t)
            return n + (cb.cuda_quant_row_padding(t.type, t.ne[0]) if be == "cuda" else 0)
        return cb.alloc_size(be, t)

    def batch_size(t: _T) -> int:  # get_op_batch_size (ggml-cuda.cu, ggml-metal.cpp)
        op = t.op
        if op == "GET_ROWS":
            return 0 if be == "cuda" else t.ne[1] * t.ne[2] * t.ne[3]
        if op == "MUL_MAT":
            return t.ne[1]
        if op == "MUL_MAT_ID" or (op == "ROPE" and be == "cuda"):
            return t.ne[2]
        return t.ne[1] * t.ne[2] * t.ne[3]

    def offload(t: _T) -> bool:  # ggml_backend_{cuda,metal}_device_offload_op, op_offload_min_batch_size 32
        if be == "metal" and t.op not in ("MUL_MAT", "MUL_MAT_ID"):
            return False
        return batch_size(t) >= 32

    pl = _Placement(layer_dev, layer_dev[0] if n_all else 0, 0 if n_all >= i_gpu_start else 1, supports, offload,
                    cuda=be == "cuda")
    ga = _Gallocr([rules.alignment, host_align], [dev_size, _T.nbytes], trace=True, max_buffer_size=[rules.max_size, SIZE_MAX])
    r = _simulate_mtp(c, ga, pl, dev_size) if getattr(c, "mtp", False) else _simulate(c, ga, pl, dev_size)
    dev_name = {"cuda": "CUDA0", "metal": "MTL0"}[be]
    host_name = {"cuda": "CUDA_Host", "metal": "CPU"}[be]
    out = []
    for i, (name, align) in enumerate(((dev_name, rules.alignment), (host_name, host_align))):
        if r.sizes[i] > 1:  # sched_reserve prints (and allocates) only buffers larger than 1 byte
            terms, top = _terms(r.peaks[i], r.sizes[i], align)
            out.append(ComputeBuffer(device=name, bytes=r.sizes[i], terms=terms, peak_tensors=top))
    return out
