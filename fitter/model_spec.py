"""What a model is, as llama.cpp will see it: hparams and per-layer kinds, from the GGUF header alone.

Mirrors `llama_model_base::load_hparams` (src/llama-model.cpp) and each architecture's
`load_arch_hparams` (src/models/<arch>.cpp) of the pinned llama.cpp, for the architectures
ggfit models. An architecture not in `ARCHITECTURES` is refused with UnsupportedModelError unless
the caller asks for a best-effort description (`allow_unknown=True`, used by `ggfit inspect`), which
is then marked `known=False`.
"""

from __future__ import annotations

from collections import defaultdict
from enum import Enum
from typing import Any, Callable

from fitter.gguf.constants import GGMLQuantizationType, Keys, LlamaFileType
from pydantic import BaseModel, ConfigDict

from fitter.errors import GGUFError, UnsupportedModelError
from fitter.gguf.reader import GGUFHeader, SkippedArray

LLAMA_MAX_LAYERS = 512  # src/llama-hparams.h
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"  # LLM_KV_ATTENTION_RECURRENT_LAYERS (not in gguf 0.19 Keys)


class LayerKind(str, Enum):
    FULL = "full"  # full attention, KV cache over the whole context
    SWA = "swa"  # sliding-window attention, KV cache over the window
    RECURRENT = "recurrent"  # linear attention / SSM: fixed-size recurrent state, no KV


class LayerSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

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


class SSMSpec(BaseModel):
    """Linear-attention / SSM parameters of recurrent layers (gated delta net, Mamba)."""

    model_config = ConfigDict(frozen=True)

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


class ModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

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


class _Meta:
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

SwaRule = Callable[[_Meta, int, int], tuple[int, list[bool]]]


def _swa_pattern(n_pattern: int, n_layer: int, n_layer_all: int, dense_first: bool = False) -> list[bool]:
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


def _load_swa_pattern(m: _Meta, n_pattern: int, n_layer: int, n_layer_all: int, dense_first: bool = False) -> list[bool]:
    # llama_model_base::load_swa_pattern: a bool array wins, else a scalar pattern overrides the default
    v = m.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if isinstance(v, list):
        return [bool(x) for x in v] + [False] * (n_layer_all - len(v))
    if isinstance(v, int) and not isinstance(v, bool):
        n_pattern = v
    return _swa_pattern(n_pattern, n_layer, n_layer_all, dense_first)


