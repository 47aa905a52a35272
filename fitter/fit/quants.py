"""Which quant fits: every `llama-quantize` file type's per-tensor types and exact file size, from one header.

Mirrors `src/llama-quant.cpp` of the pinned llama.cpp (`llama_model_quantize_impl` and the helpers it
calls) without running it: which tensors are quantized at all (`tensor_allows_quantization`), the
ftype's default type (`llama_ftype_get_default_type`), the per-tensor raises and lowers
(`llama_tensor_get_type_impl`, with its attn_v / ffn_down counters walked in the loader's tensor
order), the block-size fallbacks (`tensor_type_fallback`) and the imatrix requirement
(`tensor_requires_imatrix`). The output size is the GGUF that `llama_model_quantize` writes: the
input's key/values with `general.file_type` / `general.quantization_version` set and the `split.*`
keys removed, one tensor info per tensor, padded to 32 bytes, then each tensor's data padded to 32.

Only tensor shapes and names matter (plus a few hparams: layer count, expert count, GQA ratio), so
the header may be F32/F16/BF16 or already quantized: the prediction is what quantizing the original
weights would give. Tensors llama.cpp does not quantize (norms, routers, conv1d...) keep the input's
type, as llama-quantize copies them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterable

from fitter.errors import GGFitError
from fitter.gguf.constants import GGUFValueType
from fitter.ggml.types import BLCK, TSIZE, TYPE_TRAITS
from fitter.gguf.reader import GGUFHeader, SkippedArray, SkippedString

GGUF_DEFAULT_ALIGNMENT = 32  # ggml/include/gguf.h; llama-quant.cpp writes with it whatever the input says


class QuantError(GGFitError):
    """A quant cannot be predicted: unknown ftype name, or a header llama-quantize cannot read."""


class QuantRefused(QuantError):
    """llama-quantize itself would fail for this model and ftype (not for want of an imatrix)."""


# ---------------------------------------------------------------------------------------------
# ggml types, named as llama-quantize prints them (upper case); the table is fitter.ggml.types'

T = {name.upper(): tid for tid, (name, _, _) in TYPE_TRAITS.items()}  # type name -> ggml_type id
F32, F16, BF16 = T["F32"], T["F16"], T["BF16"]
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = T["Q4_0"], T["Q4_1"], T["Q5_0"], T["Q5_1"], T["Q8_0"]
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = T["Q2_K"], T["Q3_K"], T["Q4_K"], T["Q5_K"], T["Q6_K"]
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S = T["IQ1_S"], T["IQ1_M"], T["IQ2_XXS"], T["IQ2_XS"], T["IQ2_S"]
IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS = T["IQ3_XXS"], T["IQ3_S"], T["IQ4_NL"], T["IQ4_XS"]
TQ1_0, TQ2_0, MXFP4, Q1_0, Q2_0 = T["TQ1_0"], T["TQ2_0"], T["MXFP4"], T["Q1_0"], T["Q2_0"]
_NOT_QUANTIZED = {F32, F16, BF16, T["I8"], T["I16"], T["I32"], T["I64"], T["F64"]}  # ggml_is_quantized() false


def type_name(tid: int) -> str:
    return TYPE_TRAITS[tid][0].upper() if tid in TYPE_TRAITS else f"type{tid}"


def row_bytes(tid: int, ne0: int) -> int:
    """ggml_row_size."""
    return TSIZE[tid] * (ne0 // BLCK[tid])


def tensor_bytes(tid: int, shape: tuple[int, ...]) -> int:
    """ggml_nbytes of a contiguous tensor."""
    n = 1
    for d in shape[1:]:
        n *= d
    return row_bytes(tid, shape[0]) * n


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def _pad(n: int, align: int = GGUF_DEFAULT_ALIGNMENT) -> int:
    return n + (-n) % align


# ---------------------------------------------------------------------------------------------
# file types: tools/quantize/quantize.cpp QUANT_OPTIONS (name -> llama_ftype id), in its order


@dataclass(frozen=True)
class FType:
    name: str  # as llama-quantize prints it
    id: int  # llama_ftype
    default_type: int  # llama_ftype_get_default_type
    description: str


_FTYPE_LIST: tuple[FType, ...] = (
    FType("Q1_0", 40, Q1_0, "1.125 bpw quantization"),
    FType("Q2_0", 41, Q2_0, "2.25 bpw quantization (group 64)"),
    FType("Q4_0", 2, Q4_0, "4.34G, +0.4685 ppl @ Llama-3-8B"),
    FType("Q4_1", 3, Q4_1, "4.78G, +0.4511 ppl @ Llama-3-8B"),
    FType("MXFP4_MOE", 38, MXFP4, "MXFP4 MoE"),
    FType("Q5_0", 8, Q5_0, "5.21G, +0.1316 ppl @ Llama-3-8B"),
    FType("Q5_1", 9, Q5_1, "5.65G, +0.1062 ppl @ Llama-3-8B"),
    FType("IQ2_XXS", 19, IQ2_XXS, "2.06 bpw quantization"),
    FType("IQ2_XS", 20, IQ2_XS, "2.31 bpw quantization"),
    FType("IQ2_S", 28, IQ2_XS, "2.5  bpw quantization"),
    FType("IQ2_M", 29, IQ2_S, "2.7  bpw quantization"),
    FType("IQ1_S", 24, IQ1_S, "1.56 bpw quantization"),
    FType("IQ1_M", 31, IQ1_M, "1.75 bpw quantization"),
    FType("TQ1_0", 36, TQ1_0, "1.69 bpw ternarization"),
    FType("TQ2_0", 37, TQ2_0, "2.06 bpw ternarization"),
    FType("Q2_K", 10, Q2_K, "2.96G, +3.5199 ppl @ Llama-3-8B"),
    FType("Q2_K_S", 21, Q2_K, "2.96G, +3.1836 ppl @ Llama-3-8B"),
    FType("IQ3_XXS", 23, IQ3_XXS, "3.06 bpw quantization"),
    FType("IQ3_S", 26, IQ3_S, "3.44 bpw quantization"),
    FType("IQ3_M", 27, IQ3_S, "3.66 bpw quantization mix"),
    FType("IQ3_XS", 22, IQ3_S, "3.3 bpw quantization"),
    FType("Q3_K_S", 11, Q3_K, "3.41G, +1.6321 ppl @ Llama-3-8B"),
    FType("Q3_K_M", 12, Q3_K, "3.74G, +0.6569 ppl @ Llama-3-8B"),
    FType("Q3_K_L", 13, Q3_K, "4.03G, +0.5562 ppl @ Llama-3-8B"),
    FType("IQ4_NL", 25, IQ4_NL, "4.50 bpw non-linear quantization"),
    FType("IQ4_XS", 30, IQ4_XS, "4.25 bpw non-linear quantization"),
    FType("Q4_K_S", 14, Q4_K, "4.37G, +0.2689 ppl @ Llama-3-8B"),
    FType("Q4_K_M", 15, Q4_K, "4.58G, +0.1754 ppl @ Llama-3-8B"),
    FType("Q5_K_S", 16, Q5_K, "5.21G, +0.1049 ppl @ Llama-3-8B"),
    FType("Q5_K_M", 17, Q5_K, "5.33G, +0.0569 ppl @ Llama-3-8B"),
    FType("Q6_K", 18, Q6_K, "6.14G, +0.0217 ppl @ Llama-3-8B"),
    FType("Q8_0", 7, Q8_0, "7.96G, +0.0026 ppl @ Llama-3-8B"),
    FType("F16", 1, F16, "14.00G, +0.0020 ppl @ Mistral-7B"),
    FType("BF16", 32, BF16, "14.00G, -0.0050 ppl @ Mistral-7B"),
    FType("F32", 0, F32, "26.00G              @ 7B"),
)
FTYPES: dict[str, FType] = {f.name: f for f in _FTYPE_LIST}
QUANT_FTYPES: tuple[str, ...] = tuple(f.name for f in _FTYPE_LIST)
# quantize.cpp's other QUANT_OPTIONS: aliases, and COPY (only_copy: every tensor kept as it is)
QUANT_FTYPE_ALIASES: dict[str, str] = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
COPY = "COPY"

# names used in the rules below
_IQ2_FAMILY = {"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"}
_OUTPUT_Q5K_FAMILY = {"IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"}
_MOE8_ATTN_OUT_Q5K = {"Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                      "IQ3_M", "IQ4_XS"}


def resolve_ftype(name: str | int) -> str:
    """quantize.cpp try_parse_ftype: a name (any case, aliases allowed) or a llama_ftype number."""
    if isinstance(name, int) or (isinstance(name, str) and name.strip().isdigit()):
        n = int(name)
        for f in _FTYPE_LIST:  # first option of that id, as try_parse_ftype
            if f.id == n:
                return f.name
        raise QuantError(f"unknown llama-quantize file type number {n}")
    up = name.strip().upper()
    if up in FTYPES or up == COPY:
        return up
    if up in QUANT_FTYPE_ALIASES:
        return QUANT_FTYPE_ALIASES[up]
    raise QuantError(f"unknown llama-quantize file type {name!r}; known: {', '.join(QUANT_FTYPES)}, COPY")


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class TensorQuant:
    name: str
    shape: tuple[int, ...]  # ggml order
    input_type: int  # ggml_type id in the input header
    ggml_type: int  # ggml_type id llama-quantize writes
    nbytes: int  # ggml_nbytes in the output (unpadded)
    quantizable: bool  # tensor_allows_quantization
    wanted_type: int | None = None  # the type the rules chose when tensor_type_fallback changed it
    requires_imatrix: bool = False  # tensor_requires_imatrix (and quantizable)

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def input_type_name(self) -> str:
        return type_name(self.input_type)


@dataclass(frozen=True)
class ImatrixFile:
    """What `llama-quantize --imatrix FILE` adds to the header (quantize.cpp kv_overrides)."""

    file: str  # path as given on the command line (first 127 bytes are stored)
    dataset: str | None = None  # first dataset recorded in the imatrix, if any
    entries: int = 0  # quantize.imatrix.entries_count
    chunks: int = 0  # quantize.imatrix.chunks_count (written when > 0)


@dataclass(frozen=True)
class QuantOptions:
    """llama-quantize's options that change tensor types (llama_model_quantize_params)."""

    pure: bool = False  # --pure: every quantized tensor gets the default type (fallbacks still apply)
    leave_output_tensor: bool = False  # --leave-output-tensor: output.weight is copied as it is
    output_tensor_type: str | None = None  # --output-tensor-type
    token_embedding_type: str | None = None  # --token-embedding-type
    tensor_types: tuple[tuple[str, str], ...] = ()  # --tensor-type PATTERN=TYPE, in order (regex search)


