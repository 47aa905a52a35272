"""ggml types: the one table of block size and type size per ggml_type, and what follows from it.

Mirrors ggml/src/ggml.c (type_traits, ggml_blck_size, ggml_type_size, ggml_row_size, ggml_nbytes,
ggml_is_quantized) over the enum of ggml/include/ggml.h. A type is an int (ggml_type), a
GGMLQuantizationType or its name ("q8_0", case-insensitive).
"""

from __future__ import annotations

import functools
from typing import Sequence

from fitter.errors import GGFitError
from fitter.gguf.constants import GGMLQuantizationType

F32 = int(GGMLQuantizationType.F32)
F16 = int(GGMLQuantizationType.F16)
I32 = int(GGMLQuantizationType.I32)
I64 = int(GGMLQuantizationType.I64)

# ggml.c type_traits of the pinned build: ggml_type id -> (ggml_type_name, block size, type size). gguf-py's
# GGML_QUANT_SIZES lacks Q2_0 and gives Q8_1 40 bytes; ggml-common.h's block_q8_1 (two halves + 32) has 36.
TYPE_TRAITS: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 9: ("q8_1", 32, 36), 10: ("q2_K", 256, 84), 11: ("q3_K", 256, 110),
    12: ("q4_K", 256, 144), 13: ("q5_K", 256, 176), 14: ("q6_K", 256, 210), 15: ("q8_K", 256, 292),
    16: ("iq2_xxs", 256, 66), 17: ("iq2_xs", 256, 74), 18: ("iq3_xxs", 256, 98), 19: ("iq1_s", 256, 50),
    20: ("iq4_nl", 32, 18), 21: ("iq3_s", 256, 110), 22: ("iq2_s", 256, 82), 23: ("iq4_xs", 256, 136),
    24: ("i8", 1, 1), 25: ("i16", 1, 2), 26: ("i32", 1, 4), 27: ("i64", 1, 8), 28: ("f64", 1, 8),
    29: ("iq1_m", 256, 56), 30: ("bf16", 1, 2), 34: ("tq1_0", 256, 54), 35: ("tq2_0", 256, 66),
    39: ("mxfp4", 32, 17), 40: ("nvfp4", 64, 36), 41: ("q1_0", 128, 18), 42: ("q2_0", 64, 18),
}
GGML_TYPES: dict[str, int] = {name: tid for tid, (name, _b, _s) in TYPE_TRAITS.items()}  # ggml_type_name -> id
BLCK: dict[int, int] = {tid: b for tid, (_n, b, _s) in TYPE_TRAITS.items()}  # ggml_blck_size
TSIZE: dict[int, int] = {tid: s for tid, (_n, _b, s) in TYPE_TRAITS.items()}  # ggml_type_size


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


# kept by what it was given (a name, an id or a member): an enum member's .name is a property, about a microsecond,
# and a prediction asks ~20
@functools.cache
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


def pad(x: int, n: int) -> int:
    """GGML_PAD."""
    return (x + n - 1) // n * n
