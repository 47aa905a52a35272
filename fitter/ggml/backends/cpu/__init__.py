"""ggml-cpu (ggml/src/ggml-cpu): the CPU backend's buffer type and device (backend.py)."""

from __future__ import annotations

from fitter.ggml.backends.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
