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

from typing import Any

from fitter.cache import CACHES
from fitter.fit.quant_ftypes import (
    BF16,
    COPY,
    F16,
    F32,
    FTYPES,
    GGUF_DEFAULT_ALIGNMENT,
    NOT_QUANTIZED,
    QUANT_FTYPE_ALIASES,
    QUANT_FTYPES,
    ImatrixFile,
    QuantError,
    QuantOptions,
    QuantPrediction,
    QuantRefused,
    TensorQuant,
    gguf_pad,
    n_dims,
    parse_ggml_type,
    resolve_ftype,
    row_bytes,
    tensor_bytes,
    type_name,
)
from fitter.fit.quant_rules import (
    IMATRIX_TYPES,
    ModelFacts,
    QuantState,
    allows_quantization,
    get_type,
    model_facts,
    requires_imatrix,
    weights_order,
)
from fitter.ggml.types import BLCK
from fitter.gguf.constants import GGUFValueType
from fitter.gguf.reader import GGUFHeader, SkippedString, TensorInfo

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


_KV_BYTES: dict[int, tuple[GGUFHeader, int]] = CACHES.keep({}, "quants")


def _input_kv_bytes(header: GGUFHeader) -> int:
    """Bytes of the first shard's key/value section: its header minus the fixed fields and tensor infos
    (the same for every ftype: once per header)."""
    hit = _KV_BYTES.get(id(header))
    if hit is not None and hit[0] is header:  # the same header object, not a new one at a reused id
        return hit[1]
    shard = header.shards[0]
    infos = sum(_tensor_info_bytes(t.name, len(t.shape)) for t in header.tensors if t.shard == 0)
    n = shard.header_bytes - 24 - infos
    if len(_KV_BYTES) > 32:
        _KV_BYTES.clear()
    _KV_BYTES[id(header)] = (header, n)
    return n


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


# a row: the tensor, its shape, input type, its number of rows (ggml_nrows), the tensor as every ftype writes it where
# llama.cpp does not quantize it (copied as it is; None where it does), and its padded input bytes
_Row = tuple[TensorInfo, tuple[int, ...], int, int, "TensorQuant | None", int]
_ROWS: dict[tuple, tuple[GGUFHeader, list[_Row], int, tuple[str, ...]]] = CACHES.keep({}, "quants")


def _tensor_rows(header: GGUFHeader, arch: str, only_copy: bool,
                 quantize_output_tensor: bool) -> tuple[list[_Row], int, tuple[str, ...]]:
    """What every ftype of one header shares: the tensors in ml.weights_map order (_Row), the bytes of their tensor
    infos, and their names."""
    key = (id(header), arch, only_copy, quantize_output_tensor)
    hit = _ROWS.get(key)
    if hit is not None and hit[0] is header:  # the same header object, not a new one at a reused id
        return hit[1], hit[2], hit[3]
    rows = []
    for t in sorted(header.tensors, key=lambda t: weights_order(t.name)):  # ml.weights_map order
        shape = tuple(int(d) for d in t.shape)
        n_rows = 1
        for d in shape[1:]:
            n_rows *= d
        in_type = int(t.ggml_type)
        quantizable = allows_quantization(t.name, shape, arch, only_copy=only_copy,
                                          quantize_output_tensor=quantize_output_tensor)
        copied = None if quantizable else TensorQuant(t.name, shape, in_type, in_type, t.nbytes, False)
        rows.append((t, shape, in_type, n_rows, copied, t.nbytes + (-t.nbytes) % GGUF_DEFAULT_ALIGNMENT))
    infos = sum(_tensor_info_bytes(r[0].name, n_dims(r[1])) for r in rows)
    names = tuple(r[0].name for r in rows)
    if len(_ROWS) > 32:
        _ROWS.clear()
    _ROWS[key] = (header, rows, infos, names)
    return rows, infos, names


