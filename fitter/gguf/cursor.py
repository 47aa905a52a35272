"""The GGUF header reader's cursor: buffered reads from a byte source, each value read and checked as gguf.cpp's
gguf_reader reads it, big arrays and strings walked but not kept (fitter.gguf.reader reads the header with it)."""

from __future__ import annotations

import struct
from typing import Any

from fitter.errors import GGUFError
from fitter.gguf.constants import GGUFValueType
from fitter.gguf.header import _VALUE_TYPE_BY_ID, SkippedArray, SkippedString
from fitter.gguf.source import ByteSource

GGUF_MAX_STRING_LENGTH = 1024 * 1024 * 1024  # gguf.cpp
GGUF_MAX_ARRAY_ELEMENTS = 1024 * 1024 * 1024  # gguf.cpp

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
