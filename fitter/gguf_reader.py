"""Streaming GGUF header reader: key/value metadata and tensor infos, never tensor data.

Mirrors the checks of `gguf_init_from_file_impl` in llama.cpp's `ggml/src/gguf.cpp`, so that a
header llama.cpp would refuse is refused here too, with a `GGUFError` naming the byte offset. Big
arrays (tokenizer tokens, merges, scores) are walked but not kept: only their element type and
length survive, so a 262K-token vocabulary costs a few milliseconds and no memory. Memory stays
bounded by the read window (plus kept values, which are capped) whatever the input says.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys

from fitter.errors import GGUFError, SourceError
from fitter.source import ByteSource, open_source

GGML_MAX_DIMS = 4  # ggml.h
GGML_MAX_NAME = 64  # ggml.h; gguf.cpp refuses names of this length or longer
GGUF_MAX_STRING_LENGTH = 1024 * 1024 * 1024  # gguf.cpp
GGUF_MAX_ARRAY_ELEMENTS = 1024 * 1024 * 1024  # gguf.cpp
INT64_MAX = 2**63 - 1

# What we keep of values (everything else is walked and summarised as a SkippedArray).
KEEP_ARRAY_MAX = 16384  # numeric arrays up to this length are kept (per-layer arrays are ~100)
KEEP_STRING_ARRAY_MAX = 256  # string arrays up to this length are kept (tags, languages)
KEEP_STRING_MAX = 1 << 20  # longer string values are skipped (a chat template is ~10-50 KiB)

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

SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class SkippedArray:
    """An array the reader walked but did not keep (tokenizer tables and the like)."""

    type: GGUFValueType
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class SkippedString:
    """A string value longer than the reader keeps; only its length is known."""

    length: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (ne0)
    ggml_type: GGMLQuantizationType
    offset: int  # relative to its shard's data section
    nbytes: int  # ggml_nbytes of a contiguous tensor
    shard: int = 0

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class ShardInfo:
    location: str
    file_size: int
    version: int
    alignment: int
    data_offset: int  # where tensor data starts: the header's own size, padded to the alignment
    header_bytes: int  # end of the tensor infos, before padding
    bytes_fetched: int
    byte_order: str  # "<" little endian, ">" big endian


@dataclass(slots=True)
class GGUFHeader:
    """A model's header: metadata and tensor infos of all its shards."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def file_size(self) -> int:
        return sum(s.file_size for s in self.shards)

    @property
    def bytes_fetched(self) -> int:
        return sum(s.bytes_fetched for s in self.shards)

    @property
    def header_size(self) -> int:
        return sum(s.data_offset for s in self.shards)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get(Keys.General.ARCHITECTURE)
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None


