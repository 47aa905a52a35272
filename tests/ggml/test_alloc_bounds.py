"""The graph allocator refuses a tensor no machine could hold (a hostile header's sizes), in one line."""

from __future__ import annotations

import pytest

from fitter.errors import GGFitError
from fitter.ggml.alloc import Gallocr
from fitter.ggml.tensor import Tensor, contig_nb
from fitter.ggml.types import F32


def _node(ne: list[int], name: str) -> Tensor:
    return Tensor("ADD", F32, ne, contig_nb(F32, ne), (), None, name)


def test_a_tensor_beyond_any_address_space_is_a_clear_error() -> None:
    huge = _node([1 << 30, 1 << 30, 1 << 2, 1], "huge")  # 2**62 floats
    with pytest.raises(GGFitError, match="compute tensor \\(huge\\) of .* bytes: the file's sizes are not plausible"):
        Gallocr(32).run([huge], [])


def test_a_large_but_possible_tensor_is_allocated() -> None:
    big = _node([1 << 20, 1 << 10, 1, 1], "big")  # 4 GiB
    assert Gallocr(32).run([big], []) == 4 << 30
