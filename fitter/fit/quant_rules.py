"""src/llama-quant.cpp of the pinned llama.cpp, rule by rule: which tensors are quantized at all
(`tensor_allows_quantization`), the per-tensor raises and lowers (`llama_tensor_get_type_impl`, with its attn_v /
ffn_down counters), the block-size fallbacks (`tensor_type_fallback`) and the imatrix requirement
(`tensor_requires_imatrix`), plus the model facts they read.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable

from fitter.fit.quant_ftypes import (
    _IQ2_FAMILY,
    _MOE8_ATTN_OUT_Q5K,
    _OUTPUT_Q5K_FAMILY,
    BF16,
    F16,
    F32,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    NOT_QUANTIZED,
    Q2_0,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TQ1_0,
    TQ2_0,
    QuantError,
    QuantOptions,
    QuantRefused,
    n_dims,
    parse_ggml_type,
    type_name,
)
from fitter.ggml.types import BLCK
from fitter.gguf.reader import GGUFHeader, SkippedArray, SkippedString
from fitter.record import Record

# ---------------------------------------------------------------------------------------------
# model facts llama-quant.cpp reads (llama_model_base::load_hparams and load_arch_hparams)


class ModelFacts(Record, kw_only=False):
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


def model_facts(header: GGUFHeader) -> ModelFacts:
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
    return ModelFacts(arch, n_layer_all, n_expert, n_gqa, is_70b)


# ---------------------------------------------------------------------------------------------
# llama-quant.cpp, rule by rule

# sscanf(name, "blk.%d.", &il) == 1: %d skips blanks; the trailing "." need not match for a count of 1
_BLK = re.compile(r"blk\.\s*([+-]?\d+)")


@functools.lru_cache(maxsize=1 << 16)  # asked per tensor for every ftype: the same names again
def _layer_of(name: str) -> int | None:
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def weights_order(name: str) -> tuple[int, bytes]:
    # llama_model_loader::weight_name_comparer: by layer (-1 when not blk.N.), then by name
    layer = _layer_of(name)
    return (-1 if layer is None else layer, name.encode("utf-8", "surrogateescape"))


# tensor_get_category
OUTPUT, TOKEN_EMBD, ATTN_QKV, ATTN_KV_B, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = range(8)
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = range(8, 12)


@functools.lru_cache(maxsize=1 << 16)
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


_ATTN_V = frozenset({ATTN_V, ATTN_QKV, ATTN_KV_B})  # category_is_attn_v: `cat in _ATTN_V`


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
    if only_copy or n_dims(shape) < 2:
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


_NEEDS_IMATRIX = frozenset({IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M, IQ1_S})
IMATRIX_TYPES = _NEEDS_IMATRIX | {Q2_K}  # the types requires_imatrix can say True of (a test before the call)


def requires_imatrix(name: str, tid: int, ftype: str) -> bool:
    """tensor_requires_imatrix."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    if tid in _NEEDS_IMATRIX:
        return True
    return tid == Q2_K and ftype == "Q2_K_S"


class QuantState:
    """quantize_state_impl: the counters llama_tensor_get_type_impl walks."""

    def __init__(self, model: ModelFacts, names: Iterable[str], has_imatrix: bool, opts: QuantOptions):
        self.model = model
        self._has_imatrix = has_imatrix
        self.imatrix_read = False  # whether a rule asked has_imatrix: if none did, with or without one is one path
        self.output_tensor_type = parse_ggml_type(opts.output_tensor_type) if opts.output_tensor_type else None
        self.token_embedding_type = parse_ggml_type(opts.token_embedding_type) if opts.token_embedding_type else None
        # quantize.cpp lowercases the pattern; std::regex_search (ECMAScript) ~ re.search
        try:
            self.patterns = [(re.compile(p.lower()), parse_ggml_type(t)) for p, t in opts.tensor_types]
        except re.error as e:
            raise QuantError(f"bad --tensor-type pattern: {e}") from None
        # init_quantize_state_counters
        self.n_attention_wv, self.has_tied_embeddings = _name_counters(tuple(names))
        self.n_ffn_down = self.n_ffn_gate = self.n_ffn_up = model.n_layer_all
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_fallback = 0

    @property
    def has_imatrix(self) -> bool:
        self.imatrix_read = True
        return self._has_imatrix


@functools.lru_cache(maxsize=8)  # the same names for every ftype of a header
def _name_counters(names: tuple[str, ...]) -> tuple[int, bool]:
    """init_quantize_state_counters' counts: the attn_v tensors, and whether there is no output tensor."""
    cats = [_category(n) for n in names]
    return sum(1 for c in cats if c in _ATTN_V), OUTPUT not in cats


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama_tensor_get_type_impl's use_more_bits (C++ integer division and modulo: operands are >= 0
    # except i_layer - n/8, whose C++ remainder keeps the sign)
    d = i_layer - n_layers // 8
    rem = d - int(d / 3) * 3
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or rem == 2


def _layer_info(qs: QuantState, i_layer: int, n_layer: int, name: str) -> tuple[int, int]:
    # llama_tensor_get_type_impl's layer_info: MoE models take the layer from the name
    if max(1, qs.model.n_expert) > 1:
        layer = _layer_of(name)
        if layer is None:
            raise QuantRefused(f"llama-quantize fails: cannot determine the layer of tensor {name}")
        if layer < 0 or layer >= n_layer:
            raise QuantRefused(f"llama-quantize fails: bad layer {layer} for tensor {name} (must be in [0, {n_layer}))")
        return layer, n_layer
    return i_layer, n_layer


# long because llama_tensor_get_type_impl (llama-quant.cpp, 269 lines), mirrored branch by branch
def _get_type_impl(qs: QuantState, new_type: int, name: str, shape: tuple[int, ...], ftype: str, cat: int) -> int:
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
        if cat in _ATTN_V:
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
    elif cat in _ATTN_V:
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


def _fallback(qs: QuantState, ne0: int, target: int) -> int:
    """tensor_type_fallback's branch for a row length that is not a multiple of the block size (`ncols % qk_k != 0`,
    tested by get_type before the call): it demotes the type."""
    qk = BLCK[target]
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


def get_type(qs: QuantState, opts: QuantOptions, name: str, shape: tuple[int, ...], default: int,
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
    if default in NOT_QUANTIZED:
        return new, None
    manual = False
    for pattern, qtype in qs.patterns:  # the first matching --tensor-type wins
        if pattern.search(name):
            new, manual = qtype, True
            break
    if not manual and not opts.pure:
        new = _get_type_impl(qs, new, name, shape, ftype, cat)
    if shape[0] % BLCK[new] == 0:  # tensor_type_fallback's test: no fallback (16K tensors of `quants`, no call)
        return new, None
    chosen = new
    new = _fallback(qs, shape[0], new)
    return new, (chosen if new != chosen else None)


