"""A model's hparams from its GGUF header: llama_model_base::load_hparams and the loader's file facts.

Mirrors `llama_model_base::load_hparams` (src/llama-model.cpp), each architecture's
`load_arch_hparams` (its ArchRules, in fitter.llama.models) and the file-type naming of
llama_model_loader (src/llama-model-loader.cpp). An architecture not in the registry is refused
with UnsupportedModelError unless the caller asks for a best-effort description
(`allow_unknown=True`, used by `ggfit inspect`), which is then marked `known=False`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fitter.errors import GGUFError, UnsupportedModelError
from fitter.gguf.constants import GGMLQuantizationType, Keys, LlamaFileType
from fitter.gguf.reader import GGUFHeader, SkippedArray, read_header
from fitter.llama.hparams import (
    GENERIC_RULES,
    LLAMA_MAX_LAYERS,
    ArchRules,
    LayerKind,
    LayerSpec,
    Meta,
    ModelSpec,
    SSMSpec,
)
from fitter.llama.models import MODELS, rules_of

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


def _layers(m: Meta, rules: ArchRules, n_embd: int, n_layer: int, n_layer_all: int,
            per_layer: tuple[list[int], ...]) -> tuple[list[LayerSpec], int, list[bool]]:
    """Each layer's kind and head / FFN sizes (load_hparams, the architecture's load_arch_hparams)."""
    n_head, n_head_kv, n_ff, n_ff_exp, n_expert_used = per_layer
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
    return layers, n_swa, is_swa


def _ssm(m: Meta) -> SSMSpec:
    return SSMSpec(
        d_conv=m.uint(Keys.SSM.CONV_KERNEL, required=True),
        d_inner=m.uint(Keys.SSM.INNER_SIZE, required=True),
        d_state=m.uint(Keys.SSM.STATE_SIZE, required=True),
        n_group=m.uint(Keys.SSM.GROUP_COUNT, required=True),
        dt_rank=m.uint(Keys.SSM.TIME_STEP_RANK, required=True),
    )


def _mla(m: Meta) -> tuple[bool, int, int]:
    hk_mla = m.uint(Keys.Attention.KEY_LENGTH_MLA, 0)
    hv_mla = m.uint(Keys.Attention.VALUE_LENGTH_MLA, 0)
    return hk_mla != 0 and hv_mla != 0, hk_mla, hv_mla  # llama_hparams::is_mla


def _by_type(header: GGUFHeader) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes and parameters per ggml type, largest first."""
    sums: dict[GGMLQuantizationType, list[int]] = {}  # type -> [bytes, parameters]
    n_of: dict[tuple[int, ...], int] = {}  # elements by shape: the layers repeat a few shapes (quants: 34 headers)
    for t in header.tensors:  # by the enum member: its .name is a property, looked up once per type below
        shape = t.shape
        n = n_of.get(shape)
        if n is None:
            n = n_of[shape] = t.n_elements
        s = sums.get(t.ggml_type)
        if s is None:
            sums[t.ggml_type] = [t.nbytes, n]
        else:  # (one lookup a tensor, not a defaultdict's two per sum)
            s[0] += t.nbytes
            s[1] += n
    return ({k.name: s[0] for k, s in sorted(sums.items(), key=lambda kv: -kv[1][0])},
            {k.name: s[1] for k, s in sorted(sums.items(), key=lambda kv: -kv[1][1])})


def _arch_rules(header: GGUFHeader, src: str | None, allow_unknown: bool) -> tuple[str, ArchRules]:
    """general.architecture and its rules (llm_arch_from_string; the generic rules for an unknown one)."""
    arch = header.architecture
    if arch is None:
        raise GGUFError(0, f"key '{Keys.General.ARCHITECTURE}' is missing or not a string", src)
    if arch == "clip":  # tools/mtmd's projector: llama_model_load refuses it ("unknown model architecture: 'clip'")
        raise UnsupportedModelError(f"{src or 'model'}: a multimodal projector (mmproj), not a text model: give it as "
                                    "--mmproj FILE next to its text model")
    rules = rules_of(arch)
    if rules is None:
        if not allow_unknown:
            raise UnsupportedModelError(
                f"{src or 'model'}: architecture '{arch}' is not modelled by ggfit yet "
                f"(known: {', '.join(sorted(MODELS))})"
            )
        rules = GENERIC_RULES
    return arch, rules


