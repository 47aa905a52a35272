"""MLX (mlx-lm) models: what `mlx_lm.server` / `mlx_lm.generate` allocate, from config.json and the
safetensors headers alone, laid out as mlx-lm keeps it (models/cache.py, generate.py, utils.py).

Nothing here imports mlx: predictions need only the headers. The pinned versions below are the
reference every formula mirrors and every test measures against (`pip install "ggfit[mlx]"`).
"""

from __future__ import annotations

from importlib import metadata

from fitter.errors import GGFitError

MLX_VERSION = "0.32.4"  # mlx (mlx[cpu] here; plain mlx on a Mac)
MLX_LM_VERSION = "0.32.2"  # mlx-lm: models/cache.py, generate.py, server.py mirrored from this release


def installed_mlx_lm() -> str | None:
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return None


def require_mlx_lm() -> str:
    """The installed mlx-lm version, or one clear error naming the install command."""
    v = installed_mlx_lm()
    if v is None:
        raise GGFitError("--engine mlx needs mlx-lm: pip install 'ggfit[mlx]' (mlx and mlx-lm; on Linux mlx[cpu])")
    return v


def mlx_label() -> str:
    label = f"mlx-lm {MLX_LM_VERSION} (mlx {MLX_VERSION})"
    got = installed_mlx_lm()
    if got and got != MLX_LM_VERSION:
        label += f"; installed mlx-lm {got} differs: numbers may drift"
    return label
