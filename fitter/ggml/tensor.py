"""ggml tensors, the ggml_context and the op constructors, as far as the graph allocator can see them.

Mirrors ggml/src/ggml.c: ggml_new_tensor_impl (shapes, contiguous strides, view sources),
ggml_view_* / ggml_reshape_* / ggml_permute / ggml_transpose, ggml_is_contiguous_*, and one
constructor per op the graph builders use (ggml_add, ggml_mul_mat, ggml_flash_attn_ext, ...),
each taking the context first as ggml does. Only what shapes, ownership and placement need is kept.
"""

from __future__ import annotations

from typing import Callable, Iterable

from fitter.ggml.types import BLCK, F16, F32, I32, TSIZE

# ggml ops whose result may take over a dying parent's memory (ggml-alloc.c ggml_op_can_inplace)
INPLACE_OPS = frozenset(
    (
        "FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV",
        "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK",
        "CLAMP", "SOFT_MAX", "SOFT_MAX_BACK",
    )
)

FLAG_INPUT = 1  # ggml_set_input
FLAG_OUTPUT = 2  # ggml_set_output
# ggml_backend_sched_set_tensor_backend(sched, t, backend_cpu): a user assignment, kept by every pass of the scheduler
ON_HOST = 4
# llama_context::graph_get_cb: a layer's "norm" (build_norm with a weight or bias) set to its layer's device under
# full offload or a ubatch below 32 tokens; kept by a real load's scheduler, dropped by a dry run's (sched_reserve_size
# resets it): the scheduler presets it where Placement.pin_layer_norms
LAYER_PIN = 8
IS_WEIGHT = 2  # Tensor.w of a weight tensor (a model tensor in a WEIGHTS buffer)
# Tensor.w of a LoRA adapter's tensor: pre-allocated beside its base weight, but in a buffer whose usage is not
# GGML_BACKEND_BUFFER_USAGE_WEIGHTS (llama_adapter_lora_init_impl sets none): the scheduler neither places ops by it
# nor starts a split for it
IS_ADAPTER = 3
HOST = 1  # backend / buffer index of the CPU next to a GPU (the lowest-priority backend)


class Tensor:
    """A ggml_tensor as far as the graph allocator can see it."""

    __slots__ = ("op", "type", "ne", "nb", "src", "vs", "flags", "name", "ext", "vis", "inpl", "nc", "nv", "own", "addr",
                 "size", "glob", "be", "w", "n_expert", "uop", "sid", "memo")

    def __init__(self, op: str, type_: int, ne: list[int], nb: list[int], src: tuple, vs: "Tensor | None", name: str, ext: bool = False):
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
        self.inpl = op in INPLACE_OPS
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
        self.uop = ""  # UNARY: which (named only where a fusion reads it: MoE gating "sigmoid", "softplus"; SSM_CONV's "silu")
        self.sid = -1  # the scheduler split the node belongs to (GPU backends)
        # (buffer, alloc size) from an earlier allocation of this graph (fitter.llama.traced_graph._Traced reuses graphs
        # and clears it where the cache sizes reach)
        self.memo: tuple[int, int] | None = None

    def clone(self) -> "Tensor":
        """A copy of every field (another instance of the same node: fitter.ggml.backends.metal.segments)."""
        c = Tensor.__new__(Tensor)
        c.op, c.type, c.ne, c.nb, c.src, c.vs, c.flags, c.name = (
            self.op, self.type, self.ne, self.nb, self.src, self.vs, self.flags, self.name)
        c.ext, c.vis, c.inpl, c.nc, c.nv, c.own, c.addr, c.size = (
            self.ext, self.vis, self.inpl, self.nc, self.nv, self.own, self.addr, self.size)
        c.glob, c.be, c.w, c.n_expert, c.uop, c.sid, c.memo = (
            self.glob, self.be, self.w, self.n_expert, self.uop, self.sid, self.memo)
        return c

    def nbytes(self) -> int:  # ggml_nbytes for the contiguous tensors the allocator places
        ne = self.ne
        return TSIZE[self.type] * ne[0] // BLCK[self.type] * ne[1] * ne[2] * ne[3]

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"<{self.name} {self.op} t{self.type} {self.ne}>"


