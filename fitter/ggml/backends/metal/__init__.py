"""ggml-metal (ggml/src/ggml-metal): the Metal backend.

- backend.py: buffer types, alloc sizes and op support (ggml-metal.cpp, ggml-metal-device.m), the MetalBackend object;
- common.py: graph_optimize's concurrency reorder of each split (ggml-metal-common.cpp);
- fusion.py: the fusion table its packs come from (ggml-metal-fusion.cpp);
- segments.py, chunks.py: that reorder over a graph built one segment per distinct layer, as chunks for ggml-alloc
  (ggfit's own).
"""

from __future__ import annotations

from fitter.ggml.backends.metal.backend import MetalBackend

__all__ = ["MetalBackend"]
