"""Where ggfit keeps what it can compute again: `${GGFIT_CACHE:-~/.cache/ggfit}` (the standard library only).

Below it: `headers/` (fitter.gguf.header_cache), `gguf-constants/` (fitter.gguf.constants), the llama-server builds
(search.build_server)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$GGFIT_CACHE, else ~/.cache/ggfit."""
    return os.environ.get("GGFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ggfit")