def parse_ggml_type(name: str) -> int:
    """quantize.cpp parse_ggml_type: a ggml type name, any case."""
    tid = T.get(str(name).strip().upper())
    if tid is None:
        raise QuantError(f"unknown ggml type {name!r}")
    return tid


@dataclass(frozen=True)
class QuantPrediction:
    ftype: str
    ftype_id: int
    default_type: str
    tensors: tuple[TensorQuant, ...] = ()  # in llama-quantize's output order
    header_bytes: int = 0  # metadata and tensor infos, padded to 32
    data_bytes: int = 0  # tensor data, each tensor padded to 32
    file_bytes: int = 0
    needs_imatrix: bool = False  # llama-quantize refuses this ftype without --imatrix
    imatrix: bool = False  # the prediction assumes an importance matrix is given
    imatrix_tensors: tuple[str, ...] = ()  # tensors whose type requires one
    n_fallback: int = 0  # tensors whose row length forced tensor_type_fallback
    needs_requantize: bool = False  # quantized input tensors get a new type: needs --allow-requantize
    refused: str | None = None  # llama-quantize fails for this ftype and model (why); sizes are then 0
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.refused is None

    @property
    def file_mib(self) -> float:
        return self.file_bytes / 2**20

    @property
    def n_elements(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total

    @property
    def bpw(self) -> float:
        """Bits per weight over all tensors' data (llama-quantize's "quant size ... BPW")."""
        n = self.n_elements
        return sum(t.nbytes for t in self.tensors) * 8.0 / n if n else 0.0

    def types(self) -> dict[str, str]:
        """Tensor name -> output type name."""
        return {t.name: t.type_name for t in self.tensors}

    def type_counts(self) -> dict[str, int]:
        return dict(Counter(t.type_name for t in self.tensors))


# ---------------------------------------------------------------------------------------------
# model facts llama-quant.cpp reads (llama_model_base::load_hparams and load_arch_hparams)


@dataclass(frozen=True)
class _Model:
    arch: str
    n_layer_all: int  # hparams.n_layer_all (block_count, NextN layers included)
    n_expert: int  # hparams.n_expert
    n_gqa: int  # hparams.n_gqa(0)
    is_70b: bool  # model.type == LLM_TYPE_70B


def _scalar_or_first(v: Any) -> int | None:
    if isinstance(v, list):
        return int(v[0]) if v else None
    if isinstance(v, (bool, SkippedArray, SkippedString, str)) or v is None:
        return None
    return int(v)


def _model_facts(header: GGUFHeader) -> _Model:
    md = header.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise QuantError("the header has no general.architecture: llama-quantize cannot load it")
    n_layer_all = _scalar_or_first(md.get(f"{arch}.block_count"))
    if n_layer_all is None or n_layer_all <= 0:
        raise QuantError(f"the header has no {arch}.block_count: llama-quantize cannot load it")
    n_nextn = _scalar_or_first(md.get(f"{arch}.nextn_predict_layers")) or 0
    n_expert = _scalar_or_first(md.get(f"{arch}.expert_count")) or 0
    n_head = _scalar_or_first(md.get(f"{arch}.attention.head_count")) or 0
    kv = md.get(f"{arch}.attention.head_count_kv")
    n_head_kv = _scalar_or_first(kv) if kv is not None else n_head  # n_head_kv defaults to n_head
    n_head_kv = n_head_kv or 0
    n_gqa = n_head // n_head_kv if n_head_kv else 0  # llama_hparams::n_gqa
    n_layer = n_layer_all - n_nextn  # llama_hparams::n_layer()
    # load_arch_hparams: the only model type llama-quant.cpp looks at is LLM_TYPE_70B
    is_70b = (
        (arch == "llama" and n_expert != 8 and n_layer == 80 and n_head != n_head_kv)
        or (arch in ("qwen2", "deci", "olmo") and n_layer == 80)
        or (arch == "jais2" and n_layer == 68)
    )
    return _Model(arch, n_layer_all, n_expert, n_gqa, is_70b)


# ---------------------------------------------------------------------------------------------
# llama-quant.cpp, rule by rule

# sscanf(name, "blk.%d.", &il) == 1: %d skips blanks; the trailing "." need not match for a count of 1
_BLK = re.compile(r"blk\.\s*([+-]?\d+)")


def _layer_of(name: str) -> int | None:
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def _weights_order(name: str) -> tuple[int, bytes]:
    # llama_model_loader::weight_name_comparer: by layer (-1 when not blk.N.), then by name
    layer = _layer_of(name)
    return (-1 if layer is None else layer, name.encode("utf-8", "surrogateescape"))


# tensor_get_category
OUTPUT, TOKEN_EMBD, ATTN_QKV, ATTN_KV_B, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = range(8)
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = range(8, 12)


def _category(name: str) -> int:
    # tensor_get_category (tensor_name_match_output_weight / tensor_name_match_token_embd first)
    if name == "output.weight":
        return OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return TOKEN_EMBD
    for sub, cat in (("attn_qkv.weight", ATTN_QKV), ("attn_kv_b.weight", ATTN_KV_B), ("attn_v.weight", ATTN_V),
                     ("attn_k.weight", ATTN_K), ("attn_q.weight", ATTN_Q), ("attn_output.weight", ATTN_OUTPUT),
                     ("ffn_up", FFN_UP), ("ffn_gate", FFN_GATE), ("ffn_down", FFN_DOWN)):
        if sub in name:
            return cat
    return OTHER


def _is_attn_v(cat: int) -> bool:  # category_is_attn_v
    return cat in (ATTN_V, ATTN_QKV, ATTN_KV_B)


_NO_QUANT_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight",
    "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd",
    "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
    "mm.a.code_embd",
)
_NO_QUANT_GLM5_NEXT = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate", "indexer_compressor_ape",
    "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight", "ssm_beta.weight",
    "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight",
)


