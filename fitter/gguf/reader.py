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
from dataclasses import replace
from typing import Any

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
)
from fitter.gguf.source import ByteSource, FileSource, open_source

GGML_MAX_DIMS = 4  # ggml.h
GGML_MAX_NAME = 64  # ggml.h; gguf.cpp refuses names of this length or longer
GGUF_MAX_STRING_LENGTH = 1024 * 1024 * 1024  # gguf.cpp
GGUF_MAX_ARRAY_ELEMENTS = 1024 * 1024 * 1024  # gguf.cpp
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

# What we keep of values (everything else is walked and summarised as a SkippedArray).
KEEP_ARRAY_MAX = 16384  # numeric arrays up to this length are kept (per-layer arrays are ~100)
KEEP_STRING_ARRAY_MAX = 256  # string arrays up to this length are kept (tags, languages)
KEEP_STRING_MAX = 1 << 20  # longer string values are skipped (a chat template is ~10-50 KiB)

# Whole-header budget for kept values, so memory stays bounded whatever the header says: past it,
# arrays and strings are walked and summarised like big ones. Real headers keep well under 1 MiB.
KEEP_TOTAL_ELEMENTS = 1 << 18  # array elements kept, all arrays together (~10 MiB as Python ints)
KEEP_TOTAL_STRING_BYTES = 32 << 20  # string bytes kept, all strings together

READ_CHUNK = 1 << 20  # bytes per read from the source

