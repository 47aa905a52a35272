"""ggml types: the one table of block size and type size per ggml_type, and what follows from it.

Mirrors ggml/src/ggml.c (type_traits, ggml_blck_size, ggml_type_size, ggml_row_size, ggml_nbytes,
ggml_is_quantized) over the enum of ggml/include/ggml.h. A type is an int (ggml_type), a
GGMLQuantizationType or its name ("q8_0", case-insensitive).
"""

from __future__ import annotations

from typing import Sequence

from fitter.errors import GGFitError
from fitter.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

F32 = int(GGMLQuantizationType.F32)
F16 = int(GGMLQuantizationType.F16)
I32 = int(GGMLQuantizationType.I32)
I64 = int(GGMLQuantizationType.I64)

BLCK: dict[int, int] = {int(t): b for t, (b, _s) in GGML_QUANT_SIZES.items()}  # ggml_blck_size
TSIZE: dict[int, int] = {int(t): s for t, (_b, s) in GGML_QUANT_SIZES.items()}  # ggml_type_size


class GGMLTypeError(GGFitError):
    """A ggml type name or value ggml does not have."""


def type_of(t: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(t, GGMLQuantizationType):
        return t
    if isinstance(t, int):
        try:
            return GGMLQuantizationType(t)
        except ValueError:
            raise GGMLTypeError(f"unknown ggml type {t}") from None
    try:
        return GGMLQuantizationType[str(t).upper()]
    except KeyError:
        raise GGMLTypeError(f"unknown ggml type '{t}'") from None


def type_name(t: str | int | GGMLQuantizationType) -> str:
    return type_of(t).name.lower()


def is_quantized(t: str | int | GGMLQuantizationType) -> bool:
    """ggml_is_quantized: a block type (block size > 1); f32/f16/bf16 and the integer types are not."""
    return BLCK[type_of(t)] > 1


def type_size(t: str | int | GGMLQuantizationType) -> int:
    """ggml_type_size: bytes of one block."""
    return TSIZE[type_of(t)]


def block_size(t: str | int | GGMLQuantizationType) -> int:
    """ggml_blck_size."""
    return BLCK[type_of(t)]


def row_size(t: str | int | GGMLQuantizationType, ne: int) -> int:
    """ggml_row_size: bytes of ne elements (ne a multiple of the block size)."""
    if type(t) is not int:
        t = type_of(t)
    return TSIZE[t] * ne // BLCK[t]


def nbytes(t: str | int | GGMLQuantizationType, ne: Sequence[int]) -> int:
    """ggml_nbytes of a contiguous tensor with shape ne (ggml order, ne[0] innermost)."""
    n = row_size(t, ne[0])
    for d in ne[1:]:
        n *= d
    return n
