"""llama-quantize's vocabulary: ggml type names, the file types (tools/quantize/quantize.cpp QUANT_OPTIONS and
llama_ftype), the options and the prediction's result types. The rules are fitter.fit.quant_rules', the file
bytes and the public API fitter.fit.quants'.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fitter.errors import GGFitError
from fitter.ggml.types import BLCK, TSIZE, TYPE_TRAITS
from fitter.record import Record

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
NOT_QUANTIZED = {F32, F16, BF16, T["I8"], T["I16"], T["I32"], T["I64"], T["F64"]}  # ggml_is_quantized() false


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


def n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def gguf_pad(n: int, align: int = GGUF_DEFAULT_ALIGNMENT) -> int:
    return n + (-n) % align


# ---------------------------------------------------------------------------------------------
# file types: tools/quantize/quantize.cpp QUANT_OPTIONS (name -> llama_ftype id), in its order


class FType(Record, kw_only=False):
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


@dataclass(slots=True)
class TensorQuant:
    """One tensor of a predicted quant. Never changed once made, but not frozen (see fitter.gguf.reader.TensorInfo):
    `ggfit quants` makes 33K of these."""

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


class ImatrixFile(Record, kw_only=False):
    """What `llama-quantize --imatrix FILE` adds to the header (quantize.cpp kv_overrides)."""

    file: str  # path as given on the command line (first 127 bytes are stored)
    dataset: str | None = None  # first dataset recorded in the imatrix, if any
    entries: int = 0  # quantize.imatrix.entries_count
    chunks: int = 0  # quantize.imatrix.chunks_count (written when > 0)


class QuantOptions(Record, kw_only=False):
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


class QuantPrediction(Record, kw_only=False):
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