def allows_quantization(name: str, shape: tuple[int, ...], arch: str, *, only_copy: bool = False,
                        quantize_output_tensor: bool = True) -> bool:
    """tensor_allows_quantization: 2-D+ tensors named *weight that are not norms, routers, conv1d..."""
    if only_copy or _n_dims(shape) < 2:
        return False
    if name.rfind("weight") != len(name) - 6:  # "ends with weight" as C++ computes it (a 5-byte name passes)
        return False
    if not quantize_output_tensor and name == "output.weight":
        return False
    if name in ("position_embd.weight", "token_types.weight"):  # LLM_TN(arch)(POS_EMBD / TOKEN_TYPES)
        return False
    if any(s in name for s in _NO_QUANT_SUBSTRINGS):
        return False
    if arch == "glm5-next" and any(s in name for s in _NO_QUANT_GLM5_NEXT):
        return False
    return True


def requires_imatrix(name: str, tid: int, ftype: str) -> bool:
    """tensor_requires_imatrix."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    if tid in (IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M, IQ1_S):
        return True
    return tid == Q2_K and ftype == "Q2_K_S"


class _State:
    """quantize_state_impl: the counters llama_tensor_get_type_impl walks."""

    def __init__(self, model: _Model, names: Iterable[str], has_imatrix: bool, opts: QuantOptions):
        self.model = model
        self.has_imatrix = has_imatrix
        self.output_tensor_type = parse_ggml_type(opts.output_tensor_type) if opts.output_tensor_type else None
        self.token_embedding_type = parse_ggml_type(opts.token_embedding_type) if opts.token_embedding_type else None
        # quantize.cpp lowercases the pattern; std::regex_search (ECMAScript) ~ re.search
        try:
            self.patterns = [(re.compile(p.lower()), parse_ggml_type(t)) for p, t in opts.tensor_types]
        except re.error as e:
            raise QuantError(f"bad --tensor-type pattern: {e}") from None
        cats = [_category(n) for n in names]
        # init_quantize_state_counters
        self.n_attention_wv = sum(1 for c in cats if _is_attn_v(c))
        self.has_tied_embeddings = OUTPUT not in cats
        self.n_ffn_down = self.n_ffn_gate = self.n_ffn_up = model.n_layer_all
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_fallback = 0


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama_tensor_get_type_impl's use_more_bits (C++ integer division and modulo: operands are >= 0
    # except i_layer - n/8, whose C++ remainder keeps the sign)
    d = i_layer - n_layers // 8
    rem = d - int(d / 3) * 3
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or rem == 2


def _layer_info(qs: _State, i_layer: int, n_layer: int, name: str) -> tuple[int, int]:
    # llama_tensor_get_type_impl's layer_info: MoE models take the layer from the name
    if max(1, qs.model.n_expert) > 1:
        layer = _layer_of(name)
        if layer is None:
            raise QuantRefused(f"llama-quantize fails: cannot determine the layer of tensor {name}")
        if layer < 0 or layer >= n_layer:
            raise QuantRefused(f"llama-quantize fails: bad layer {layer} for tensor {name} (must be in [0, {n_layer}))")
        return layer, n_layer
    return i_layer, n_layer


def _get_type_impl(qs: _State, new_type: int, name: str, shape: tuple[int, ...], ftype: str, cat: int) -> int:
    """llama_tensor_get_type_impl."""
    m = qs.model
    arch = m.arch
    n_expert = m.n_expert

    if arch == "glm5-next" and ("attn_q_a" in name or "attn_q_b" in name or "nextn.eh_proj" in name):
        if new_type not in (F32, BF16, F16):
            return Q8_0

    if cat == OUTPUT or (qs.has_tied_embeddings and cat == TOKEN_EMBD):
        nx = shape[0]
        if qs.output_tensor_type is not None:
            new_type = qs.output_tensor_type
        elif ftype == "MXFP4_MOE":
            new_type = Q8_0
        elif arch == "falcon" or nx % BLCK[new_type] != 0:
            new_type = Q8_0
        elif ftype in _OUTPUT_Q5K_FAMILY:
            new_type = Q5_K
        elif new_type != Q8_0:
            new_type = Q6_K
    elif ftype == "MXFP4_MOE":
        # MoE tensors -> MXFP4, other tensors -> Q8_0
        is_bailing3_expert = arch == "bailingmoe3" and cat in (FFN_UP, FFN_GATE, FFN_DOWN)
        ne2 = shape[2] if len(shape) > 2 else 1
        new_type = MXFP4 if ne2 > 1 and (arch != "bailingmoe3" or is_bailing3_expert) else Q8_0
    elif cat == TOKEN_EMBD:
        if qs.token_embedding_type is not None:
            new_type = qs.token_embedding_type
        elif ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            new_type = Q2_K
        elif ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            new_type = IQ3_S
        elif ftype in ("TQ1_0", "TQ2_0", "Q2_0"):
            new_type = Q4_K
    elif ftype in _IQ2_FAMILY:
        if _is_attn_v(cat):
            if m.n_gqa >= 4 or n_expert >= 4:
                new_type = Q4_K
            else:
                new_type = IQ3_S if ftype in ("IQ2_S", "IQ2_M") else Q2_K
            qs.i_attention_wv += 1
        elif n_expert == 8 and cat == ATTN_K:
            new_type = Q4_K
        elif cat == FFN_DOWN:
            if qs.i_ffn_down < qs.n_ffn_down // 8:
                new_type = IQ3_S if ftype in ("IQ2_S", "IQ2_M") else Q2_K
            qs.i_ffn_down += 1
        elif cat == ATTN_OUTPUT:
            if n_expert == 8:
                new_type = Q5_K
            elif ftype in ("IQ1_S", "IQ1_M"):
                new_type = IQ2_XXS
            elif ftype in ("IQ2_S", "IQ2_M"):
                new_type = IQ3_S
    elif _is_attn_v(cat):
        gqa4 = m.n_gqa >= 4
        if ftype == "Q2_K":
            new_type = Q4_K if gqa4 else Q3_K
        elif ftype == "Q2_K_S" and gqa4:
            new_type = Q4_K
        elif ftype == "IQ3_XXS":
            new_type = Q4_K if gqa4 else (IQ3_S if not qs.has_imatrix else IQ3_XXS)
        elif ftype in ("IQ3_XS", "IQ3_S") and gqa4:
            new_type = Q4_K
        elif ftype == "IQ3_M":
            new_type = Q4_K
        elif ftype == "Q3_K_M":
            new_type = Q5_K if qs.i_attention_wv < 2 else Q4_K
        elif ftype == "Q3_K_L":
            new_type = Q5_K
        elif ftype in ("IQ4_NL", "IQ4_XS") and gqa4:
            new_type = Q5_K
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new_type = Q6_K
        elif ftype == "Q4_K_S" and qs.i_attention_wv < 4:
            new_type = Q5_K
        if m.is_70b and new_type in (Q3_K, Q4_K):
            new_type = Q5_K  # 70B: attn_v is 8x smaller than attn_q, more bits are cheap
        if n_expert == 8:
            new_type = Q8_0
        qs.i_attention_wv += 1
    elif cat == ATTN_K:
        if n_expert == 8:
            new_type = Q8_0
        elif ftype == "IQ3_XS":
            new_type = IQ3_XXS
        elif ftype == "IQ3_XXS":
            new_type = IQ2_S
    elif cat == ATTN_Q:
        if ftype == "IQ3_XS":
            new_type = IQ3_XXS
        elif ftype == "IQ3_XXS":
            new_type = IQ2_S
    elif cat == FFN_DOWN:
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_down, qs.n_ffn_down, name)
        if ftype == "Q2_K":
            new_type = Q3_K
        elif ftype == "Q2_K_S":
            if i_layer < n_layer // 8:
                new_type = Q4_K
        elif ftype == "IQ3_XXS" and not qs.has_imatrix:
            new_type = Q4_K if i_layer < n_layer // 8 else Q3_K
        elif ftype == "Q3_K_M":
            if i_layer < n_layer // 16:
                new_type = Q5_K
            elif arch != "falcon" or _use_more_bits(i_layer, n_layer):
                new_type = Q4_K
            else:
                new_type = Q3_K
        elif ftype == "IQ3_M" and (i_layer < n_layer // 8 or (n_expert == 8 and _use_more_bits(i_layer, n_layer))):
            new_type = Q4_K
        elif ftype == "Q3_K_L":
            new_type = Q4_K if arch == "falcon" else Q5_K
        elif ftype == "Q4_K_M":
            if arch == "falcon":
                new_type = Q6_K if i_layer < n_layer // 16 else (Q5_K if _use_more_bits(i_layer, n_layer) else Q4_K)
            elif _use_more_bits(i_layer, n_layer):
                new_type = Q6_K
        elif i_layer < n_layer // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not qs.has_imatrix:
            new_type = Q5_K
        elif ftype == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
            new_type = Q6_K
        elif ftype == "Q4_K_S" and arch != "falcon" and i_layer < n_layer // 8:
            new_type = Q5_K
        elif ftype in ("Q4_0", "Q5_0") and qs.has_imatrix and i_layer < n_layer // 8:
            new_type = Q4_1 if ftype == "Q4_0" else Q5_1
        qs.i_ffn_down += 1
    elif cat == ATTN_OUTPUT:
        if arch != "falcon":
            if n_expert == 8:
                if ftype in _MOE8_ATTN_OUT_Q5K:
                    new_type = Q5_K
            else:
                new_type = {"Q2_K": Q3_K, "IQ3_XXS": IQ3_S, "Q3_K_M": Q4_K, "Q3_K_L": Q5_K, "IQ3_M": Q4_K}.get(
                    ftype, new_type)
        elif ftype == "Q3_K_L":
            new_type = Q4_K
    elif cat == ATTN_QKV:
        if ftype in ("Q3_K_M", "Q3_K_L", "IQ3_M"):
            new_type = Q4_K
        elif ftype == "Q4_K_M":
            new_type = Q5_K
        elif ftype == "Q5_K_M":
            new_type = Q6_K
    elif cat == FFN_GATE:
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_gate, qs.n_ffn_gate, name)
        if ftype == "IQ3_XS" and n_layer // 8 <= i_layer < 7 * n_layer // 8:
            new_type = IQ3_XXS
        qs.i_ffn_gate += 1
    elif cat == FFN_UP:
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_up, qs.n_ffn_up, name)
        if ftype == "IQ3_XS" and n_layer // 8 <= i_layer < 7 * n_layer // 8:
            new_type = IQ3_XXS
        qs.i_ffn_up += 1
    return new_type


_FALLBACK = {
    # tensor_type_fallback: 256-block types to a 32-block type
    IQ1_S: IQ4_NL, IQ1_M: IQ4_NL, IQ2_XXS: IQ4_NL, IQ2_XS: IQ4_NL, IQ2_S: IQ4_NL, IQ3_XXS: IQ4_NL, IQ3_S: IQ4_NL,
    IQ4_XS: IQ4_NL, Q2_0: Q4_0, Q2_K: Q4_0, Q3_K: Q4_0, TQ1_0: Q4_0, TQ2_0: Q4_0, Q4_K: Q5_0, Q5_K: Q5_1,
    Q6_K: Q8_0,
}


def _fallback(qs: _State, ne0: int, target: int) -> int:
    """tensor_type_fallback: a row length that is not a multiple of the block size demotes the type."""
    qk = BLCK[target]
    if ne0 % qk == 0:
        return target
    qs.n_fallback += 1
    if target in _FALLBACK:
        ret = _FALLBACK[target]
    elif qk <= 32:
        ret = target  # already a 32-block type: F16 below
    else:
        raise QuantRefused(f"llama-quantize fails: no tensor type fallback is defined for type {type_name(target)} "
                           f"(a row of {ne0} is not a multiple of {qk})")
    if ne0 % BLCK[ret] != 0:
        ret = F16  # "must use F16 due to unusual shape"
    return ret


def _get_type(qs: _State, opts: QuantOptions, name: str, shape: tuple[int, ...], default: int,
              ftype: str) -> tuple[int, int | None]:
    """llama_tensor_get_type for a quantizable tensor: (type, the type the rules wanted if a fallback changed it)."""
    cat = _category(name)
    if qs.token_embedding_type is not None and cat == TOKEN_EMBD:
        # per_layer_token_embd follows --token-embedding-type unless a --tensor-type names it
        named = name == "per_layer_token_embd.weight" and any(p.search(name) for p, _ in qs.patterns)
        if not named:
            return qs.token_embedding_type, None
    if qs.output_tensor_type is not None and cat == OUTPUT:
        return qs.output_tensor_type, None
    new = default
    if default in _NOT_QUANTIZED:
        return new, None
    manual = False
    for pattern, qtype in qs.patterns:  # the first matching --tensor-type wins
        if pattern.search(name):
            new, manual = qtype, True
            break
    if not manual and not opts.pure:
        new = _get_type_impl(qs, new, name, shape, ftype, cat)
    chosen = new
    new = _fallback(qs, shape[0], new)
    return new, (chosen if new != chosen else None)


# ---------------------------------------------------------------------------------------------
# header bytes


def _value_bytes(vtype: GGUFValueType, value: Any) -> int | None:
    fixed = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
             GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
             GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
    if vtype in fixed:
        return fixed[vtype]
    if vtype == GGUFValueType.STRING:
        if isinstance(value, SkippedString):
            return 8 + value.length
        return 8 + len(str(value).encode("utf-8", "surrogateescape"))
    return None  # arrays: not needed (only scalar keys are replaced or removed)


def _kv_bytes(key: str, vtype: GGUFValueType, value: Any) -> int:
    vb = _value_bytes(vtype, value)
    if vb is None:
        raise QuantError(f"key {key} is an array where llama-quantize expects a scalar")
    return 8 + len(key.encode("utf-8", "surrogateescape")) + 4 + vb


def _tensor_info_bytes(name: str, n_dims: int) -> int:
    # gguf_writer write_tensor_meta: name (u64 length + bytes), n_dims u32, ne[] i64, type i32, offset u64
    return 8 + len(name.encode("utf-8", "surrogateescape")) + 4 + 8 * n_dims + 4 + 8


def _input_kv_bytes(header: GGUFHeader) -> int:
    """Bytes of the first shard's key/value section: its header minus the fixed fields and tensor infos."""
    shard = header.shards[0]
    infos = sum(_tensor_info_bytes(t.name, len(t.shape)) for t in header.tensors if t.shard == 0)
    return shard.header_bytes - 24 - infos


