"""What a model is, as llama.cpp will see it: hparams and per-layer kinds (src/llama-hparams.h/.cpp).

ModelSpec is llama_hparams plus what llama_model_loader reports about the file; `Meta` reads
`{arch}.*` keys as llama_model_loader::get_key / get_key_or_arr do; ArchRules is what one
architecture's load_arch_hparams decides beyond the common keys (sliding-window pattern, recurrent
layers, KV sharing, MLA, SSM) and the few load_tensors / create_memory facts that differ by
architecture. Each family's rules live in its fitter.llama.models module; fitter.llama.model reads
a header into a ModelSpec.
"""

from __future__ import annotations

from collections import defaultdict
from enum import Enum
from typing import Any, Callable

from fitter.errors import GGUFError
from fitter.gguf.constants import Keys
from fitter.gguf.reader import GGUFHeader, SkippedArray
from fitter.record import Record

LLAMA_MAX_LAYERS = 512  # src/llama-hparams.h
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"  # LLM_KV_ATTENTION_RECURRENT_LAYERS (not in gguf 0.19 Keys)


class LayerKind(str, Enum):
    FULL = "full"  # full attention, KV cache over the whole context
    SWA = "swa"  # sliding-window attention, KV cache over the window
    RECURRENT = "recurrent"  # linear attention / SSM: fixed-size recurrent state, no KV


class LayerSpec(Record):
    index: int
    kind: LayerKind
    has_kv: bool  # llama_hparams::has_kv (False for layers that reuse another layer's KV)
    nextn: bool = False  # an MTP / NextN prediction layer appended after the trunk
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    n_ff_exp: int = 0
    n_expert_used: int = 0

    @property
    def n_embd_k_gqa(self) -> int:  # llama_hparams::n_embd_k_gqa
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:  # llama_hparams::n_embd_v_gqa
        return self.n_embd_head_v * self.n_head_kv


class SSMSpec(Record):
    """Linear-attention / SSM parameters of recurrent layers (gated delta net, Mamba)."""

    d_conv: int
    d_inner: int
    d_state: int
    n_group: int
    dt_rank: int

    @property
    def n_embd_r(self) -> int:  # llama_hparams::n_embd_r (conv state)
        return (self.d_conv - 1 if self.d_conv > 0 else 0) * (self.d_inner + 2 * self.n_group * self.d_state)

    @property
    def n_embd_s(self) -> int:  # llama_hparams::n_embd_s (ssm state)
        return self.d_state * self.d_inner


class ModelSpec(Record):
    architecture: str
    known: bool = True  # False: an architecture ggfit does not model; the rules below are generic guesses
    name: str | None = None
    file_type: int | None = None
    file_type_name: str  # as llama.cpp prints it ("Q4_K - Medium"; "(guessed) ..." without general.file_type)
    file_size: int
    header_size: int
    tensor_bytes: int
    n_tensors: int
    n_params: int
    bytes_by_type: dict[str, int]
    params_by_type: dict[str, int]

    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int  # llama_hparams::n_layer(): the trunk, without NextN layers
    n_layer_nextn: int = 0
    layers: list[LayerSpec]

    n_swa: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    n_layer_dense_lead: int = 0

    is_mla: bool = False  # llama_hparams::is_mla: K cache only (no V), K width = kv_lora_rank + rope dims
    n_lora_kv: int = 0
    n_embd_head_k_mla: int = 0
    n_embd_head_v_mla: int = 0

    ssm: SSMSpec | None = None
    supports_rs_rollback: bool = False  # llm_arch_supports_rs_rollback (the family's ArchRules.rs_rollback)

    @property
    def has_mtp(self) -> bool:
        return self.n_layer_nextn > 0

    @property
    def is_hybrid(self) -> bool:
        kinds = {layer.kind for layer in self.layers}
        return LayerKind.RECURRENT in kinds and len(kinds) > 1

    @property
    def is_swa_any(self) -> bool:
        return any(layer.kind == LayerKind.SWA for layer in self.layers)

    def layer_kind_counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for layer in self.layers:
            if layer.nextn:
                counts["nextn"] += 1
            else:
                counts[layer.kind.value] += 1
        return dict(counts)