class Context:
    """A ggml_context: where the op constructors below create their tensors.

    Besides what ggml keeps there, it carries the simulator's state while a segment is built (once
    module globals): `track` collects every tensor created (None: nothing is collected), `dev` is the
    backend of the layer being built (0 the device, HOST the CPU next to it), where its weights and
    caches live, `layer` the layer being built (None: prologue / epilogue). With `weights` set, ops
    that read a model weight get it as a source (the GPU scheduler needs to see where weights are;
    the CPU path leaves them out of the graph), typed by `wtype(name)` (name: the op's base name,
    e.g. "ffn_up").
    """

    __slots__ = ("track", "dev", "layer", "weights", "wtype", "wdev", "kv_dev", "lora")

    def __init__(self) -> None:
        self.track: list[Tensor] | None = None
        self.dev = 0
        self.layer: int | None = None
        self.weights = False
        self.wtype: Callable[[str], int] = _default_wtype
        # a weight's backend by (name, the backend it has without tensor overrides)
        self.wdev: Callable[[str, int], int] | None = None
        self.kv_dev: int | None = None  # the caches' backend when not the layer's (-nkvo: HOST)
        # LoRA adapters: the (rank, lora_a type, lora_b type) pairs a matmul's weight has, by the op's base name
        # (fitter.llama.graph.GraphContext.lora_pairs); None: no adapter
        self.lora: Callable[[str], tuple[tuple[int, int, int], ...]] | None = None

    def add(self, t: Tensor) -> Tensor:
        if self.track is not None:
            self.track.append(t)
        return t


def _default_wtype(name: str) -> int:
    return F16


def contig_nb(type_: int, ne: list[int]) -> list[int]:  # ggml_new_tensor_impl strides
    nb0 = TSIZE[type_]
    nb1 = nb0 * (ne[0] // BLCK[type_])
    nb2 = nb1 * ne[1]
    return [nb0, nb1, nb2, nb2 * ne[2]]


def new_tensor(ctx: Context, op: str, type_: int, ne: Iterable[int], src: tuple, name: str = "") -> Tensor:  # ggml_new_tensor
    ne = list(ne)
    if len(ne) < 4:
        ne += [1] * (4 - len(ne))
    return ctx.add(Tensor(op, type_, ne, contig_nb(type_, ne), src, None, name))


def view_of(ctx: Context, a: Tensor, op: str, ne: list[int], nb: list[int], src: tuple, name: str) -> Tensor:
    return ctx.add(Tensor(op, a.type, ne, nb, src, a.vs if a.vs is not None else a, name))


def is_contiguous_mn(t: Tensor, m: int, n: int = 4) -> bool:  # ggml_is_contiguous_m_n
    nxt = TSIZE[t.type]
    if t.ne[0] != BLCK[t.type] and t.nb[0] != nxt:
        return False
    nxt *= t.ne[0] // BLCK[t.type]
    for i in range(1, n):
        if i > m:
            if t.ne[i] != 1 and t.nb[i] != nxt:
                return False
            nxt *= t.ne[i]
        else:
            nxt = t.ne[i] * t.nb[i]
    return True


def is_contiguous(t: Tensor) -> bool:
    return is_contiguous_mn(t, 0)


def nelements(t: Tensor) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


# --- op constructors (ggml.c), only what shapes and ownership need ---------------------------------


def weight(ctx: Context, ne: Iterable[int], name: str = "w", host: bool = False, type_: int = F32,
           user: str = "", cls: type[Tensor] = Tensor) -> Tensor:
    """A model weight; `user`: the op reading it, for a small weight whose own name is generic (bias, norm)."""
    ne = list(ne) + [1] * (4 - len(list(ne)))
    t = ctx.add(cls("NONE", type_, ne, contig_nb(type_, ne), (), None, name, ext=True))
    t.w = IS_WEIGHT
    t.be = HOST if host else ctx.dev
    if ctx.wdev is not None:
        t.be = ctx.wdev(user or name, t.be)
    return t


# Whether any header-typed weight's type (or strides, which follow from it) was read since the last reset:
# when a graph never looked, its compute buffers are the same for any weight types (fitter.llama.context
# then shares them between quants of one model).
header_types_read = [False]
_TYPE_SLOT = Tensor.__dict__["type"]
_NB_SLOT = Tensor.__dict__["nb"]


class HeaderTypedWeight(Tensor):
    """A weight typed by `Context.wtype` (the header's type): reading `type` or `nb` sets header_types_read."""

    __slots__ = ()

    @property
    def type(self) -> int:
        header_types_read[0] = True
        return _TYPE_SLOT.__get__(self, Tensor)

    @type.setter
    def type(self, value: int) -> None:
        _TYPE_SLOT.__set__(self, value)

    @property
    def nb(self) -> list[int]:
        header_types_read[0] = True
        return _NB_SLOT.__get__(self, Tensor)

    @nb.setter
    def nb(self, value: list[int]) -> None:
        _NB_SLOT.__set__(self, value)


def op_weight(ctx: Context, ne: Iterable[int], name: str, small: bool = False, user: str = "") -> Tensor | None:
    """The weight an op reads, when the scheduler needs to see it (see Context.weights)."""
    if not ctx.weights:
        return None
    base = name.split("-", 1)[0]
    if small:
        return weight(ctx, ne, base, type_=F32, user=user)
    t = ctx.wtype(base)
    ne = list(ne)
    if BLCK[t] > 1 and ne[0] % BLCK[t]:
        t = F16
    return weight(ctx, ne, base, type_=t, user=user, cls=HeaderTypedWeight)


class CacheTensor(Tensor):
    """A KV cache or recurrent-state tensor: `buf` says which llama.cpp buffer holds it and where (Metal's reorder
    compares the memory ranges ops read and write: fitter.ggml.backends.metal.common)."""

    __slots__ = ("buf",)
    buf: tuple


def cache(ctx: Context, type_: int, ne: Iterable[int], name: str, buf: tuple = ()) -> CacheTensor:
    """A cache tensor; `buf`: ("kv", the cache's first layer) for a llama_kv_cache (each cache, e.g. the SWA one, has
    its own buffer), ("rs", layer, 0 for R / 1 for S) for llama_memory_recurrent's r_l / s_l (one buffer, that order)."""
    ne = list(ne) + [1] * (4 - len(list(ne)))
    t = CacheTensor("NONE", type_, ne, contig_nb(type_, ne), (), None, name, ext=True)
    ctx.add(t)
    t.be = ctx.dev if ctx.kv_dev is None else ctx.kv_dev  # a layer's KV / recurrent state lives on its device
    t.buf = buf
    return t


def inp(ctx: Context, type_: int, ne: Iterable[int], name: str) -> Tensor:  # ggml_new_tensor + ggml_set_input
    t = new_tensor(ctx, "NONE", type_, ne, (), name)
    t.flags |= FLAG_INPUT
    return t


def dup(ctx: Context, op: str, a: Tensor, src: tuple, name: str = "") -> Tensor:  # ggml_dup_tensor + op
    return ctx.add(Tensor(op, a.type, list(a.ne), contig_nb(a.type, a.ne), src, None, name))


def view_tensor(ctx: Context, a: Tensor, op: str, src: tuple, name: str = "") -> Tensor:  # ggml_view_tensor
    return view_of(ctx, a, op, list(a.ne), list(a.nb), src, name)


def mul_mat(ctx: Context, a: Tensor, b: Tensor, name: str = "") -> Tensor:
    # a weight whose only relevant dim is ne1 goes through mm() instead
    return new_tensor(ctx, "MUL_MAT", F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), (a, b), name)