_SCALAR_FMT: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_VALUE_TYPES = {int(t) for t in GGUFValueType}
def _show(name: str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message: control characters escaped, long names cut."""
    text = name if name.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    return text if len(text) <= limit else f"{text[:limit]}...({len(name)} characters)"


def ggml_nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    """ggml_nbytes for a contiguous tensor (ggml.c)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape[1:]:
        n *= d
    return (shape[0] // block) * type_size * n if shape else type_size


class _Cursor:
    """A position in a source with a bounded read-ahead window."""

    __slots__ = (
        "src", "size", "pos", "buf", "buf_start", "bo", "_u32", "_u64", "_i64",
        "kept_elements", "kept_string_bytes",
    )

    def __init__(self, src: ByteSource):
        self.src = src
        self.size = src.size
        self.pos = 0
        self.buf = b""
        self.buf_start = 0
        self.kept_elements = 0
        self.kept_string_bytes = 0
        self.set_byte_order("<")

    def set_byte_order(self, bo: str) -> None:
        self.bo = bo
        self._u32 = struct.Struct(bo + "I").unpack_from
        self._u64 = struct.Struct(bo + "Q").unpack_from
        self._i64 = struct.Struct(bo + "q").unpack_from

    def fail(self, problem: str, at: int | None = None) -> GGUFError:
        return GGUFError(self.pos if at is None else at, problem, self.src.name)

    def remaining(self) -> int:
        return self.size - self.pos

    def truncated(self, n: int, what: str) -> GGUFError:
        return self.fail(f"file truncated: {what} needs {n} bytes but only {self.size - self.pos} remain")

    def need(self, n: int, what: str) -> int:
        """Make [pos, pos+n) readable from self.buf; returns its index in self.buf."""
        if n > self.size - self.pos:
            raise self.truncated(n, what)
        rel = self.pos - self.buf_start
        if 0 <= rel and rel + n <= len(self.buf):
            return rel
        if 0 <= rel <= len(self.buf):
            keep = self.buf[rel:]
            fetch_from = self.buf_start + len(self.buf)
        else:
            keep = b""
            fetch_from = self.pos
        short = self.pos + n - fetch_from
        want = max(short, READ_CHUNK)
        data = self.src.read(fetch_from, want)
        if len(data) < short:
            # A source may answer with less than asked (an HTTP source serves what it already holds
            # first); ask again for the rest, until the field is whole or the source has nothing more.
            parts = [data]
            got = len(data)
            while got < short:
                more = self.src.read(fetch_from + got, want - got)
                if not more:
                    raise self.fail(f"{what}: the source ended early (short read at byte {fetch_from + got})")
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self.buf = keep + data
        self.buf_start = self.pos
        return 0

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.truncated(n, what)
        self.pos += n

    def u32(self, what: str) -> int:
        i = self.need(4, what)
        self.pos += 4
        return self._u32(self.buf, i)[0]

    def u64(self, what: str) -> int:
        i = self.need(8, what)
        self.pos += 8
        return self._u64(self.buf, i)[0]

    def i64(self, what: str) -> int:
        i = self.need(8, what)
        self.pos += 8
        return self._i64(self.buf, i)[0]

    def raw(self, n: int, what: str) -> bytes:
        i = self.need(n, what)
        self.pos += n
        return self.buf[i : i + n]

    def string_len(self, what: str) -> int:
        """Read a string's u64 length and check it as gguf.cpp does (at most 1 GiB, within the file)."""
        at = self.pos
        n = self.u64(what + " length")
        if n > GGUF_MAX_STRING_LENGTH:
            raise self.fail(f"{what} length {n} exceeds the maximum {GGUF_MAX_STRING_LENGTH}", at)
        if n > self.size - self.pos:
            raise self.fail(f"{what} length {n} exceeds the {self.size - self.pos} bytes that remain in the file", at)
        return n

    def string(self, what: str, limit: int) -> str | SkippedString:
        n = self.string_len(what)
        if n > limit or n > KEEP_TOTAL_STRING_BYTES - self.kept_string_bytes:
            self.pos += n
            return SkippedString(n)
        self.kept_string_bytes += n
        return self.raw(n, what).decode("utf-8", errors="replace")

    def skip_strings(self, count: int, what: str) -> None:
        """Walk `count` length-prefixed strings without keeping them (the hot loop of big vocabs).

        Strings wholly inside the read window are walked unchecked, eight per loop turn: a string
        inside the window is inside the file and shorter than the window, so gguf.cpp's checks hold
        for it by construction. The turn that reads a length past the window (struct.error), or ends
        past it, is walked again one string at a time; the string that crosses the window's end
        goes through the checked path (string_len), which refills the window.
        """
        u64 = self._u64
        done = 0
        while done < count:
            buf = self.buf
            off = self.pos - self.buf_start
            end = len(buf)
            if 0 <= off and off + 8 <= end:
                left = count - done
                turns = left >> 3
                g = off
                j = 0
                try:
                    for j in range(turns):  # noqa: B007 - j is read by the OverflowError handler
                        g = off
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        off += 8 + u64(buf, off)[0]
                        if off > end:
                            raise OverflowError  # this turn ran past the window: walk it again, checked
                    walked = turns << 3
                except (struct.error, OverflowError):
                    off = g
                    walked = j << 3
                # The rest (under eight, or the turn that crossed the window's end), one at a time.
                limit = end - 8
                while walked < left and off <= limit:
                    nxt = off + 8 + u64(buf, off)[0]
                    if nxt > end:
                        break
                    off = nxt
                    walked += 1
                done += walked
                self.pos = self.buf_start + off
            if done < count:
                n = self.string_len(f"{what}[{done}]")
                if n > READ_CHUNK:
                    self.pos += n
                else:
                    self.need(n, f"{what}[{done}]")
                    self.pos += n
                done += 1


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of '{key}'", KEEP_STRING_MAX)
    fmt = _SCALAR_FMT.get(vtype)
    if fmt is None:
        raise cur.fail(f"key '{key}' has invalid GGUF type {vtype}", cur.pos - 4)
    size = struct.calcsize(fmt)
    i = cur.need(size, f"value of '{key}'")
    cur.pos += size
    return struct.unpack_from(cur.bo + fmt, cur.buf, i)[0]


def _read_array(cur: _Cursor, key: str) -> Any:
    at = cur.pos
    etype = cur.u32(f"element type of array '{key}'")
    count = cur.u64(f"length of array '{key}'")
    if etype == GGUFValueType.ARRAY:
        raise cur.fail(f"array '{key}' is nested (arrays of arrays are not valid GGUF)", at)
    if etype not in _VALUE_TYPES:
        raise cur.fail(f"array '{key}' has invalid element type {etype}", at)
    if count > GGUF_MAX_ARRAY_ELEMENTS:
        raise cur.fail(f"array '{key}' has {count} elements, more than the maximum {GGUF_MAX_ARRAY_ELEMENTS}", at + 4)
    etype = _VALUE_TYPE_BY_ID[etype]
    keep = count <= KEEP_TOTAL_ELEMENTS - cur.kept_elements
    if etype == GGUFValueType.STRING:
        if count * 8 > cur.remaining():
            raise cur.fail(f"array '{key}' of {count} strings cannot fit in the {cur.remaining()} bytes that remain", at + 4)
        if keep and count <= KEEP_STRING_ARRAY_MAX:
            cur.kept_elements += count
            return [cur.string(f"'{key}'[{i}]", KEEP_STRING_MAX) for i in range(count)]
        cur.skip_strings(count, f"'{key}'")
        return SkippedArray(etype, count)
    fmt = _SCALAR_FMT[etype]
    nbytes = count * struct.calcsize(fmt)
    if nbytes > cur.remaining():
        raise cur.fail(f"array '{key}' of {count} elements needs {nbytes} bytes, only {cur.remaining()} remain", at + 4)
    if keep and count <= KEEP_ARRAY_MAX:
        cur.kept_elements += count
        data = cur.raw(nbytes, f"array '{key}'")
        return list(struct.unpack(f"{cur.bo}{count}{fmt}", data))
    cur.skip(nbytes, f"array '{key}'")
    return SkippedArray(etype, count)


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


def _split_key(part: GGUFHeader, key: str, vtype: GGUFValueType, required: bool) -> int | None:
    """A split.* key as llama-model-loader reads it: of exactly this type, required or not."""
    where = part.shards[0].location
    if key not in part.metadata:
        if required:
            raise GGUFError(0, f"split model: missing key {key}", where)
        return None
    at = part.key_offsets.get(key, 0)
    if part.value_types.get(key) != vtype:
        got = part.value_types.get(key)
        raise GGUFError(at, f"key {key} has type {got.name if got else '?'}, llama.cpp expects {vtype.name}", where)
    return part.metadata[key]


def _split_locations(location: str, idx: int, count: int) -> list[str] | None:
    """All shard locations, from one shard's name, as llama_split_prefix/llama_split_path build them."""
    base, query = location, ""
    if location.startswith(("http://", "https://")) and "?" in location:
        base, rest = location.split("?", 1)
        query = "?" + rest
    postfix = f"-{idx + 1:05d}-of-{count:05d}.gguf"
    if len(base) <= len(postfix) or not base.endswith(postfix):
        return None
    prefix = base[: -len(postfix)]
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf{query}" for i in range(1, count + 1)]


def read_header(location: str | os.PathLike[str]) -> GGUFHeader:
    """Read a model's header from a path or URL.

    As llama.cpp's model loader does, a file whose `split.count` is above 1 is one shard of a split
    model named `<prefix>-0000i-of-0000N.gguf`: every shard is read (any shard may be given, llama.cpp
    wants the first), their tensors are merged and the metadata is the first shard's.
    """
    loc = os.fspath(location)
    given = _read_one(loc, 0)
    n_split = _split_key(given, Keys.Split.LLM_KV_SPLIT_COUNT, GGUFValueType.UINT16, required=False)
    if not n_split or n_split <= 1:
        return given
    idx = _split_key(given, Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16, required=True)
    assert idx is not None  # required: a missing key raises
    if idx >= n_split:
        raise GGUFError(given.key_offsets[Keys.Split.LLM_KV_SPLIT_NO], f"split.no is {idx} but split.count is {n_split}", loc)
    shards = _split_locations(loc, idx, n_split)
    if shards is None:
        raise GGUFError(
            0,
            f"split.count is {n_split} and split.no {idx}, so the file name must end in "
            f"'-{idx + 1:05d}-of-{n_split:05d}.gguf' (llama.cpp finds the other shards by name)",
            loc,
        )
    parts: list[GGUFHeader] = []
    for i, shard_loc in enumerate(shards):
        if i == idx:
            part = given
            if i != 0:
                part.tensors = [replace(t, shard=i) for t in part.tensors]
        else:
            part = _read_one(shard_loc, i)
            no = _split_key(part, Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16, required=True)
            if no != i:
                raise GGUFError(part.key_offsets[Keys.Split.LLM_KV_SPLIT_NO], f"split.no is {no}, expected {i}", shard_loc)
        parts.append(part)
    first = parts[0]
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for i, part in enumerate(parts):
        for t in part.tensors:
            if t.name in names:
                raise GGUFError(part.shards[0].data_offset, f"tensor '{_show(t.name)}' is in more than one shard", shards[i])
            names.add(t.name)
            tensors.append(t)
    want = _split_key(first, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, GGUFValueType.INT32, required=True)
    if want != len(tensors):
        raise GGUFError(
            first.key_offsets[Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT],
            f"split.tensors.count is {want} but the {n_split} shards hold {len(tensors)} tensors",
            shards[0],
        )
    return GGUFHeader(first.metadata, tensors, [p.shards[0] for p in parts], first.value_types, first.key_offsets)


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