class Meta:
    """Typed access to `{arch}.*` keys, mirroring llama_model_loader::get_key / get_key_or_arr."""

    def __init__(self, header: GGUFHeader, arch: str):
        self.md = header.metadata
        self.arch = arch
        self.src = header.shards[0].location if header.shards else None

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def has(self, template: str) -> bool:
        return self.key(template) in self.md

    def get(self, template: str, default: Any = None, *, required: bool = False) -> Any:
        k = self.key(template)
        if k not in self.md:
            if required:
                raise GGUFError(0, f"required key '{k}' is missing (llama.cpp refuses this model too)", self.src)
            return default
        return self.md[k]

    def uint(self, template: str, default: int = 0, *, required: bool = False) -> int:
        v = self.get(template, None, required=required)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GGUFError(0, f"key '{self.key(template)}' must be a non-negative integer, got {v!r}", self.src)
        return v

    def per_layer(self, template: str, n: int, default: int, *, required: bool = False) -> list[int]:
        """llama_model_loader::get_key_or_arr: a scalar for every layer, or an array of n_layer_all."""
        v = self.get(template, None, required=required)
        if v is None:
            return [default] * n
        if isinstance(v, SkippedArray):
            raise GGUFError(0, f"key '{self.key(template)}' is an array of {v.length} elements, too long", self.src)
        if isinstance(v, list):
            if len(v) != n:  # llama_model_loader::get_key_or_arr: "key %s has wrong array length"
                raise GGUFError(0, f"key '{self.key(template)}' has {len(v)} elements, expected {n} (one per layer)", self.src)
            return [int(x) for x in v]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GGUFError(0, f"key '{self.key(template)}' must be a non-negative integer, got {v!r}", self.src)
        return [v] * n


# --- per-architecture rules: (sliding window, recurrent layers, kv sharing) -----------------------


def swa_pattern(n_pattern: int, n_layer: int, n_layer_all: int, dense_first: bool = False) -> list[bool]:
    # llama_hparams::set_swa_pattern
    out = []
    for il in range(n_layer_all):
        if il >= n_layer:
            out.append(False)
        elif dense_first:
            out.append(n_pattern == 0 or il % n_pattern != 0)
        else:
            out.append(n_pattern == 0 or il % n_pattern < n_pattern - 1)
    return out


def load_swa_pattern(m: Meta, n_pattern: int, n_layer: int, n_layer_all: int, dense_first: bool = False) -> list[bool]:
    # llama_model_base::load_swa_pattern: a bool array wins, else a scalar pattern overrides the default
    v = m.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if isinstance(v, list):
        return [bool(x) for x in v] + [False] * (n_layer_all - len(v))
    if isinstance(v, int) and not isinstance(v, bool):
        n_pattern = v
    return swa_pattern(n_pattern, n_layer, n_layer_all, dense_first)


def _no_swa(m: Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    return 0, [False] * n_layer_all


def _no_recurrent(m: Meta, n_layer: int, n_layer_all: int) -> list[bool]:
    return [False] * n_layer_all


def _kv_from_start_all(m: Meta, n_layer_all: int) -> int:
    return -1


class ArchRules(Record):
    """What one architecture decides beyond the common hparams (its load_arch_hparams, load_tensors, create_memory)."""

    # load_arch_hparams
    swa: Callable[[Meta, int, int], tuple[int, list[bool]]] = _no_swa  # (n_swa, is_swa per layer)
    recurrent: Callable[[Meta, int, int], list[bool]] = _no_recurrent  # is_recurrent per layer
    kv_from_start: Callable[[Meta, int], int] = _kv_from_start_all  # n_layer_kv_from_start (-1: every layer)
    ssm: bool = False  # reads the ssm.* keys
    mla: bool = False  # reads the MLA head sizes (llama_hparams::is_mla)
    # llama_model::create_memory: llama_memory_hybrid (llm_arch_is_hybrid) instead of a KV cache
    hybrid_memory: bool = False
    rs_rollback: bool = False  # llm_arch_supports_rs_rollback: MTP keeps recurrent snapshots to roll back
    # load_tensors
    tied_output: bool = True  # a missing output.weight is token_embd created again (TENSOR_DUPLICATED)
    output_before_tok_embd: bool = False  # that tied output is created before token_embd itself
    per_layer_globals_full_only: bool = False  # rope_freqs & co. are duplicated on full-attention layers only


# Any architecture ggfit does not model (`allow_unknown`): the generic rules
GENERIC_RULES = ArchRules()