def mm(ctx: Context, rows: int, b: Tensor, name: str = "", wne: Iterable[int] | None = None) -> Tensor:
    """ggml_mul_mat(W, b) for a weight W with ne1 = rows (wne: W's shape when it is not [b.ne0, rows]); with LoRA
    adapters on W, llm_graph_context::build_lora_mm."""
    w = op_weight(ctx, wne or (b.ne[0], rows), name)
    t = new_tensor(ctx, "MUL_MAT", F32, (rows, b.ne[1], b.ne[2], b.ne[3]), (w, b) if w is not None else (b,), name)
    return lora_mm(ctx, t, b, name) if ctx.lora is not None else t


def mul_mat_id(ctx: Context, rows: int, b: Tensor, ids: Tensor, name: str = "", n_expert: int = 0) -> Tensor:  # ggml_mul_mat_id(as, b, ids)
    w = op_weight(ctx, (b.ne[0], rows, n_expert), name)
    t = new_tensor(ctx, "MUL_MAT_ID", F32, (rows, ids.ne[0], b.ne[2], 1), (w, b, ids) if w is not None else (b, ids), name)
    t.n_expert = n_expert
    return lora_mm(ctx, t, b, name, ids) if ctx.lora is not None else t


def lora_mm(ctx: Context, res: Tensor, cur: Tensor, name: str, ids: Tensor | None = None) -> Tensor:
    """llm_graph_context::build_lora_mm (ids None) / build_lora_mm_id after the base matmul `res` of `cur`: per
    adapter on the weight, res + scale(W_b x (W_a x cur)), the matmuls by expert with ids. The adapter's weights
    sit in the buffer type of the base weight (llama_adapter_lora_init_impl): placed as it is."""
    assert ctx.lora is not None
    base = name.split("-", 1)[0]
    for rank, ta, tb in ctx.lora(base):
        n_exp = res.n_expert
        wa = weight(ctx, (cur.ne[0], rank) + ((n_exp,) if ids is not None else ()), base, type_=ta) if ctx.weights else None
        wb = weight(ctx, (rank, res.ne[0]) + ((n_exp,) if ids is not None else ()), base, type_=tb) if ctx.weights else None
        if wa is not None and wb is not None:
            wa.w = wb.w = IS_ADAPTER
        if ids is None:
            ab = new_tensor(ctx, "MUL_MAT", F32, (rank, cur.ne[1], cur.ne[2], cur.ne[3]), srcs(wa, cur), name + "_lora_a")
            ab = new_tensor(ctx, "MUL_MAT", F32, (res.ne[0], ab.ne[1], ab.ne[2], ab.ne[3]), srcs(wb, ab), name + "_lora_b")
        else:
            ab = new_tensor(ctx, "MUL_MAT_ID", F32, (rank, ids.ne[0], cur.ne[2], 1), srcs(wa, cur, ids), name + "_lora_a")
            ab.n_expert = n_exp
            ab = new_tensor(ctx, "MUL_MAT_ID", F32, (res.ne[0], ids.ne[0], ab.ne[2], 1), srcs(wb, ab, ids), name + "_lora_b")
            ab.n_expert = n_exp
        ab = scale(ctx, ab, name + "_lora_scaled")
        res = add(ctx, res, ab, name)
    return res


