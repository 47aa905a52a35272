"""tools/mtmd/models/qwen3vl.cpp clip_graph_qwen3vl::build (Qwen3-VL: learned positions, deepstack)."""

from __future__ import annotations

from fitter.ggml.tensor import Tensor
from fitter.mtmd.graph import ClipGraph


def build(c: ClipGraph) -> Tensor:
    raise NotImplementedError
