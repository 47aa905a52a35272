"""Build GGUF header bytes by hand, field by field, for the malformed files gguf.GGUFWriter refuses to write.

    b = GGUFBytes()
    b.kv("general.architecture", STRING, "llama")
    b.kv_array("tokenizer.ggml.tokens", STRING, ["a", "b"])
    b.tensor("w", (32, 2), GGMLQuantizationType.F32)
    data = b.build()                 # a valid file: header, padding, zeroed tensor data
    b.marks()["t0.type"]             # byte offset where tensor 0's type field starts
    b.upto("kv0.key")                # the file truncated just before kv 0's key bytes

Every field can be overridden with raw bytes or a lying length, so tests can say exactly which byte
is wrong and check that the reader's error names that offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from fitter.gguf.cursor import _SCALAR_FMT

STRING = GGUFValueType.STRING
ARRAY = GGUFValueType.ARRAY

_FMT = _SCALAR_FMT  # the reader's own table of scalar formats

Segment = tuple[str, bytes]


def tensor_nbytes(shape: Sequence[int], ggml_type: int) -> int:
    """ggml_nbytes of a contiguous tensor; 0 for a type gguf-py does not know."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return 0
    n = 1
    for d in shape[1:]:
        n *= d
    ne0 = shape[0] if shape else 1
    return (ne0 // block) * size * n if all(d > 0 for d in shape) else 0


def pad(n: int, alignment: int) -> int:
    return n + (-n) % alignment


@dataclass
class GGUFBytes:
    version: int = 3
    magic: bytes = b"GGUF"
    byte_order: str = "<"
    alignment: int = 32  # used for the padding before the data and for automatic tensor offsets
    n_tensors: int | None = None  # None: the number of tensors added
    n_kv: int | None = None  # None: the number of key/values added
    data: bytes | None = None  # None: zeroed tensor data, each tensor padded to the alignment
    kvs: list[list[Segment]] = field(default_factory=list)
    tensors: list[list[Segment]] = field(default_factory=list)
    _next_offset: int = 0
    _data_size: int = 0

    # --- encoding -------------------------------------------------------------------------------
    def pack(self, fmt: str, *values: Any) -> bytes:
        return struct.pack(self.byte_order + fmt, *values)

    def gstr(self, s: str | bytes, length: int | None = None) -> tuple[bytes, bytes]:
        raw = s.encode() if isinstance(s, str) else s
        return self.pack("Q", len(raw) if length is None else length), raw

    def value(self, vtype: int, v: Any) -> bytes:
        if vtype == STRING:
            n, raw = self.gstr(v)
            return n + raw
        return self.pack(_FMT[GGUFValueType(vtype)], v)

    # --- key/values -----------------------------------------------------------------------------
    def kv(self, key: str | bytes, vtype: int, value: Any = None, *, key_len: int | None = None,
           raw_value: bytes | None = None, value_len: int | None = None) -> GGUFBytes:
        """A scalar or string key/value; raw_value replaces the encoded value, value_len lies about a string's length."""
        i = len(self.kvs)
        klen, kraw = self.gstr(key, key_len)
        segs: list[Segment] = [(f"kv{i}.key_len", klen), (f"kv{i}.key", kraw), (f"kv{i}.type", self.pack("I", vtype))]
        if raw_value is not None:
            segs.append((f"kv{i}.value", raw_value))
        elif vtype == STRING:
            vlen, vraw = self.gstr(value, value_len)
            segs += [(f"kv{i}.value_len", vlen), (f"kv{i}.value", vraw)]
        else:
            segs.append((f"kv{i}.value", self.value(vtype, value)))
        self.kvs.append(segs)
        return self

    def kv_array(self, key: str | bytes, etype: int, values: Sequence[Any] = (), *, count: int | None = None,
                 raw_body: bytes | None = None) -> GGUFBytes:
        """An array key/value; count lies about the length, raw_body replaces the encoded elements."""
        i = len(self.kvs)
        klen, kraw = self.gstr(key)
        body = raw_body if raw_body is not None else b"".join(self.value(etype, v) for v in values)
        self.kvs.append([
            (f"kv{i}.key_len", klen),
            (f"kv{i}.key", kraw),
            (f"kv{i}.type", self.pack("I", ARRAY)),
            (f"kv{i}.arr_type", self.pack("I", etype)),
            (f"kv{i}.arr_len", self.pack("Q", len(values) if count is None else count)),
            (f"kv{i}.arr_body", body),
        ])
        return self

    def kv_raw(self, *segs: Segment) -> GGUFBytes:
        self.kvs.append(list(segs))
        return self

    # --- tensor infos ---------------------------------------------------------------------------
    def tensor(self, name: str | bytes, shape: Sequence[int], ggml_type: int = GGMLQuantizationType.F32, *,
               offset: int | None = None, n_dims: int | None = None, name_len: int | None = None,
               raw_dims: bytes | None = None) -> GGUFBytes:
        """A tensor info, shape in ggml order (ne0 first); offset None packs it after the previous one."""
        i = len(self.tensors)
        nlen, nraw = self.gstr(name, name_len)
        nbytes = tensor_nbytes(shape, ggml_type)
        if offset is None:
            offset = self._next_offset
        self._next_offset = pad(offset + nbytes, self.alignment)
        self._data_size = max(self._data_size, self._next_offset)
        dims = raw_dims if raw_dims is not None else b"".join(self.pack("q", d) for d in shape)
        self.tensors.append([
            (f"t{i}.name_len", nlen),
            (f"t{i}.name", nraw),
            (f"t{i}.n_dims", self.pack("I", len(shape) if n_dims is None else n_dims)),
            (f"t{i}.dims", dims),
            (f"t{i}.type", self.pack("I", ggml_type)),
            (f"t{i}.offset", self.pack("Q", offset)),
        ])
        return self

    # --- output ---------------------------------------------------------------------------------
    def segments(self) -> list[Segment]:
        segs: list[Segment] = [
            ("magic", self.magic),
            ("version", self.pack("I", self.version)),
            ("n_tensors", self.pack("q", len(self.tensors) if self.n_tensors is None else self.n_tensors)),
            ("n_kv", self.pack("q", len(self.kvs) if self.n_kv is None else self.n_kv)),
        ]
        for kv in self.kvs:
            segs += kv
        for t in self.tensors:
            segs += t
        header = sum(len(b) for _, b in segs)
        if self.tensors:
            segs.append(("pad", b"\0" * ((-header) % self.alignment)))
        segs.append(("data", b"\0" * self._data_size if self.data is None else self.data))
        return segs

    def marks(self) -> dict[str, int]:
        """Byte offset where each labelled field starts."""
        out: dict[str, int] = {}
        pos = 0
        for label, b in self.segments():
            out[label] = pos
            pos += len(b)
        out["end"] = pos
        return out

    def build(self) -> bytes:
        return b"".join(b for _, b in self.segments())

    def upto(self, label: str, extra: int = 0) -> bytes:
        """The file cut just before field `label` (plus `extra` bytes of it)."""
        return self.build()[: self.marks()[label] + extra]


class MemSource:
    """A ByteSource over bytes in memory, for read_header_from (counts what it hands out)."""

    def __init__(self, data: bytes, name: str = "<mem>"):
        self.data = data
        self.size = len(data)
        self.name = name
        self.bytes_fetched = 0

    def read(self, offset: int, n: int) -> bytes:
        out = self.data[offset : offset + max(0, n)]
        self.bytes_fetched += len(out)
        return out

    def close(self) -> None:
        pass


def minimal(arch: str = "llama") -> GGUFBytes:
    """A small valid file: a few key/values of several types and two tensors."""
    b = GGUFBytes()
    b.kv("general.architecture", STRING, arch)
    b.kv("general.alignment", GGUFValueType.UINT32, 32)
    b.kv(f"{arch}.block_count", GGUFValueType.UINT32, 2)
    b.kv_array("tokenizer.ggml.tokens", STRING, ["<s>", "</s>", "a"])
    b.tensor("token_embd.weight", (32, 3), GGMLQuantizationType.F32)
    b.tensor("output.weight", (32, 3), GGMLQuantizationType.Q8_0)
    return b


# --- gguf.cpp itself, as an oracle ----------------------------------------------------------------
# The llama-cpp-python wheel ships libggml-base, whose gguf_init_from_buffer/_file is the reader ggfit
# mirrors. Tests use it to check that what ggfit refuses, llama.cpp refuses too (and the reverse).


@dataclass(frozen=True)
class GGUFCppHeader:
    version: int
    alignment: int
    data_offset: int
    keys: tuple[str, ...]
    tensors: tuple[tuple[str, int, int, int], ...]  # name, ggml type, offset, size in bytes


_LIB: Any = None


def gguf_cpp() -> Any:
    """The ctypes handle of libggml-base from llama-cpp-python, or None when it is not installed."""
    global _LIB
    if _LIB is not None:
        if _LIB:  # importing llama_cpp since then put its own logger back (which fails on non-UTF-8 text)
            _LIB.ggml_log_set(_void_p(_LIB._log_cb), None)
        return _LIB or None
    import ctypes
    import importlib.util
    import os

    _LIB = False
    spec = importlib.util.find_spec("llama_cpp")  # find it without importing llama_cpp (no log hooks)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "lib", "libggml-base.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    vp, sz, cp, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int64
    lib.Params = Params
    lib.gguf_init_from_buffer.restype = vp
    lib.gguf_init_from_buffer.argtypes = [vp, sz, Params]
    lib.gguf_init_from_file.restype = vp
    lib.gguf_init_from_file.argtypes = [cp, Params]
    lib.gguf_free.argtypes = [vp]
    for fn, res, args in [
        ("gguf_get_version", ctypes.c_uint32, [vp]),
        ("gguf_get_alignment", sz, [vp]),
        ("gguf_get_data_offset", sz, [vp]),
        ("gguf_get_n_kv", i64, [vp]),
        ("gguf_get_key", cp, [vp, i64]),
        ("gguf_get_n_tensors", i64, [vp]),
        ("gguf_get_tensor_name", cp, [vp, i64]),
        ("gguf_get_tensor_type", ctypes.c_int, [vp, i64]),
        ("gguf_get_tensor_offset", sz, [vp, i64]),
        ("gguf_get_tensor_size", sz, [vp, i64]),
    ]:
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args
    # Silence gguf.cpp's error log (it prints one line per refused file).
    log_cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda level, text, ud: None)
    lib._log_cb = log_cb
    lib.ggml_log_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ggml_log_set(_void_p(log_cb), None)
    _LIB = lib
    return lib


