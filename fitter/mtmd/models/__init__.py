"""One module per clip graph builder (tools/mtmd/models/*.cpp); BUILDERS: projector type -> its build function."""

from __future__ import annotations

from typing import Callable

from fitter.ggml.tensor import Tensor
from fitter.mtmd.graph import ClipGraph
from fitter.mtmd.hparams import GEMMA3, GEMMA4V, PIXTRAL, QWEN2VL, QWEN3VL, QWEN25VL
from fitter.mtmd.models import gemma4v, pixtral, qwen2vl, qwen3vl, siglip

# clip.cpp clip_get_graph_builder, for the projector types mirrored
BUILDERS: dict[str, Callable[[ClipGraph], Tensor]] = {
    GEMMA3: siglip.build,
    QWEN2VL: qwen2vl.build,
    QWEN25VL: qwen2vl.build,
    QWEN3VL: qwen3vl.build,
    GEMMA4V: gemma4v.build,
    PIXTRAL: pixtral.build,
}
