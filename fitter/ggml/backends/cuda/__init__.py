"""ggml-cuda (ggml/src/ggml-cuda): the CUDA backend's buffer types, alloc sizes and op support (backend.py), and the
alloc deps of its graph_optimize's fusions (fusion.py)."""

from __future__ import annotations

from fitter.ggml.backends.cuda.backend import CUDABackend

__all__ = ["CUDABackend"]