_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")  # LLM_KV_SPLIT_*


def _output_kv_bytes(header: GGUFHeader, imatrix_file: ImatrixFile | None) -> int:
    md, vt = header.metadata, header.value_types
    n = _input_kv_bytes(header)
    # gguf_set_kv copies every key, then general.quantization_version and general.file_type are set
    # as u32 (replacing any existing value) and the split keys removed (llama_model_quantize_impl)
    for key in ("general.quantization_version", "general.file_type"):
        if key in md:
            n -= _kv_bytes(key, vt[key], md[key])
        n += _kv_bytes(key, GGUFValueType.UINT32, 0)
    for key in _SPLIT_KEYS:
        if key in md:
            n -= _kv_bytes(key, vt[key], md[key])
    if imatrix_file is not None:
        # quantize.cpp kv_overrides: strings are cut to 127 bytes, ints written as u32
        adds: list[tuple[str, GGUFValueType, Any]] = [
            ("quantize.imatrix.file", GGUFValueType.STRING, imatrix_file.file.encode()[:127].decode("utf-8", "ignore"))]
        if imatrix_file.dataset is not None:
            adds.append(("quantize.imatrix.dataset", GGUFValueType.STRING,
                         imatrix_file.dataset.encode()[:127].decode("utf-8", "ignore")))
        adds.append(("quantize.imatrix.entries_count", GGUFValueType.UINT32, 0))
        if imatrix_file.chunks > 0:
            adds.append(("quantize.imatrix.chunks_count", GGUFValueType.UINT32, 0))
        for key, t, v in adds:
            if key in md:
                n -= _kv_bytes(key, vt[key], md[key])
            n += _kv_bytes(key, t, v)
    return n