def _predict(header: GGUFHeader, ftype: str, model: ModelFacts, has_imatrix: bool,
             imatrix_file: ImatrixFile | None, opts: QuantOptions) -> tuple[QuantPrediction, bool]:
    """The prediction, and whether any rule asked has_imatrix (QuantState.imatrix_read)."""
    only_copy = ftype == COPY
    default, ftype_id = (None, _guess_file_type(header)) if only_copy else (FTYPES[ftype].default_type, FTYPES[ftype].id)
    rows, infos, names = _tensor_rows(header, model.arch, only_copy, not opts.leave_output_tensor)
    qs = QuantState(model, names, has_imatrix, opts)
    out: list[TensorQuant] = []
    imatrix_tensors: list[str] = []
    needs_requantize = False
    data_bytes = 0  # each tensor's data padded to the alignment (gguf_pad)
    for t, shape, in_type, n_rows, copied, copied_bytes in rows:
        if copied is not None:  # not quantized: copied as it is, alike in every ftype
            data_bytes += copied_bytes
            out.append(copied)
            continue
        new, wanted = get_type(qs, opts, t.name, shape, default, ftype)  # type: ignore[arg-type]
        if new not in NOT_QUANTIZED and shape[0] % BLCK[new] != 0:
            # gguf_set_tensor_type: GGML_ASSERT "tensor row size not divisible by block size of new type"
            raise QuantRefused(f"llama-quantize aborts: tensor {t.name} has rows of {shape[0]}, not a multiple "
                               f"of the {type_name(new)} block size {BLCK[new]} (an explicit type skips the "
                               "fallback)")
        req = new in IMATRIX_TYPES and requires_imatrix(t.name, new, ftype)
        if req:
            imatrix_tensors.append(t.name)
        if new != in_type:
            if in_type not in NOT_QUANTIZED:
                needs_requantize = True
            elif in_type not in (F32, F16, BF16):
                raise QuantRefused(f"llama-quantize fails: cannot dequantize/convert tensor {t.name} of type "
                                   f"{type_name(in_type)}")
            nbytes = row_bytes(new, shape[0]) * n_rows  # tensor_bytes(new, shape)
        else:
            nbytes = t.nbytes
        data_bytes += nbytes + (-nbytes) % GGUF_DEFAULT_ALIGNMENT
        out.append(TensorQuant(t.name, shape, in_type, new, nbytes, True, wanted, req))

    kv = _output_kv_bytes(header, imatrix_file)
    header_bytes = gguf_pad(24 + kv + infos)
    notes = _notes(header, needs_requantize, qs.n_fallback)
    pred = QuantPrediction(
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
    return pred, qs.imatrix_read


def _notes(header: GGUFHeader, needs_requantize: bool, n_fallback: int) -> list[str]:
    notes = []
    if needs_requantize:
        notes.append("the input is already quantized: llama-quantize needs --allow-requantize; the types and sizes "
                     "are those of quantizing the original weights")
    if n_fallback:
        notes.append(f"{n_fallback} tensor(s) have rows that are not a multiple of the block size and fall "
                     "back to another type")
    align = header.metadata.get("general.alignment")
    if isinstance(align, int) and align != GGUF_DEFAULT_ALIGNMENT:
        notes.append(f"the input's general.alignment {align} is copied, but llama-quantize writes with alignment "
                     f"{GGUF_DEFAULT_ALIGNMENT}")
    return notes


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
    model = model_facts(header)
    opts = options or QuantOptions()
    imatrix_file = imatrix if isinstance(imatrix, ImatrixFile) else None
    if imatrix is None:
        pred, asked = _predict(header, name, model, False, None, opts)
        if pred.needs_imatrix:
            # a pass whose rules never asked has_imatrix takes the same path with one (they ask it only for IQ3_XXS,
            # IQ4_NL / IQ4_XS and Q4_0 / Q5_0)
            with_im = (_predict(header, name, model, True, None, opts)[0] if asked
                       else pred.model_copy(update={"imatrix": True}))
            note = ("llama-quantize refuses this ftype without an importance matrix (--imatrix); "
                    "the prediction assumes one")
            pred = with_im.model_copy(update={"needs_imatrix": True, "notes": (note, *with_im.notes)})
        return pred
    pred = _predict(header, name, model, bool(imatrix), imatrix_file, opts)[0]
    if pred.needs_imatrix and not imatrix:
        note = "llama-quantize refuses this ftype without an importance matrix (--imatrix)"
        pred = pred.model_copy(update={"notes": (note, *pred.notes)})
    return pred


def predict_all(header: GGUFHeader, *, imatrix: bool | ImatrixFile | None = None,
                options: QuantOptions | None = None) -> list[QuantPrediction]:
    """predict_quant for every ftype in QUANT_FTYPES, in llama-quantize's order; an ftype llama-quantize
    would fail on comes back with ``refused`` set (and zero sizes) rather than raising."""
    _check_header(header)
    model_facts(header)  # an unusable header is an error, not 35 refusals
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