def model_spec_from_header(header: GGUFHeader, *, allow_unknown: bool = False) -> ModelSpec:
    """Describe a model from its header, the way llama.cpp's load_hparams reads it."""
    src = header.shards[0].location if header.shards else None
    arch, rules = _arch_rules(header, src, allow_unknown)
    m = Meta(header, arch)

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

    layers, n_swa, is_swa = _layers(m, rules, n_embd, n_layer, n_layer_all,
                                    (n_head, n_head_kv, n_ff, n_ff_exp, n_expert_used))

    ssm = _ssm(m) if rules.ssm else None
    is_mla, hk_mla, hv_mla = _mla(m) if rules.mla else (False, 0, 0)

    name = header.metadata.get(Keys.General.NAME)
    return ModelSpec(
        architecture=arch,
        known=arch in MODELS,
        name=name if isinstance(name, str) else None,
        **_tensor_facts(header),
        n_vocab=_n_vocab(header, m),
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
        supports_rs_rollback=rules.rs_rollback,
    )


def _n_vocab(header: GGUFHeader, m: Meta) -> int:
    """The token list's length (llama_vocab::load), or vocab_size where there is no list."""
    tokens = header.metadata.get(Keys.Tokenizer.LIST)
    if isinstance(tokens, (list, SkippedArray)):
        return len(tokens)
    return m.uint(Keys.LLM.VOCAB_SIZE, 0)


def _tensor_facts(header: GGUFHeader) -> dict[str, Any]:
    """The ModelSpec fields that follow from the header's tensors and file (their types and sizes), not its metadata:
    file_type_name too, where llama.cpp guesses it from the tensors' types."""
    bytes_by_type, params_by_type = _by_type(header)
    ft, ft_name = _file_type(header)
    return {"file_type": ft, "file_type_name": ft_name, "file_size": header.file_size, "header_size": header.header_size,
            "tensor_bytes": sum(bytes_by_type.values()), "n_tensors": len(header.tensors),  # (header.tensor_bytes)
            "n_params": sum(params_by_type.values()), "bytes_by_type": bytes_by_type, "params_by_type": params_by_type}


def requantized_spec(spec: ModelSpec, header: GGUFHeader) -> ModelSpec:
    """model_spec_from_header(header) for a header with the metadata, tensor names and shapes of the one `spec` was
    read from and other tensor types (fitter.fit.quant_fit.quantized_header: llama-quantize's output): `spec` with
    its tensor facts replaced, without reading the hparams and validating the layers again."""
    return spec.model_copy(update=_tensor_facts(header))


def load_model_spec(location: str, *, allow_unknown: bool = False) -> tuple[GGUFHeader, ModelSpec]:
    header = read_header(location)
    return header, model_spec_from_header(header, allow_unknown=allow_unknown)


def n_embd_inp(header: GGUFHeader, n_embd: int) -> int:
    """llama_hparams::n_embd_inp (llama-hparams.cpp): n_embd, plus n_embd per deepstack layer (qwen3vl.cpp,
    qwen3vlmoe.cpp: %s.n_deepstack_layers; granite.cpp, granite-swa.cpp: the distinct %s.deepstack_mapping indices)."""
    arch, md = header.architecture, header.metadata
    n_ds = int(md.get(f"{arch}.n_deepstack_layers", 0)) if arch in ("qwen3vl", "qwen3vlmoe") else 0
    mapping = md.get(f"{arch}.deepstack_mapping")
    if arch in ("granite", "granite_swa") and isinstance(mapping, list):
        n_ds = len({int(v) for v in mapping if int(v) >= 0})
    return n_embd * (1 + n_ds)