# ---------------------------------------------------------------------------------------------
# public API


def _check_header(header: GGUFHeader) -> None:
    if not header.shards:
        raise QuantError("the header has no shard information (read it with fitter.gguf.reader.read_header)")
    if header.shards[0].byte_order != "<":
        raise QuantError("big-endian GGUF: llama.cpp refuses to load it, so llama-quantize cannot quantize it")


def _predict(header: GGUFHeader, ftype: str, model: _Model, has_imatrix: bool,
             imatrix_file: ImatrixFile | None, opts: QuantOptions) -> QuantPrediction:
    only_copy = ftype == COPY
    if only_copy:
        ft = None
        default = None
        ftype_id = _guess_file_type(header)
    else:
        ft = FTYPES[ftype]
        default = ft.default_type
        ftype_id = ft.id

    tensors = sorted(header.tensors, key=lambda t: _weights_order(t.name))  # ml.weights_map order
    qs = _State(model, (t.name for t in tensors), has_imatrix, opts)
    out: list[TensorQuant] = []
    notes: list[str] = []
    imatrix_tensors: list[str] = []
    needs_requantize = False
    for t in tensors:
        shape = tuple(int(d) for d in t.shape)
        in_type = int(t.ggml_type)
        quantizable = allows_quantization(t.name, shape, model.arch, only_copy=only_copy,
                                          quantize_output_tensor=not opts.leave_output_tensor)
        wanted: int | None = None
        if not quantizable:
            new = in_type  # copied as it is
        else:
            new, wanted = _get_type(qs, opts, t.name, shape, default, ftype)  # type: ignore[arg-type]
            if new not in _NOT_QUANTIZED and shape[0] % BLCK[new] != 0:
                # gguf_set_tensor_type: GGML_ASSERT "tensor row size not divisible by block size of new type"
                raise QuantRefused(f"llama-quantize aborts: tensor {t.name} has rows of {shape[0]}, not a multiple "
                                   f"of the {type_name(new)} block size {BLCK[new]} (an explicit type skips the "
                                   "fallback)")
        req = quantizable and requires_imatrix(t.name, new, ftype)
        if req:
            imatrix_tensors.append(t.name)
        if new != in_type:
            if in_type not in _NOT_QUANTIZED:
                needs_requantize = True
            elif in_type not in (F32, F16, BF16):
                raise QuantRefused(f"llama-quantize fails: cannot dequantize/convert tensor {t.name} of type "
                                   f"{type_name(in_type)}")
            nbytes = tensor_bytes(new, shape)
        else:
            nbytes = t.nbytes
        out.append(TensorQuant(t.name, shape, in_type, new, nbytes, quantizable, wanted, req))

    kv = _output_kv_bytes(header, imatrix_file)
    infos = sum(_tensor_info_bytes(t.name, _n_dims(t.shape)) for t in out)
    header_bytes = _pad(24 + kv + infos)
    data_bytes = sum(_pad(t.nbytes) for t in out)

    if needs_requantize:
        notes.append("the input is already quantized: llama-quantize needs --allow-requantize; the types and sizes "
                     "are those of quantizing the original weights")
    if qs.n_fallback:
        notes.append(f"{qs.n_fallback} tensor(s) have rows that are not a multiple of the block size and fall "
                     "back to another type")
    align = header.metadata.get("general.alignment")
    if isinstance(align, int) and align != GGUF_DEFAULT_ALIGNMENT:
        notes.append(f"the input's general.alignment {align} is copied, but llama-quantize writes with alignment "
                     f"{GGUF_DEFAULT_ALIGNMENT}")
    return QuantPrediction(
        ftype=ftype,
        ftype_id=ftype_id,
        default_type=type_name(default) if default is not None else "input",
        tensors=tuple(out),
        header_bytes=header_bytes,
        data_bytes=data_bytes,
        file_bytes=header_bytes + data_bytes,
        imatrix=has_imatrix,
        imatrix_tensors=tuple(imatrix_tensors),
        needs_imatrix=bool(imatrix_tensors),
        n_fallback=qs.n_fallback,
        needs_requantize=needs_requantize,
        notes=tuple(notes),
    )