def _no_swa(m: _Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    return 0, [False] * n_layer_all


def _gemma2_swa(m: _Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_gemma2::load_arch_hparams: window defaults to 4096, pattern 2
    return m.uint(Keys.Attention.SLIDING_WINDOW, 4096), _load_swa_pattern(m, 2, n_layer, n_layer_all)


def _gemma3_swa(m: _Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_gemma3::load_arch_hparams: SWA only when the window key is present and > 0; pattern 6
    n_swa = m.uint(Keys.Attention.SLIDING_WINDOW, 0)
    if n_swa == 0:
        return 0, [False] * n_layer_all
    return n_swa, _load_swa_pattern(m, 6, n_layer, n_layer_all)


def _gemma4_swa(m: _Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_gemma4::load_arch_hparams: the pattern is a required bool array
    v = m.get(Keys.Attention.SLIDING_WINDOW_PATTERN, required=True)
    if not isinstance(v, list):
        raise GGUFError(0, f"'{m.key(Keys.Attention.SLIDING_WINDOW_PATTERN)}' must be an array for gemma4", m.src)
    return m.uint(Keys.Attention.SLIDING_WINDOW, required=True), [bool(x) for x in v] + [False] * (n_layer_all - len(v))


def _gpt_oss_swa(m: _Meta, n_layer: int, n_layer_all: int) -> tuple[int, list[bool]]:
    # llama_model_openai_moe::load_arch_hparams: required window, pattern 2
    return m.uint(Keys.Attention.SLIDING_WINDOW, required=True), _load_swa_pattern(m, 2, n_layer, n_layer_all)


def _no_recurrent(m: _Meta, n_layer: int, n_layer_all: int) -> list[bool]:
    return [False] * n_layer_all


def _gdn_recurrent(m: _Meta, n_layer: int, n_layer_all: int) -> list[bool]:
    # llama_model_qwen35::load_arch_hparams (same in qwen35moe, qwen3next): recurrent_layers array,
    # else every layer but each full_attention_interval-th; NextN layers are never recurrent
    if m.has(RECURRENT_LAYERS_KEY):
        return [bool(x) for x in m.per_layer(RECURRENT_LAYERS_KEY, n_layer_all, 0)]
    interval = m.uint(Keys.LLM.FULL_ATTENTION_INTERVAL, 4)
    if interval == 0:
        raise GGUFError(0, f"'{m.key(Keys.LLM.FULL_ATTENTION_INTERVAL)}' is 0", m.src)
    return [i < n_layer and (i + 1) % interval != 0 for i in range(n_layer_all)]


def _kv_from_start_all(m: _Meta, n_layer_all: int) -> int:
    return -1


def _gemma4_kv_from_start(m: _Meta, n_layer_all: int) -> int:
    # llama_model_gemma4::load_arch_hparams: the last shared_kv_layers layers reuse earlier KV
    return n_layer_all - m.uint(Keys.Attention.SHARED_KV_LAYERS, 0)


class _ArchRules(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    swa: Any = _no_swa
    recurrent: Any = _no_recurrent
    kv_from_start: Any = _kv_from_start_all
    ssm: bool = False
    mla: bool = False


ARCHITECTURES: dict[str, _ArchRules] = {
    "llama": _ArchRules(),
    "mistral3": _ArchRules(),
    "qwen2": _ArchRules(),
    "qwen3": _ArchRules(),
    "qwen3moe": _ArchRules(),
    "phi3": _ArchRules(),  # llama_model_phi3: a sliding window in the file is ignored (SWA disabled)
    "gemma2": _ArchRules(swa=_gemma2_swa),
    "gemma3": _ArchRules(swa=_gemma3_swa),
    "gemma4": _ArchRules(swa=_gemma4_swa, kv_from_start=_gemma4_kv_from_start),
    "gpt-oss": _ArchRules(swa=_gpt_oss_swa),
    "qwen35": _ArchRules(recurrent=_gdn_recurrent, ssm=True),
    "qwen35moe": _ArchRules(recurrent=_gdn_recurrent, ssm=True),
    "qwen3next": _ArchRules(recurrent=_gdn_recurrent, ssm=True),
    "deepseek2": _ArchRules(mla=True),
    "glm4moe": _ArchRules(),
}


def _type_name(t: GGMLQuantizationType) -> str:
    return t.name


# llama_ftype_name (src/llama-model-loader.cpp), keyed by gguf's LlamaFileType member names
FTYPE_NAMES = {
    "ALL_F32": "all F32", "MOSTLY_F16": "F16", "MOSTLY_BF16": "BF16", "MOSTLY_Q4_0": "Q4_0", "MOSTLY_Q4_1": "Q4_1",
    "MOSTLY_Q5_0": "Q5_0", "MOSTLY_Q5_1": "Q5_1", "MOSTLY_Q8_0": "Q8_0", "MOSTLY_MXFP4_MOE": "MXFP4 MoE",
    "MOSTLY_Q2_K": "Q2_K - Medium", "MOSTLY_Q2_K_S": "Q2_K - Small", "MOSTLY_Q3_K_S": "Q3_K - Small",
    "MOSTLY_Q3_K_M": "Q3_K - Medium", "MOSTLY_Q3_K_L": "Q3_K - Large", "MOSTLY_Q4_K_S": "Q4_K - Small",
    "MOSTLY_Q4_K_M": "Q4_K - Medium", "MOSTLY_Q5_K_S": "Q5_K - Small", "MOSTLY_Q5_K_M": "Q5_K - Medium",
    "MOSTLY_Q6_K": "Q6_K", "MOSTLY_TQ1_0": "TQ1_0 - 1.69 bpw ternary", "MOSTLY_TQ2_0": "TQ2_0 - 2.06 bpw ternary",
    "MOSTLY_IQ2_XXS": "IQ2_XXS - 2.0625 bpw", "MOSTLY_IQ2_XS": "IQ2_XS - 2.3125 bpw", "MOSTLY_IQ2_S": "IQ2_S - 2.5 bpw",
    "MOSTLY_IQ2_M": "IQ2_M - 2.7 bpw", "MOSTLY_IQ3_XS": "IQ3_XS - 3.3 bpw", "MOSTLY_IQ3_XXS": "IQ3_XXS - 3.0625 bpw",
    "MOSTLY_IQ1_S": "IQ1_S - 1.5625 bpw", "MOSTLY_IQ1_M": "IQ1_M - 1.75 bpw", "MOSTLY_IQ4_NL": "IQ4_NL - 4.5 bpw",
    "MOSTLY_IQ4_XS": "IQ4_XS - 4.25 bpw", "MOSTLY_IQ3_S": "IQ3_S - 3.4375 bpw", "MOSTLY_IQ3_M": "IQ3_S mix - 3.66 bpw",
    "MOSTLY_NVFP4": "NVFP4", "MOSTLY_Q1_0": "Q1_0",
}
# llama_model_loader::llama_model_loader: without general.file_type, the most common tensor type decides
_GUESS = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0", "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M",
    "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K", "TQ1_0": "MOSTLY_TQ1_0",
    "TQ2_0": "MOSTLY_TQ2_0", "IQ2_XXS": "MOSTLY_IQ2_XXS", "IQ2_XS": "MOSTLY_IQ2_XS", "IQ2_S": "MOSTLY_IQ2_S",
    "IQ3_XXS": "MOSTLY_IQ3_XXS", "IQ1_S": "MOSTLY_IQ1_S", "IQ1_M": "MOSTLY_IQ1_M", "IQ4_NL": "MOSTLY_IQ4_NL",
    "IQ4_XS": "MOSTLY_IQ4_XS", "IQ3_S": "MOSTLY_IQ3_S", "NVFP4": "MOSTLY_NVFP4", "Q1_0": "MOSTLY_Q1_0",
}


def _file_type(header: GGUFHeader) -> tuple[int | None, str]:
    """(general.file_type, llama.cpp's name for it), or llama.cpp's guess with its "(guessed)" prefix."""
    ft = header.metadata.get(Keys.General.FILE_TYPE)
    if isinstance(ft, int) and not isinstance(ft, bool):
        try:
            return ft, FTYPE_NAMES.get(LlamaFileType(ft).name, "unknown, may not work")
        except ValueError:
            return ft, "unknown, may not work"
    counts: dict[str, int] = defaultdict(int)
    best, best_n = "F32", 0
    for t in sorted(header.tensors, key=lambda t: t.name):  # weights_map is ordered by name
        counts[t.ggml_type.name] += 1
        if counts[t.ggml_type.name] > best_n:
            best, best_n = t.ggml_type.name, counts[t.ggml_type.name]
    guess = _GUESS.get(best, "ALL_F32")
    return None, "(guessed) " + FTYPE_NAMES[guess]


def model_spec_from_header(header: GGUFHeader, *, allow_unknown: bool = False) -> ModelSpec:
    """Describe a model from its header, the way llama.cpp's load_hparams reads it."""
    src = header.shards[0].location if header.shards else None
    arch = header.architecture
    if arch is None:
        raise GGUFError(0, f"key '{Keys.General.ARCHITECTURE}' is missing or not a string", src)
    rules = ARCHITECTURES.get(arch)
    if rules is None:
        if not allow_unknown:
            raise UnsupportedModelError(
                f"{src or 'model'}: architecture '{arch}' is not modelled by ggfit yet "
                f"(known: {', '.join(sorted(ARCHITECTURES))})"
            )
        rules = _ArchRules()
    m = _Meta(header, arch)

    # llama_model_base::load_hparams
    n_ctx_train = m.uint(Keys.LLM.CONTEXT_LENGTH, required=True)
    n_embd = m.uint(Keys.LLM.EMBEDDING_LENGTH, required=True)
    n_layer_all = m.uint(Keys.LLM.BLOCK_COUNT, required=True)
    if not 0 < n_layer_all <= LLAMA_MAX_LAYERS:
        raise GGUFError(0, f"block_count {n_layer_all} is outside llama.cpp's 1..{LLAMA_MAX_LAYERS}", src)
    n_layer_nextn = m.uint(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    if n_layer_nextn > n_layer_all:
        raise GGUFError(0, f"nextn_predict_layers {n_layer_nextn} > block_count {n_layer_all}", src)
    n_layer = n_layer_all - n_layer_nextn
    n_expert = m.uint(Keys.LLM.EXPERT_COUNT, 0)
    n_expert_used = m.per_layer(Keys.LLM.EXPERT_USED_COUNT, n_layer_all, 0)
    n_ff = m.per_layer(Keys.LLM.FEED_FORWARD_LENGTH, n_layer_all, 0)
    n_head = m.per_layer(Keys.Attention.HEAD_COUNT, n_layer_all, 0)
    n_head_kv = m.per_layer(Keys.Attention.HEAD_COUNT_KV, n_layer_all, 0) if m.has(Keys.Attention.HEAD_COUNT_KV) else list(n_head)
    n_ff_exp = m.per_layer(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, n_layer_all, 0)
    if max(n_expert_used) > n_expert:
        raise GGUFError(0, f"expert_used_count {max(n_expert_used)} > expert_count {n_expert}", src)

    head0 = n_head[0]
    if head0 > 0:
        hk_full = m.uint(Keys.Attention.KEY_LENGTH, n_embd // head0)
        hv_full = m.uint(Keys.Attention.VALUE_LENGTH, n_embd // head0)
    else:
        hk_full = hv_full = 0
    hk_swa = m.uint(Keys.Attention.KEY_LENGTH_SWA, hk_full)
    hv_swa = m.uint(Keys.Attention.VALUE_LENGTH_SWA, hv_full)

    n_swa, is_swa = rules.swa(m, n_layer, n_layer_all)
    is_recr = rules.recurrent(m, n_layer, n_layer_all)
    kv_from_start = rules.kv_from_start(m, n_layer_all)

    layers = []
    for il in range(n_layer_all):
        swa = il < len(is_swa) and is_swa[il]
        recr = il < len(is_recr) and is_recr[il]
        kind = LayerKind.RECURRENT if recr else (LayerKind.SWA if swa else LayerKind.FULL)
        layers.append(
            LayerSpec(
                index=il,
                kind=kind,
                has_kv=kv_from_start < 0 or il < kv_from_start,
                nextn=il >= n_layer,
                n_head=n_head[il],
                n_head_kv=n_head_kv[il],
                n_embd_head_k=hk_swa if swa else hk_full,
                n_embd_head_v=hv_swa if swa else hv_full,
                n_ff=n_ff[il],
                n_ff_exp=n_ff_exp[il],
                n_expert_used=n_expert_used[il],
            )
        )

    ssm = None
    if rules.ssm:
        ssm = SSMSpec(
            d_conv=m.uint(Keys.SSM.CONV_KERNEL, required=True),
            d_inner=m.uint(Keys.SSM.INNER_SIZE, required=True),
            d_state=m.uint(Keys.SSM.STATE_SIZE, required=True),
            n_group=m.uint(Keys.SSM.GROUP_COUNT, required=True),
            dt_rank=m.uint(Keys.SSM.TIME_STEP_RANK, required=True),
        )

    is_mla = False
    hk_mla = hv_mla = 0
    if rules.mla:
        hk_mla = m.uint(Keys.Attention.KEY_LENGTH_MLA, 0)
        hv_mla = m.uint(Keys.Attention.VALUE_LENGTH_MLA, 0)
        is_mla = hk_mla != 0 and hv_mla != 0  # llama_hparams::is_mla

    # Vocabulary: the token list's length (llama_vocab::load), or vocab_size where there is no list.
    tokens = header.metadata.get(Keys.Tokenizer.LIST)
    if isinstance(tokens, (list, SkippedArray)):
        n_vocab = len(tokens)
    else:
        n_vocab = m.uint(Keys.LLM.VOCAB_SIZE, 0)

    bytes_by_type: dict[str, int] = defaultdict(int)
    params_by_type: dict[str, int] = defaultdict(int)
    for t in header.tensors:
        bytes_by_type[_type_name(t.ggml_type)] += t.nbytes
        params_by_type[_type_name(t.ggml_type)] += t.n_elements
    ft, ft_name = _file_type(header)

    name = header.metadata.get(Keys.General.NAME)
    return ModelSpec(
        architecture=arch,
        known=arch in ARCHITECTURES,
        name=name if isinstance(name, str) else None,
        file_type=ft,
        file_type_name=ft_name,
        file_size=header.file_size,
        header_size=header.header_size,
        tensor_bytes=header.tensor_bytes,
        n_tensors=len(header.tensors),
        n_params=sum(params_by_type.values()),
        bytes_by_type=dict(sorted(bytes_by_type.items(), key=lambda kv: -kv[1])),
        params_by_type=dict(sorted(params_by_type.items(), key=lambda kv: -kv[1])),
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_layer_nextn=n_layer_nextn,
        layers=layers,
        n_swa=n_swa if any(is_swa) else 0,
        n_expert=n_expert,
        n_expert_used=max(n_expert_used) if n_expert_used else 0,
        n_expert_shared=m.uint(Keys.LLM.EXPERT_SHARED_COUNT, 0),
        n_ff_shexp=m.uint(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
        n_layer_dense_lead=m.uint(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        is_mla=is_mla,
        n_lora_kv=m.uint(Keys.Attention.KV_LORA_RANK, 0),
        n_embd_head_k_mla=hk_mla,
        n_embd_head_v_mla=hv_mla,
        ssm=ssm,
    )


def load_model_spec(location: str, *, allow_unknown: bool = False) -> tuple[GGUFHeader, ModelSpec]:
    from fitter.gguf.reader import read_header

    header = read_header(location)
    return header, model_spec_from_header(header, allow_unknown=allow_unknown)