def _void_p(fn: Any) -> Any:
    import ctypes

    return ctypes.cast(fn, ctypes.c_void_p)


def _describe(lib: Any, ctx: int) -> GGUFCppHeader:
    try:
        return GGUFCppHeader(
            version=lib.gguf_get_version(ctx),
            alignment=lib.gguf_get_alignment(ctx),
            data_offset=lib.gguf_get_data_offset(ctx),
            keys=tuple(lib.gguf_get_key(ctx, i).decode("utf-8", "backslashreplace") for i in range(lib.gguf_get_n_kv(ctx))),
            tensors=tuple(
                (
                    lib.gguf_get_tensor_name(ctx, i).decode("utf-8", "backslashreplace"),
                    lib.gguf_get_tensor_type(ctx, i),
                    lib.gguf_get_tensor_offset(ctx, i),
                    lib.gguf_get_tensor_size(ctx, i),
                )
                for i in range(lib.gguf_get_n_tensors(ctx))
            ),
        )
    finally:
        lib.gguf_free(ctx)


def gguf_cpp_read(data: bytes) -> GGUFCppHeader | None:
    """gguf.cpp's verdict on these bytes: their header as it reads it, or None if it refuses them."""
    import ctypes

    lib = gguf_cpp()
    assert lib is not None, "libggml-base not available"
    if not data:
        return None  # gguf_init_from_buffer refuses size 0 before reading anything
    buf = ctypes.create_string_buffer(data, len(data))
    ctx = lib.gguf_init_from_buffer(buf, len(data), lib.Params(True, None))
    return _describe(lib, ctx) if ctx else None


def gguf_cpp_read_file(path: str) -> GGUFCppHeader | None:
    lib = gguf_cpp()
    assert lib is not None, "libggml-base not available"
    ctx = lib.gguf_init_from_file(path.encode(), lib.Params(True, None))
    return _describe(lib, ctx) if ctx else None