def _guess_file_type(header: GGUFHeader) -> int:
    # COPY writes ml.ftype: general.file_type when present (the loader's guess otherwise; a u32 either way)
    v = header.metadata.get("general.file_type")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 1024


def predict_quant(header: GGUFHeader, ftype: str | int, *, imatrix: bool | ImatrixFile | None = None,
                  options: QuantOptions | None = None) -> QuantPrediction:
    """What `llama-quantize <header's model> <ftype>` writes: per-tensor types, sizes, total file bytes.

    ``imatrix``: None (default) predicts without an importance matrix unless the ftype requires one,
    then with one (``needs_imatrix`` says so either way); False / True force it; an ``ImatrixFile``
    also counts the quantize.imatrix.* keys the llama-quantize tool writes into the header (the library
    call `llama_model_quantize` writes none). ``options``: --pure, --leave-output-tensor,
    --output-tensor-type, --token-embedding-type, --tensor-type. Raises QuantRefused when llama-quantize
    itself fails, QuantError for an unknown ftype or an unusable header.
    """
    _check_header(header)
    name = resolve_ftype(ftype)
    model = _model_facts(header)
    opts = options or QuantOptions()
    imatrix_file = imatrix if isinstance(imatrix, ImatrixFile) else None
    if imatrix is None:
        pred = _predict(header, name, model, False, None, opts)
        if pred.needs_imatrix:
            with_im = _predict(header, name, model, True, None, opts)
            note = ("llama-quantize refuses this ftype without an importance matrix (--imatrix); "
                    "the prediction assumes one")
            pred = replace(with_im, needs_imatrix=True, notes=(note, *with_im.notes))
        return pred
    pred = _predict(header, name, model, bool(imatrix), imatrix_file, opts)
    if pred.needs_imatrix and not imatrix:
        note = "llama-quantize refuses this ftype without an importance matrix (--imatrix)"
        pred = replace(pred, notes=(note, *pred.notes))
    return pred