def ggml_nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    """ggml_nbytes for a contiguous tensor (ggml.c)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape[1:]:
        n *= d
    return (shape[0] // block) * type_size * n if shape else type_size


class _Cursor:
    """A position in a source with a bounded read-ahead window."""

    __slots__ = ("src", "size", "pos", "buf", "buf_start", "bo", "_u32", "_u64", "_i64")

    def __init__(self, src: ByteSource):
        self.src = src
        self.size = src.size
        self.pos = 0
        self.buf = b""
        self.buf_start = 0
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

    def need(self, n: int, what: str) -> int:
        """Make [pos, pos+n) readable from self.buf; returns its index in self.buf."""
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain in the file")
        rel = self.pos - self.buf_start
        if 0 <= rel and rel + n <= len(self.buf):
            return rel
        if 0 <= rel <= len(self.buf):
            keep = self.buf[rel:]
            fetch_from = self.buf_start + len(self.buf)
        else:
            keep = b""
            fetch_from = self.pos
        want = max(self.pos + n - fetch_from, READ_CHUNK)
        data = self.src.read(fetch_from, want)
        if len(data) < self.pos + n - fetch_from:
            raise self.fail(f"{what}: the source ended early (short read)")
        self.buf = keep + data
        self.buf_start = self.pos
        return 0

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain in the file")
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
        at = self.pos
        n = self.u64(what + " length")
        if n > GGUF_MAX_STRING_LENGTH:
            raise self.fail(f"{what} length {n} exceeds the maximum {GGUF_MAX_STRING_LENGTH}", at)
        if n > self.size - self.pos:
            raise self.fail(f"{what} length {n} exceeds the {self.size - self.pos} bytes that remain", at)
        return n

    def string(self, what: str, limit: int) -> str | SkippedString:
        n = self.string_len(what)
        if n > limit:
            self.pos += n
            return SkippedString(n)
        return self.raw(n, what).decode("utf-8", errors="replace")

    def skip_strings(self, count: int, what: str) -> None:
        """Walk `count` length-prefixed strings without keeping them (the hot loop of big vocabs)."""
        u64 = self._u64
        done = 0
        while done < count:
            buf = self.buf
            off = self.pos - self.buf_start
            end = len(buf)
            if 0 <= off and off + 8 <= end:
                # Fast path: walk every string wholly inside the window. `limit` keeps the next
                # length readable, so the loop body has one comparison.
                limit = end - 8
                left = count - done
                i = 0
                nxt = off
                for i in range(left):
                    nxt = off + 8 + u64(buf, off)[0]
                    if nxt > limit:
                        break
                    off = nxt
                else:
                    i = left
                if i < left and nxt <= end:  # the string that stopped the loop may still fit
                    off = nxt
                    i += 1
                done += i
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
        raise cur.fail(f"key '{key}' has invalid GGUF type {vtype}")
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
        raise cur.fail(f"array '{key}' has {count} elements, more than the maximum {GGUF_MAX_ARRAY_ELEMENTS}", at)
    etype = GGUFValueType(etype)
    if etype == GGUFValueType.STRING:
        if count * 8 > cur.remaining():
            raise cur.fail(f"array '{key}' of {count} strings cannot fit in the {cur.remaining()} bytes that remain", at)
        if count <= KEEP_STRING_ARRAY_MAX:
            return [cur.string(f"'{key}'[{i}]", KEEP_STRING_MAX) for i in range(count)]
        cur.skip_strings(count, f"'{key}'")
        return SkippedArray(etype, count)
    fmt = _SCALAR_FMT[etype]
    nbytes = count * struct.calcsize(fmt)
    if nbytes > cur.remaining():
        raise cur.fail(f"array '{key}' of {count} elements needs {nbytes} bytes, only {cur.remaining()} remain", at)
    if count <= KEEP_ARRAY_MAX:
        data = cur.raw(nbytes, f"array '{key}'")
        return list(struct.unpack(f"{cur.bo}{count}{fmt}", data))
    cur.skip(nbytes, f"array '{key}'")
    return SkippedArray(etype, count)


def read_header_from(src: ByteSource, shard: int = 0) -> GGUFHeader:
    """Parse one GGUF file's header from a byte source (one shard of a split model)."""
    cur = _Cursor(src)
    magic = cur.raw(4, "magic")
    if struct.unpack("<I", magic)[0] != GGUF_MAGIC:
        raise cur.fail(f"bad magic {magic!r}, expected b'GGUF' (not a GGUF file)", 0)
    version = cur.u32("version")
    if version & 0x0000FFFF == 0 and version != 0:
        # gguf.cpp: "version is extremely large, is there a mismatch between the host and model endianness?"
        cur.set_byte_order(">")
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version == 1:
        raise cur.fail("GGUF version 1 is no longer supported (llama.cpp refuses it too)", 4)
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version} (ggfit reads 2 and 3)", 4)
    n_tensors = cur.i64("tensor count")
    n_kv = cur.i64("key/value count")
    # Every tensor info takes at least 8+4+8+4+8 bytes, every key/value at least 8+1+4+1.
    if n_tensors < 0 or n_tensors * 32 > cur.remaining():
        raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.remaining()} bytes that remain", 8)
    if n_kv < 0 or n_kv * 14 > cur.remaining():
        raise cur.fail(f"key/value count {n_kv} cannot fit in the {cur.remaining()} bytes that remain", 16)

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        at = cur.pos
        klen = cur.string_len(f"key {i}")
        if klen == 0:
            raise cur.fail(f"key {i} is empty", at)
        if klen > 65535:
            raise cur.fail(f"key {i} is {klen} bytes long (keys are at most 65535)", at)
        key = cur.raw(klen, f"key {i}").decode("utf-8", errors="replace")
        if key in metadata:
            raise cur.fail(f"duplicate key '{key}'", at)
        vtype = cur.u32(f"type of '{key}'")
        if vtype == GGUFValueType.ARRAY:
            metadata[key] = _read_array(cur, key)
        else:
            metadata[key] = _read_value(cur, vtype, key)

    alignment = GGUF_DEFAULT_ALIGNMENT
    if Keys.General.ALIGNMENT in metadata:
        alignment = metadata[Keys.General.ALIGNMENT]
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment {alignment!r} is not a power of 2")

    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
    for i in range(n_tensors):
        at = cur.pos
        nlen = cur.string_len(f"name of tensor {i}")
        if nlen >= GGML_MAX_NAME:
            raise cur.fail(f"tensor {i} name is {nlen} bytes, llama.cpp allows fewer than {GGML_MAX_NAME}", at)
        name = cur.raw(nlen, f"name of tensor {i}").decode("utf-8", errors="replace")
        if name in seen:
            raise cur.fail(f"duplicate tensor name '{name}'", at)
        seen.add(name)
        n_dims = cur.u32(f"dimension count of '{name}'")
        if n_dims > GGML_MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions, at most {GGML_MAX_DIMS} are allowed", at)
        shape = tuple(cur.i64(f"shape of '{name}'") for _ in range(n_dims))
        if any(d < 0 for d in shape):
            raise cur.fail(f"tensor '{name}' has a negative dimension {shape}", at)
        n_el = 1
        for d in shape:
            if d > 1 and INT64_MAX // d < n_el:
                raise cur.fail(f"tensor '{name}' shape {shape} overflows int64 elements", at)
            n_el *= d
        tpos = cur.pos
        traw = cur.u32(f"type of '{name}'")
        try:
            gtype = GGMLQuantizationType(traw)
            block, type_size = GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor '{name}' has invalid ggml type {traw}", tpos) from None
        if shape and shape[0] % block != 0:
            raise cur.fail(
                f"tensor '{name}' of type {gtype.name} has {shape[0]} elements per row, not a multiple of its block size {block}",
                tpos,
            )
        offset = cur.u64(f"offset of '{name}'")
        infos.append((name, shape or (1,), gtype, offset, at))

    header_bytes = cur.pos
    data_offset = header_bytes + (-header_bytes) % alignment if n_tensors > 0 else header_bytes
    if n_tensors > 0 and data_offset > cur.size:
        raise cur.fail(f"the data section would start at {data_offset}, past the end of the {cur.size}-byte file", header_bytes)
    data_size = cur.size - data_offset
    expected = 0
    for name, shape, gtype, offset, at in infos:
        nbytes = ggml_nbytes(shape, gtype)
        if offset % alignment:
            raise cur.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment}", at)
        if offset != expected:
            # gguf.cpp requires tensors packed in order, each padded to the alignment.
            raise cur.fail(f"tensor '{name}' has data offset {offset}, expected {expected}", at)
        if offset + nbytes > data_size:
            raise cur.fail(
                f"tensor '{name}' data ({nbytes} bytes at data offset {offset}) runs past the end of the file", at
            )
        expected = offset + nbytes + (-nbytes) % alignment
        tensors.append(TensorInfo(name, shape, gtype, offset, nbytes, shard))

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
    return GGUFHeader(metadata, tensors, [info])


