"""Streaming GGUF header reader: key/value metadata and tensor infos, never tensor data.

Mirrors the checks of `gguf_init_from_reader` (formerly `gguf_init_from_file_impl`) in llama.cpp's
`ggml/src/gguf.cpp`, and those of llama-model-loader on tensor data bounds and split models, so that
a header llama.cpp would refuse is refused here too, with a `GGUFError` naming the byte offset (the
tests check this against gguf.cpp itself). Big
arrays (tokenizer tokens, merges, scores) are walked but not kept: only their element type and
length survive, so a 262K-token vocabulary costs a few milliseconds and no memory. Memory stays
bounded by the read window (plus kept values, which are capped) whatever the input says.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, Any

from fitter.errors import GGUFError, SourceError, UnsupportedModelError
from fitter.gguf import header_cache
from fitter.gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, Keys
from fitter.gguf.header import (
    _GGML_TYPE_BY_ID,
    _VALUE_TYPE_BY_ID,
    GGUFHeader,
    ShardInfo,
    SkippedArray,
    SkippedString,
    TensorInfo,
    _show,
)
from fitter.gguf.source import ByteSource, FileSource, open_source
from fitter.gguf.split import whole_model

if TYPE_CHECKING:
    from fitter.gguf.cursor import _Cursor

GGML_MAX_DIMS = 4  # ggml.h
GGML_MAX_NAME = 64  # ggml.h; gguf.cpp refuses names of this length or longer
INT64_MAX = 2**63 - 1
SIZE_MAX = 2**64 - 1
# Minimum bytes of one entry (gguf.cpp accepts empty tensor names and 0 dims; keys are non-empty).
MIN_TENSOR_INFO_BYTES = 8 + 0 + 4 + 0 + 4 + 8  # name length, name, n_dims, dims, type, offset
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, key, value type, smallest value
GGUF_MAX_KEY_LENGTH = 65535  # the GGUF spec; gguf.cpp itself only caps strings at 1 GiB
# ggfit's own caps (gguf.cpp has none): each key/value or tensor info costs a few hundred bytes of
# Python objects for its 14 to 40 bytes of file, so these bound memory (~25 and ~100 MiB) whatever a
# hostile header claims. Real models have under a thousand keys and a few tens of thousands of tensors.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 18

# ggml.h of the reference llama.cpp: ids in [0, GGML_TYPE_COUNT) are types, these ids have
# block size 0 in ggml.c (removed), and gguf.cpp refuses tensors of them ("not a multiple of block size (0)").
GGML_TYPE_COUNT = 43
GGML_REMOVED_TYPES = {4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8",
                      36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}
# Types the reference ggml knows but gguf-py (pinned) does not: valid for llama.cpp, not sizable here yet.
GGML_TYPES_UNKNOWN_TO_GGUF_PY = {42: "Q2_0"}


def ggml_nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    """ggml_nbytes for a contiguous tensor (ggml.c)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape[1:]:
        n *= d
    return (shape[0] // block) * type_size * n if shape else type_size


def _ggml_type(cur: _Cursor, traw: int, name: str, at: int) -> GGMLQuantizationType:
    """The tensor type as gguf.cpp checks it: an id of ggml.h, not one of the removed ones."""
    signed = traw - (1 << 32) if traw >= 1 << 31 else traw  # gguf.cpp reads an int32
    if not 0 <= signed < GGML_TYPE_COUNT:
        raise cur.fail(f"tensor '{name}' has invalid ggml type {signed} (valid: 0 to {GGML_TYPE_COUNT - 1})", at)
    if signed in GGML_REMOVED_TYPES:
        raise cur.fail(
            f"tensor '{name}' has ggml type {signed} ({GGML_REMOVED_TYPES[signed]}), removed from ggml "
            "(block size 0; llama.cpp refuses it)",
            at,
        )
    gtype = _GGML_TYPE_BY_ID.get(signed)
    if gtype is None:
        tname = GGML_TYPES_UNKNOWN_TO_GGUF_PY.get(signed, f"type {signed}")
        raise UnsupportedModelError(
            f"{cur.src.name}: tensor '{name}' has ggml type {signed} ({tname}), which llama.cpp knows but "
            "ggfit's gguf package does not: ggfit cannot size it yet"
        )
    return gtype


# long because gguf_init_from_reader (gguf.cpp, 473 lines): its checks in file order
def read_header_from(src: ByteSource, shard: int = 0) -> GGUFHeader:
    """Parse one GGUF file's header from a byte source (one shard of a split model).

    It reads the header in file order with the checks of gguf_init_from_reader (ggml/src/gguf.cpp) where they
    fall, so that each refusal can be matched to upstream's.
    """
    from fitter.gguf.cursor import _Cursor, _read_array, _read_value  # a parse only: a cached header needs none

    cur = _Cursor(src)
    if cur.size == 0:
        raise cur.fail("the file is empty (0 bytes), not a GGUF file", 0)
    magic = cur.raw(4, "magic")
    if magic != b"GGUF":
        raise cur.fail(f"bad magic {magic!r}, expected b'GGUF' (not a GGUF file)", 0)
    version = cur.u32("version")
    if version & 0x0000FFFF == 0 and version != 0:
        # gguf.cpp: "version is extremely large, is there a mismatch between the host and model endianness?"
        # llama.cpp refuses a file of the other byte order; ggfit reads it (gguf-py writes them) and says so
        # in ShardInfo.byte_order.
        cur.set_byte_order(">")
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version == 1:
        raise cur.fail("GGUF version 1 is no longer supported (llama.cpp refuses it too)", 4)
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version} (llama.cpp reads 2 and 3)", 4)
    n_tensors = cur.i64("tensor count")
    if n_tensors < 0:
        raise cur.fail(f"tensor count {n_tensors} is negative", 8)
    n_kv = cur.i64("key/value count")
    if n_kv < 0:
        raise cur.fail(f"key/value count {n_kv} is negative", 16)
    # gguf.cpp would run out of bytes later; refusing now keeps memory bounded by the file.
    if n_kv * MIN_KV_BYTES > cur.remaining():
        raise cur.fail(f"key/value count {n_kv} cannot fit in the {cur.remaining()} bytes that remain", 16)
    if n_tensors * MIN_TENSOR_INFO_BYTES > cur.remaining():
        raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.remaining()} bytes that remain", 8)
    if n_kv > MAX_KV:
        raise cur.fail(f"key/value count {n_kv} is more than ggfit reads ({MAX_KV}; real models have under a thousand)", 16)
    if n_tensors > MAX_TENSORS:
        raise cur.fail(f"tensor count {n_tensors} is more than ggfit reads ({MAX_TENSORS})", 8)

    metadata: dict[str, Any] = {}
    value_types: dict[str, GGUFValueType] = {}
    key_offsets: dict[str, int] = {}
    seen_keys: set[bytes] = set()
    for i in range(n_kv):
        at = cur.pos
        klen = cur.string_len(f"key {i}")
        if klen == 0:
            raise cur.fail(f"key {i} is empty", at)
        if klen > GGUF_MAX_KEY_LENGTH:
            raise cur.fail(f"key {i} is {klen} bytes long (GGUF keys are at most {GGUF_MAX_KEY_LENGTH})", at)
        kraw = cur.raw(klen, f"key {i}")
        key = kraw.decode("utf-8", errors="backslashreplace")
        shown = _show(key)
        if kraw in seen_keys:
            raise cur.fail(f"duplicate key '{shown}' (key {i})", at)
        seen_keys.add(kraw)
        vtype = cur.u32(f"value type of '{shown}'")
        if vtype == GGUFValueType.ARRAY:
            metadata[key] = _read_array(cur, shown)
        else:
            metadata[key] = _read_value(cur, vtype, shown)
        value_types[key] = _VALUE_TYPE_BY_ID[vtype]
        key_offsets[key] = at

    alignment = GGUF_DEFAULT_ALIGNMENT
    if Keys.General.ALIGNMENT in metadata:
        at = key_offsets[Keys.General.ALIGNMENT]
        atype = value_types[Keys.General.ALIGNMENT]
        if atype != GGUFValueType.UINT32:
            raise cur.fail(f"{Keys.General.ALIGNMENT} must be of type UINT32 but is {atype.name}", at)
        alignment = metadata[Keys.General.ALIGNMENT]
        if alignment == 0 or alignment & (alignment - 1):
            raise cur.fail(f"{Keys.General.ALIGNMENT} {alignment} is not a power of 2", at)

    seen: set[bytes] = set()
    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int, int]] = []
    for i in range(n_tensors):
        at = cur.pos
        nlen = cur.string_len(f"name of tensor {i}")
        if nlen >= GGML_MAX_NAME:
            raise cur.fail(f"tensor {i} name is {nlen} bytes, llama.cpp allows fewer than {GGML_MAX_NAME}", at)
        nraw = cur.raw(nlen, f"name of tensor {i}")
        name = nraw.decode("utf-8", errors="backslashreplace")
        tname, name = name, _show(name)  # `name` is only used in messages from here on
        if nraw in seen:
            raise cur.fail(f"duplicate tensor name '{name}' (tensor {i})", at)
        seen.add(nraw)
        dpos = cur.pos
        n_dims = cur.u32(f"dimension count of tensor '{name}'")
        if n_dims > GGML_MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions, at most {GGML_MAX_DIMS} are allowed", dpos)
        dims: list[int] = []
        for j in range(n_dims):
            jpos = cur.pos
            d = cur.i64(f"dimension {j} of tensor '{name}'")
            if d < 0:
                raise cur.fail(f"tensor '{name}' dimension {j} is negative ({d})", jpos)
            dims.append(d)
        shape = tuple(dims)
        n_el = 1
        for d in shape:
            if d > 1 and INT64_MAX // d < n_el:
                raise cur.fail(f"tensor '{name}' shape {shape} has more than INT64_MAX elements", dpos + 4)
            n_el *= d
        tpos = cur.pos
        gtype = _ggml_type(cur, cur.u32(f"type of tensor '{name}'"), name, tpos)
        block, type_size = GGML_QUANT_SIZES[gtype]
        ne0 = shape[0] if shape else 1
        if ne0 % block != 0:
            raise cur.fail(
                f"tensor '{name}' of type {gtype.name} has {ne0} elements per row, "
                f"not a multiple of its block size {block}",
                tpos,
            )
        if n_el // block > SIZE_MAX // type_size:
            raise cur.fail(f"tensor '{name}' shape {shape} of type {gtype.name} is more than SIZE_MAX bytes", tpos)
        opos = cur.pos
        offset = cur.u64(f"data offset of tensor '{name}'")
        infos.append((tname, shape or (1,), gtype, offset, opos, ggml_nbytes(shape or (1,), gtype)))

    header_bytes = cur.pos
    data_offset = header_bytes + (-header_bytes) % alignment if n_tensors > 0 else header_bytes
    if n_tensors > 0 and data_offset > cur.size:
        raise cur.fail(
            f"file truncated: the data section would start at {data_offset}, past the end of the {cur.size}-byte file",
            header_bytes,
        )
    data_size = cur.size - data_offset
    expected = 0
    tensors: list[TensorInfo] = []
    for tname, shape, gtype, offset, opos, nbytes in infos:
        name = _show(tname)
        if offset % alignment:
            raise cur.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment}", opos)
        if offset != expected:
            # gguf.cpp requires tensors packed in order, each padded to the alignment.
            raise cur.fail(f"tensor '{name}' has data offset {offset}, expected {expected}", opos)
        if offset + nbytes > data_size:
            # llama-model-loader: "tensor data is not within the file bounds, model is corrupted or incomplete"
            raise cur.fail(
                f"tensor '{name}' data ({nbytes} bytes at data offset {offset}) runs past the end of the file "
                f"({data_size} bytes of data after byte {data_offset}); the file is truncated or corrupted",
                opos,
            )
        expected = offset + nbytes + (-nbytes) % alignment
        tensors.append(TensorInfo(tname, shape, gtype, offset, nbytes, shard))

    info = ShardInfo(
        location=src.name,
        file_size=cur.size,
        version=version,
        alignment=alignment,
        data_offset=data_offset,
        header_bytes=header_bytes,
        bytes_fetched=src.bytes_fetched,
        byte_order=cur.bo,
    )
    return GGUFHeader(metadata, tensors, [info], value_types, key_offsets)


