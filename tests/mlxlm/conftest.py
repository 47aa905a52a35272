"""Tiny MLX models (tests/mlxlm/synth.py); the whole folder skips where mlx-lm is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm", reason="the MLX tests need mlx-lm: pip install 'ggfit[mlx]'")


@pytest.fixture(scope="session")
def mlx_model():
    """build(name, bits) -> the cached model directory."""
    from tests.mlxlm.synth import build

    return build
