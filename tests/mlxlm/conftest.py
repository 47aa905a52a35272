"""Tiny MLX models (tests/mlxlm/synth.py). Tests that run mlx skip where mlx-lm is not installed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mlx_model():
    """build(name, bits) -> the cached model directory."""
    pytest.importorskip("mlx_lm", reason="needs mlx-lm: pip install 'ggfit[mlx]'")
    from tests.mlxlm.synth import build

    return build