def srcs(*src: Tensor | None) -> tuple:
    return tuple(x for x in src if x is not None)


def add(ctx: Context, a: Tensor, b: Tensor | None = None, name: str = "") -> Tensor:  # b None: a weight (bias)
    if b is None:
        b = op_weight(ctx, (a.ne[0],), "bias", small=True, user=name)
    return dup(ctx, "ADD", a, (a, b) if b is not None else (a,), name)


def mul(ctx: Context, a: Tensor, b: Tensor | None = None, name: str = "") -> Tensor:  # b None: a weight (norm, scale)
    if b is None:
        b = op_weight(ctx, (a.ne[0],), "norm", small=True, user=name)
    return dup(ctx, "MUL", a, (a, b) if b is not None else (a,), name)


def div(ctx: Context, a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "DIV", a, (a, b), name)


def sub(ctx: Context, a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "SUB", a, (a, b), name)


def scale(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "SCALE", a, (a,), name)


def clamp(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "CLAMP", a, (a,), name)


def unary(ctx: Context, a: Tensor, name: str = "", uop: str = "") -> Tensor:  # ggml_silu / gelu / tanh / sigmoid / exp / softplus / neg ...
    t = dup(ctx, "UNARY", a, (a,), name)
    t.uop = uop
    return t


def sqr(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "SQR", a, (a,), name)


def sqrt(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "SQRT", a, (a,), name)


def rms_norm(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "RMS_NORM", a, (a,), name)


def norm(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "NORM", a, (a,), name)


def l2_norm(ctx: Context, a: Tensor, name: str = "") -> Tensor:  # ggml_l2_norm
    return dup(ctx, "L2_NORM", a, (a,), name)


def rope(ctx: Context, a: Tensor, pos: Tensor, factors: Tensor | None = None, name: str = "") -> Tensor:
    return dup(ctx, "ROPE", a, (a, pos, factors) if factors is not None else (a, pos), name)


def soft_max(ctx: Context, a: Tensor, mask: Tensor | None = None, sinks: Tensor | None = None, name: str = "") -> Tensor:  # soft_max_ext (+ add_sinks)
    return dup(ctx, "SOFT_MAX", a, srcs(a, mask, sinks), name)


def cont(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "CONT", a, (a,), name)


def cont_nd(ctx: Context, a: Tensor, ne: Iterable[int], name: str = "") -> Tensor:  # ggml_cont_2d/3d/4d
    return new_tensor(ctx, "CONT", a.type, ne, (a,), name)


def cast(ctx: Context, a: Tensor, type_: int, name: str = "") -> Tensor:  # ggml_cast (src[1] = itself)
    t = new_tensor(ctx, "CPY", type_, a.ne, (a,), name)
    t.src = (a, t)
    return t


def cpy(ctx: Context, a: Tensor, b: Tensor, name: str = "") -> Tensor:  # ggml_cpy: a view of b
    return view_tensor(ctx, b, "CPY", (a, b), name)


def reshape(ctx: Context, a: Tensor, ne: Iterable[int], name: str = "") -> Tensor:  # ggml_reshape_Nd
    ne = list(ne) + [1] * (4 - len(list(ne)))
    return view_of(ctx, a, "RESHAPE", ne, contig_nb(a.type, ne), (a,), name)