def _shard_locations(location: str) -> list[str] | None:
    base = location.rsplit("/", 1)
    name = base[-1]
    m = SPLIT_NAME.match(name.split("?", 1)[0])
    if not m:
        return None
    count = int(m.group("count"))
    if count < 1:
        return None
    prefix = (base[0] + "/") if len(base) == 2 else ""
    query = ("?" + name.split("?", 1)[1]) if "?" in name else ""
    return [f"{prefix}{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf{query}" for i in range(1, count + 1)]


def read_header(location: str | os.PathLike[str]) -> GGUFHeader:
    """Read a model's header from a path or URL; split models (`*-00001-of-0000N.gguf`) read every shard."""
    loc = os.fspath(location)
    shards = _shard_locations(loc)
    if shards is None:
        return _read_one(loc, 0)
    if loc not in shards[:1]:
        # Any shard given: start from the first, as llama.cpp does.
        pass
    parts = [_read_one(s, i) for i, s in enumerate(shards)]
    first = parts[0]
    count = first.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT, len(shards))
    if count != len(shards):
        raise GGUFError(0, f"{Keys.Split.LLM_KV_SPLIT_COUNT} is {count} but the file name says {len(shards)} shards", shards[0])
    merged = dict(first.metadata)
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for i, part in enumerate(parts):
        no = part.metadata.get(Keys.Split.LLM_KV_SPLIT_NO, i)
        if no != i:
            raise GGUFError(0, f"{Keys.Split.LLM_KV_SPLIT_NO} is {no}, expected {i}", shards[i])
        for t in part.tensors:
            if t.name in names:
                raise GGUFError(part.shards[0].data_offset, f"duplicate tensor name '{t.name}' across shards", shards[i])
            names.add(t.name)
            tensors.append(t)
    want = first.metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if isinstance(want, int) and want != len(tensors):
        raise GGUFError(0, f"{Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT} is {want} but the shards hold {len(tensors)} tensors", shards[0])
    return GGUFHeader(merged, tensors, [p.shards[0] for p in parts])


def _read_one(location: str, shard: int) -> GGUFHeader:
    src = open_source(location)
    try:
        if src.size < 24:
            raise GGUFError(0, f"the file is {src.size} bytes, too short for a GGUF header (24 bytes)", src.name)
        return read_header_from(src, shard)
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
    "ggml_nbytes",
    "read_header",
    "read_header_from",
]