def read_header(location: str | os.PathLike[str]) -> GGUFHeader:
    """Read a model's header from a path or URL.

    As llama.cpp's model loader does, a file whose `split.count` is above 1 is one shard of a split
    model named `<prefix>-0000i-of-0000N.gguf`: every shard is read (any shard may be given, llama.cpp
    wants the first), their tensors are merged and the metadata is the first shard's.
    """
    loc = os.fspath(location)
    return whole_model(_read_one(loc, 0), loc, _read_one)


def _read_one(location: str, shard: int) -> GGUFHeader:
    src = open_source(location)
    try:
        if not (header_cache.is_enabled() and isinstance(src, FileSource)):
            return read_header_from(src, shard)
        before = os.fstat(src.fileno())  # the very file read, whatever happens to the path meanwhile
        hit = header_cache.load(location, shard, before)
        if hit is not None:
            return hit
        header = read_header_from(src, shard)
        header_cache.store(location, shard, before, os.fstat(src.fileno()), header)
        return header
    finally:
        src.close()


__all__ = [
    "GGUFHeader",
    "GGUFError",
    "ShardInfo",
    "SkippedArray",
    "SkippedString",
    "SourceError",
    "TensorInfo",
    "UnsupportedModelError",
    "ggml_nbytes",
    "read_header",
    "read_header_from",
]