def view(ctx: Context, a: Tensor, ne: Iterable[int], nbs: Iterable[int] = (), name: str = "") -> Tensor:  # ggml_view_1d..4d
    ne = list(ne)
    nd = len(ne)
    nbs = list(nbs)
    full = ne + [1] * (4 - nd)
    nb = contig_nb(a.type, full)
    for i, v in enumerate(nbs):
        nb[i + 1] = v
    if nd == 2:
        nb[2] = nb[1] * full[1]
        nb[3] = nb[2]
    elif nd == 3:
        nb[3] = nb[2] * full[2]
    return view_of(ctx, a, "VIEW", full, nb, (a,), name)


def permute(ctx: Context, a: Tensor, ax0: int, ax1: int, ax2: int, ax3: int, name: str = "") -> Tensor:
    ne = [0] * 4
    nb = [0] * 4
    for src_i, dst_i in enumerate((ax0, ax1, ax2, ax3)):
        ne[dst_i] = a.ne[src_i]
        nb[dst_i] = a.nb[src_i]
    return view_of(ctx, a, "PERMUTE", ne, nb, (a,), name)


def transpose(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    ne = [a.ne[1], a.ne[0], a.ne[2], a.ne[3]]
    nb = [a.nb[1], a.nb[0], a.nb[2], a.nb[3]]
    return view_of(ctx, a, "TRANSPOSE", ne, nb, (a,), name)


def get_rows(ctx: Context, a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return new_tensor(ctx, "GET_ROWS", I32 if a.type == I32 else F32, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), (a, b), name)


def set_rows(ctx: Context, a: Tensor, b: Tensor, c: Tensor, name: str = "") -> Tensor:  # a view of a; src = (b, c, a)
    return view_tensor(ctx, a, "SET_ROWS", (b, c, a), name)


def glu_split(ctx: Context, a: Tensor, b: Tensor, name: str = "") -> Tensor:  # ggml_swiglu_split / geglu_split / swiglu_oai
    return new_tensor(ctx, "GLU", a.type, a.ne, (a, b), name)


def glu(ctx: Context, a: Tensor, name: str = "") -> Tensor:  # fused ggml_swiglu(a): half of ne0
    return new_tensor(ctx, "GLU", a.type, (a.ne[0] // 2, a.ne[1], a.ne[2], a.ne[3]), (a,), name)


def argsort(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return new_tensor(ctx, "ARGSORT", I32, a.ne, (a,), name)


def argsort_top_k(ctx: Context, a: Tensor, k: int, name: str = "") -> Tensor:
    r = argsort(ctx, a, name)
    return view(ctx, r, (k, r.ne[1], r.ne[2], r.ne[3]), (r.nb[1], r.nb[2], r.nb[3]), name)


def sum_rows(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return new_tensor(ctx, "SUM_ROWS", a.type, (1, a.ne[1], a.ne[2], a.ne[3]), (a,), name)


def concat(ctx: Context, a: Tensor, b: Tensor, dim: int, name: str = "") -> Tensor:
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return new_tensor(ctx, "CONCAT", a.type, ne, (a, b), name)


def pad(ctx: Context, a: Tensor, p0: int, p1: int = 0, p2: int = 0, p3: int = 0, name: str = "") -> Tensor:
    return new_tensor(ctx, "PAD", a.type, (a.ne[0] + p0, a.ne[1] + p1, a.ne[2] + p2, a.ne[3] + p3), (a,), name)


def fill(ctx: Context, a: Tensor, name: str = "") -> Tensor:
    return dup(ctx, "FILL", a, (a,), name)


def repeat_4d(ctx: Context, a: Tensor, ne: Iterable[int], name: str = "") -> Tensor:
    return new_tensor(ctx, "REPEAT", a.type, ne, (a,), name)


def flash_attn_ext(ctx: Context, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor | None = None, name: str = "") -> Tensor:
    src = (q, k, v, mask) if sinks is None else (q, k, v, mask, sinks)
    return new_tensor(ctx, "FLASH_ATTN_EXT", F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), src, name)


VIEW_OPS = frozenset(("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))  # ggml_is_view_op


def nbytes_strided(t: Tensor) -> int:  # ggml_nbytes of a possibly non-contiguous tensor
    ne, nb = t.ne, t.nb
    for x in ne:  # each extent on its own, as ggml_nbytes (min() would compare them: a guard in a trace)
        if x <= 0:
            return 0
    if BLCK[t.type] == 1:
        n = TSIZE[t.type]
        for i in range(4):
            n += (ne[i] - 1) * nb[i]
        return n
    n = ne[0] * nb[0] // BLCK[t.type]
    for i in range(1, 4):
        n += (ne[i] - 1) * nb[i]
    return n