def predict_all(header: GGUFHeader, *, imatrix: bool | ImatrixFile | None = None,
                options: QuantOptions | None = None) -> list[QuantPrediction]:
    """predict_quant for every ftype in QUANT_FTYPES, in llama-quantize's order; an ftype llama-quantize
    would fail on comes back with ``refused`` set (and zero sizes) rather than raising."""
    _check_header(header)
    _model_facts(header)  # an unusable header is an error, not 35 refusals
    out: list[QuantPrediction] = []
    for name in QUANT_FTYPES:
        try:
            out.append(predict_quant(header, name, imatrix=imatrix, options=options))
        except QuantRefused as e:
            ft = FTYPES[name]
            out.append(QuantPrediction(ftype=name, ftype_id=ft.id, default_type=type_name(ft.default_type),
                                       refused=str(e)))
    return out


__all__ = [
    "COPY",
    "FTYPES",
    "ImatrixFile",
    "QUANT_FTYPES",
    "QUANT_FTYPE_ALIASES",
    "QuantError",
    "QuantOptions",
    "QuantPrediction",
    "QuantRefused",
    "TensorQuant",
    "allows_quantization",
    "predict_all",
    "parse_ggml_type",
    "predict_quant",
    "requires_imatrix",
    "resolve_ftype",
    "row_bytes",
    "tensor_bytes",
    "type_name",
]
