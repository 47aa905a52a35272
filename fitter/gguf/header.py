"""What a GGUF header holds once read: metadata, tensor infos, shards (fitter.gguf.reader makes them,
fitter.gguf.header_cache keeps them on disk as plain values and makes them again)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fitter.gguf.constants import GGMLQuantizationType, GGUFValueType, Keys
from fitter.record import Record

# Enum lookups by value through a dict: calling the enum class costs microseconds per call.
_VALUE_TYPE_BY_ID = {int(t): t for t in GGUFValueType}
_GGML_TYPE_BY_ID = {int(t): t for t in GGMLQuantizationType}

class SkippedArray(Record, kw_only=False):
    """An array the reader walked but did not keep (tokenizer tables and the like)."""

    type: GGUFValueType
    length: int

    def __len__(self) -> int:
        return self.length


class SkippedString(Record, kw_only=False):
    """A string value longer than the reader keeps; only its length is known."""

    length: int


@dataclass(slots=True)
class TensorInfo:
    """A tensor's entry in the header. Never changed once made (headers share them), but not frozen: a frozen
    dataclass sets each field through object.__setattr__ (~1 us an object, 5x a plain one), and `ggfit quants` makes
    26K of these and 33K TensorQuants (frozen, they were 17% of its instructions)."""

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


class ShardInfo(Record, frozen=False, kw_only=False):
    location: str
    file_size: int
    version: int
    alignment: int
    data_offset: int  # where tensor data starts: the header's own size, padded to the alignment
    header_bytes: int  # end of the tensor infos, before padding
    bytes_fetched: int
    byte_order: str  # "<" little endian, ">" big endian


class GGUFHeader(Record, frozen=False, kw_only=False):
    """A model's header: metadata and tensor infos of all its shards."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    shards: list[ShardInfo] = field(default_factory=list)
    # GGUF type of each key's value (ARRAY for arrays) and the byte offset of its key, in the first
    # shard: llama.cpp refuses some keys by type (general.alignment must be u32, split.count u16).
    value_types: dict[str, GGUFValueType] = field(default_factory=dict)
    key_offsets: dict[str, int] = field(default_factory=dict)

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


def _show(name: str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message: control characters escaped, long names cut."""
    text = name if name.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    return text if len(text) <= limit else f"{text[:limit]}...({len(name)} characters)"
