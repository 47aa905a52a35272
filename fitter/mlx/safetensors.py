"""safetensors headers (never tensor data), from a local file or over HTTP Range requests.

Layout (safetensors' format): an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data.
A hostile file gets one GGFitError line: N is bounded (safetensors' own MAX_HEADER_SIZE, 100 MB),
every entry is checked against its dtype, shape and the file's size.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from fitter.errors import GGFitError
from fitter.gguf.source import ByteSource, open_source

MAX_HEADER_SIZE = 100_000_000  # safetensors::tensor::MAX_HEADER_SIZE
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class SafetensorsError(GGFitError):
    """The bytes are not a safetensors header ggfit can trust."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def _read_exact(src: ByteSource, offset: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = src.read(offset + len(out), n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_safetensors_header(location: str) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape (the `__metadata__` entry is skipped)."""
    return read_safetensors(location)[0]


def read_safetensors(location: str) -> tuple[dict[str, TensorInfo], int]:
    """The header's tensors and the file's size (over HTTP, from the ranged reply: nothing else travels)."""
    src = open_source(location)
    try:
        return _parse(src), src.size
    finally:
        src.close()


def _parse(src: ByteSource) -> dict[str, TensorInfo]:
    name = src.name
    head = _read_exact(src, 0, 8)
    if len(head) < 8:
        raise SafetensorsError(f"{name}: not a safetensors file ({src.size} bytes, shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_SIZE:
        raise SafetensorsError(f"{name}: invalid safetensors header length {n} (more than {MAX_HEADER_SIZE} bytes)")
    if 8 + n > src.size:
        raise SafetensorsError(f"{name}: invalid safetensors header length {n}: the file has {src.size} bytes")
    raw = _read_exact(src, 8, n)
    if len(raw) < n:
        raise SafetensorsError(f"{name}: truncated safetensors header ({len(raw)} of {n} bytes)")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsError(f"{name}: safetensors header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise SafetensorsError(f"{name}: safetensors header is not a JSON object")
    data_size = src.size - 8 - n
    out: dict[str, TensorInfo] = {}
    for key, entry in obj.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{name}: tensor {key!r}: entry is not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise SafetensorsError(f"{name}: tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**53 for d in shape) or len(shape) > 8:
            raise SafetensorsError(f"{name}: tensor {key!r}: invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_size):
            raise SafetensorsError(f"{name}: tensor {key!r}: data_offsets {offs!r} outside the data ({data_size} bytes)")
        t = TensorInfo(key, dtype, tuple(shape))
        if offs[1] - offs[0] != t.nbytes:
            raise SafetensorsError(f"{name}: tensor {key!r}: {offs[1] - offs[0]} bytes of data for shape {shape} {dtype}")
        out[key] = t
    return out
