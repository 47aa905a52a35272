"""What llama.cpp's log says of a run, as records (`LlamaReport` and its parts); fitter.oracle.llama_log parses a log
into them. Sizes are the printed MiB figures (two decimals: PRINT_TOLERANCE_BYTES) unless said otherwise."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MIB = 1 << 20
PRINT_PRECISION_MIB = 0.01  # every "%8.2f MiB" / "%7.2f MiB" figure
PRINT_TOLERANCE_BYTES = 5243  # ceil(0.005 MiB): the most a two-decimal MiB figure can be off
FINE_PRECISION_MIB = 0.0001  # the DEBUG "%8.4f MiB" compute-buffer check after a real load

BufferKind = Literal["model", "kv", "rs", "output", "compute", "state", "lora", "other"]


def mib_to_bytes(mib: float) -> int:
    return round(mib * MIB)


class BufferLine(BaseModel):
    """One `<func>: <buffer> <label> buffer size = <MiB> MiB` line."""

    kind: BufferKind
    label: str  # as printed before "buffer size": "model", "KV", "RS", "output", "compute", "DSV4 csa state", ...
    buffer: str  # buffer (type) name as printed: CPU, CPU_Mapped, CUDA0, CUDA_Host, ...
    func: str  # printing function as it appears in the line (load_tensors, llama_kv_cache, sched_reserve, ...)
    mib: float
    bytes: int  # round(mib * 2**20); +-PRINT_TOLERANCE_BYTES
    dummy: bool = False  # no_alloc run: llama.cpp printed the size of a zero-size dummy buffer, not a size
    line: int  # 1-based line number in the log


class KVCacheSize(BaseModel):
    """`llama_kv_cache: size = X MiB (N cells, L layers, a/b seqs), K (t): X MiB, V (t): Y MiB`.

    One per KV cache (an iSWA model prints one for the non-SWA cache and one for the SWA cache).
    Authoritative in dry and real runs (computed from the cache tensors, see `llama_kv_cache::llama_kv_cache`).
    """

    role: str | None = None  # "non-SWA", "SWA", "indexer" from the preceding "creating ... KV cache" line
    mib: float
    bytes: int
    cells: int
    layers: int
    n_seq_max: int
    n_stream: int  # 1 when kv_unified, else n_seq_max
    type_k: str
    k_mib: float
    k_bytes: int
    type_v: str
    v_mib: float
    v_bytes: int
    line: int


class RecurrentStateSize(BaseModel):
    """`llama_memory_recurrent: size = X MiB (N cells, L layers, a seqs b rs_seq), R (t): .., S (t): .., P (t): ..`."""

    mib: float
    bytes: int
    cells: int
    layers: int
    n_seq_max: int
    n_rs_seq: int | None = None
    type_r: str
    r_mib: float
    r_bytes: int
    type_s: str
    s_mib: float
    s_bytes: int
    type_p: str | None = None
    p_mib: float | None = None
    p_bytes: int | None = None
    line: int


class ComputeCheck(BaseModel):
    """`~llama_context: <buf> compute buffer size is|of X MiB, [does not ]match[es] expectation of Y MiB`.

    Printed when a real (allocating) context is freed: DEBUG when it matches, WARN when it does not.
    """

    buffer: str
    actual_mib: float
    actual_bytes: int
    expected_mib: float
    expected_bytes: int
    matches: bool
    line: int


class GraphInfo(BaseModel):
    """`sched_reserve: graph[ (pp bs=P, tg bs=T)]: nodes = a[ / b], splits = c[ / d], ...`."""

    nodes_pp: int
    nodes_tg: int
    splits_pp: int
    splits_tg: int
    input_objects_pp: int | None = None
    input_objects_tg: int | None = None
    input_tensors_pp: int | None = None
    input_tensors_tg: int | None = None
    pp_bs: int | None = None
    tg_bs: int | None = None


class ContextInfo(BaseModel):
    """What `llama_context::llama_context` prints about its cparams."""

    n_seq_max: int | None = None
    n_ctx: int | None = None
    n_ctx_seq: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    causal_attn: bool | None = None
    flash_attn: str | None = None  # as printed: the requested type "auto" / "enabled" / "disabled"
    # the effective value: "enabled"/"disabled" when requested so, else resolve_fused_ops's verdict on "auto"
    flash_attn_resolved: bool | None = None
    kv_unified: bool | None = None
    # not printed by llama_context: True when llama_kv_cache_iswa warns "using full-size SWA cache",
    # False when an iSWA cache was created without that warning, None when there is no iSWA cache
    swa_full: bool | None = None
    n_rs_seq: int | None = None
    n_outputs_max: int | None = None
    n_outputs_max_per_seq: int | None = None
    freq_base: float | None = None
    freq_scale: float | None = None


class LayerInfo(BaseModel):
    """DEBUG `load_tensors: layer %3d assigned to device %s, is_swa = %d` (llama_model::load_tensors).

    llama.cpp prints n_layer_all + 1 of them: the last (il == n_layer_all) is the output layer's device.
    """

    il: int
    device: str
    is_swa: bool
    is_output: bool = False


class HParams(BaseModel):
    """The print_info values ggfit needs, normalised. Per-layer values stay lists when llama.cpp printed a list."""

    model_config = ConfigDict(protected_namespaces=())

    arch: str | None = None
    n_layer: int | None = None
    n_layer_all: int | None = None
    n_head: int | list[int] | None = None
    n_head_kv: int | list[int] | None = None
    n_embd: int | None = None
    n_embd_inp: int | None = None
    n_embd_out: int | None = None
    n_embd_head_k: int | None = None
    n_embd_head_v: int | None = None
    n_embd_k_gqa: int | list[int] | None = None
    n_embd_v_gqa: int | list[int] | None = None
    n_embd_head_k_swa: int | None = None
    n_embd_head_v_swa: int | None = None
    n_ff: int | list[int] | None = None
    n_rot: int | None = None
    n_swa: int | None = None
    is_swa_any: bool | None = None
    is_swa: list[bool] | None = None  # per layer, from the DEBUG load_tensors lines (not in print_info)
    n_ctx_train: int | None = None
    n_expert: int | None = None
    n_expert_used: int | None = None
    causal_attn: bool | None = None
    pooling_type: int | None = None
    file_type: str | None = None
    file_size_mib: float | None = None  # print_info prints MiB or GiB; normalised to MiB
    file_bpw: float | None = None
    model_type: str | None = None
    model_params: int | None = None  # "268.10 M" -> 268100000 (printed to 4-5 significant digits)
    n_vocab: int | None = None
    vocab_type: str | None = None
    general_name: str | None = None
    ssm_d_conv: int | None = None
    ssm_d_inner: int | None = None
    ssm_d_state: int | None = None
    ssm_dt_rank: int | None = None
    ssm_n_group: int | None = None


class LlamaReport(BaseModel):
    print_info: dict[str, str] = Field(default_factory=dict)  # first value of every `print_info: key = value`
    print_info_repeats: dict[str, list[str]] = Field(default_factory=dict)  # keys printed more than once (EOG token)
    hparams: HParams = Field(default_factory=HParams)
    layers: list[LayerInfo] = Field(default_factory=list)
    no_alloc: bool | None = None  # print_info: no_alloc
    load_mode: str | None = None  # "loading model tensors, ... (load_mode = none)"
    buffers: list[BufferLine] = Field(default_factory=list)
    kv_caches: list[KVCacheSize] = Field(default_factory=list)
    kv_cache_cells: list[tuple[str, int]] = Field(default_factory=list)  # ("non-SWA", 4096) from llama_kv_cache_iswa
    recurrent: list[RecurrentStateSize] = Field(default_factory=list)
    context: ContextInfo | None = None
    graph: GraphInfo | None = None
    reserve_ms: float | None = None
    compute_checks: list[ComputeCheck] = Field(default_factory=list)
    mismatch_warnings: list[str] = Field(default_factory=list)  # "does not match expectation" lines, verbatim
    abort: str | None = None  # "file:line: message" of a GGML_ASSERT/GGML_ABORT, or an uncaught C++ exception

    def rows(self, kind: BufferKind, *, include_dummy: bool = False) -> list[BufferLine]:
        return [b for b in self.buffers if b.kind == kind and (include_dummy or not b.dummy)]

    def printed_bytes(self, kind: BufferKind) -> int | None:
        """Sum of the printed (non-dummy) buffer lines of one kind; None when there is none."""
        rows = self.rows(kind)
        return sum(r.bytes for r in rows) if rows else None

    def kv_bytes(self) -> int | None:
        """KV cache bytes from the authoritative `size = ...` lines (K + V of every cache)."""
        if not self.kv_caches:
            return None
        return sum(c.k_bytes + c.v_bytes for c in self.kv_caches)
